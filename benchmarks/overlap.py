"""Overlap scheduling (``Engine(overlap=True)``) against plain steps, in process and with the executor in its own
process, paired round by round: tokens/s, ms per step, the engine's own work per step, and whether every arm
emitted the same tokens.

    python benchmarks/overlap.py --out runs/overlap --rounds 3 [--models bundled,ouro-mid] [--threads 2]

Each round runs the four arms (local / process executor x plain / overlap, in an order rotated per round) on the
same prompts: ``--prompts`` GSM8K questions at batch 1 (one after another) and all together, for AR and DAS-Wave,
``--new-tokens`` greedy tokens without EOS.  ``host ms/step`` is the engine's own work per step outside the wait for
the executor (with overlap, planning the next step and processing outputs run while the executor works).  Models:
``bundled``, ``ouro-mid`` (``auto_speed.py``'s builder), and ``tiny``: a one-layer random Huginn of 256 token ids
on ``--tiny-prompts`` random prompts, whose steps are so short that the engine's own work is a large share of them -
the regime of a fast GPU with many requests, where overlap has something to hide.  Writes results.json and results.md into --out.  A benchmark,
not a test: it asserts nothing but reports whether the tokens agree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from dasspec.engine.api.engine import Engine  # noqa: E402
from executor_process import model_and_prompts  # noqa: E402

ARMS = [("local", False), ("local", True), ("process", False), ("process", True)]


def one_run(model, prompts, method: str, B: int, executor: str, overlap: bool, new: int) -> dict:
    steps = 0
    tokens: list[list[int]] = []
    with Engine(model, method, max_batch=B, executor=executor, overlap=overlap, closed=True) as engine:
        for p in prompts[:B]:                  # warm-up (a fresh process or thread: kernels, allocator)
            engine.add(p[::-1], max_new_tokens=4, eos=False)
        while engine.has_work:
            engine.step()
        host0 = engine.host_seconds
        t = time.perf_counter()
        for i in range(0, len(prompts), B):
            ids = [engine.add(p, max_new_tokens=new, eos=False) for p in prompts[i: i + B]]
            while engine.has_work:
                engine.step()
                steps += 1
            tokens += [engine.result(j).tokens for j in ids]
        seconds = time.perf_counter() - t
        host = engine.host_seconds - host0
    return {"seconds": seconds, "steps": steps, "host": host, "tokens": tokens}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--models", default="bundled,ouro-mid")
    p.add_argument("--methods", default="ar,das-wave")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    p.add_argument("--ouro-src", type=Path, default=ROOT.parent / "shared/checkpoints/ouro-1.4b")
    p.add_argument("--work", type=Path, default=Path("/tmp/dasspec-paired"))
    p.add_argument("--tiny-prompts", type=int, default=64)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.models.split(","):
        if name == "tiny":
            from dasspec.testing import random_model
            model = random_model("huginn", seed=7, mean_recurrence=4, n_prelude=1, n_core=1, n_coda=1, vocab_size=256)
            g = torch.Generator().manual_seed(0)
            prompts = [torch.randint(2, 256, (int(torch.randint(8, 40, (1,), generator=g)),), generator=g).tolist()
                       for _ in range(args.tiny_prompts)]
        else:
            model, prompts = model_and_prompts(name, args)
        for method in args.methods.split(","):
            for B in ((len(prompts),) if name == "tiny" else (1, len(prompts))):
                runs = []
                for r in range(args.rounds):
                    order = ARMS[r % len(ARMS):] + ARMS[: r % len(ARMS)]
                    got = {arm: one_run(model, prompts, method, B, *arm, args.new_tokens) for arm in order}
                    runs.append(got)
                    print(f"{name} {method} B={B} round {r + 1}: " + ", ".join(
                        f"{ex}{'+overlap' if ov else ''} {1e3 * g['seconds'] / g['steps']:.1f} ms/step"
                        for (ex, ov), g in got.items()), flush=True)

                def ratio(a, b):
                    rs = [g[b]["seconds"] / g[a]["seconds"] for g in runs]     # a's speed over b's
                    return statistics.median(rs), min(rs), max(rs)
                row = {"model": name, "method": method, "B": B,
                       "same_tokens": all(g[arm]["tokens"] == g[ARMS[0]]["tokens"] for g in runs for arm in ARMS),
                       "new_tokens": sum(len(t) for t in runs[0][ARMS[0]]["tokens"])}
                for ex, ov in ARMS:
                    key = f"{ex}{'+overlap' if ov else ''}"
                    row[f"ms_per_step[{key}]"] = statistics.median(1e3 * g[(ex, ov)]["seconds"] / g[(ex, ov)]["steps"]
                                                                   for g in runs)
                    row[f"host_ms_per_step[{key}]"] = statistics.median(1e3 * g[(ex, ov)]["host"] /
                                                                        g[(ex, ov)]["steps"] for g in runs)
                    row[f"steps[{key}]"] = runs[0][(ex, ov)]["steps"]
                row["overlap_speed_local"] = ratio(("local", True), ("local", False))
                row["overlap_speed_process"] = ratio(("process", True), ("process", False))
                rows.append(row)
    (args.out / "results.json").write_text(json.dumps({"threads": args.threads, "rounds": args.rounds,
                                                       "new_tokens": args.new_tokens, "rows": rows}, indent=1))
    out = ["| model | method | B | ms/step local: plain / overlap | host ms/step: plain / overlap | steps: plain / "
           "overlap | overlap speed, local | ms/step process: plain / overlap | overlap speed, process | same tokens |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = lambda k: f"{r[k + '[local]']:.1f} / {r[k + '[local+overlap]']:.1f}"        # noqa: E731
        g = lambda t: f"{t[0]:.3f} [{t[1]:.3f}, {t[2]:.3f}]"                              # noqa: E731
        out.append(f"| {r['model']} | {r['method']} | {r['B']} | {f('ms_per_step')} | "
                   f"{r['host_ms_per_step[local]']:.2f} / {r['host_ms_per_step[local+overlap]']:.2f} | "
                   f"{r['steps[local]']} / {r['steps[local+overlap]']} | {g(r['overlap_speed_local'])} | "
                   f"{r['ms_per_step[process]']:.1f} / {r['ms_per_step[process+overlap]']:.1f} | "
                   f"{g(r['overlap_speed_process'])} | {r['same_tokens']} |")
    (args.out / "results.md").write_text("\n".join(out) + "\n")
    print("\n".join(out))


if __name__ == "__main__":
    main()
