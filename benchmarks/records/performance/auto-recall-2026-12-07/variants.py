# Ran (2026-12-07) against a working tree whose memory kept the budget too (``(costs, priors, budget)``): there
# "v2" is that build, "v1" the same with a fresh budget per call (what was kept: the final code), "fresh" recall=False.
# On the final code "v1" and "v2" are the same.
import sys, time, collections, statistics, torch, dasspec
sys.path.insert(0, "benchmarks")
from iquest_vllm import random_prompts
from dasspec.methods.auto import drafter as D
from dasspec.methods.auto.explorer import Budget
torch.set_num_threads(1)
model = dasspec.load_model(sys.argv[1], dtype=torch.float32)
P = random_prompts(8, 1000)
real_bind = D.AutoDrafter.bind
MODE = {"v": None}
def bind(self, model, num_steps=None, sampled=False):
    real_bind(self, model, num_steps, sampled)
    if MODE["v"] == "v1":
        self.budget = Budget(self.knobs.explore)
D.AutoDrafter.bind = bind
cells = [("ar", "ar", {}), ("fresh", "auto", {"recall": False}), ("v1", "auto", {"explore": 0.0500001}), ("v2", "auto", {})]
for name, m, kn in cells:
    MODE["v"] = name; dasspec.generate(model, P[0], m, max_new_tokens=8, eos=False, **kn)
res = collections.defaultdict(list)
for rnd in range(int(sys.argv[2])):
    order = cells[rnd % 4:] + cells[:rnd % 4]
    t_ = {}
    for name, m, kn in order:
        MODE["v"] = name; t = time.perf_counter()
        for q in P:
            dasspec.generate(model, q, m, max_new_tokens=32, eos=False, **kn)
        t_[name] = time.perf_counter() - t
    for k in ("fresh", "v1", "v2"):
        res[k].append(t_["ar"] / t_[k])
    print(rnd, {k: round(v, 2) for k, v in t_.items()}, flush=True)
for k, xs in res.items():
    print(k, f"median {statistics.median(xs):.3f} range {min(xs):.3f}-{max(xs):.3f}")
