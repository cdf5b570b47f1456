"""What a verification pass costs by its rows, against what auto's calibration says (issue 37): the small random
Ouro, 8 GSM8K questions x 32 greedy tokens at max_batch 8 with AR, PLD and SAM (twice each), one thread; each
decode step's verify pass timed and grouped by its total rows, beside ``Sizing.full(rows)`` of the cached
calibration.
    PYTHONPATH=. python docs/performance/auto/verify_rows.py [--model DIR]"""
import argparse, statistics, sys, time, dasspec
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from batch8 import setup
from dasspec.engine import loop
from dasspec.methods import auto as A
a, model, P = setup(argparse.ArgumentParser())
rec = []
verify = loop.verify_step
def timed(placed, chunks):
    t = time.perf_counter(); out = verify(placed, chunks)
    if not chunks:
        rec.append((sum(x.inputs for x in placed), time.perf_counter() - t))
    return out
loop.verify_step = timed
sizing = A.Sizing.of(A.calibration(model), model.depth(None))
for m in ("ar", "pld", "sam") * 2:
    dasspec.generate_batch(model, P, method=m, max_new_tokens=32, eos=False, max_batch=8)
by: dict[int, list[float]] = {}
for rows, dt in rec:
    by.setdefault(rows if rows <= 8 else rows // 4 * 4, []).append(dt)
for r in sorted(by):
    print(f"rows {r:3d}  passes {len(by[r]):3d}  verify median {1e3 * statistics.median(by[r]):6.1f} ms  "
          f"calibrated full(rows) {1e3 * sizing.full(max(r, 1)):6.1f} ms")
