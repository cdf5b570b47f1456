"""Verification steps of a closed batch (8 GSM8K prompts, max_batch 8, 32 greedy tokens) under AR and auto on the
mid-size random Ouro, one thread (issue 37, 2026-12-04): step count, verification time, and the steps that verified
more rows than requests (drafts).  Reads /tmp/vs/prompts.json (the 8 token lists of docs/performance/ouro-vllm).
    PYTHONPATH=. python docs/performance/auto/closed_batch_steps.py"""
import json, time, torch, dasspec, collections, sys
from dasspec.engine import verify as V
import dasspec.engine.loop as LP
torch.set_num_threads(1)
model = dasspec.load_model("/tmp/dasspec-auto-models/ouro-mid", dtype=torch.float32)
ids = json.load(open("/tmp/vs/prompts.json"))
real = V.verify_step
log = []
def vs(drafts, prefills=()):
    t = time.perf_counter(); r = real(drafts, prefills); log.append((len(drafts), sum(d.inputs for d in drafts), sum(c.size for c in prefills), time.perf_counter() - t)); return r
LP.verify_step = vs
import dasspec.engine.executor as EX
real_ex = EX.Executor.execute if hasattr(EX, "Executor") else None
for method in ("ar", "auto", "ar", "auto"):
    log.clear()
    t = time.perf_counter()
    res = dasspec.generate_batch(model, ids, method, max_new_tokens=32, eos=False, max_batch=8)
    T = time.perf_counter() - t
    ver = sum(x[3] for x in log)
    print(method, f"total {T:.2f}s steps {len(log)} verify {ver:.2f}s (so drafting/other {T-ver:.2f}s)", "rows>8 steps:", [(n, w, round(s*1e3)) for n, w, p, s in log if w > n and not p][:12])
