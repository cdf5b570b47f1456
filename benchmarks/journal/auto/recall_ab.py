"""auto / AR with and without the outcomes kept on the model (issue 53; ``recall``, ``dasspec/methods/auto/memory.py``):
each round runs, in a rotated order, AR, auto with ``recall=False`` (every call's drafter starts afresh, as before
the change) and auto as ``generate`` now builds it (starting from what the process measured on the model), each
over 8 prompts of 40-120 random ids x --tokens greedy tokens, no EOS: at B = 1 one ``generate`` call per prompt, at
B = 8 one ``generate_batch``.  One warm-up call of each beforehand (which also leaves the kept outcomes), on prompts of
its own; every round and B decodes 8 new prompts (the same in its three cells), so what a call recalls was measured
on other texts.
    python benchmarks/journal/auto/recall_ab.py --model FOLDER [--threads N] [--rounds N] [--tokens N] [--batches 1,8]
Prints per round and cell the seconds and auto / AR, then per B the median and range of auto / AR over rounds."""
import os, statistics, sys, time
import dasspec
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import random_prompts, setup

a, model = setup(add=lambda p: p.add_argument("--batches", default="1,8"))
P = random_prompts(8, 1000, seed=1000)          # the warm-up's; each round's below
CELLS = {"ar": ("ar", {}), "auto-fresh": ("auto", {"recall": False}), "auto": ("auto", {})}


def run(B: int, cell: str, tokens: int = a.tokens) -> tuple[float, list]:
    method, kn = CELLS[cell]
    t = time.perf_counter()
    if B == 1:
        toks = [dasspec.generate(model, q, method, max_new_tokens=tokens, eos=False, **kn).tokens for q in P]
    else:
        toks = [o.tokens for o in dasspec.generate_batch(model, P, method, max_new_tokens=tokens, eos=False,
                                                         max_batch=B, **kn)]
    return time.perf_counter() - t, toks


batches = [int(b) for b in a.batches.split(",")]
for B in batches:
    for cell in CELLS:
        run(B, cell, 4)
ratios = {(B, c): [] for B in batches for c in ("auto-fresh", "auto")}
for r in range(a.rounds):
    for B in batches:
        P = random_prompts(8, 1000, seed=10 * r + B)
        order = list(CELLS)[r % 3:] + list(CELLS)[:r % 3]
        got = {c: run(B, c) for c in order}
        assert all(got[c][1] == got["ar"][1] for c in got), "tokens differ from AR"
        line = []
        for c in ("auto-fresh", "auto"):
            ratios[B, c].append(got["ar"][0] / got[c][0])
            line.append(f"{c} {got[c][0]:.3f} s ({ratios[B, c][-1]:.3f}x AR)")
        print(f"round {r} B={B}: ar {got['ar'][0]:.3f} s, " + ", ".join(line), flush=True)
for (B, c), xs in ratios.items():
    print(f"B={B} {c}: speed vs AR median {statistics.median(xs):.3f}x, range {min(xs):.3f}-{max(xs):.3f}x")
