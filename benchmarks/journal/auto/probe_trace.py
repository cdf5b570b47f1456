"""Where auto's time goes against AR on random-id prompts (issue 53): the steps its probes took, and its own host
work per part.  8 prompts of 40-120 random ids x 32 (--tokens) greedy tokens, no EOS.
    python benchmarks/journal/auto/probe_trace.py --model FOLDER [--threads N] [--rounds N] [--tokens N] \
        [--parts trace,kept,batch]
``trace``: every prompt alone (``dasspec.generate``: a fresh drafter each) after an AR pass of the same prompts;
prints auto / AR and, per prompt, each step not decided by exploiting (step, rule, choosing + drafting ms, the
step's ms).  ``kept``: the same with one drafter kept across the prompts (``drafter=``, as a server keeps it).  ``batch``: ``generate_batch`` of the 8 at max_batch 8; prints the run's seconds and the milliseconds
spent in auto's parts (choosing, the batch plan, the lookups' shadow drafts, the whole propose)."""
import collections, os, sys, time
import dasspec
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import random_prompts, setup
from dasspec.methods.auto import drafter as D, earnings as E

a, model = setup(rounds=2, add=lambda p: p.add_argument("--parts", default="trace,kept,batch"))
P = random_prompts(8, 1000)
log, acc = [], collections.Counter()


def timed(f, key, record=False):
    def g(*args, **kw):
        t0 = time.perf_counter()
        try:
            return f(*args, **kw)
        finally:
            acc[key] += time.perf_counter() - t0
            if record:                                   # (the drafter, its sessions)
                log.append((t0, time.perf_counter() - t0, [s.choice.rule for s in args[1]]))
    return g


D.AutoDrafter.propose_batch = timed(D.AutoDrafter.propose_batch, "propose", record=True)
parts = a.parts.split(",")
if "batch" in parts:
    D.AutoSession.choose = timed(D.AutoSession.choose, "choose")
    E.Earnings.shadow = timed(E.Earnings.shadow, "shadow")
    D.closed_plan = timed(D.closed_plan, "closed_plan")
    D.together = timed(D.together, "together")
dasspec.generate(model, P[0], "auto", max_new_tokens=4, eos=False)
for r in range(a.rounds if "batch" in parts else 0):
    dasspec.generate_batch(model, P, method="auto", max_new_tokens=a.tokens, eos=False, max_batch=8)
    acc.clear()
    t = time.perf_counter()
    dasspec.generate_batch(model, P, method="auto", max_new_tokens=a.tokens, eos=False, max_batch=8)
    print(f"auto {time.perf_counter() - t:.3f} s", {k: round(v * 1e3, 1) for k, v in acc.items()})
def traced(drafter_of) -> tuple[float, list]:
    """auto over every prompt alone, the drafter of each call from ``drafter_of()``: seconds, per prompt the steps
    not decided by exploiting."""
    total, steps = 0.0, []
    for q in P:
        log.clear()
        t = time.perf_counter()
        dasspec.generate(model, q, max_new_tokens=a.tokens, eos=False, drafter=drafter_of())
        total += time.perf_counter() - t
        steps.append([(i, rules[0], round(dt * 1e3, 1), round((log[i + 1][0] - t0) * 1e3, 1))
                      for i, (t0, dt, rules) in enumerate(log[:-1]) if rules[0] not in ("best", "margin")])
    return total, steps


ways = [w for w in ("trace", "kept") if w in parts]
for r in range(a.rounds if ways else 0):
    t = time.perf_counter()
    for q in P:
        dasspec.generate(model, q, "ar", max_new_tokens=a.tokens, eos=False)
    t_ar = time.perf_counter() - t
    for way in ways:
        if way == "trace":                                  # a fresh drafter per call, as generate(method=) builds
            t_auto, steps = traced(lambda: dasspec.build_drafter(model, "auto"))
        else:                                               # one drafter kept across the calls, as a server keeps
            kept = dasspec.build_drafter(model, "auto")
            t_auto, steps = traced(lambda: kept)
        print(f"round {r} ({'fresh drafter per prompt' if way == 'trace' else 'one drafter kept'}): "
              f"AR {t_ar:.3f} s, auto {t_auto:.3f} s, auto / AR {t_ar / t_auto:.3f}")
        for s in steps:
            print("  ", s)
