"""Old code against new code on the same prompts: is a refactor no slower?  A paired, alternating comparison.

    python benchmarks/compare_versions.py --old 1e8a978 --out runs/compare --tasks gsm8k,mbpp,math500,humaneval \\
        --prompts 5 --rounds 3

The old commit is checked out into a temporary git worktree.  Each round runs one worker process per version
(old first on odd rounds, new first on even ones, so drift of a shared machine hits both alike); a worker loads the
bundled model (or --model) with that version's code and times every method on every prompt through the public
``dasspec.generate`` (methods in an order that rotates per prompt; Token Recycling keeps its table across the
prompts in both versions).  The prompts are encoded once, by the new code, and given to both.

Per (prompt, method) the fastest of the rounds is kept for each version (noise on this machine only ever adds
time); the report gives, per method, the geometric mean over prompts of new time / old time with a 95% bootstrap
interval, and checks that both versions produced the same tokens.  A benchmark, not a test: it asserts nothing
about speed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
METHODS = "ar,self-spec,mature-spec,das-wave,pld,lookahead,token-recycling,sam"

WORKER = r"""
import json, sys, time
import torch
job = json.loads(sys.stdin.read())
if job["threads"]:
    torch.set_num_threads(job["threads"])
import dasspec
model = dasspec.load_model(job["model"], dtype=job["dtype"])
methods = job["methods"]
kept = {}
if hasattr(dasspec, "build_drafter"):                 # new code: stream state lives on a kept drafter
    kept = {m: dasspec.build_drafter(model, m) for m in methods if m == "token-recycling"}
def run(m, p, cap):
    if m in kept:
        return dasspec.generate(model, p["ids"], max_new_tokens=cap, stop=p["stop"], drafter=kept[m])
    return dasspec.generate(model, p["ids"], m, max_new_tokens=cap, stop=p["stop"])
for m in methods:                                      # warm-up: allocator, kernel selection
    run(m, job["prompts"][0], 8)
out = []
for i, p in enumerate(job["prompts"]):
    k = i % len(methods)
    for m in methods[k:] + methods[:k]:
        r = run(m, p, p["cap"])
        out.append({"prompt": i, "method": m, "time": r.stats.wall_time, "tokens": r.tokens})
print(json.dumps(out))
"""


def run_worker(tree: Path, job: dict) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    res = subprocess.run([sys.executable, "-c", WORKER], input=json.dumps(job), capture_output=True, text=True,
                         env=env, cwd=tempfile.gettempdir())
    if res.returncode:
        raise RuntimeError(f"worker for {tree} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def geo_ci(ratios: list[float], n_resamples: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    import numpy as np

    logs = np.log(np.asarray(ratios))
    rng = np.random.default_rng(seed)
    means = logs[rng.integers(0, len(logs), size=(n_resamples, len(logs)))].mean(axis=1)
    lo, hi = np.quantile(means, [0.025, 0.975])
    return math.exp(logs.mean()), math.exp(lo), math.exp(hi)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=True, help="git revision of the old code")
    p.add_argument("--new", default=None, help="git revision of the new code (default: the working tree)")
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--tasks", default="gsm8k,mbpp,math500,humaneval")
    p.add_argument("--prompts", type=int, default=5, help="development prompts per task")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--shots", action="append", default=["gsm8k=2"], metavar="TASK=N")
    p.add_argument("--methods", default=METHODS)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default=None, help="the model's dtype in both versions (default: load_model's)")
    p.add_argument("--data", default=os.environ.get("DASSPEC_DATA") or str(REPO.parent / "shared" / "data"))
    args = p.parse_args(argv)

    sys.path.insert(0, str(REPO))
    import dasspec
    from dasspec.eval.bench.runner import dev_prompts

    model = dasspec.load_model(args.model)
    prompts = [{"ids": pr.ids, "stop": list(pr.task.stop), "cap": pr.task.cap, "id": pr.example.id}
               for pr in dev_prompts(model, args.tasks, args.prompts, args.max_new_tokens, args.shots, args.data)]
    methods = args.methods.split(",")
    job = {"model": args.model, "methods": methods, "prompts": prompts, "threads": args.threads, "dtype": args.dtype}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"old": Path(tmp) / "old", "new": Path(tmp) / "new" if args.new else REPO}
        for version, rev in (("old", args.old), ("new", args.new)):
            if rev:
                subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(trees[version]), rev],
                               check=True, capture_output=True)
        try:
            best: dict[str, dict[tuple, dict]] = {"old": {}, "new": {}}
            for r in range(args.rounds):
                order = ("old", "new") if r % 2 == 0 else ("new", "old")
                for version in order:
                    for row in run_worker(trees[version], job):
                        key = (row["prompt"], row["method"])
                        if key not in best[version] or row["time"] < best[version][key]["time"]:
                            best[version][key] = row
                    print(f"round {r + 1}/{args.rounds}: {version} done", file=sys.stderr, flush=True)
        finally:
            for tree in trees.values():
                if tree != REPO:
                    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                                   capture_output=True)
    lines = [f"Old `{args.old}` vs new `{args.new or 'working tree'}`, {len(prompts)} development prompts ({args.tasks}, cap "
             f"{args.max_new_tokens}), fastest of {args.rounds} alternating rounds per version, {args.threads} "
             f"threads{f', {args.dtype}' if args.dtype else ''}.", "", "| method | new time / old time (geo. mean) [95% CI] | same tokens |", "|---|---|---|"]
    rows = []
    for m in methods:
        keys = [(i, m) for i in range(len(prompts))]
        ratios = [best["new"][k]["time"] / best["old"][k]["time"] for k in keys]
        same = sum(best["new"][k]["tokens"] == best["old"][k]["tokens"] for k in keys)
        g, lo, hi = geo_ci(ratios)
        rows.append({"method": m, "ratio": g, "lo": lo, "hi": hi, "same_tokens": same, "prompts": len(keys)})
        lines.append(f"| {m} | {g:.3f} [{lo:.3f}, {hi:.3f}] | {same}/{len(keys)} |")
    text = "\n".join(lines)
    (out / "compare.md").write_text(text + "\n")
    (out / "compare.json").write_text(json.dumps({"rows": rows, "best": {v: [dict(r, key=list(k)) for k, r in
                                                                             b.items()] for v, b in best.items()}}))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
