"""Paired A/B of decode steps in one engine: HEAD's versions of some functions (their code rebound to the
current modules' globals) against the working tree's, alternating every STEPS steps (issue 34, 2026-12-04).
    SWAPS="LY:Attention.forward,LY:GatedMLP.forward" PYTHONPATH=.:docs/performance/ouro-vllm \
        python docs/performance/ouro-vllm/swap_ab.py MODEL|bundled B THREADS STEPS PAIRS
(A: model/attention.py, L: model/linear.py, LY: model/layers.py, V: engine/verify.py)"""
import statistics, subprocess, sys, time, types
import torch, dasspec
sys.path.insert(0, "docs/performance/ouro-vllm")
from decoding import decoding_engine
from dasspec.model import attention as A, linear as L
import os
from dasspec.model import layers as LY
from dasspec.engine import verify as V
SWAPS = [tuple(x.split(":")) for x in os.environ.get("SWAPS", "").split(",") if x]
MODS = {"A": A, "L": L, "LY": LY, "V": V}
SWAPS = [(MODS[m], path) for m, path in SWAPS]
def old_ns(mod):
    src = subprocess.run(["git", "show", os.environ.get("OLD", "HEAD") + ":" + mod.__name__.replace(".", "/") + ".py"], capture_output=True,
                         text=True, check=True).stdout
    m = types.ModuleType(mod.__name__ + "_old"); m.__package__ = mod.__package__
    sys.modules[m.__name__] = m
    exec(compile(src, mod.__file__ + "@HEAD", "exec"), m.__dict__)
    return m.__dict__
def resolve(obj, path):
    *head, last = path.split(".")
    for h in head: obj = getattr(obj, h) if not isinstance(obj, dict) else obj[h]
    return obj, last
arms = {"old": [], "new": []}
for mod, path in SWAPS:
    ns = old_ns(mod)
    o, last = resolve(ns, path)
    oldf = o[last] if isinstance(o, dict) else getattr(o, last)
    oldf = types.FunctionType(oldf.__code__, mod.__dict__, oldf.__name__, oldf.__defaults__, oldf.__closure__)
    tgt, last = resolve(mod, path)
    arms["old"].append((tgt, last, oldf)); arms["new"].append((tgt, last, getattr(tgt, last)))
def use(arm):
    for tgt, last, f in arms[arm]: setattr(tgt, last, f)
torch.set_num_threads(int(sys.argv[3]))
model = dasspec.load_model(None if sys.argv[1] == "bundled" else sys.argv[1], dtype=torch.float32)
B, S, P = int(sys.argv[2]), int(sys.argv[4]), int(sys.argv[5])
eng = decoding_engine(model, B)
for _ in range(3): eng.step()
t = {"old": [], "new": []}
for i in range(P):
    for arm in (("old", "new") if i % 2 == 0 else ("new", "old")):
        use(arm)
        t0 = time.perf_counter()
        for _ in range(S): eng.step()
        t[arm].append((time.perf_counter() - t0) / S)
r = [a / b for a, b in zip(t["new"], t["old"])]
q = statistics.quantiles(r, n=4)
print(f"B={B} threads={sys.argv[3]}: step ms old median {1e3*statistics.median(t['old']):.1f}, new {1e3*statistics.median(t['new']):.1f}; "
      f"new/old per pair median {statistics.median(r):.3f} [quartiles {q[0]:.3f}, {q[2]:.3f}]")
