#!/usr/bin/env bash
# Set up (idempotent) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. .venv/bin/activate
export DASSPEC_DATA="${DASSPEC_DATA:-$(cd .. && pwd)/shared/data}"
python -m pytest "$@"
