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

if [ ${#need[@]} -gt 0 ]; then
  echo "installing test dependencies: ${need[*]}"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo_cmd apt-get update -qq
  $sudo_cmd apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
