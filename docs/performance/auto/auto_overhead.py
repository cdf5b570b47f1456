"""auto's own work per step (issue 37): the closed batch of batch8.py (8 GSM8K questions on a random Ouro, one
thread) x 64 greedy tokens under auto, three times after a warm-up, with its methods timed - milliseconds per
``propose_batch`` call (one engine step) of each and its calls per step.  ``propose_batch`` includes the sub-drafters'
drafting (a DAS-Wave probe a batch) and the others' time.
    PYTHONPATH=. python docs/performance/auto/auto_overhead.py [--model DIR] [--data DIR]"""
import argparse, sys, time, collections, dasspec
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from batch8 import setup
from dasspec.methods import auto as A
p = argparse.ArgumentParser(); a, model, P = setup(p)
acc = collections.defaultdict(float); cnt = collections.defaultdict(int)
def wrap(cls, name):
    f = getattr(cls, name)
    def g(*args, **kw):
        t = time.perf_counter(); r = f(*args, **kw); acc[name] += time.perf_counter() - t; cnt[name] += 1; return r
    setattr(cls, name, g)
for cls, names in ((A.AutoDrafter, ["propose_batch", "closed_plan", "together", "_step_time"]),
                   (A.AutoSession, ["choose", "shadow", "resolve", "observe", "values"])):
    for n in names: wrap(cls, n)
run = lambda m: dasspec.generate_batch(model, P, method=m, max_new_tokens=64, eos=False, max_batch=8)
run("auto"); acc.clear(); cnt.clear()
for _ in range(3): run("auto")
steps = cnt["propose_batch"]
for k in acc: print(f"{k:15s} {acc[k]/steps*1e3:7.3f} ms/step  calls/step {cnt[k]/steps:.1f}")
