"""The command-line flags the ``dasspec`` commands share, and what they parse into: method knobs, sampling, the
target's early exit, execution (``Runtime``), the model to load, and the exit codes.

Below every command module (``dasspec.cli``, ``eval.bench.cli``, ``serve.cli``, the benchmarks), which import these
from here; ``dasspec.cli`` re-exports them.  Importing this module loads no torch: the helpers that need the
methods, the model or the runtime import them when called.
"""

from __future__ import annotations

import argparse

import dasspec

EXIT_USAGE = 2                  # argparse's code for a bad command line: every command's input errors use it too
EXIT_FAILED = 1                 # the environment failed (disk full, ...), not the input
EXIT_INTERRUPTED = 130          # the shell's code for a process stopped by SIGINT


def add_knob_flags(p: argparse.ArgumentParser) -> None:
    """Every registered method's knobs as flags (derived from their dataclasses), plus --set NAME=VALUE."""
    # lazy: the methods load torch; only a command that declares its knob flags pays for it
    from .methods import all_knobs
    from .methods.knobs import add_knob_flags as add

    g = p.add_argument_group("method knobs (named after the paper; defaults per model family, Table 5)")
    add(g, all_knobs())
    g.add_argument("--set", dest="extra", action="append", default=[], metavar="NAME=VALUE",
                   help="a method knob as NAME=VALUE (repeatable), e.g. --set static_corpus=docs.jsonl")


def knobs_from_args(args: argparse.Namespace) -> dict:
    # lazy: the methods load torch (as in add_knob_flags)
    from .methods import all_knobs
    from .methods.knobs import knobs_from_args as parse

    return parse(args, all_knobs(), getattr(args, "extra", []))


def add_sampling_flags(p, seed_flag: str = "--seed") -> None:
    p.add_argument("--temperature", type=float, default=None,
                   help="sample at this temperature (> 0; 0 = greedy, the default); lossless: every method emits "
                        f"what AR sampling emits at the same {seed_flag}")
    p.add_argument("--top-k", dest="top_k", type=int, default=None, help="sample from the k most likely tokens")
    p.add_argument("--top-p", dest="top_p", type=float, default=None, help="sample from the top tokens holding p")
    p.add_argument("--min-p", dest="min_p", type=float, default=None,
                   help="sample from tokens at least min_p x as likely as the most likely one")


def sampling_from_args(args: argparse.Namespace) -> dict:
    """generate()'s sampling options from the flags: a temperature > 0 or any filter samples (temperature 1.0 by
    default); --temperature 0 (or none of them) decodes greedily."""
    filters = {k: getattr(args, k) for k in ("top_k", "top_p", "min_p") if getattr(args, k, None) is not None}
    t = getattr(args, "temperature", None)
    if t == 0:
        if filters:
            raise ValueError(f"--temperature 0 decodes greedily; {', '.join(filters)} need sampling (a temperature "
                             "> 0)")
        return {}
    if t is None and not filters:
        return {}
    return {"do_sample": True, "temperature": t, **filters}


def add_exit_flags(p) -> None:
    """The target's early exit, for models with an exit gate (Ouro); every method stays lossless against it."""
    p.add_argument("--exit-threshold", dest="exit_threshold", type=float, default=None, metavar="TAU",
                   help="read each position from the first recurrence step whose cumulative exit probability "
                        "reaches TAU in [0, 1] (Ouro's early exit; default: the last step)")
    p.add_argument("--exit-at-step", dest="exit_at_step", type=int, default=None, metavar="S",
                   help="read every position from recurrence step S (0-based, as Ouro's exit_at_step)")


def exit_from_args(args: argparse.Namespace) -> dict:
    """generate()'s exit options from the flags, their values checked before any model loads (whether the model
    has an exit gate, and S against its depth, once it has loaded)."""
    from .model.exit import ExitRule        # lazy: the model loads torch; a flag check should not wait for it

    given = {k: getattr(args, k) for k in ("exit_threshold", "exit_at_step") if getattr(args, k, None) is not None}
    try:
        ExitRule.of(**given)
    except ValueError as err:
        raise ValueError(f"{err} (--exit-threshold / --exit-at-step)") from None
    return given


def add_exec_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("execution (GPU options; see dasspec.Runtime)")
    g.add_argument("--static-shapes", action="store_true", help="fixed-shape attention over the whole cache")
    g.add_argument("--compile", action="store_true", help="torch.compile the model primitives (implies static)")
    g.add_argument("--cuda-graphs", action="store_true", help="CUDA graphs via torch.compile reduce-overhead")


def runtime_from_args(args: argparse.Namespace, track_memory: bool = False):
    from .engine.base.runtime import Runtime     # lazy: torch

    return Runtime(static_shapes=getattr(args, "static_shapes", False), compile=getattr(args, "compile", False),
                   cuda_graphs=getattr(args, "cuda_graphs", False), track_memory=track_memory)


def load_for_args(args: argparse.Namespace):
    """load_model for the --model / --device / --dtype flags shared by generate / bench / probe and benchmarks."""
    return dasspec.load_model(args.model, device=args.device, dtype=args.dtype)
