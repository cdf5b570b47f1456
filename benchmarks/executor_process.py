"""The executor in its own process against in process, paired round by round: per-step time, tokens/s, the engine's
own work per step (what overlap scheduling could hide), and whether both emitted the same tokens.

    python benchmarks/executor_process.py --out runs/executor --rounds 3 [--models bundled,ouro-mid]

Each round runs both engines (in-process first on odd rounds, the child process first on even ones) on the same
prompts: ``--prompts`` GSM8K questions (``--data``) at batch 1 (one after another) and all together (batch =
``--prompts``), for AR and DAS-Wave, ``--new-tokens`` greedy tokens without EOS.  A step's time is the engine's wall
time over its steps; ``host`` is the engine's own share of it (planning, applying outputs, events: the work a
scheduler that plans step n + 1 while step n executes takes off the critical path); ``ipc`` the process engine's
step time less the in-process one's (pickling plans and outputs, the pipe).  Models: ``bundled``, ``ouro-mid``
(``auto_speed.py``'s builder, Ouro-1.4B's config at width 512).  Writes results.json and results.md into --out.
A benchmark, not a test: it asserts nothing but prints whether the tokens agree.
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

import dasspec  # noqa: E402
from dasspec.engine.api.engine import Engine  # noqa: E402

METHODS = {"ar": {}, "das-wave": {}}


def one_run(model, prompts: list[list[int]], method: str, B: int, executor: str, new: int) -> dict:
    steps = host = 0
    tokens: list[list[int]] = []
    groups = [prompts[i: i + B] for i in range(0, len(prompts), B)]
    with Engine(model, method, METHODS[method], max_batch=B, executor=executor, closed=True) as engine:
        for p in prompts[:B]:                  # warm-up (a fresh process: kernels, allocator, first touches)
            engine.add(p[::-1], max_new_tokens=4, eos=False)     # (reversed: no prompt block to share)
        while engine.has_work:
            engine.step()
        host0 = engine.host_seconds
        t = time.perf_counter()                # start-up is not a step
        for group in groups:
            ids = [engine.add(p, max_new_tokens=new, eos=False) for p in group]
            while engine.has_work:
                engine.step()
                steps += 1
            tokens += [engine.result(i).tokens for i in ids]
        seconds = time.perf_counter() - t
        host = engine.host_seconds - host0
    return {"seconds": seconds, "steps": steps, "host": host, "tokens": tokens}


def model_and_prompts(name: str, args) -> tuple:
    """``bundled``, or ``ouro-mid`` (``auto_speed.py``'s builder, into ``args.work``), with the first ``args.prompts``
    GSM8K test questions (``args.data``) as its token ids (``overlap.py`` uses it too)."""
    if name == "bundled":
        model = dasspec.load_model()
    else:
        from auto_speed import build_ouro
        model = dasspec.load_model(str(build_ouro(args.ouro_src, args.work / name, 512)))
    lines = (args.data / "gsm8k" / "test.jsonl").read_text().splitlines()[: args.prompts]
    return model, [model.tokenizer.encode(json.loads(line)["question"]) for line in lines]


def round_trip_ms(model, n: int = 200) -> float:
    """The pipe alone: the median time to send an empty plan to the executor's process and get its output back."""
    from dasspec.engine.base.contract import StepPlan
    with Engine(model, "ar", max_batch=1, executor="process") as engine:
        times = []
        for i in range(n):
            t = time.perf_counter()
            engine.executor.execute(StepPlan(i))
            times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--models", default="bundled,ouro-mid")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    p.add_argument("--ouro-src", type=Path, default=ROOT.parent / "shared/checkpoints/ouro-1.4b")
    p.add_argument("--work", type=Path, default=Path("/tmp/dasspec-paired"))      # paired_versions.py builds there too
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.models.split(","):
        model, prompts = model_and_prompts(name, args)
        rt = round_trip_ms(model)
        print(f"{name}: an empty plan's round trip {rt:.3f} ms", flush=True)
        for method in METHODS:
            for B in (1, len(prompts)):
                one_run(model, prompts[:2], method, min(B, 2), "local", 4)        # warm-up
                pairs = []
                for r in range(args.rounds):
                    order = ("local", "process") if r % 2 == 0 else ("process", "local")
                    got = {ex: one_run(model, prompts, method, B, ex, args.new_tokens) for ex in order}
                    pairs.append(got)
                    print(f"{name} {method} B={B} round {r + 1}: " + ", ".join(
                        f"{ex} {1e3 * g['seconds'] / g['steps']:.1f} ms/step" for ex, g in got.items()), flush=True)
                loc = [g["local"] for g in pairs]
                pro = [g["process"] for g in pairs]
                step_l = [1e3 * g["seconds"] / g["steps"] for g in loc]
                step_p = [1e3 * g["seconds"] / g["steps"] for g in pro]
                rows.append({
                    "model": name, "method": method, "B": B, "steps": loc[0]["steps"], "round_trip_ms": rt,
                    "ms_per_step_local": statistics.median(step_l), "ms_per_step_process": statistics.median(step_p),
                    "host_ms_per_step": statistics.median(1e3 * g["host"] / g["steps"] for g in loc),
                    "ipc_ms_per_step": statistics.median(b - a for a, b in zip(step_l, step_p)),
                    "speed_process_over_local": statistics.median(
                        a["seconds"] / b["seconds"] for a, b in zip(loc, pro)),
                    "speed_range": [min(a["seconds"] / b["seconds"] for a, b in zip(loc, pro)),
                                    max(a["seconds"] / b["seconds"] for a, b in zip(loc, pro))],
                    "same_tokens": all(g["local"]["tokens"] == g["process"]["tokens"] for g in pairs),
                    "new_tokens": sum(len(t) for t in loc[0]["tokens"]),
                })
    (args.out / "results.json").write_text(json.dumps({"threads": args.threads, "rounds": args.rounds,
                                                       "new_tokens": args.new_tokens, "rows": rows}, indent=1))
    lines = ["Pipe round trip of an empty plan: " + ", ".join(sorted({f"{r['model']} {r['round_trip_ms']:.3f} ms"
                                                                      for r in rows})), "",
             "| model | method | B | steps | ms/step in process | ms/step own process | engine's own ms/step | "
             "pipe ms/step | speed own/in (range) | same tokens |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["speed_range"]
        lines.append(f"| {r['model']} | {r['method']} | {r['B']} | {r['steps']} | {r['ms_per_step_local']:.1f} | "
                     f"{r['ms_per_step_process']:.1f} | {r['host_ms_per_step']:.2f} | {r['ipc_ms_per_step']:.2f} | "
                     f"{r['speed_process_over_local']:.3f} [{lo:.3f}, {hi:.3f}] | {r['same_tokens']} |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
