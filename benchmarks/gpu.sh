#!/usr/bin/env bash
# The CUDA checks and measurements of stalwart, in one run under 8 minutes.
#
#   benchmarks/gpu.sh               on a machine with a CUDA GPU (state 256 MiB)
#   benchmarks/gpu.sh --dry-run     the same code paths on the CPU: a self-check
#
# Extra arguments go to benchmarks/gpu.py (--size MiB, --repeats N). PYTHON picks
# the interpreter (default .venv/bin/python, else python3). Prints one PASS/FAIL
# line per check and one RATIO line per measurement; exits 1 if anything failed.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
# The whole run stays under 8 minutes: a hung collective or device ends it, not the machine.
exec timeout --kill-after=10 470 "$PYTHON" benchmarks/gpu.py "$@"
