"""``dasspec probe NAME``: run one mechanism probe on GSM8K prompts and write NAME.md, NAME.csv and NAME.png into
--out.

    dasspec probe maturity  --prompts 8 --max-new-tokens 64 --out results/probes
    dasspec probe channels  --depths 1,2,4,8 [--coda aligned]
    dasspec probe grid      --draft-depth 2 [--k-depths r,1,2,4,R --v-depths ...]
    dasspec probe factorial [--gamma 32 --rounds 24 --w-init 2 -k 2]
    dasspec probe sweep     [--ks 1,2,4,8 --gammas 8,16,32 --w-inits 1,2,4,8]
    dasspec probe cost      [--self-spec-depth 8 --mature-depth 4 --block 8]
"""

from __future__ import annotations

import argparse
import time

import dasspec

from ...host import THREADS_HELP, check_out_dir, set_threads
from ...methods import resolve_knobs
from ...methods.knobs import add_knob_flags, knobs_from_args
from ...methods.wave import WaveKnobs

PROBES = ("maturity", "channels", "grid", "factorial", "sweep", "cost")


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _common() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("common probe options")
    g.add_argument("--model", default=None, help="checkpoint folder or HF repo id (default: the bundled model)")
    g.add_argument("--prompts", type=int, default=8, help="number of GSM8K test prompts (default 8)")
    g.add_argument("--prompt-offset", type=int, default=0, help="skip this many GSM8K test questions first")
    g.add_argument("--max-new-tokens", type=int, default=64, help="generation cap per prompt (default 64)")
    g.add_argument("--out", default="probe-results",
                   help="folder for NAME.md / NAME.csv / NAME.png (default: %(default)s)")
    g.add_argument("--data", default=None,
                   help="evaluation data folder holding gsm8k/test.jsonl (default: $DASSPEC_DATA)")
    g.add_argument("--num-steps", type=int, default=None, help="target recurrence depth R (default: config)")
    g.add_argument("--init-scale", type=float, default=1.0, help="initial-state scale (0: zero state)")
    g.add_argument("--seed", type=int, default=0, help="seed of the per-position initial states")
    g.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: CUDA when available, else CPU)")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weight and compute type (default: bfloat16 on CUDA, float32 on CPU)")
    g.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    g.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    return p


WAVE_BUDGET = ("gamma", "rounds", "w_init", "k", "guesses", "trim", "seed_branch", "copy_run", "early_stop")


def _wave_flags(p: argparse.ArgumentParser, what: str) -> None:
    """The DAS-Wave budget knobs as flags, derived from ``WaveKnobs`` (default: the model's)."""
    add_knob_flags(p.add_argument_group(f"{what} (default: the model's DAS-Wave knobs)"), [WaveKnobs],
                   set(WAVE_BUDGET))


def add_parser(sub) -> None:
    probe = sub.add_parser("probe", help="mechanism probes (maturity, channels, grid, factorial, sweep, cost)",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = probe.add_subparsers(dest="probe", required=True, metavar="NAME")
    common = _common()

    p = names.add_parser("maturity", parents=[common], help="Q/K/V cosine to the final depth (Figure 2 top)")
    p = names.add_parser("channels", parents=[common], help="agreement of Aligned/Deep V/Deep K/Deep K/V (Table 6)")
    p.add_argument("--depths", type=_ints, default=None, help="draft depths (default 1,2,4,8 up to R)")
    p.add_argument("--coda", choices=["target", "aligned"], default="target",
                   help="prefix coda K/V: the full-depth target's (as decoders do) or the depth-d pass's")
    p = names.add_parser("grid", parents=[common], help="agreement over prefix K depth x V depth (Figure 4)")
    p.add_argument("--draft-depth", type=int, default=2, help="draft depth r (default 2)")
    p.add_argument("--k-depths", default=None, help="key depths, e.g. r,1,2,4,8,R (default: r, powers of 2, R)")
    p.add_argument("--v-depths", default=None, help="value depths (default: as --k-depths)")
    p.add_argument("--coda", choices=["target", "aligned"], default="target",
                   help="prefix coda K/V: the full-depth target's or the depth-d pass's (default: %(default)s)")
    p = names.add_parser("factorial", parents=[common], help="carry x Deep K x Deep V, G and E_cKV (Table 9)")
    _wave_flags(p, "fixed DAS-Wave")
    p = names.add_parser("sweep", parents=[common], help="DAS-Wave speedup and A vs k, gamma, W_init (Fig. 3)")
    _wave_flags(p, "base DAS-Wave")
    p.add_argument("--ks", type=_ints, default=[1, 2, 4, 8], help="k values (default 1,2,4,8)")
    p.add_argument("--gammas", type=_ints, default=[8, 16, 32], help="gamma values (default 8,16,32)")
    p.add_argument("--w-inits", type=_ints, default=[1, 2, 4, 8], help="W_init values (default 1,2,4,8)")
    p = names.add_parser("cost", parents=[common], help="sequential drafters' proposal time (Table 14)")
    p.add_argument("--self-spec-depth", type=int, default=8, help="self-speculation draft depth (default 8)")
    p.add_argument("--mature-depth", type=int, default=4, help="Mature-Spec draft depth (default 4)")
    p.add_argument("--block", "-b", type=int, default=None, help="block length b (default: family)")
    probe.set_defaults(func=cmd_probe)


def _wave_budget(args: argparse.Namespace, model, R: int) -> dict:
    """The flags given, over the model's tuned DAS-Wave defaults, resolved as ``generate`` resolves them (so a
    tuned W_init or seed branch yields to a caller's smaller gamma or anchor window the same way)."""
    user = {k: v for k, v in knobs_from_args(args, [WaveKnobs]).items() if k in WAVE_BUDGET}
    knobs = resolve_knobs(model, "das-wave", user, R)
    return {k: getattr(knobs, k) for k in WAVE_BUDGET}


def cmd_probe(args: argparse.Namespace) -> int:
    # lazy: the probes (and the benchmark harness they share) only when one runs, not for `dasspec probe --help`
    from . import channels, common, cost, factorial, grid, maturity, sweep

    name = args.probe
    progress = not args.no_progress
    out = check_out_dir(args.out)               # before minutes of work, not when the results are written
    set_threads(args.threads)
    t0 = time.perf_counter()
    model = dasspec.load_model(args.model, device=args.device, dtype=args.dtype)
    R = model.depth(args.num_steps)
    prompts = common.encode_prompts(model, common.gsm8k_prompts(args.prompts, args.data, args.prompt_offset))
    kw = dict(num_steps=args.num_steps, init_scale=args.init_scale, seed=args.seed, progress=progress)
    setup = common.model_setup(model, args.num_steps, max_new_tokens=args.max_new_tokens,
                               prompts=f"{args.prompts} GSM8K test (offset {args.prompt_offset})")
    if name in ("maturity", "channels", "grid"):
        trajs = common.greedy_trajectories(model, prompts, args.max_new_tokens, args.num_steps, args.init_scale,
                                           args.seed, progress)
        setup["new tokens (mean)"] = f"{sum(t.new_tokens for t in trajs) / len(trajs):.1f}"
        if name == "maturity":
            maturity.write(maturity.run(model, trajs, **kw), out, setup)
        elif name == "channels":
            channels.write(channels.run(model, trajs, args.depths, coda=args.coda, **kw), out, setup)
        else:
            ka = args.k_depths
            rows = grid.run(model, trajs, args.draft_depth, ka, args.v_depths or ka, coda=args.coda, **kw)
            grid.write(rows, out, setup)
    elif name == "factorial":
        budget = _wave_budget(args, model, R)
        rows, summary = factorial.run(model, prompts, args.max_new_tokens, **budget, **kw)
        factorial.write(rows, summary, out, setup)
    elif name == "sweep":
        base = _wave_budget(args, model, R)
        setup["base schedule"] = sweep.arm_name(base)
        rows = sweep.run(model, prompts, args.max_new_tokens, base,
                         {"k": args.ks, "gamma": args.gammas, "w_init": args.w_inits}, **kw)
        sweep.write(rows, out, setup)
    elif name == "cost":
        cost.write(cost.run(model, prompts, args.max_new_tokens, args.self_spec_depth, args.mature_depth, args.block,
                            **kw), out, setup)
    else:   # argparse restricts NAME; keep the error explicit anyway
        raise ValueError(f"unknown probe {name!r}; available: {', '.join(PROBES)}")
    print(f"[probe {name}] R={R}, {len(prompts)} prompts, {time.perf_counter() - t0:.1f}s -> "
          f"{out / (name + '.md')}, {name}.csv, {name}.png")
    return 0
