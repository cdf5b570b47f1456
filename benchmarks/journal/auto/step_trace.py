"""One closed batch under auto, step by step (issue 37): 8 GSM8K questions x 32 (--tokens) greedy tokens,
generate_batch at max_batch 8, one thread; after an AR run of the same batch, prints each step's time (one
propose_batch call to the next) and the arms chosen (``*``: a probe).
    python benchmarks/journal/auto/step_trace.py [--model DIR] [--rounds N] [--tokens N]"""
import argparse, sys, time, dasspec
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from batch8 import setup
from dasspec.methods import auto as A
p = argparse.ArgumentParser()
p.add_argument("--rounds", type=int, default=2)
p.add_argument("--tokens", type=int, default=32, help="new tokens per request")
a, model, P = setup(p)
log = []
propose = A.AutoDrafter.propose_batch
def timed(self, sessions):
    t0 = time.perf_counter(); out = propose(self, sessions)
    log.append((t0, time.perf_counter() - t0, [s.arm + ("*" if s.probe else "") for s in sessions]))
    return out
A.AutoDrafter.propose_batch = timed
run = lambda m: dasspec.generate_batch(model, P, method=m, max_new_tokens=a.tokens, eos=False, max_batch=8)
run("ar"); run("auto")
for r in range(a.rounds):
    t = time.perf_counter(); run("ar"); t_ar = time.perf_counter() - t
    log.clear()
    t = time.perf_counter(); run("auto"); t_auto = time.perf_counter() - t
    print(f"round {r}: AR {t_ar:.3f} s, auto {t_auto:.3f} s, {len(log)} steps")
    for i, (t0, dt, arms) in enumerate(log):
        step = (log[i + 1][0] - t0) * 1e3 if i + 1 < len(log) else float("nan")
        count = {x: arms.count(x) for x in dict.fromkeys(arms)}
        print(f"  {i:3d} choosing + drafting {dt * 1e3:5.1f} ms  step {step:6.1f} ms  {count}")
