"""Mature-Spec with its draft steps (prefix read at depth R) in one call (LoopedLM.recur with reads) and step by
step through the one-call layers, alternating in one process; tokens compared with AR's."""
import time, json, glob, sys, statistics, torch
torch.set_num_threads(2)
import dasspec
from dasspec.model import looped
path = None if sys.argv[1] == "bundled" else sys.argv[1]
policy = sys.argv[3] if len(sys.argv) > 3 else "deep-kv"
m = dasspec.load_model(path); tok = dasspec.load_tokenizer(path)
f = sorted(glob.glob("/work/shared/data/gsm8k/*.jsonl"))[0]
prompts = [tok.encode(json.loads(l)["question"]) for l in open(f)][:8]
fam = type(m.family)
real = fam.recur_rows
def off(self, model, h, span, cache, steps, inj=None, reads=None):
    return None if reads is not None else real(self, model, h, span, cache, steps, inj, reads)
def run(on, b, method="mature-spec"):
    fam.recur_rows = real if on else off
    t = time.perf_counter()
    if b == 1:
        toks = [dasspec.generate(m, p, method, max_new_tokens=64, eos=False, policy=policy).tokens for p in prompts[:4]]; n = 256
    else:
        toks = [r.tokens for r in dasspec.generate_batch(m, prompts, method, max_new_tokens=64, eos=False, policy=policy)]; n = 512
    return n / (time.perf_counter() - t), toks
ar1 = [dasspec.generate(m, p, "ar", max_new_tokens=64, eos=False).tokens for p in prompts]
for b in (1, 8):
    run(True, b); run(False, b)
    r = {True: [], False: []}
    for i in range(int(sys.argv[2])):
        for on in ((True, False) if i % 2 == 0 else (False, True)):
            v, toks = run(on, b); assert toks == ar1[:len(toks)], (on, b); r[on].append(v)
    ratios = [a / c for a, c in zip(r[True], r[False])]
    print(f"mature-spec {policy} B={b} one call {[round(x, 1) for x in r[True]]} layer calls {[round(x, 1) for x in r[False]]} tok/s; "
          f"one/layers median {statistics.median(ratios):.3f} range [{min(ratios):.3f}, {max(ratios):.3f}]", flush=True)
