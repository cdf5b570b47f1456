"""Aggregate throughput of the batched engine (issue 28): ``dasspec.generate_batch`` over the same prompts at batch
sizes B = 1, 2, 4, 8, 16 for each arm (AR, DAS-Wave, the engine's default speculation policy, ...), all in one
process, the arms and batch sizes interleaved round by round; every output is checked equal to AR's at B = 1.

    python benchmarks/batch_throughput.py --out runs/batch --prompts 4 --batches 1,2,4,8,16
    python benchmarks/batch_throughput.py --model /tmp/huginn-random --dtype bfloat16 --tasks gsm8k --prompts 8 \\
        --batches 1,4,8 --max-new-tokens 4 --arms ar --rounds 1 --out runs/batch-huginn

An arm is ``METHOD`` or ``METHOD@POLICY``: POLICY ``always`` (speculate at every batch size), ``default`` (the
engine's default policy, ``SpeculationPolicy()``), ``off>N`` (no drafts with more than N requests decoding) or
``tokens=N`` (at most N proposals per step over the batch).  Tokens/s is the batch's new tokens over its wall
time, prefill included; ``x B=1`` divides by the same arm at B = 1 in the same round, ``x AR`` by AR at the same B
(the median over rounds, with the range).  Writes runs.jsonl (one line per timed run), summary.md, summary.csv and
throughput.png into --out.  A benchmark, never a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import time
from pathlib import Path

ARMS = "ar,das-wave@always,das-wave@default"


def parse_arm(text: str):
    """``METHOD[@POLICY]`` -> (method, SpeculationPolicy or None for the engine default)."""
    from dasspec.engine.core.policy import SpeculationPolicy

    method, _, policy = text.partition("@")
    if policy in ("", "default"):
        return method, None
    if policy == "always":
        return method, SpeculationPolicy(off_above=None, max_tokens=None)
    if policy.startswith("off>"):
        return method, SpeculationPolicy(off_above=int(policy[4:]), max_tokens=None)
    if policy.startswith("tokens="):
        return method, SpeculationPolicy(off_above=None, max_tokens=int(policy[7:]))
    raise ValueError(f"unknown policy {policy!r} in arm {text!r}: always | default | off>N | tokens=N")


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for arm in dict.fromkeys(s["arm"] for s in summary):
        rows = [s for s in summary if s["arm"] == arm]
        ax.plot([r["B"] for r in rows], [r["tokens_per_second"] for r in rows], marker="o", label=arm)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size B (max_batch)")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title("generate_batch throughput (median over rounds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=None, help="checkpoint folder (default: the bundled model)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--tasks", default="gsm8k,math500,humaneval,mbpp")
    p.add_argument("--prompts", type=int, default=4, help="prompts per task")
    p.add_argument("--shots", action="append", default=[], metavar="TASK=N")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batches", default="1,2,4,8,16")
    p.add_argument("--arms", default=ARMS)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-steps", type=int, default=None)
    p.add_argument("--data", default=os.environ.get("DASSPEC_DATA") or str(Path(__file__).resolve().parents[2] / "shared" / "data"),
                   help="data folder (default $DASSPEC_DATA, else ../shared/data beside the repository)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="prefill each task's shared few-shot prefix with every request (default: once, before "
                        "timing, as dasspec bench --prefix-cache: the exemplars' prefill is the same for every arm)")
    args = p.parse_args(argv)

    import torch

    import dasspec
    from dasspec.eval.bench.setup import dev_prompts

    if args.threads:
        torch.set_num_threads(args.threads)
    model = dasspec.load_model(args.model, device=args.device, dtype=args.dtype)
    prompts = dev_prompts(model, args.tasks, args.prompts, args.max_new_tokens, args.shots, args.data)
    if not prompts:
        raise SystemExit("no prompts: check --tasks / --data")
    ids = [pr.ids for pr in prompts]
    caps = [pr.task.cap for pr in prompts]
    prefixes = [None] * len(prompts)
    if args.prefix_cache:
        from dasspec.eval.bench.setup import BenchPlan
        from dasspec.eval.bench.work import task_prefix_caches
        plan = BenchPlan(tasks=list({pr.task.name: pr.task for pr in prompts}.values()), methods=["ar"],
                         num_steps=args.num_steps)
        caches = task_prefix_caches(model, prompts, model.depth(args.num_steps), plan)
        prefixes = [caches.get(pr.task.name) for pr in prompts]
    stops = [list(pr.task.stop) or None for pr in prompts]
    batches = [int(b) for b in args.batches.split(",")]
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"{len(prompts)} prompts ({args.tasks}), {sum(len(i) for i in ids)} prompt tokens; arms {arms}; "
          f"B in {batches}; {args.rounds} round(s); {torch.get_num_threads()} thread(s)", file=sys.stderr)

    def run(arm: str, B: int):
        method, policy = parse_arm(arm)
        t = time.perf_counter()
        res = dasspec.generate_batch(model, ids, method, max_new_tokens=caps, stop=stops, max_batch=B,
                                     policy=policy, num_steps=args.num_steps, prefix_cache=prefixes)
        return time.perf_counter() - t, res

    dasspec.generate_batch(model, ids[:2], "das-wave", max_new_tokens=8, max_batch=2)      # warm-up
    reference = None
    runs = []
    with open(out / "runs.jsonl", "w") as log:
        for r in range(args.rounds):
            cells = [(a, B) for B in batches for a in arms]
            shift = r * 7 % len(cells)                           # a different order every round
            for arm, B in cells[shift:] + cells[:shift]:
                seconds, res = run(arm, B)
                tokens = [o.tokens for o in res]
                if reference is None:
                    _, ref_res = run("ar", 1) if (arm, B) != ("ar", 1) else (seconds, res)
                    reference = [o.tokens for o in ref_res]
                equal = sum(a == b for a, b in zip(tokens, reference))
                new = sum(len(t) for t in tokens)
                row = {"round": r, "arm": arm, "B": B, "seconds": seconds, "new_tokens": new,
                       "tokens_per_second": new / seconds, "equal_to_ar": equal, "prompts": len(ids),
                       "A": statistics.fmean(o.stats.A for o in res),
                       "cached_tokens": sum(o.stats.cached_tokens for o in res)}
                runs.append(row)
                log.write(json.dumps(row) + "\n")
                log.flush()
                print(f"round {r} {arm:>22} B={B:<3} {row['tokens_per_second']:8.1f} tok/s  "
                      f"{equal}/{len(ids)} = AR", file=sys.stderr)

    def ratio_cells(arm: str, B: int, base) -> tuple[float, float, float]:
        ratios = []
        for r in range(args.rounds):
            mine = [x for x in runs if x["round"] == r and x["arm"] == arm and x["B"] == B]
            other = [x for x in runs if x["round"] == r and base(x)]
            if mine and other:
                ratios.append(mine[0]["tokens_per_second"] / other[0]["tokens_per_second"])
        return (statistics.median(ratios), min(ratios), max(ratios)) if ratios else (float("nan"),) * 3

    summary = []
    for arm in arms:
        for B in batches:
            mine = [x for x in runs if x["arm"] == arm and x["B"] == B]
            vs1 = ratio_cells(arm, B, lambda x: x["arm"] == arm and x["B"] == 1)
            vsar = ratio_cells(arm, B, lambda x: x["arm"] == "ar" and x["B"] == B)
            summary.append({"arm": arm, "B": B, "tokens_per_second": statistics.median(x["tokens_per_second"]
                                                                                    for x in mine),
                            "x_B1": vs1[0], "x_B1_lo": vs1[1], "x_B1_hi": vs1[2],
                            "x_AR": vsar[0], "x_AR_lo": vsar[1], "x_AR_hi": vsar[2],
                            "A": statistics.fmean(x["A"] for x in mine),
                            "equal_to_ar": min(x["equal_to_ar"] for x in mine), "prompts": len(ids)})
    cached = runs[0]["cached_tokens"]
    lines = [f"{len(ids)} prompts ({args.tasks}, cap {args.max_new_tokens}; {sum(len(i) for i in ids)} prompt tokens, "
             f"{cached} of them from task prefix caches), {args.rounds} round(s), "
             f"{torch.get_num_threads()} thread(s), {model.dtype}, {model.device}", "",
             "| arm | B | tok/s | x B=1 [range] | x AR at B [range] | A | = AR |", "|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['arm']} | {s['B']} | {s['tokens_per_second']:.1f} | {s['x_B1']:.2f} "
                     f"[{s['x_B1_lo']:.2f}, {s['x_B1_hi']:.2f}] | {s['x_AR']:.2f} [{s['x_AR_lo']:.2f}, "
                     f"{s['x_AR_hi']:.2f}] | {s['A']:.2f} | {s['equal_to_ar']}/{s['prompts']} |")
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    with open(out / "summary.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(summary[0]))
        w.writeheader()
        w.writerows(summary)
    plot(summary, out / "throughput.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
