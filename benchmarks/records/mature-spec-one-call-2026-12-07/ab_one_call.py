"""A draft path in one call against its per-step path, alternating in one process; tokens compared with AR's.

    python ab_one_call.py mature-spec MODEL ROUNDS [BATCHES [POLICY]]   # off: a draft's reads take the layer calls
    python ab_one_call.py das-wave MODEL ROUNDS [BATCHES]               # off: one core_step per round update

MODEL: ``bundled`` or a checkpoint folder; BATCHES: "1,8" (batch 1: 4 GSM8K questions one after another; batch 8:
8 questions in one generate_batch), 64 greedy tokens each, 2 threads."""
import glob, json, statistics, sys, time
import torch
torch.set_num_threads(2)
import dasspec
from dasspec.engine.drafting import batch as batch_module

method, path, rounds = sys.argv[1], (None if sys.argv[2] == "bundled" else sys.argv[2]), int(sys.argv[3])
batches = [int(b) for b in (sys.argv[4] if len(sys.argv) > 4 else "1,8").split(",")]
knobs = {"policy": sys.argv[5]} if len(sys.argv) > 5 else {}
m = dasspec.load_model(path); tok = dasspec.load_tokenizer(path)
f = sorted(glob.glob("/work/shared/data/gsm8k/*.jsonl"))[0]
prompts = [tok.encode(json.loads(l)["question"]) for l in open(f)][:8]
family, recur = type(m.family), batch_module.Batch.recur
family_rows = family.recur_rows


def off():
    if method == "mature-spec":        # the family answers None for a draft's reads: each step through its layers
        family.recur_rows = lambda self, model, h, span, cache, steps, inj=None, reads=None: (
            None if reads is not None else family_rows(self, model, h, span, cache, steps, inj, reads))
    else:                              # one core_step per aligned update
        def stepwise(self, h, inj, depths, reads=None):
            if reads is not None:
                return recur(self, h, inj, depths, reads)
            for r in depths:
                h = self.core_step(h, inj, (r, r))
            return h
        batch_module.Batch.recur = stepwise


def run(on: bool, b: int):
    family.recur_rows, batch_module.Batch.recur = family_rows, recur
    if not on:
        off()
    t = time.perf_counter()
    if b == 1:
        toks = [dasspec.generate(m, p, method, max_new_tokens=64, eos=False, **knobs).tokens for p in prompts[:4]]
    else:
        toks = [r.tokens for r in dasspec.generate_batch(m, prompts, method, max_new_tokens=64, eos=False, **knobs)]
    return 64 * len(toks) / (time.perf_counter() - t), toks


ar = [dasspec.generate(m, p, "ar", max_new_tokens=64, eos=False).tokens for p in prompts]
for b in batches:
    run(True, b), run(False, b)
    got = {True: [], False: []}
    for i in range(rounds):
        for on in ((True, False) if i % 2 == 0 else (False, True)):
            v, toks = run(on, b)
            assert toks == ar[:len(toks)], (on, b)
            got[on].append(v)
    ratios = [a / c for a, c in zip(got[True], got[False])]
    print(f"{method} B={b} one call {[round(x, 1) for x in got[True]]} per step {[round(x, 1) for x in got[False]]} "
          f"tok/s; one/per-step median {statistics.median(ratios):.3f} range [{min(ratios):.3f}, {max(ratios):.3f}]",
          flush=True)
