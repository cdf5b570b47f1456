"""benchmarks/engine_fuzz.py (random engines at the edges, issue 51): its first cases run here, so a change to the
engine's interface breaks the script now rather than the next time someone fuzzes, and an edge those cases reach
that crashes or loses a request fails here too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "engine_fuzz.py"


def test_the_first_cases_run_and_lose_nothing(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--cases", "6"], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    cases = [json.loads(line) for line in (tmp_path / "cases.jsonl").read_text().splitlines()]
    assert [c["seed"] for c in cases] == list(range(6))
    assert all(not c["failures"] for c in cases), [c["failures"] for c in cases]
    assert "6 cases" in (tmp_path / "summary.md").read_text()
