"""The journal's scripts (benchmarks/journal/): each runs its cheapest path on the bundled model, so a script that
imports dasspec's internals fails here when they change, not the next time someone reruns a measurement.

Every script there is either run below or a helper the others import; a new one must be added to one of the two.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dasspec.model.checkpoint import BUNDLED_DIR

JOURNAL = Path(__file__).resolve().parents[1] / "benchmarks" / "journal"
BUNDLED = str(BUNDLED_DIR)

# script -> its arguments: the smallest run that still goes through every line of its measurement
RUNS = {
    "auto/step_trace.py": ["--model", BUNDLED, "--rounds", "1", "--tokens", "4"],
    "auto/probe_trace.py": ["--model", BUNDLED, "--rounds", "1", "--tokens", "4"],
    "auto/auto_pair.py": ["--model", BUNDLED, "--pairs", "1", "--tokens", "4"],
    "auto/recall_ab.py": ["--model", BUNDLED, "--rounds", "1", "--tokens", "4"],
    "auto/server_life.py": ["1", "2", "ar,auto", "greedy", BUNDLED, "4"],      # rounds, levels, methods, -, model, tokens
    "ouro-vllm/step_profile.py": [BUNDLED, "1", "2"],                           # model, threads, B
    "one-call/one_call_ab.py": ["--model", BUNDLED, "--pairs", "1", "--tokens", "4", "--threads", "1"],
    "one-call/alone_ab.py": ["--model", BUNDLED, "--rounds", "1", "--tokens", "4"],
    "closed-budget/budget_ab.py": ["--model", BUNDLED, "--pairs", "1", "--tokens", "2", "--threads", "1"],
    "closed-budget/product_rows.py": ["--rows", "17,64", "--threads", "1"],
    "noise/noise_ab.py": ["--model", BUNDLED, "--methods", "ar,token-recycling", "--pairs", "1", "--tokens", "2",
                          "--threads", "1"],
    "host/swap_ab.py": ["--base", "HEAD", "--swap", "dasspec.model.layers:kernel_pair,"
                        "dasspec.model.linear:kernel_takes,dasspec.model.layers:NormedBlock.plain_parts",
                        "--rounds", "1", "--tokens", "2", "--threads", "1"],
}
NEEDS_GIT = {"host/swap_ab.py"}       # reads the old side's functions from git
HELPERS = {"auto/batch8.py", "common.py", "ouro-vllm/decoding.py"}


def test_every_journal_script_is_run_or_a_helper():
    found = {p.relative_to(JOURNAL).as_posix() for p in JOURNAL.rglob("*.py")}
    assert found == set(RUNS) | HELPERS


@pytest.mark.parametrize("script", sorted(RUNS))
def test_journal_script_runs(script, eval_data):
    if script in NEEDS_GIT and (shutil.which("git") is None or subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=JOURNAL, capture_output=True).returncode):
        pytest.skip("not a git checkout")
    data = eval_data("gsm8k/test.jsonl", "mbpp")
    env = dict(os.environ, DASSPEC_DATA=str(data), OMP_WAIT_POLICY="PASSIVE")
    done = subprocess.run([sys.executable, str(JOURNAL / script), *RUNS[script]], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), f"{script} printed nothing"
