"""benchmarks/speed.py's tables from records (no model): the prefill bound and the per-task speedups."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path


def _script(name: str):
    """A script of benchmarks/ loaded as a module."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _speed_module():
    return _script("speed")


def _bundled_data() -> Path:
    """The shared data folder, skipping the test when it or the bundled model is missing."""
    import os

    import pytest

    from dasspec.model.checkpoint import BUNDLED_DIR

    data = Path(os.environ.get("DASSPEC_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
    if not (BUNDLED_DIR / "config.json").exists() or not (data / "gsm8k").exists():
        pytest.skip("needs the bundled model and the GSM8K data")
    return data


def _record(task, i, method, wall, prefill, tokens, accepted, prompt=(40, 0), passes=32 * 4):
    return {"task": task, "prompt_id": f"{task}/{i}", "prompt_index": i, "method": method, "session": "s",
            "prompt_tokens": prompt[0], "cached_tokens": prompt[1], "prefill_passes": 32,
            "new_tokens": len(tokens), "wall_time": wall, "prefill_time": prefill, "sequential_passes": passes,
            "accepted": accepted, "target_tokens": [1] * len(accepted), "tokens": tokens, "stop_reason": "length",
            "stateful": False, "peak_memory": 2**20, "cache_bytes": 2**20}


def test_per_task_table_reports_the_prefill_bound(tmp_path):
    speed = _speed_module()
    toks = [5, 6, 7, 8]
    records = [
        # task a: AR 2.0 s of which 0.5 s prefill -> share 25 %, bound 4x; DAS-Wave 1.0 s -> S 2x
        _record("gsm8k", 0, "ar", 2.0, 0.5, toks, [0, 0, 0, 0], prompt=(240, 182)),   # a cached few-shot prefix
        _record("gsm8k", 0, "das-wave", 1.0, 0.5, toks, [3], prompt=(240, 182)),
        # task b: AR 1.0 s, prefill 0.8 s -> share 80 %, bound 1.25x; DAS-Wave 0.9 s -> S 1.11x
        _record("humaneval", 0, "ar", 1.0, 0.8, toks, [0, 0, 0, 0]),
        _record("humaneval", 0, "das-wave", 0.9, 0.8, toks, [3]),
    ]
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text, table = speed.speed_table(tmp_path, n_resamples=100)
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "| 1 | 240 (182) | 4.0 | 25% | 4.00× | 2.00× (3.0) |" in rows["GSM8K"]
    assert "| 1 | 40 (0) | 4.0 | 80% | 1.25× | 1.11× (3.0) |" in rows["HumanEval"]
    wave = next(t for t in table if t["method"] == "das-wave")
    assert abs(wave["S"] - (2.0 + 1.0 / 0.9) / 2) < 1e-9


def test_decode_table_leaves_the_prefill_out_on_both_sides(tmp_path):
    speed = _speed_module()
    toks = [5, 6, 7, 8]
    records = [
        # decode phase: AR 3 tokens in 1.5 s and 96 passes; DAS-Wave 3 tokens in 0.5 s and 32 passes
        # -> decode S 3x, decode pass-count 3x, decode efficiency 1.0 (overall: S 1.5x of 2x passes)
        _record("gsm8k", 0, "ar", 2.0, 0.5, toks, [0, 0, 0], passes=32 + 96),
        _record("gsm8k", 0, "das-wave", 1.0, 0.5, toks, [3], passes=32 + 32),
        # a request that stops at its first token has no decode phase: left out of the decode cells only
        _record("gsm8k", 1, "ar", 0.6, 0.5, [5], []),
        _record("gsm8k", 1, "das-wave", 0.6, 0.5, [5], []),
    ]
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text, table = speed.speed_table(tmp_path, n_resamples=100)
    wave = next(t for t in table if t["method"] == "das-wave")
    assert wave["prompts"] == 2 and wave["decode_prompts"] == 1
    assert abs(wave["decode_S"] - 3.0) < 1e-9 and abs(wave["decode_pass_speedup"] - 3.0) < 1e-9
    assert abs(wave["decode_efficiency"] - 1.0) < 1e-9
    assert abs(wave["S"] - (2.0 + 1.0) / 2) < 1e-9          # the paper's S still includes the prefill
    assert "| DAS-Wave | 1 | 3.00× | 3.00× | 1.00 |" in text


def test_wave_blocks_script_compares_seed_and_chain(tmp_path):
    """benchmarks/wave_blocks.py (the diagnostic behind seed_branch / copy_run) runs end to end on the bundled model
    and its counts add up: every seeded block is a seed win, a chain win or a tie."""
    import csv

    data = _bundled_data()
    mod = _script("wave_blocks")
    assert mod.main(["--out", str(tmp_path), "--tasks", "gsm8k", "--prompts", "1", "--max-new-tokens", "32",
                     "--knobs", "gamma=8,w_init=8", "--data", str(data)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "blocks.csv")))
    assert rows and all(int(r["wave_len"]) <= 8 and int(r["seed_len"]) <= 8 for r in rows)
    line = next(x for x in (tmp_path / "blocks.md").read_text().splitlines() if x.startswith("| gsm8k"))
    blocks, no_seed, seed_won, _, chain_won, tie = (int(c) for c in line.split(" | ")[1:7])
    assert blocks == len(rows) and no_seed + seed_won + chain_won + tie == blocks


def test_tune_wave_script_keeps_the_fastest_of_repeats(tmp_path):
    """benchmarks/tune_wave.py runs a small grid end to end on the bundled model: one row per configuration
    (early stop off and on), each checked token for token against AR, timed --repeats times."""
    data = _bundled_data()
    mod = _script("tune_wave")
    assert mod.main(["--out", str(tmp_path), "--tasks", "gsm8k", "--prompts", "1", "--max-new-tokens", "24",
                     "-k", "1", "--rounds", "3", "--gamma", "8", "--w-init", "g", "--guesses", "copy",
                     "--trim", "true", "--seed-branch", "8", "--copy-run", "true", "--early-stop", "false,true",
                     "--repeats", "2", "--data", str(data)]) == 0
    text = (tmp_path / "tune.md").read_text()
    assert "fastest of 2 run(s)" in text
    table = json.loads((tmp_path / "tune.json").read_text())
    assert sorted(t["early_stop"] for t in table) == [False, True]
    assert all(t["S"] > 0 and t["gamma"] == 8 and t["seed_branch"] == 8 for t in table)
