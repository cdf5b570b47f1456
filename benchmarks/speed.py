"""Speed benchmark (issue 8): every decoder and every baseline on the same prompts, in one process, interleaved per
prompt, each paired with full-depth AR; prints and writes, per method:

    tokens/s | measured speedup S over AR (eq. 8, 95% CI) | pass-count speedup | efficiency | A | G | memory

* pass-count speedup: AR's sequential core passes / the method's, per prompt (tokens-normalised), averaged like S.
  It is what the method would gain if a core pass cost the same at every width - hardware independent.
* efficiency = measured S / pass-count speedup: how much of that limit the hardware delivers.  Wider passes
  (DAS-Wave drafts W_j positions, verifies gamma) cost more than one-position passes, so efficiency < 1.
* the same three for the decode phase alone (a second table): the first token and the prefill, identical for
  every method and weighed by the pass count as only R passes, are left out on both sides.
* memory: peak resident memory of the process during the generation on CPU (peak allocated on CUDA), and the
  depth cache allocated for it.

and per task: each method's S (and A), AR's share of time in prefill and the *prefill bound* - the S a method
would reach if everything after the prefill cost nothing (mean over prompts of AR's time / AR's prefill time).
Every method runs the same full-depth prefill and the paper's S includes it, so a task whose outputs are short
(a request that stops after a few tokens is mostly prefill) caps every method near 1x, whatever it drafts.
``--prefix-cache`` prefills each task's shared few-shot prefix once before timing and lets every method, AR
included, copy those rows (``dasspec.PrefixCache``; the task table shows the mean prompt and cached tokens).

    python benchmarks/speed.py --out runs/speed                      # bundled model, HumanEval + GSM8K
    python benchmarks/speed.py --model PATH --tasks gsm8k --prompts 10 --threads 2 --out runs/speed-gsm

Results are resumable (records.jsonl, the benchmark harness's format); ``--report-only`` rebuilds the tables.
This is a benchmark, never a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

METHODS = ["ar", "self-spec", "mature-spec", "das-wave", "pld", "lookahead", "token-recycling", "sam"]
BASELINES = ["pld", "lookahead", "token-recycling", "sam"]


def speed_table(out: Path, n_resamples: int = 10_000) -> tuple[str, list[dict]]:
    from dasspec.eval.bench import metrics
    from dasspec.eval.bench.report import method_label, pair_with_ar
    from dasspec.eval.bench.runner import RECORDS, load_records

    records = load_records(out / RECORDS)
    rows, _ = pair_with_ar(records)
    by_method: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by_method[row["method"]].append(row)
    mem: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        mem[r["method"]].append(r)
    table = []
    for method in sorted(by_method, key=lambda m: METHODS.index(m) if m in METHODS else len(METHODS)):
        g = sorted(by_method[method], key=lambda x: (x["task"], x["prompt_index"]))
        stateful = any(x["stateful"] for x in g)
        cell = metrics.summarize_speedup([x["ratio"] for x in g], stateful, n_resamples)
        S, passes = cell["S"], metrics.speedup([x["pass_ratio"] for x in g])
        peaks = [r.get("peak_memory") for r in mem[method] if r.get("peak_memory")]
        table.append({
            "method": method, "prompts": len(g), "matches": sum(x["match"] for x in g),
            "tokens_per_second": float(np.mean([x["tokens_per_second"] for x in g])),
            "S": S, "lo": cell["lo"], "hi": cell["hi"], "pass_speedup": passes, "efficiency": S / passes,
            "A": metrics.mean_over_prompts([x["A_p"] for x in g]),
            "G": metrics.mean_over_prompts([x["G_p"] for x in g]),
            **decode_cells([x for x in g if x["decode_ratio"] is not None]),
            "peak_memory_mib": max(peaks) / 2**20 if peaks else None,
            "cache_mib": max(r.get("cache_bytes", 0) for r in mem[method]) / 2**20,
        })
    fastest = max((t for t in table if t["method"] in BASELINES), key=lambda t: t["S"], default=None)

    def f(x, d=2):
        return "–" if x is None else f"{x:.{d}f}"

    lines = ["| method | tok/s | speedup S [95% CI] | pass-count speedup | efficiency | A | G | peak mem (MiB) "
             "| cache (MiB) | = AR |", "|---|---|---|---|---|---|---|---|---|---|"]
    for t in table:
        name = method_label(t["method"]) + (" (fastest baseline)" if fastest is t else "")
        ci = "" if t["method"] == "ar" else f" [{f(t['lo'])}, {f(t['hi'])}]"
        lines.append(f"| {name} | {f(t['tokens_per_second'], 1)} | {f(t['S'])}×{ci} | {f(t['pass_speedup'])}× | "
                     f"{f(t['efficiency'])} | {f(t['A'])} | {f(t['G'])} | {f(t['peak_memory_mib'], 0)} | "
                     f"{f(t['cache_mib'], 1)} | {t['matches']}/{t['prompts']} |")
    return ("\n".join(lines) + "\n\n" + task_table(rows, [t["method"] for t in table]) + "\n\n"
            + decode_table(table), table)


def decode_cells(g: list[dict]) -> dict:
    """S, pass-count speedup and efficiency of the decode phase alone (``report.decode_ratios``: the tokens after
    the first, over the time and passes after the prefill), averaged over the prompts where both sides decoded."""
    from dasspec.eval.bench import metrics

    if not g:
        return {"decode_prompts": 0, "decode_S": None, "decode_pass_speedup": None, "decode_efficiency": None}
    S, passes = metrics.speedup([x["decode_ratio"] for x in g]), metrics.speedup([x["decode_pass_ratio"] for x in g])
    return {"decode_prompts": len(g), "decode_S": S, "decode_pass_speedup": passes, "decode_efficiency": S / passes}


def decode_table(table: list[dict]) -> str:
    """The decode phase alone: every method runs the same full-depth prefill, which the paper's S includes and the
    pass count weighs as only R passes, so this separates what the drafting and verification deliver."""
    from dasspec.eval.bench.report import method_label

    lines = ["Decode phase alone (the prefill and its first token left out on both sides):", "",
             "| method | prompts | decode S | decode pass-count speedup | decode efficiency |", "|---|---|---|---|---|"]
    for t in table:
        if t["method"] == "ar" or not t["decode_prompts"]:
            continue
        lines.append(f"| {method_label(t['method'])} | {t['decode_prompts']} | {t['decode_S']:.2f}× | "
                     f"{t['decode_pass_speedup']:.2f}× | {t['decode_efficiency']:.2f} |")
    return "\n".join(lines)


def task_table(rows: list[dict], methods: list[str]) -> str:
    """Per task: S (A) of every method, AR's prefill share and the prefill bound (see the module docstring)."""
    from dasspec.eval.bench import metrics
    from dasspec.eval.bench.report import method_label, prefill_share_and_bound, task_label

    others = [m for m in methods if m != "ar"]
    head = ["task", "prompts", "prompt tokens (cached)", "AR new tokens", "AR time in prefill", "prefill bound"] + \
        [f"{method_label(m)} S (A)" for m in others]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for task in sorted({r["task"] for r in rows}):
        ar = [r for r in rows if r["task"] == task and r["method"] == "ar"]
        share, bound = prefill_share_and_bound(ar)
        if share is None:
            continue
        cells = []
        for m in others:
            g = [r for r in rows if r["task"] == task and r["method"] == m]
            cells.append(f"{metrics.speedup([r['ratio'] for r in g]):.2f}× "
                         f"({metrics.mean_over_prompts([r['A_p'] for r in g]):.1f})" if g else "–")
        prompt = np.mean([r["prompt_tokens"] or 0 for r in ar])
        cached = np.mean([r["cached_tokens"] or 0 for r in ar])
        lines.append(f"| {task_label(task)} | {len(ar)} | {prompt:.0f} ({cached:.0f}) | "
                     f"{np.mean([r['ar_new_tokens'] for r in ar]):.1f} | "
                     f"{share:.0%} | {bound:.2f}× | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(table: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from dasspec.eval.bench.report import method_label

    rows = [t for t in table if t["method"] != "ar"]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(8, 3.8))
    ax.bar(x - 0.2, [t["pass_speedup"] for t in rows], 0.4, label="pass-count speedup (limit)", color="#c8d6e5")
    ax.bar(x + 0.2, [t["S"] for t in rows], 0.4, label="measured speedup S", color="#2e86de",
           yerr=[[t["S"] - t["lo"] for t in rows], [t["hi"] - t["S"] for t in rows]], capsize=3)
    for i, t in enumerate(rows):
        ax.text(i + 0.2, t["hi"] + 0.1, f"{t['efficiency']:.2f}", ha="center", fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(x, [method_label(t["method"]) for t in rows], rotation=20, ha="right")
    ax.set_ylabel("× over full-depth AR")
    ax.set_title("Measured vs pass-count speedup (numbers: efficiency)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from dasspec.cli import (add_exec_flags, add_sampling_flags, load_for_args, runtime_from_args,
                             sampling_from_args)

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=None, help="checkpoint folder (default: the bundled model)")
    p.add_argument("--tasks", default="humaneval,gsm8k")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--prompts", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--shots", action="append", default=[], metavar="TASK=N", help="e.g. gsm8k=2")
    p.add_argument("--knobs", action="append", default=[], metavar="METHOD:NAME=VALUE[,...]")
    p.add_argument("--data", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's, = cores)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--report-only", action="store_true")
    add_exec_flags(p)
    add_sampling_flags(p, seed_flag="seed (0)")
    p.add_argument("--fresh", action="store_true")
    p.add_argument("--prefix-cache", action="store_true",
                   help="every method reuses each task's shared few-shot prefix, prefilled once before timing")
    args = p.parse_args(argv)

    import torch

    from dasspec.eval.bench.runner import BenchPlan, RunFolder, parse_knobs, resolve_tasks, run_bench

    out = Path(args.out)
    if not args.report_only:
        if args.threads:
            torch.set_num_threads(args.threads)
        model = load_for_args(args)
        shots = {k: int(v) for k, v in (s.split("=") for s in args.shots)}
        tasks = resolve_tasks(args.tasks.split(","), {"*": args.max_new_tokens}, shots)
        sampling = {k: v for k, v in sampling_from_args(args).items() if k != "do_sample"} or None
        plan = BenchPlan(tasks=tasks, methods=args.methods.split(","), knobs=parse_knobs(args.knobs),
                         prompts=args.prompts, data=args.data, prefix_cache=args.prefix_cache, sampling=sampling,
                         runtime=runtime_from_args(args, track_memory=True))
        with RunFolder(out, fresh=args.fresh) as folder:     # --fresh clears it once the run starts
            run_bench(model, plan, folder, model_name=args.model or "bundled")
    from dasspec.eval.bench.report import decoding_label

    text, table = speed_table(out)
    info = json.loads((out / "run.json").read_text()) if (out / "run.json").exists() else {}
    text = f"Decoding: {decoding_label(info.get('sampling'))}\n\n" + text
    (out / "speed.md").write_text(text + "\n")
    with open(out / "speed.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(table[0]))
        w.writeheader()
        w.writerows(table)
    (out / "speed.json").write_text(json.dumps(table, indent=2))
    plot(table, out / "speed.png")
    print(text)
    print(f"\nwritten: {out / 'speed.md'}, speed.csv, speed.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
