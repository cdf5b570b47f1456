"""auto against AR on a random Ouro (issue 37), paired in one process: 8 GSM8K prompts x 32 (--tokens) greedy tokens,
generate_batch at max_batch 8, one thread, alternating, tokens checked equal.
    python benchmarks/journal/auto/auto_pair.py --pairs 12 [--arms sam,pld] [--model DIR]"""
import argparse, statistics, sys, time, dasspec
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from batch8 import setup
p = argparse.ArgumentParser()
p.add_argument("--pairs", type=int, default=12)
p.add_argument("--arms", default=None, help="auto's arms (default: all)")
p.add_argument("--tokens", type=int, default=32, help="new tokens per request")
a, model, P = setup(p)
KN = dict(arms=a.arms) if a.arms else {}
def run(m):
    t = time.perf_counter(); r = dasspec.generate_batch(model, P, method=m, max_new_tokens=a.tokens, eos=False, max_batch=8, **(KN if m == "auto" else {})); return time.perf_counter() - t, [x.tokens for x in r]
run("ar"); run("auto")
rs = []
for i in range(a.pairs):
    order = ("ar", "auto") if i % 2 == 0 else ("auto", "ar")
    res = {m: run(m) for m in order}
    assert res["ar"][1] == res["auto"][1]
    rs.append(res["auto"][0] / res["ar"][0])
q = statistics.quantiles(rs, n=4) if len(rs) > 1 else rs * 3
print(f"{a.model} {a.tokens} tokens: auto/ar time median {statistics.median(rs):.3f} quartiles {q[0]:.3f} {q[2]:.3f} n={len(rs)}")
