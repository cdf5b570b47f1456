"""A closed batch's step budget and a windowed request's prompt chunk, paired in one process (issue 53):
``generate_batch`` with each arm - ``BUDGET:RING``, the step budget (``max_step_tokens``) and the windowed chunk
rule (``old``: at most ``WINDOW_PREFILL_ROWS`` rows a step; ``new``: what the rings hold) - alternating, tokens
checked equal; prints each arm's speed against the first (median and range over the pairs).  8 prompts of random
ids (``iquest_vllm.random_prompts``; ``--repeat K`` repeats each K times) x ``--tokens`` greedy tokens, 2 threads.

    python benchmarks/journal/closed-budget/budget_ab.py --model /tmp/iquest-mid --arms 512:old,1024:new \
        [--methods ar,auto] [--tokens 32] [--pairs 8] [--batch 8] [--repeat 1]

(``--model ''``: the bundled model.)  ``--tokens 1`` times the prefill alone."""
import argparse, statistics, sys, time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))      # benchmarks/
import dasspec
from dasspec.engine.core import scheduler
from dasspec.engine.core.blocks import WINDOW_PREFILL_ROWS
from iquest_vllm import random_prompts

p = argparse.ArgumentParser()
p.add_argument("--model", default="")
p.add_argument("--arms", default="512:old,1024:new")
p.add_argument("--methods", default="ar")
p.add_argument("--tokens", type=int, default=32)
p.add_argument("--pairs", type=int, default=8)
p.add_argument("--batch", type=int, default=8)
p.add_argument("--repeat", type=int, default=1)
p.add_argument("--threads", type=int, default=2)
a = p.parse_args()
torch.set_num_threads(a.threads)
new_room = scheduler.Scheduler._ring_room


def old_room(self, e, start):
    return WINDOW_PREFILL_ROWS


arms = [(int(x.split(":")[0]), x.split(":")[1]) for x in a.arms.split(",")]
model = dasspec.load_model(a.model or None, dtype=torch.float32)
prompts = [q * a.repeat for q in random_prompts(8, min(166100, model.config.vocab_size))]
name = (a.model or "bundled").rstrip("/").split("/")[-1]
print(f"{name}: prompts of {min(map(len, prompts))}-{max(map(len, prompts))} ids, {sum(map(len, prompts))} in all",
      flush=True)


def run(arm, method, tokens):
    scheduler.Scheduler._ring_room = new_room if arm[1] == "new" else old_room
    return dasspec.generate_batch(model, prompts, method, max_new_tokens=tokens, max_batch=a.batch, eos=False,
                                  max_step_tokens=arm[0])


for m in a.methods.split(","):
    for arm in arms:
        run(arm, m, 4)
    ts, ref = {arm: [] for arm in arms}, None
    for i in range(a.pairs):
        for arm in (arms if i % 2 == 0 else arms[::-1]):
            t = time.perf_counter()
            toks = [list(x.tokens) for x in run(arm, m, a.tokens)]
            ts[arm].append(time.perf_counter() - t)
            ref = ref or toks
            assert toks == ref, (arm, m)
    for arm in arms[1:]:
        r = [o / n for o, n in zip(ts[arms[0]], ts[arm])]
        print(f"{name} {m} B={a.batch} {a.tokens} tokens: {arm[0]}:{arm[1]} / {arms[0][0]}:{arms[0][1]} speed "
              f"{statistics.median(r):.3f} [{min(r):.3f}, {max(r):.3f}] ({a.pairs} pairs; medians "
              f"{statistics.median(ts[arms[0]]):.3f} s and {statistics.median(ts[arm]):.3f} s), tokens equal",
              flush=True)
