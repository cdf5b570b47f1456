"""Tune DAS-Wave's budget (k, J, gamma, W_init) on the *development* prompts, as the paper tuned its settings
before freezing them (Appendix A.2).  Each configuration is paired with full-depth AR on the same dev prompts in
the same process, configurations interleaved per prompt; prints S (eq. 8), the pass-count speedup, A and G.

    python benchmarks/tune_wave.py --out runs/tune --rounds 4,8 --gammas 48 --w-inits g --guesses anchor,copy

The chosen setting goes into the model folder's generation_config.json ("dasspec": {"das-wave": {...}}), which
``dasspec.generate`` reads as the model's defaults.  Never tune on the evaluation prompts.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--tasks", default="humaneval,gsm8k")
    p.add_argument("--prompts", type=int, default=4, help="dev prompts per task")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--shots", action="append", default=[], metavar="TASK=N")
    p.add_argument("--ks", default="1,2")
    p.add_argument("--rounds", default="16,24,32")
    p.add_argument("--gammas", default="32")
    p.add_argument("--w-inits", default="2", help="comma list; 'g' means W_init = gamma (a full window at once)")
    p.add_argument("--guesses", default="anchor", help="window seeds to try: anchor, lookup, copy (comma list)")
    p.add_argument("--trims", default="false", help="trim settings to try: false, true or both (comma list)")
    p.add_argument("--carries", default="true", help="carry latent states across rounds: false, true or both")
    p.add_argument("--seed-branches", default="0",
                   help="longest seed branch verified beside the wave's chain (guesses lookup/copy), comma list; "
                        "0 = off")
    p.add_argument("--copy-runs", default="false",
                   help="after a block whose seed was accepted whole, verify the next seed without rounds: "
                        "false, true or both")
    p.add_argument("--early-stops", default="false",
                   help="stop a block's rounds after one that changed no guess: false, true or both")
    p.add_argument("--repeats", type=int, default=1,
                   help="time every generation this many times (order rotated) and keep each one's fastest run")
    p.add_argument("--policy", default="deep-kv")
    p.add_argument("--data", default=None)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)

    import torch
    from tqdm.auto import tqdm

    import dasspec
    from dasspec.eval.bench import metrics
    from dasspec.eval.bench.runner import dev_prompts

    if args.threads:
        torch.set_num_threads(args.threads)
    model = dasspec.load_model(args.model)
    prompts = dev_prompts(model, args.tasks, args.prompts, args.max_new_tokens, args.shots, args.data)
    ints = lambda s: [int(x) for x in s.split(",")]                                      # noqa: E731
    bools = lambda s: [x.strip().lower() in ("1", "true", "on", "yes") for x in s.split(",")]     # noqa: E731
    configs = [{"k": k, "rounds": J, "gamma": g, "w_init": w, "guesses": s, "trim": t, "carry": c,
                "seed_branch": b, "copy_run": r, "early_stop": e, "policy": args.policy}
               for k, J, g, w, s, t, c, b, r, e in itertools.product(
                   ints(args.ks), ints(args.rounds), ints(args.gammas), args.w_inits.split(","),
                   args.guesses.split(","), bools(args.trims), bools(args.carries), ints(args.seed_branches),
                   bools(args.copy_runs), bools(args.early_stops))
               for w in [g if w.strip() == "g" else int(w)] if w <= g]
    arms = [("ar", {})] + [("das-wave", c) for c in configs]
    rows: dict[int, list[dict]] = {i: [] for i in range(len(arms))}
    toks: dict[int, list[list[int]]] = {i: [] for i in range(len(arms))}
    dasspec.generate(model, prompts[0].ids, "das-wave", max_new_tokens=16)            # warm-up
    reps = max(1, args.repeats)
    bar = tqdm(total=len(prompts) * len(arms) * reps, desc="tune", unit="gen")
    for pi, pr in enumerate(prompts):
        best: dict[int, object] = {}
        for rep in range(reps):
            first = (pi + rep) % len(arms)
            order = list(range(first, len(arms))) + list(range(first))                 # interleave
            for a in order:
                method, knobs = arms[a]
                res = dasspec.generate(model, pr.ids, method, max_new_tokens=pr.task.cap, stop=list(pr.task.stop),
                                       **knobs)
                if a in best and best[a].tokens != res.tokens:
                    raise AssertionError(f"{method} {knobs} is not deterministic on a development prompt")
                if a not in best or res.stats.wall_time < best[a].stats.wall_time:
                    best[a] = res
                bar.update(1)
        for a, res in best.items():
            rows[a].append(res.stats)
            toks[a].append(res.tokens)
    bar.close()
    ar = rows[0]
    table = []
    for a, (method, knobs) in enumerate(arms[1:], 1):
        s = rows[a]
        if toks[a] != toks[0]:
            raise AssertionError(f"das-wave {knobs} produced tokens that differ from AR's")
        ratio = metrics.throughput_ratios([x.new_tokens for x in s], [x.wall_time for x in s],
                                          [y.new_tokens for y in ar], [y.wall_time for y in ar])
        passes = metrics.throughput_ratios([x.new_tokens for x in s], [x.sequential_passes for x in s],
                                           [y.new_tokens for y in ar], [y.sequential_passes for y in ar])
        table.append({**{k: v for k, v in knobs.items()}, "S": float(np.mean(ratio)),
                      "pass_speedup": float(np.mean(passes)), "A": float(np.mean([x.A for x in s])),
                      "G": float(np.mean([x.G for x in s]))})
    table.sort(key=lambda t: -t["S"])
    lines = ["| k | J | gamma | W_init | guesses | trim | carry | seed branch | copy run | early stop | S (dev) "
             "| pass-count | A | G |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    onoff = lambda b: "on" if b else "off"                                              # noqa: E731
    for t in table:
        lines.append(f"| {t['k']} | {t['rounds']} | {t['gamma']} | {t['w_init']} | {t['guesses']} | "
                     f"{onoff(t['trim'])} | {onoff(t['carry'])} | {t['seed_branch'] or 'off'} | "
                     f"{onoff(t['copy_run'])} | {onoff(t['early_stop'])} | {t['S']:.2f}× | "
                     f"{t['pass_speedup']:.2f}× | {t['A']:.2f} | {t['G']:.2f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune.md").write_text(f"dev prompts: {len(prompts)} ({args.tasks}), cap {args.max_new_tokens}, "
                                 f"torch threads {torch.get_num_threads()}, fastest of {reps} run(s) per "
                                 "generation\n\n" + "\n".join(lines) + "\n")
    (out / "tune.json").write_text(json.dumps(table, indent=2))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
