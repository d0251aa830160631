#!/usr/bin/env bash
# kvd GPU check: prove kvd's GPU paths on a bare, offline accelerator machine (docs/gpu-check.md).
#
#   bash scripts/gpu-check.sh --prepare     # where PyPI is reachable: wheels into .whl/, budget checked
#   bash scripts/gpu-check.sh               # on the GPU machine: install them privately, run the checks,
#                                           # write gpu-check.json/.txt/.log under $OUT (or --out DIR)
#   bash scripts/gpu-check.sh --help        # every option, the steps, the report, the exit codes
#
# Exit: 0 all passed, 1 a step failed, 2 usage, 3 --prepare failed or over budget, 4 no CUDA device.
# A thin wrapper: the logic is tools/gpu_check.py (standard library only, tested in tests/unit).
set -euo pipefail
cd "$(dirname "$0")/.."

# The Python that holds torch: $PYTHON, else the project's .venv where it exists, else python3.
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
# The device tool names the folder whose files come back in $OUT; an explicit --out wins (last one).
if [ -n "${OUT:-}" ]; then
    set -- --out "$OUT" "$@"
fi
exec "$PYTHON" tools/gpu_check.py "$@"
