#!/usr/bin/env bash
# Set up a development / CI environment from a fresh clone: .venv with everything kvd needs.
#
#   bash scripts/setup.sh            # daemon, client, engine patch, tests, lint (+ vLLM 0.33 CPU build)
#   KVD_SETUP_VLLM=0 bash scripts/setup.sh   # skip vLLM (its tests then skip)
#
# torch is pinned first: an unpinned torch would pull several GB of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
TORCH_VERSION=2.13.0
PIP_FLAGS=(-q --disable-pip-version-check)

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install "${PIP_FLAGS[@]}" --upgrade pip
"${PIP[@]}" install "${PIP_FLAGS[@]}" "torch==${TORCH_VERSION}"
"${PIP[@]}" install "${PIP_FLAGS[@]}" nixl
"${PIP[@]}" install "${PIP_FLAGS[@]}" -e ".[test,lint,bench]"

# Tools that check deploy/: systemd-analyze (deploy/kvd.service: verify, security exposure) and
# promtool (deploy/prometheus: check and unit-test the alert rules, parse the dashboard's queries;
# Debian's package "prometheus"). Where we are root and apt is there (CI containers), install what
# is missing; elsewhere those tests skip and say why.
APT_PACKAGES=()
command -v systemd-analyze >/dev/null 2>&1 || APT_PACKAGES+=(systemd)
command -v promtool >/dev/null 2>&1 || APT_PACKAGES+=(prometheus)
if [ "${#APT_PACKAGES[@]}" -gt 0 ]; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${APT_PACKAGES[@]}") >/dev/null \
            || echo "setup: could not install ${APT_PACKAGES[*]} (systemd-analyze, promtool); their tests will skip" >&2
    else
        echo "setup: ${APT_PACKAGES[*]} missing (systemd-analyze, promtool) and not root with apt-get; their tests will skip" >&2
    fi
fi

# The fleet (scripts/fleet.py, tests/fleet/) needs ip and tc (iproute2) and, where the kernel has no
# netem qdisc, nft (nftables) for its lossy-link fault. Installed the same way; the fleet says so if missing.
if ! command -v tc >/dev/null 2>&1 || ! command -v nft >/dev/null 2>&1; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            iproute2 nftables) >/dev/null || echo "setup: could not install iproute2/nftables (the fleet's faults)" >&2
    fi
fi

if [ "${KVD_SETUP_VLLM:-1}" = "1" ]; then
    bash scripts/setup_vllm.sh "$VENV"
fi

"$VENV/bin/python" - <<'PY'
import torch, nixl._api, grpc, kvd_client, kvd
print(f"kvd {kvd.__version__}: torch {torch.__version__}, grpc {grpc.__version__}, nixl ok")
PY
