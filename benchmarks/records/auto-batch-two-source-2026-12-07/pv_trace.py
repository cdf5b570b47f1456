import json, sys, time, glob, collections
import torch
torch.set_num_threads(2)
import dasspec
model = dasspec.load_model(); tok = dasspec.load_tokenizer()
f = sorted(glob.glob("/work/shared/data/gsm8k/*.jsonl"))[0]
prompts = [tok.encode(json.loads(l)["question"]) for l in open(f)][:8]
methods = ["ar", "auto"]
for m in methods:
    dasspec.generate(model, prompts[0], m, max_new_tokens=4, eos=False)
    dasspec.generate_batch(model, prompts[:2], m, max_new_tokens=4, eos=False, max_batch=2)
def ch(rs):
    c = collections.Counter()
    for r in rs:
        for k, v in (getattr(r.stats, "choices", None) or {}).items(): c[k] += v
    return dict(c)
for m in methods:
    t = time.perf_counter()
    rs = [dasspec.generate(model, p, m, max_new_tokens=64, eos=False) for p in prompts]
    print(m, "B1", round(512 / (time.perf_counter() - t), 1), ch(rs))
    t = time.perf_counter()
    res = dasspec.generate_batch(model, prompts, m, max_new_tokens=64, eos=False, max_batch=8)
    print(m, "B8", round(512 / (time.perf_counter() - t), 1), ch(res), flush=True)
