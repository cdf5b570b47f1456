"""Tune DAS-Wave's knobs (or another method's: ``--method self-spec``) on the *development* prompts, as the paper
tuned its settings before freezing them (Appendix A.2).  Every configuration of the grid is paired with full-depth
AR on the same dev prompts in the same process, configurations interleaved per prompt (``dasspec.eval.pairing``);
prints S (eq. 8), the pass-count speedup, A and G.

    python benchmarks/tune_wave.py --out runs/tune -J 4,8 --gamma 48 --w-init g --guesses anchor,copy
    python benchmarks/tune_wave.py --out runs/tune-seq --method self-spec --draft-depth 1,2,3 --block 2,4,8

Every knob of the method is a flag taking a comma-separated list of values (derived from its knobs dataclass:
``--gamma``, ``-J/--rounds``, ``-k``, ``--w-init`` (``g`` = gamma: a full window at once), ``--guesses``,
``--trim true,false``, ...); a knob not given keeps the model's default.  The chosen setting goes into the model
folder's generation_config.json ("dasspec": {"das-wave": {...}}), which ``dasspec.generate`` reads as the model's
defaults, or, for a model family's built-in defaults, into its ``knob_defaults``.  Never tune on the evaluation
prompts.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    from dasspec.cli import add_sampling_flags, sampling_from_args
    from dasspec.methods import get_method
    from dasspec.methods.knobs import add_knob_flags, knobs_from_args

    pick = argparse.ArgumentParser(add_help=False)
    pick.add_argument("--method", default="das-wave")
    method = get_method(pick.parse_known_args(argv)[0].method).name     # its knobs are the grid's flags
    Grid = get_method(method).knobs
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--method", default="das-wave", help="the method tuned (default: %(default)s)")
    p.add_argument("--model", default=None)
    p.add_argument("--tasks", default="humaneval,gsm8k")
    p.add_argument("--prompts", type=int, default=4, help="dev prompts per task")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--shots", action="append", default=[], metavar="TASK=N")
    p.add_argument("--repeats", type=int, default=1,
                   help="time every generation this many times (order rotated) and keep each one's fastest run")
    p.add_argument("--data", default=None)
    p.add_argument("--threads", type=int, default=None)
    add_knob_flags(p.add_argument_group(f"{method} knob grid"), [Grid], grid=True)
    add_sampling_flags(p, seed_flag="seed (0)")
    args = p.parse_args(argv)
    sampling = sampling_from_args(args)              # every arm, AR included, samples alike

    import torch
    from tqdm.auto import tqdm

    import dasspec
    from dasspec.eval.bench import metrics
    from dasspec.eval.bench.runner import dev_prompts
    from dasspec.eval.pairing import paired_runs
    from dasspec.methods import resolve_knobs

    if args.threads:
        torch.set_num_threads(args.threads)
    model = dasspec.load_model(args.model)
    prompts = dev_prompts(model, args.tasks, args.prompts, args.max_new_tokens, args.shots, args.data)
    w_init = getattr(args, "w_init", None)
    args.w_init = None                               # "g" is not an integer: expanded per gamma below
    grid = knobs_from_args(args, [Grid], grid=True)
    names = list(grid)
    sampled = bool(sampling.get("do_sample"))        # the defaults an arm does not set: the sampled ones then
    default_gamma = resolve_knobs(model, method, {n: v[0] for n, v in grid.items()},    # (for w_init g)
                                  sampled=sampled).gamma if w_init else None
    configs = []
    for values in itertools.product(*grid.values()):
        config = dict(zip(names, values))
        for w in (w_init.split(",") if w_init else [None]):
            c = dict(config)
            if w is not None:
                c["w_init"] = c.get("gamma", default_gamma) if w.strip() == "g" else int(w)
            configs.append(c)
    knobs = [resolve_knobs(model, method, c, sampled=sampled).as_dict() for c in configs]   # validated early
    arms = [("ar", {})] + [(method, c) for c in configs]
    reps = max(1, args.repeats)
    best: dict[tuple[int, int], object] = {}
    bar = tqdm(total=len(prompts) * len(arms) * reps, desc="tune", unit="gen")

    def run_one(job, a: int):
        (_, pr, _), (method, kn) = job, arms[a]
        res = dasspec.generate(model, pr.ids, method, max_new_tokens=pr.task.cap, stop=list(pr.task.stop), **kn,
                               **sampling)
        bar.update(1)
        return res

    jobs = [(pi, pr, rep) for pi, pr in enumerate(prompts) for rep in range(reps)]
    warm = lambda job, a: dasspec.generate(model, job[1].ids, arms[a][0], max_new_tokens=16,  # noqa: E731
                                           **arms[a][1], **sampling)
    for run in paired_runs(jobs, list(range(len(arms))), run_one, warmup=warm, shift=lambda job: job[0] + job[2],
                           cuda=model.device.type == "cuda"):
        key, res = (run.prompt[0], run.arm), run.result
        if key in best and best[key].tokens != res.tokens:
            raise AssertionError(f"{arms[run.arm]} is not deterministic on a development prompt")
        if key not in best or res.stats.wall_time < best[key].stats.wall_time:
            best[key] = res
    bar.close()
    ar = [best[pi, 0] for pi in range(len(prompts))]
    table = []
    for a in range(1, len(arms)):
        rr = [best[pi, a] for pi in range(len(prompts))]
        if [r.tokens for r in rr] != [r.tokens for r in ar]:
            raise AssertionError(f"{method} {arms[a][1]} produced tokens that differ from AR's")
        s, sa = [r.stats for r in rr], [r.stats for r in ar]
        ratio = metrics.throughput_ratios([x.new_tokens for x in s], [x.wall_time for x in s],
                                          [y.new_tokens for y in sa], [y.wall_time for y in sa])
        passes = metrics.throughput_ratios([x.new_tokens for x in s], [x.sequential_passes for x in s],
                                           [y.new_tokens for y in sa], [y.sequential_passes for y in sa])
        table.append({**{k: getattr(v, 'name', v) for k, v in knobs[a - 1].items()}, "S": float(np.mean(ratio)),
                      "pass_speedup": float(np.mean(passes)), "A": float(np.mean([x.A for x in s])),
                      "G": float(np.mean([x.G for x in s]))})
    table.sort(key=lambda t: -t["S"])
    shown = [n for n in Grid.names() if n in names or n == "w_init" and w_init]
    lines = ["| " + " | ".join(shown) + " | S (dev) | pass-count | A | G |", "|---" * (len(shown) + 4) + "|"]
    for t in table:
        lines.append("| " + " | ".join(str(t[n]) for n in shown) +
                     f" | {t['S']:.2f}× | {t['pass_speedup']:.2f}× | {t['A']:.2f} | {t['G']:.2f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune.md").write_text(f"{method}, dev prompts: {len(prompts)} ({args.tasks}), cap {args.max_new_tokens}, "
                                 f"torch threads {torch.get_num_threads()}, {sampling or 'greedy'}, fastest of {reps} "
                                 "run(s) per "
                                 "generation; knobs not in the grid: the model's defaults\n\n" + "\n".join(lines)
                                 + "\n")
    (out / "tune.json").write_text(json.dumps(table, indent=2))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
