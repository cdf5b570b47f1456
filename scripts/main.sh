#!/usr/bin/env bash
# The README's main job: set up (idempotent), run the quick benchmark preset on the bundled model - every
# registered method paired with full-depth AR on a few HumanEval (+ GSM8K) prompts - into runs/quick, and print
# the Table 1-style result.  A few minutes on a 2-core CPU.  Extra arguments go to `dasspec bench`
# (e.g. --prompts 5, --threads 1).  Results: runs/quick/{report.md, summary.csv, records.jsonl, *.png}.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. .venv/bin/activate
if [ -z "${DASSPEC_DATA:-}" ] && [ -d ../shared/data ]; then
    export DASSPEC_DATA="$(cd ../shared/data && pwd)"
fi
dasspec bench --preset quick --fresh --out "${OUT:-runs/quick}" "$@"
