"""``dasspec train``: the bundled model's recipe on the command line.

    dasspec train --out DIR                      # the shipped model: CPU, 2 threads, <= 90 minutes
    dasspec train --out DIR --preset cuda-small --device cuda
    dasspec train --out DIR                      # again, after Ctrl-C or a kill: resumes where it stopped

The run works in ``DIR.partial`` and renames it to DIR when the model is complete; an existing DIR is replaced only
with ``--force`` (``resume.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import typing
from dataclasses import replace
from pathlib import Path

from .config import PRESETS, TrainConfig

_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "text"}


def _parse_override(item: str) -> tuple[str, object]:
    """One ``--set NAME=VALUE``: a TrainConfig field and its value, checked against the field's declared type."""
    name, eq, text = item.partition("=")
    name = name.strip()
    if not eq or not name:
        raise ValueError(f"--set expects NAME=VALUE, got {item!r}")
    if name not in TrainConfig.__dataclass_fields__:
        raise ValueError(f"--set {name}: unknown training field; fields: {', '.join(TrainConfig.__dataclass_fields__)}")
    return name, _field_value(name, text.strip())


def _field_value(name: str, text: str) -> object:
    """``text`` (JSON, or plain text for a text field) as a value of TrainConfig field ``name``'s type; an error
    that names the field, what it takes and an example otherwise."""
    kind = typing.get_type_hints(TrainConfig)[name]
    optional = type(None) in typing.get_args(kind)
    base = next(a for a in typing.get_args(kind) if a is not type(None)) if optional else kind
    if base is str:
        return text
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = text
    if value is None and optional:
        return None
    if typing.get_origin(base) is tuple:
        items = value if isinstance(value, list) else [value]
        if len(items) == len(typing.get_args(base)) and all(_is_number(x) for x in items):
            return tuple(float(x) for x in items)
    elif base is bool and isinstance(value, bool):
        return value
    elif base is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif base is float and _is_number(value):
        return float(value)
    want = (f"{len(typing.get_args(base))} numbers as a JSON list" if typing.get_origin(base) is tuple
            else _KINDS.get(base, str(base))) + (" or null" if optional else "")
    example = json.dumps(getattr(TrainConfig(), name)).replace(" ", "")
    raise ValueError(f"--set {name}={text}: {name} takes {want}, e.g. --set {name}={example}")


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The preset with ``--set`` / ``--device`` / ``--minutes`` / ``--seed`` applied."""
    over = dict(_parse_override(s) for s in args.set)
    if args.device:
        over["device"] = args.device
    if args.minutes is not None:
        if not 0 < args.minutes < math.inf:
            raise ValueError(f"--minutes must be a positive number of minutes, got {args.minutes:g}")
        over["time_budget_s"] = 60 * args.minutes
    if args.seed is not None:
        over["seed"] = args.seed
    return replace(PRESETS[args.preset], **over)


def _pilots(folders: list[str]) -> dict[str, dict]:
    """--pilots: each folder's train_summary.json, read before the run so that a bad one fails it at once."""
    out = {}
    for d in folders:
        path = Path(d) / "train_summary.json"
        try:
            out[Path(d).name] = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"--pilots {d}: no train_summary.json there (not a finished dasspec train run)") from None
        except json.JSONDecodeError as err:
            raise ValueError(f"--pilots {d}: {path} is not valid JSON (line {err.lineno}: {err.msg})") from None
    return out


def cmd_train(args: argparse.Namespace) -> int:
    # lazy: the training modules load torch; `dasspec train --help` (this module) must not
    from .loop import Interrupted
    from .resume import STATE_FILE, partial_dir
    from .run import train

    cfg = config_from_args(args)
    pilots = _pilots(args.pilots)
    try:
        summary = train(cfg, args.out, data_dir=args.data, pilots=pilots, fresh=args.fresh, force=args.force)
    except Interrupted:
        raise
    except KeyboardInterrupt:                   # a second Ctrl-C: the last periodic state stands
        state = partial_dir(Path(args.out)) / STATE_FILE
        saved = f"the last saved state is {state}" if state.exists() else "no state was saved yet"
        raise Interrupted(f"stopped at once; {saved} - run the same command again to resume") from None
    agree = summary["val"]["agreement"]
    print(f"saved {args.out}: {summary['parameters']:,} parameters, {summary['steps']} steps, "
          f"{summary['tokens_seen']:,} tokens in {summary['train_s'] / 60:.1f} min; val loss at R "
          f"{summary['val']['loss'][summary['val']['R']]:.3f}; agreement with depth R: "
          + ", ".join(f"d={d}: {a:.3f}" for d, a in agree.items()))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train the bundled looped model (or a bigger preset on a GPU); rerun to resume")
    p.add_argument("--out", required=True, help="model folder to create (checkpoint + train_log.csv + "
                                                "train_summary.json); the run works in OUT.partial, where a "
                                                "stopped run resumes, and renames it to OUT when complete")
    p.add_argument("--force", action="store_true",
                   help="replace an existing --out folder (only once the new run completes; until then it is "
                        "left as it is)")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="settings (default: %(default)s)")
    p.add_argument("--data", default=None, help="data folder: GSM8K and MBPP train are trained on, every "
                                                "evaluation split is kept out (default: $DASSPEC_DATA)")
    p.add_argument("--device", default=None, help="cpu (default for tiny) or cuda")
    p.add_argument("--minutes", type=float, default=None,
                   help="training-time safety stop, > 0 (default 82, counted across resumes); with --set "
                        "max_steps=null the cosine runs over this budget instead of over steps")
    p.add_argument("--seed", type=int, default=None, help="seed of the initialisation, the data order and the "
                                                          "depth draws (default: the preset's, 0)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="override any TrainConfig field, e.g. --set mean_recurrence=16 or --set betas=[0.9,0.99] "
                        "(repeatable; values are JSON, checked against the field's type)")
    p.add_argument("--fresh", action="store_true",
                   help="start over: discard the stopped run in OUT.partial")
    p.add_argument("--pilots", nargs="*", default=[], metavar="DIR",
                   help="earlier runs (folders with train_summary.json) to tabulate in the model card")
    p.set_defaults(func=cmd_train)
