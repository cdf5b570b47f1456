"""self-spec with its aligned draft steps in one call (Batch.recur) and step by step, alternating in one process."""
import time, json, glob, sys, statistics, torch
torch.set_num_threads(2)
import dasspec
from dasspec.engine.drafting import batch as B
path = None if sys.argv[1] == "bundled" else sys.argv[1]
m = dasspec.load_model(path); tok = dasspec.load_tokenizer(path)
f = sorted(glob.glob("/work/shared/data/gsm8k/*.jsonl"))[0]
prompts = [tok.encode(json.loads(l)["question"]) for l in open(f)][:8]
real = B.Batch.recur
def stepwise(self, h, inj, depths):
    for j in depths:
        h = self.core_step(h, inj, (j, j), own=(j, j))
    return h
def run(on, b):
    B.Batch.recur = real if on else stepwise
    t = time.perf_counter()
    if b == 1:
        toks = [dasspec.generate(m, p, "self-spec", max_new_tokens=64, eos=False).tokens for p in prompts[:4]]; n = 256
    else:
        toks = [r.tokens for r in dasspec.generate_batch(m, prompts, "self-spec", max_new_tokens=64, eos=False)]; n = 512
    return n / (time.perf_counter() - t), toks
for b in (1, 8):
    run(True, b); run(False, b)
    r = {True: [], False: []}; ref = None
    for i in range(int(sys.argv[2])):
        for on in ((True, False) if i % 2 == 0 else (False, True)):
            v, toks = run(on, b); ref = ref or toks; assert toks == ref; r[on].append(v)
    ratios = [a / c for a, c in zip(r[True], r[False])]
    print("self-spec B", b, "on", [round(x, 1) for x in r[True]], "off", [round(x, 1) for x in r[False]],
          "on/off median", round(statistics.median(ratios), 3), "range", round(min(ratios), 3), round(max(ratios), 3), flush=True)
