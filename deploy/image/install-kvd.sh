#!/bin/sh
# The node image's Python environment (deploy/Containerfile runs this; so does
# tests/integration/test_release.py, in a plain venv, to prove each step before an image is built):
#
#   install-kvd.sh VENV WHEELS_DIR
#
# makes VENV with torch (TORCH_VERSION, from TORCH_INDEX_URL when set: the PyTorch index of the
# CUDA build that matches the image's base), then kvd-client and kvd[daemon] (NIXL) from the built
# wheels in WHEELS_DIR at KVD_VERSION, not editable and with no source tree, and checks that the
# installed `kvd` is that version. PIP_NO_CACHE_DIR=1 keeps pip's cache out of an image layer.
set -eu

venv=${1:?usage: install-kvd.sh VENV WHEELS_DIR}
wheels=${2:?usage: install-kvd.sh VENV WHEELS_DIR}
: "${KVD_VERSION:?KVD_VERSION: the version of the wheels to install}"
: "${TORCH_VERSION:?TORCH_VERSION: the torch release to install (CPU build or the base image's CUDA)}"
python=${PYTHON:-python3}

client_wheel="$wheels/kvd_client-$KVD_VERSION-py3-none-any.whl"
daemon_wheel="$wheels/kvd-$KVD_VERSION-py3-none-any.whl"
for wheel in "$client_wheel" "$daemon_wheel"; do
    [ -f "$wheel" ] || { echo "install-kvd.sh: $wheel not found (build both wheels first)" >&2; exit 1; }
done

"$python" -m venv "$venv"
pip="$venv/bin/python -m pip --disable-pip-version-check"
# torch first and pinned: left to the resolver, it would pull another (CUDA) build.
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    $pip install --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"
else
    $pip install "torch==$TORCH_VERSION"
fi
$pip install "$client_wheel" "$daemon_wheel[daemon]"
$pip check

installed=$("$venv/bin/kvd" --version)
[ "$installed" = "kvd $KVD_VERSION" ] || { echo "install-kvd.sh: installed '$installed', wanted kvd $KVD_VERSION" >&2; exit 1; }
echo "install-kvd.sh: $installed in $venv"
