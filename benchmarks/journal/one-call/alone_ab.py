"""A request alone called as a plain span against a ragged batch of one (``batch._one_call``), alternating in one
process: AR over 8 prompts of 40-120 random ids, ``dasspec.generate`` per prompt; prints each pass's seconds and
whether its tokens equal the first pass's.
    python benchmarks/journal/one-call/alone_ab.py --model FOLDER [--threads N] [--rounds N] [--tokens N]"""
import os, sys, time
import dasspec
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import random_prompts, setup
from dasspec.engine.drafting import batch as BT

a, model = setup()
P = random_prompts(8, 1000)
ways = [("plain", lambda span, cache: False), ("ragged", BT._one_call)]
ref = None
dasspec.generate(model, P[0], "ar", max_new_tokens=4, eos=False)
for r in range(a.rounds):
    for name, rule in (ways if r % 2 == 0 else ways[::-1]):       # each first on alternate rounds
        BT._one_call = rule
        t = time.perf_counter()
        toks = [dasspec.generate(model, q, "ar", max_new_tokens=a.tokens, eos=False).tokens for q in P]
        dt = time.perf_counter() - t
        ref = ref or toks
        print(r, name, f"{dt:.3f} s", "same" if toks == ref else "DIFFERENT")
