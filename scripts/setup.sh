#!/usr/bin/env bash
# Create .venv and install dasspec with its test extras (and lm-eval, so the evaluation tests run). torch is pinned to 2.13.0: an unpinned torch pulls a
# multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test,ray,eval]"
dasspec kernels build || echo "setup: the CPU kernels did not build; dasspec runs on torch's kernels (see: dasspec kernels info)" >&2
