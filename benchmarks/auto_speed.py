"""Method ``auto`` against AR and DAS-Wave (issue 37), side by side in one process, the arms interleaved round by
round; every output is checked equal to AR's (greedy, or sampled with the same seed).

    python benchmarks/auto_speed.py --out runs/auto --threads 1
    python benchmarks/auto_speed.py --out runs/auto --parts trace          # only the switching trace

Parts (``--parts``, comma-separated):

* ``ouro-mid``: a mid-size random Ouro - the real Ouro-1.4B config.json and tokenizer (``--ouro-src``) at width
  512, 8 layers looped T = 4, the real 49,152-id vocabulary, HF's default normal(0, 0.02) init
  (``dasspec.testing.build_real_checkpoint`` at full scale of that config) - and ``ouro-small``: the small random
  Ouro of docs/performance-journal.md ("Ouro": ``build-real --scale small``, width 64, 24 layers).  ``--ouro-prompts``
  GSM8K / MBPP development prompts (zero-shot), ``--ouro-tokens`` greedy tokens each, ``generate_batch`` with
  max_batch B for B in ``--batches``: ar, das-wave (the model's defaults), auto.
* ``bundled``: the bundled model on ``--prompts`` development prompts of each task of ``--tasks`` (default the four
  workloads; GSM8K 2-shot), cap ``--max-new-tokens``, greedy and sampled (T 0.7, top-p 0.95, seed per prompt),
  ``generate_batch`` with max_batch B for B in ``--bundled-batches`` (default 1): ar, das-wave, auto.
* ``trace``: auto on a GSM8K question (``--trace-tokens`` greedy tokens) on each model - the random Ouros' output
  falls into loops after a while: which drafter each step used, what it committed, and how much of it a
  prompt-lookup draft would have matched (where the text starts repeating itself).

Tokens/s is the new tokens of a cell (all its prompts) over its wall time, prefill included; ratios are per round
(paired: the same prompts, one after the other), the median over rounds with the range.  Writes runs.jsonl,
summary.md and trace-*.txt into --out.  A benchmark, never a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build_ouro(src: Path, out: Path, width: int | None) -> Path:
    """A random Ouro folder from ``src``'s config and tokenizer: ``width`` (with 8 layers) at full scale of that
    config, or None for the small scale of docs/performance-journal.md."""
    from dasspec.testing import build_real_checkpoint
    if (out / "config.json").is_file():
        return out
    if width is None:
        return build_real_checkpoint(src, out, "small")
    cfg = json.loads((src / "config.json").read_text())
    heads = width // 64
    cfg.update(hidden_size=width, num_hidden_layers=8, intermediate_size=int(width * 2.75), num_attention_heads=heads,
               num_key_value_heads=heads, head_dim=64, layer_types=["full_attention"] * 8, max_window_layers=8,
               torch_dtype="float32")
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        for f in src.iterdir():
            if f.is_file() and f.name != "config.json":
                shutil.copy(f, t / f.name)
        (t / "config.json").write_text(json.dumps(cfg, indent=1))
        return build_real_checkpoint(t, out, "full")


def ratio(runs, arm, base, **where):
    """Per-round paired ratios arm / base (tokens/s) among the runs matching ``where``: (median, lo, hi)."""
    by = {}
    for r in runs:
        if all(r[k] == v for k, v in where.items()):
            by.setdefault(r["round"], {})[r["arm"]] = r["tokens_per_second"]
    rs = [v[arm] / v[base] for v in by.values() if arm in v and base in v]
    return (statistics.median(rs), min(rs), max(rs)) if rs else (float("nan"),) * 3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--parts", default="ouro-mid,ouro-small,bundled,trace")
    p.add_argument("--ouro-src", default=str(ROOT.parent / "shared" / "checkpoints" / "ouro-1.4b"))
    p.add_argument("--models-dir", default="/tmp/dasspec-auto-models", help="where the random Ouro folders are kept")
    p.add_argument("--data", default=os.environ.get("DASSPEC_DATA") or str(ROOT.parent / "shared" / "data"))
    p.add_argument("--ouro-prompts", type=int, default=4, help="Ouro: prompts per task (GSM8K, MBPP)")
    p.add_argument("--ouro-tokens", type=int, default=32)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompts", type=int, default=2, help="bundled: prompts per task of --tasks")
    p.add_argument("--tasks", default="gsm8k,mbpp,math500,humaneval", help="bundled: the workloads")
    p.add_argument("--bundled-batches", default="1", help="bundled: batch sizes")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--arms", default="ar,das-wave,auto")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--trace-tokens", type=int, default=96)
    args = p.parse_args(argv)

    import torch

    import dasspec
    from dasspec.eval.bench.setup import dev_prompts

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    batches = [int(b) for b in args.batches.split(",")]
    bundled_batches = [int(b) for b in args.bundled_batches.split(",")]
    models_dir = Path(args.models_dir)
    runs: list[dict] = []
    log = open(out / "runs.jsonl", "a")

    def cell(part, model, ids, caps, stops, arm, B, r, sampled=False):
        kw = dict(do_sample=True, temperature=0.7, top_p=0.95, seed=list(range(len(ids)))) if sampled else {}
        t = time.perf_counter()
        res = dasspec.generate_batch(model, ids, arm, max_new_tokens=caps, stop=stops, max_batch=B, **kw)
        sec = time.perf_counter() - t
        new = sum(len(o.tokens) for o in res)
        choices: dict[str, int] = {}
        for o in res:
            for k, v in o.stats.choices.items():
                choices[k] = choices.get(k, 0) + v
        row = {"part": part, "round": r, "arm": arm, "B": B, "sampled": sampled, "seconds": sec, "new_tokens": new,
               "tokens_per_second": new / sec, "A": statistics.fmean(o.stats.A for o in res), "choices": choices}
        return row, [o.tokens for o in res]

    def bench(part, model, ids, caps, stops, settings):
        refs = {}
        for r in range(args.rounds):
            order = [(s, B, a) for s in settings for B in batches_of(part) for a in arms]
            shift = (r * 5) % len(order)
            for sampled, B, arm in order[shift:] + order[:shift]:
                row, toks = cell(part, model, ids, caps, stops, arm, B, r, sampled)
                if sampled not in refs:
                    refs[sampled] = toks if arm == "ar" and B == 1 else \
                        cell(part, model, ids, caps, stops, "ar", 1, r, sampled)[1]
                row["equal_to_ar"] = sum(a == b for a, b in zip(toks, refs[sampled]))
                row["prompts"] = len(ids)
                runs.append(row)
                log.write(json.dumps(row) + "\n")
                log.flush()
                print(f"{part:>10} round {r} {'T0.7' if sampled else 'greedy':>6} B={B:<2} {arm:>9} "
                      f"{row['tokens_per_second']:7.1f} tok/s  {row['equal_to_ar']}/{len(ids)} = AR  {row['choices']}",
                      file=sys.stderr, flush=True)

    def batches_of(part):
        return bundled_batches if part == "bundled" else batches

    def ouro_model(name):
        src = Path(args.ouro_src)
        folder = build_ouro(src, models_dir / name, 512 if name == "ouro-mid" else None)
        return dasspec.load_model(str(folder))

    for part in parts:
        if part in ("ouro-mid", "ouro-small"):
            model = ouro_model(part)
            prompts = dev_prompts(model, "gsm8k,mbpp", args.ouro_prompts, args.ouro_tokens, ["gsm8k=0"], args.data)
            ids = [pr.ids for pr in prompts]
            dasspec.generate_batch(model, ids[:2], "auto", max_new_tokens=4)           # calibration, warm-up
            bench(part, model, ids, [args.ouro_tokens] * len(ids), None, [False])
        elif part == "bundled":
            model = dasspec.load_model()
            prompts = dev_prompts(model, args.tasks, args.prompts, args.max_new_tokens, ["gsm8k=2"], args.data)
            ids = [pr.ids for pr in prompts]
            stops = [list(pr.task.stop) or None for pr in prompts]
            dasspec.generate_batch(model, ids[:2], "auto", max_new_tokens=4)
            bench(part, model, ids, [pr.task.cap for pr in prompts], stops, [False, True])
        elif part == "trace":
            import numpy as np
            from dasspec.methods.pld import find_draft
            for name in ("ouro-mid", "ouro-small", "bundled"):
                model = dasspec.load_model() if name == "bundled" else ouro_model(name)
                pr = dev_prompts(model, "gsm8k", 1, args.trace_tokens, ["gsm8k=0"], args.data)[0]
                res = dasspec.generate(model, pr.ids, "auto", max_new_tokens=args.trace_tokens, trace=True)
                ar = dasspec.generate(model, pr.ids, "ar", max_new_tokens=args.trace_tokens)
                text = list(pr.ids) + res.tokens
                lines = [f"# {name}: auto on a GSM8K question ({len(pr.ids)} prompt tokens), {args.trace_tokens} "
                         f"greedy tokens; equal to AR: {res.tokens == ar.tokens}; steps per drafter "
                         f"{res.stats.choices}; auto {res.stats.tokens_per_second:.1f} tok/s, AR "
                         f"{ar.stats.tokens_per_second:.1f} tok/s",
                         "# repeats: how many of the tokens this step committed a prompt-lookup draft made at its "
                         "start would have matched (the text repeating itself)",
                         "# step  position  drafter  probe  proposed  committed  repeats"]
                pos = len(pr.ids) + 1                 # the first token came from the prefill
                for i, (d, v) in enumerate(res.trace):
                    guess = find_draft(np.array(text[:pos], dtype=np.int64), 3, 64).tolist()
                    got = v.tokens[: v.kept]
                    m = 0
                    while m < min(len(guess), len(got)) and guess[m] == got[m]:
                        m += 1
                    lines.append(f"{i:5d}  {pos - len(pr.ids):8d}  {d.notes.get('auto', '?'):>7}  "
                                 f"{'yes' if d.notes.get('probe') else '':>5}  {len(d.tokens):8d}  {v.kept:9d}  "
                                 f"{m:7d}")
                    pos += v.kept
                (out / f"trace-{name}.txt").write_text("\n".join(lines) + "\n")
                print("\n".join(lines), file=sys.stderr)
    log.close()

    md = ["| part | decoding | B | AR tok/s | DAS-Wave tok/s | auto tok/s | auto / AR | auto / DAS-Wave | "
          "DAS-Wave / AR | = AR |", "|---|---|---|---|---|---|---|---|---|---|"]
    keys = dict.fromkeys((r["part"], r["sampled"], r["B"]) for r in runs)
    for part, sampled, B in keys:
        sel = [r for r in runs if (r["part"], r["sampled"], r["B"]) == (part, sampled, B)]
        tps = {a: statistics.median(r["tokens_per_second"] for r in sel if r["arm"] == a) for a in arms
               if any(r["arm"] == a for r in sel)}
        w = dict(part=part, sampled=sampled, B=B)

        def fmt(x):
            return f"{x[0]:.2f}x [{x[1]:.2f}, {x[2]:.2f}]"
        eq = f"{sum(r['equal_to_ar'] for r in sel)}/{sum(r['prompts'] for r in sel)}"
        md.append(f"| {part} | {'T 0.7' if sampled else 'greedy'} | {B} | {tps.get('ar', 0):.1f} | "
                  f"{tps.get('das-wave', 0):.1f} | {tps.get('auto', 0):.1f} | {fmt(ratio(runs, 'auto', 'ar', **w))} | "
                  f"{fmt(ratio(runs, 'auto', 'das-wave', **w))} | {fmt(ratio(runs, 'das-wave', 'ar', **w))} | {eq} |")
    (out / "summary.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
