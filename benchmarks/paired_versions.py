"""Old code against new code, batch 1 and batch 8, paired round by round: is a change no slower?

    python benchmarks/paired_versions.py --old c6dd6bb --out runs/paired --rounds 3 [--models bundled,ouro-mid,NAME=FOLDER]

The old commit is checked out into a git worktree named by its hash and removed at the end; each round runs one worker process per version (old
first on odd rounds, new first on even ones, so drift of a shared machine hits both alike).  A worker loads each model
with its version's code and decodes the same token ids: every prompt alone (``dasspec.generate``, B = 1) and all of
them together (``dasspec.generate_batch``, B = 8), for each method, ``--new-tokens`` greedy tokens without EOS.
Tokens/s is new tokens over wall time, prefill included.  The report gives per (model, B, method) the median over
rounds of new / old tokens/s with its range, and whether both versions emitted the same tokens.
Models: ``bundled``; ``ouro-mid`` (Ouro-1.4B's config at width 512, 8 layers, the real 49,152-id vocabulary, random
weights: ``benchmarks/auto_speed.py``'s builder, from ``--ouro-src``); ``NAME=FOLDER``: any checkpoint folder.  Prompts:
the first GSM8K test questions (``--data``) in the model's tokenizer (random ids of 40-120 where it has none).  Writes results.json and results.md into --out.  A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

WORKER = r"""
import json, sys, time
import torch
job = json.loads(sys.stdin.read())
torch.set_num_threads(job["threads"])
import dasspec
out = []
for name, path in job["models"].items():
    model = dasspec.load_model(path)
    prompts = job["prompts"][name]
    for m in job["methods"]:                                    # warm-up: kernels, allocator
        dasspec.generate(model, prompts[0], m, max_new_tokens=4, eos=False)
        dasspec.generate_batch(model, prompts[:2], m, max_new_tokens=4, eos=False, max_batch=2)
    for m in job["methods"]:
        t = time.perf_counter()
        toks = [dasspec.generate(model, p, m, max_new_tokens=job["new"], eos=False).tokens for p in prompts]
        out.append({"model": name, "B": 1, "method": m, "seconds": time.perf_counter() - t, "tokens": toks})
        t = time.perf_counter()
        res = dasspec.generate_batch(model, prompts, m, max_new_tokens=job["new"], eos=False, max_batch=len(prompts))
        out.append({"model": name, "B": len(prompts), "method": m, "seconds": time.perf_counter() - t,
                    "tokens": [r.tokens for r in res]})
print(json.dumps(out))
"""


def run_worker(tree: Path, job: dict, extra_env: dict[str, str]) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(tree), **extra_env}
    got = subprocess.run([sys.executable, "-c", WORKER], input=json.dumps(job), cwd=tree, env=env,
                         capture_output=True, text=True, check=False)
    if got.returncode != 0:
        raise SystemExit(f"worker in {tree} failed:\n{got.stderr[-3000:]}")
    return json.loads(got.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", required=True, help="the old commit")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--models", default="bundled,ouro-mid")
    p.add_argument("--methods", default="ar,das-wave")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--data", type=Path, default=Path(os.environ.get("DASSPEC_DATA", REPO.parent / "shared/data")))
    p.add_argument("--ouro-src", type=Path, default=REPO.parent / "shared/checkpoints/ouro-1.4b")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "dasspec-paired")
    p.add_argument("--new-env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable for the new side only (e.g. DASSPEC_CPU_ISA=avx2 with --old HEAD: "
                        "one code, two kernel paths)")
    p.add_argument("--old-env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable for the old side only (e.g. CXX=a wrapper adding -mno-avx512f and "
                        "TORCH_EXTENSIONS_DIR=a folder of its own: the old code's kernels built for an AVX2 CPU)")
    p.add_argument("--random-ids", type=int, default=0, metavar="HIGH",
                   help="every model's prompts: random ids of 40-120 in [3, min(HIGH, vocabulary)) (the vLLM "
                        "comparisons' prompts: HIGH 166100 for Nanbeige), instead of GSM8K questions")
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO))
    import dasspec
    from benchmarks.auto_speed import build_ouro
    from benchmarks.iquest_vllm import random_prompts
    from dasspec.model.safetensors_io import CheckpointError
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    questions = [json.loads(l)["question"] for l in (args.data / "gsm8k" / "test.jsonl").read_text().splitlines()]
    models, prompts = {}, {}
    for name in args.models.split(","):
        if "=" in name:                               # NAME=FOLDER: any checkpoint (random ids without a tokenizer)
            name, path = name.split("=", 1)
        else:
            path = None if name == "bundled" else str(build_ouro(args.ouro_src, args.work / name, 512))
        models[name] = path
        if args.random_ids:
            cfg = json.loads((Path(path) / "config.json").read_text()) if path else {"vocab_size": 32000}
            prompts[name] = random_prompts(args.prompts, min(cfg["vocab_size"], args.random_ids))
            continue
        try:
            tok = dasspec.load_tokenizer(path)
            prompts[name] = [tok.encode(q) for q in questions[: args.prompts]]
        except CheckpointError:                       # a folder without tokenizer files
            cfg = json.loads((Path(path) / "config.json").read_text())
            prompts[name] = random_prompts(args.prompts, min(cfg["vocab_size"], 32000))
    # the worktree is named by the commit, not by the name given (``--old HEAD`` must not reuse an earlier HEAD's)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", f"{args.old}^{{commit}}"], check=True,
                            capture_output=True, text=True).stdout.strip()
    old = args.work / f"old-{commit[:12]}"
    if not old.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(old), commit], check=True)
    try:
        return compare(args, old, models, prompts)
    finally:                                          # temporary: no worktree left registered in the repository
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(old)], capture_output=True)


def compare(args: argparse.Namespace, old: Path, models: dict, prompts: dict) -> int:
    """The rounds, old and new in turn, and the report."""
    job = {"models": models, "prompts": prompts, "methods": args.methods.split(","), "new": args.new_tokens,
           "threads": args.threads}
    new_env = dict(kv.split("=", 1) for kv in args.new_env)
    old_env = dict(kv.split("=", 1) for kv in args.old_env)
    runs = []
    for r in range(args.rounds):
        order = [("old", old), ("new", REPO)] if r % 2 == 0 else [("new", REPO), ("old", old)]
        for version, tree in order:
            for row in run_worker(tree, job, new_env if version == "new" else old_env):
                runs.append({**row, "version": version, "round": r})
            print(f"round {r + 1}/{args.rounds}: {version} done", file=sys.stderr, flush=True)
        (args.out / "results.json").write_text(json.dumps(runs))
    lines = [f"# New{' (' + ', '.join(args.new_env) + ')' if args.new_env else ''} against old ({args.old}"
             f"{'; ' + ', '.join(args.old_env) if args.old_env else ''}), "
             "paired by round", "",
             f"{args.rounds} rounds, {args.prompts} "
             f"{'prompts of random ids' if args.random_ids else 'GSM8K questions'} x {args.new_tokens} new tokens, "
             f"{args.threads} thread(s); tokens/s includes the prefill.", "",
             "| model | B | method | new / old tok/s, median [range] | new tok/s (median) | same tokens |",
             "|---|---|---|---|---|---|"]
    keys = sorted({(x["model"], x["B"], x["method"]) for x in runs})
    for model, B, method in keys:
        ratios, speeds, same = [], [], True
        for r in range(args.rounds):
            pair = {x["version"]: x for x in runs if (x["model"], x["B"], x["method"], x["round"]) == (model, B, method, r)}
            n = sum(len(t) for t in pair["new"]["tokens"])
            ratios.append(pair["old"]["seconds"] / pair["new"]["seconds"])
            speeds.append(n / pair["new"]["seconds"])
            same &= pair["old"]["tokens"] == pair["new"]["tokens"]
        lines.append(f"| {model} | {B} | {method} | {statistics.median(ratios):.3f} [{min(ratios):.3f}, "
                     f"{max(ratios):.3f}] | {statistics.median(speeds):.1f} | {'yes' if same else 'no'} |")
    methods = args.methods.split(",")
    if len(methods) > 1:                 # within each version: a method against the first, same process and round
        lines += ["", f"Each method against {methods[0]} within a version (tok/s ratio per round, median [range]):", "",
                  "| model | B | method | old | new |", "|---|---|---|---|---|"]
        for model, B, method in keys:
            if method == methods[0]:
                continue
            cells = []
            for version in ("old", "new"):
                rs = []
                for r in range(args.rounds):
                    got = {x["method"]: x["seconds"] for x in runs
                           if (x["model"], x["B"], x["version"], x["round"]) == (model, B, version, r)}
                    rs.append(got[methods[0]] / got[method])
                cells.append(f"{statistics.median(rs):.3f} [{min(rs):.3f}, {max(rs):.3f}]")
            lines.append(f"| {model} | {B} | {method} | {cells[0]} | {cells[1]} |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
