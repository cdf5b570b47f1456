"""Mature-Spec with the two-source one call on and off, alternating in one process."""
import time, json, glob, sys, statistics, torch
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
import dasspec
from dasspec.model import attention, layers
path = None if sys.argv[1] == "bundled" else sys.argv[1]
m = dasspec.load_model(path); tok = dasspec.load_tokenizer(path)
f = sorted(glob.glob("/work/shared/data/gsm8k/*.jsonl"))[0]
prompts = [tok.encode(json.loads(l)["question"]) for l in open(f)][:8]
real = attention.row_plan
def off(x, kv, span, two_source=False):
    parts = getattr(kv, "parts", None)
    if parts is not None and not all(p.one_source for p in parts):
        return None
    return real(x, kv, span, two_source)
def run(on, B, method):
    layers.row_plan = attention.row_plan = real if on else off
    t = time.perf_counter()
    if B == 1:
        toks = [dasspec.generate(m, p, method, max_new_tokens=64, eos=False).tokens for p in prompts[:4]]
        n = 4 * 64
    else:
        toks = [r.tokens for r in dasspec.generate_batch(m, prompts, method, max_new_tokens=64, eos=False)]
        n = 8 * 64
    return n / (time.perf_counter() - t), toks
method = sys.argv[3] if len(sys.argv) > 3 else "mature-spec"
for B in ((1,) if len(sys.argv) > 5 else (1, 8)):
    run(True, B, method); run(False, B, method)
    r = {True: [], False: []}
    ref = None
    for i in range(int(sys.argv[4]) if len(sys.argv) > 4 else 4):
        for on in ((True, False) if i % 2 == 0 else (False, True)):
            v, toks = run(on, B, method)
            ref = ref or toks
            assert toks == ref
            r[on].append(v)
    ratios = [a / b for a, b in zip(r[True], r[False])]
    print(method, "B", B, "on", [round(x, 1) for x in r[True]], "off", [round(x, 1) for x in r[False]],
          "on/off median", round(statistics.median(ratios), 3), "range", round(min(ratios), 3), round(max(ratios), 3), flush=True)
