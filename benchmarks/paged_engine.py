"""Paged engine benchmarks (issue 34), each arm run side by side in one invocation, old code against new:

    python benchmarks/paged_engine.py concurrency --old ../wt-old --out DIR   # requests running at once, fixed pool
    python benchmarks/paged_engine.py hol --old ../wt-old --out DIR           # head-of-line: a long prompt arrives

``--old`` is a checkout of the code before the change (``git worktree add ../wt-old b1b14e7``); every arm runs in
a subprocess with that checkout's ``dasspec`` first on the path and this venv's dependencies, one arm after the
other, alternating over ``--rounds``.  The arms only use the public API both versions share (``Engine(model,
method, max_batch=, kv_budget=)``, ``add``, ``step``, ``running``), so the same script measures both.

concurrency: the bundled model, a pool of ``--pool`` positions (4,096), ``--requests`` chat requests without
max_tokens - the old server reserved 1,024 tokens for such a request (``CHAT_DEFAULT_MAX_TOKENS``), the new one
allows the rest of the context - each a ``--prompt-len`` (300) token prompt whose answer ends after ``--answer``
(100) tokens (a stopping criterion, the same in both).  Per arm: requests running at once (max and mean over
steps), tokens/s, and whether every answer equals the arm's own batch-1 AR decode (checked on a few).

hol: ``--short`` (7) short chats decode; once each has ``--warm`` tokens a ``--long-len`` (3,000) token prompt
arrives; the chats may run up to ``--short-tokens`` (3,000) so they decode through the whole prefill, and every
request is cancelled when the long prompt's first token comes (pool: a full context per request).  Their contexts
grow meanwhile, and with them their own step time; ``--control`` runs each new-code arm again without the long
prompt for as many chat tokens, so the long prompt's own effect is p99 during / the control's p99.  Per arm: the short requests' per-token latency (time between the steps that gave them tokens, divided by
the tokens) p50 before the long prompt arrived and p99 while it was prefilled; the ratio (goal: <= 2).  New-code
arms may set ``--max-step-tokens``.

Writes results.json and results.md into --out.  A benchmark, never a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CONCURRENCY_ARM = r'''
import json, sys, time, torch
import dasspec
from dasspec.engine.api.engine import Engine
cfg = json.loads(sys.argv[1])
torch.set_num_threads(cfg["threads"])
model = dasspec.load_model()
tok = model.tokenizer
ctx = model.config.block_size
g = torch.Generator().manual_seed(0)
texts = [l for l in open(cfg["corpus"]).read().split("\n") if l.strip()]
prompts = []
for i in range(cfg["requests"]):
    ids = []
    j = i * 7
    while len(ids) < cfg["prompt_len"]:
        ids += tok.encode(texts[j % len(texts)] + "\n")
        j += 1
    prompts.append(ids[: cfg["prompt_len"]])
answer = cfg["answer"]
stop = [lambda input_ids, scores, P=len(p): input_ids.shape[1] - P >= answer for p in prompts]
kw = dict(max_batch=cfg["max_batch"], kv_budget=cfg["pool"])
if cfg["max_step_tokens"]:
    kw["max_step_tokens"] = cfg["max_step_tokens"]
engine = Engine(model, cfg["method"], **kw)
allow = cfg["allow"] if cfg["allow"] else None
with torch.inference_mode():
    t0 = time.perf_counter()
    ids = [engine.add(p, max_new_tokens=(allow or ctx - len(p)), stopping_criteria=[s], eos=False)
           for p, s in zip(prompts, stop)]
    running, steps = [], 0
    while engine.has_work:
        engine.step()
        running.append(len(engine.running))
        steps += 1
    wall = time.perf_counter() - t0
    outs = [engine.result(i) for i in ids]
    check = []
    for p, s, o in list(zip(prompts, stop, outs))[: cfg["check"]]:
        ref = dasspec.generate(model, p, "ar", max_new_tokens=(allow or ctx - len(p)), stopping_criteria=[s], eos=False)
        check.append(ref.tokens == o.tokens)
tokens = sum(len(o.tokens) for o in outs)
print(json.dumps({"max_running": max(running), "mean_running": sum(running) / len(running), "steps": steps,
                  "tokens": tokens, "wall": wall, "tokens_per_second": tokens / wall, "equal_checked": check}))
'''

HOL_ARM = r'''
import json, sys, time, torch
import dasspec
from dasspec.engine.api.engine import Engine
cfg = json.loads(sys.argv[1])
torch.set_num_threads(cfg["threads"])
model = dasspec.load_model()
tok = model.tokenizer
texts = [l for l in open(cfg["corpus"]).read().split("\n") if l.strip()]
def text_ids(n, start):
    ids, j = [], start
    while len(ids) < n:
        ids += tok.encode(texts[j % len(texts)] + "\n")
        j += 1
    return ids[:n]
shorts = [text_ids(cfg["short_len"], 11 * i) for i in range(cfg["short"])]
long = text_ids(cfg["long_len"], 5000)
kw = dict(max_batch=cfg["short"] + 1, kv_budget=(cfg["short"] + 1) * model.config.block_size)
if cfg["max_step_tokens"]:
    kw["max_step_tokens"] = cfg["max_step_tokens"]
engine = Engine(model, cfg["method"], **kw)
last, count = {}, {}
gaps_before, gaps_during = [], []
state, lid, t_arrive, t_done = "warm", None, None, None
with torch.inference_mode():
    sids = [engine.add(p, max_new_tokens=cfg["short_tokens"], eos=False) for p in shorts]
    count = {i: 0 for i in sids}
    while engine.has_work:
        evs = engine.step()
        now = time.perf_counter()
        for ev in evs:
            if ev.id in count and ev.tokens:
                count[ev.id] += len(ev.tokens)
                if ev.id in last:
                    gap = (now - last[ev.id]) / len(ev.tokens)
                    if state == "warm" and all(c > 1 for c in count.values()):   # all of them decoding
                        gaps_before.append(gap)
                    elif state == "prefill":
                        gaps_during.append(gap)
                last[ev.id] = now
            done = (ev.id == lid and ev.tokens) if not cfg["control_gaps"] else len(gaps_during) >= cfg["control_gaps"]
            if state == "prefill" and done:
                state, t_done = "after", now
                for i in sids + ([lid] if lid is not None else []):   # the short streams ran through the prefill
                    engine.cancel(i)
        if state == "warm" and all(c >= cfg["warm"] for c in count.values()):
            if not cfg["control_gaps"]:                 # the control: the same window, no long prompt
                lid = engine.add(long, max_new_tokens=4, eos=False)
            state, t_arrive = "prefill", time.perf_counter()
    for i in sids + ([lid] if lid is not None else []):
        engine.result(i)
import numpy as np
p50 = float(np.percentile(gaps_before, 50)) if gaps_before else float("nan")
p99 = float(np.percentile(gaps_during, 99)) if gaps_during else float("nan")
print(json.dumps({"p50_before": p50, "p99_during": p99, "ratio": p99 / p50, "n_before": len(gaps_before),
                  "p50_during": float(np.percentile(gaps_during, 50)) if gaps_during else float("nan"),
                  "n_during": len(gaps_during), "prefill_seconds": (t_done - t_arrive) if t_done else None,
                  "max_during": max(gaps_during) if gaps_during else None}))
'''


def run_arm(code: str, checkout: str | None, cfg: dict) -> dict:
    env = dict(os.environ)
    if checkout:
        env["PYTHONPATH"] = str(Path(checkout).resolve())
    r = subprocess.run([sys.executable, "-c", code, json.dumps(cfg)], env=env, capture_output=True, text=True,
                       cwd=str(Path(checkout).resolve()) if checkout else str(REPO), timeout=3600)
    if r.returncode != 0:
        raise SystemExit(f"an arm failed ({checkout or 'new'}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def corpus_file(out: Path) -> str:
    """Text for prompts: Python standard-library source (as the bundled model was trained on), written once."""
    import inspect
    import json as j
    import textwrap
    path = out / "corpus.txt"
    if not path.exists():
        src = inspect.getsource(j) + inspect.getsource(textwrap) + inspect.getsource(argparse)
        path.write_text(src)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["concurrency", "hol"])
    p.add_argument("--out", required=True)
    p.add_argument("--old", default=None, help="a checkout of the old code (run side by side)")
    p.add_argument("--method", default="ar")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--pool", type=int, default=4096)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--answer", type=int, default=100)
    p.add_argument("--check", type=int, default=3, help="answers checked against their own AR decode, per arm")
    p.add_argument("--short", type=int, default=7)
    p.add_argument("--short-len", type=int, default=40)
    p.add_argument("--short-tokens", type=int, default=3000)
    p.add_argument("--warm", type=int, default=16)
    p.add_argument("--long-len", type=int, default=3000)
    p.add_argument("--control", action="store_true",
                   help="hol: after each new-code arm, the same arm without the long prompt for as many short-chat "
                        "tokens (their contexts grow alike): the p99 the long prompt's prefill is compared with")
    p.add_argument("--max-step-tokens", default="",
                   help="comma-separated budgets: one new-code arm per value (default: the engine's)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = corpus_file(out)
    budgets = [int(b) for b in args.max_step_tokens.split(",") if b] or [0]
    arms = []
    if args.old:
        arms.append(("old", args.old, 0))
    arms += [(f"new{'' if not b else f' (max_step_tokens {b})'}", None, b) for b in budgets]
    results: dict[str, list] = {label: [] for label, _, _ in arms}
    for r in range(args.rounds):
        for label, checkout, budget in (arms if r % 2 == 0 else arms[::-1]):
            cfg = dict(threads=args.threads, corpus=corpus, method=args.method, max_step_tokens=budget,
                       requests=args.requests, prompt_len=args.prompt_len, answer=args.answer, pool=args.pool,
                       max_batch=args.max_batch, check=args.check, short=args.short, short_len=args.short_len,
                       short_tokens=args.short_tokens, warm=args.warm, long_len=args.long_len,
                       allow=1024 if (args.what == "concurrency" and checkout) else 0)
            t = time.perf_counter()
            cfg["control_gaps"] = 0
            res = run_arm(CONCURRENCY_ARM if args.what == "concurrency" else HOL_ARM, checkout, cfg)
            res["seconds"] = time.perf_counter() - t
            if args.what == "hol" and args.control and not checkout:
                cfg["control_gaps"] = res["n_during"]
                ctl = run_arm(HOL_ARM, checkout, cfg)
                res["control_p99"], res["control_p50"] = ctl["p99_during"], ctl["p50_during"]
            results[label].append(res)
            print(f"[round {r + 1}] {label}: {json.dumps(res)}", flush=True)
    (out / "results.json").write_text(json.dumps({"what": args.what, "args": vars(args), "results": results},
                                                 indent=1))
    lines = [f"# paged engine: {args.what}", "", f"`{' '.join(sys.argv)}`", ""]
    if args.what == "concurrency":
        lines += ["| arm | max running | mean running | tokens/s | answers = own AR (checked) |", "|---|---|---|---|---|"]
        for label, rs in results.items():
            for res in rs:
                lines.append(f"| {label} | {res['max_running']} | {res['mean_running']:.1f} | "
                             f"{res['tokens_per_second']:.1f} | {sum(res['equal_checked'])}/{len(res['equal_checked'])} |")
    else:
        lines += ["| arm | per-token p50 before (ms) | p99 during the long prefill (ms) | ratio | prefill (s) | "
                  "control p99, no long prompt (ms) | p99 during / control p99 |", "|---|---|---|---|---|---|---|"]
        for label, rs in results.items():
            for res in rs:
                c = res.get("control_p99")
                lines.append(f"| {label} | {1e3 * res['p50_before']:.1f} | {1e3 * res['p99_during']:.1f} | "
                             f"{res['ratio']:.2f} | {res['prefill_seconds'] or float('nan'):.1f} | "
                             + (f"{1e3 * c:.1f} | {res['p99_during'] / c:.2f} |" if c else "- | - |"))
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
