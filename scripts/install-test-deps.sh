#!/usr/bin/env bash
# Installs the third-party programs the test suite drives, when they are missing.
# Needs root (or passwordless sudo) for apt-get; does nothing when everything is present.
set -euo pipefail

need=()
command -v curl >/dev/null 2>&1 || need+=(curl)
command -v nc >/dev/null 2>&1 || need+=(netcat-openbsd)
command -v openssl >/dev/null 2>&1 || need+=(openssl)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v nginx >/dev/null 2>&1 || need+=(nginx)
[ -e /usr/lib/nginx/modules/ngx_stream_module.so ] || need+=(libnginx-mod-stream)
command -v haproxy >/dev/null 2>&1 || need+=(haproxy)
command -v squid >/dev/null 2>&1 || need+=(squid)
command -v htpasswd >/dev/null 2>&1 || need+=(apache2-utils)
command -v tinyproxy >/dev/null 2>&1 || need+=(tinyproxy)
command -v nft >/dev/null 2>&1 || need+=(nftables)
command -v python3 >/dev/null 2>&1 || need+=(python3)

if [ ${#need[@]} -gt 0 ]; then
  echo "installing test dependencies: ${need[*]}"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo_cmd apt-get update -qq
  $sudo_cmd apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# Chart tests (e2e/tests/suite/charts.rs): helm, and kubernetes-validate for offline schema checks,
# both in Tether's tools directory (the tests look there first, then in PATH).
tools="${TETHER_TOOLS_DIR:-$HOME/.cache/tether-tools}"
"$(dirname "$0")/install-helm.sh" >/dev/null
if [ ! -x "$tools/bin/kubernetes-validate" ]; then
  echo "installing kubernetes-validate into $tools/venv"
  if ! python3 -m venv "$tools/venv" >/dev/null 2>&1; then
    rm -rf "$tools/venv"
    sudo_cmd=""
    [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $sudo_cmd apt-get update -qq
    $sudo_cmd apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
    python3 -m venv "$tools/venv"
  fi
  "$tools/venv/bin/python" -m pip install --quiet --disable-pip-version-check "kubernetes-validate==1.37.0"
  mkdir -p "$tools/bin"
  ln -sf "$tools/venv/bin/kubernetes-validate" "$tools/bin/kubernetes-validate"
fi

# gRPC frontend tests (e2e/tests/suite/grpc.rs): a kube-apiserver stand-in in Python's grpcio, with
# stubs generated from gateway/proto/konnectivity.proto by grpcio-tools, in the same venv.
if ! "$tools/venv/bin/python" -c "import grpc, grpc_tools" >/dev/null 2>&1; then
  echo "installing grpcio and grpcio-tools into $tools/venv"
  "$tools/venv/bin/python" -m pip install --quiet --disable-pip-version-check "grpcio==1.71.0" "grpcio-tools==1.71.0"
fi
