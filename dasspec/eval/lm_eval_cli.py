"""``dasspec eval``: lm-evaluation-harness's own command line (``lm-eval run ...``) with dasspec's model and tasks.

lm-eval's command line has no way for an installed package to add a model name, so this command registers
``dasspec`` (``DasspecLM``) in lm-eval's model registry, adds the offline tasks shipped with dasspec
(``dasspec/eval/lm_eval_tasks``) to ``--include_path``, and hands every argument to lm-eval unchanged: its run
(``simple_evaluate``) takes ``--tasks``, ``--limit``, ``--num_fewshot``, ``--output_path``, ``--log_samples``,
``--batch_size``, ``--gen_kwargs`` ... as documented by lm-eval (``dasspec eval --help``)::

    dasspec eval --model dasspec --model_args method=das-wave --tasks dasspec_gsm8k_cot --limit 20 \\
        --output_path runs/eval --log_samples

Needs the ``eval`` extra (``pip install 'dasspec[eval]'``: lm-eval 0.4.13).
"""

from __future__ import annotations

import argparse
import sys

HELP = "lm-evaluation-harness with dasspec's model and offline tasks (lm-eval's own arguments)"
LM_EVAL_COMMANDS = ("run", "ls", "validate")


def add_parser(sub) -> argparse.ArgumentParser:
    # every argument is lm-eval's: no option of ours (a prefix character nobody types keeps argparse from reading
    # lm-eval's --flags as this parser's)
    p = sub.add_parser("eval", help=HELP, description=__doc__, add_help=False, prefix_chars="\x01",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("lm_eval_args", nargs="*", help="lm-eval's arguments (lm-eval run --help)")
    p.set_defaults(func=cmd_eval)
    return p


def lm_eval_argv(args: list[str]) -> list[str]:
    """lm-eval's argv: ``run`` unless a subcommand of lm-eval's is named (its own legacy rule)."""
    if not args:
        return ["run", "--help"]
    if args[0] in ("-h", "--help"):
        return ["run", "--help"]
    return args if args[0] in LM_EVAL_COMMANDS else ["run", *args]


def cmd_eval(args: argparse.Namespace) -> int:
    try:
        # optional: lm-eval (the [eval] extra), named below when it is missing
        from lm_eval._cli import HarnessCLI
        from lm_eval.utils import setup_logging
    except ImportError as err:
        raise ValueError(f"dasspec eval needs lm-evaluation-harness, which is not installed ({err}); install "
                         "it with: pip install 'dasspec[eval]'") from None
    from .lm_eval_model import TASKS_DIR, register     # optional: imports lm-eval, checked just above

    register()
    setup_logging()
    cli = HarnessCLI()
    argv = lm_eval_argv(list(args.lm_eval_args))
    saved = sys.argv
    sys.argv = ["dasspec eval", *argv]
    try:
        ns = cli.parse_args()
    finally:
        sys.argv = saved
    if hasattr(ns, "include_path"):
        ns.include_path = str(TASKS_DIR) if ns.include_path is None else [str(TASKS_DIR), ns.include_path]
    cli.execute(ns)
    return 0
