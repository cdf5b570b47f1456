"""``dasspec train``: the bundled model's recipe on the command line.

    dasspec train --out DIR                      # the shipped model: CPU, 2 threads, <= 90 minutes
    dasspec train --out DIR --preset cuda-small --device cuda
    dasspec train --out DIR                      # again, after Ctrl-C or a kill: resumes where it stopped
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from .config import PRESETS, TrainConfig

EXIT_INTERRUPTED = 130          # the shell's code for a process stopped by SIGINT


def _parse_override(item: str) -> tuple[str, object]:
    if "=" not in item:
        raise SystemExit(f"--set expects NAME=VALUE, got {item!r}")
    name, value = item.split("=", 1)
    if name not in TrainConfig.__dataclass_fields__:
        raise SystemExit(f"unknown training field {name!r}; fields: {', '.join(TrainConfig.__dataclass_fields__)}")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The preset with ``--set`` / ``--device`` / ``--minutes`` / ``--seed`` applied."""
    over = dict(_parse_override(s) for s in args.set)
    if args.device:
        over["device"] = args.device
    if args.minutes is not None:
        over["time_budget_s"] = 60 * args.minutes
    if args.seed is not None:
        over["seed"] = args.seed
    if "betas" in over:
        over["betas"] = tuple(over["betas"])
    return replace(PRESETS[args.preset], **over)


def cmd_train(args: argparse.Namespace) -> int:
    from .loop import Interrupted
    from .run import train

    cfg = config_from_args(args)
    pilots = {Path(d).name: json.loads((Path(d) / "train_summary.json").read_text()) for d in args.pilots}
    try:
        summary = train(cfg, args.out, data_dir=args.data, pilots=pilots, fresh=args.fresh)
    except KeyboardInterrupt as stop:           # Interrupted: saved at a step boundary; otherwise a second Ctrl-C
        print(stop if isinstance(stop, Interrupted) else "interrupted; the same command resumes from the last saved "
              "state, if there is one")
        return EXIT_INTERRUPTED
    agree = summary["val"]["agreement"]
    print(f"saved {args.out}: {summary['parameters']:,} parameters, {summary['steps']} steps, "
          f"{summary['tokens_seen']:,} tokens in {summary['train_s'] / 60:.1f} min; val loss at R "
          f"{summary['val']['loss'][summary['val']['R']]:.3f}; agreement with depth R: "
          + ", ".join(f"d={d}: {a:.3f}" for d, a in agree.items()))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train the bundled looped model (or a bigger preset on a GPU); rerun to resume")
    p.add_argument("--out", required=True, help="output folder (checkpoint + train_log.csv + train_summary.json); "
                                                "a run stopped there resumes")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--data", default=None, help="data folder: GSM8K and MBPP train are trained on, every "
                                                "evaluation split is kept out (default: $DASSPEC_DATA)")
    p.add_argument("--device", default=None, help="cpu (default for tiny) or cuda")
    p.add_argument("--minutes", type=float, default=None,
                   help="training-time safety stop (default 82, counted across resumes); with --set "
                        "max_steps=null the cosine runs over this budget instead of over steps")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="override any TrainConfig field, e.g. --set mean_recurrence=16 (repeatable)")
    p.add_argument("--fresh", action="store_true",
                   help="start over: discard the resume state (or the finished run) in --out")
    p.add_argument("--pilots", nargs="*", default=[], metavar="DIR",
                   help="earlier runs (folders with train_summary.json) to tabulate in the model card")
    p.set_defaults(func=cmd_train)
