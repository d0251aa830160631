#!/usr/bin/env bash
# Install vLLM 0.33.0 (CPU) into a venv that already has torch==2.13.0: --no-deps plus its
# pure-Python dependencies, so pip does not replace torch with a CUDA build.
set -euo pipefail
VENV=${1:-.venv}
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --no-deps vllm==0.33.0
"${PIP[@]}" packaging psutil pyzmq regex numpy "transformers>=5.16.1,<5.21.0" cbor2 aiohttp requests \
    openai-harmony openai pillow pybase64 cachetools msgspec cloudpickle uvloop py-cpuinfo prometheus-client \
    "fastapi>=0.133.0,<0.137.0" partial-json-parser "llguidance>=1.7.0,<1.8.0" einops
"${PIP[@]}" --no-deps xgrammar apache-tvm-ffi
