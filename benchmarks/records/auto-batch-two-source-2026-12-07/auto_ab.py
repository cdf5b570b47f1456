"""auto at B = 8 on the bundled model with and without the host-time term, one process, alternating, every call cold
(auto's kept outcomes cleared), AR beside; 2 threads."""
import time, json, glob, statistics, sys
import torch
import dasspec
from dasspec.methods.auto import memory
from dasspec.methods.auto.costs import CostModel
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
m = dasspec.load_model(); tok = dasspec.load_tokenizer()
f = sorted(glob.glob("/work/shared/data/gsm8k/*.jsonl"))[0]
prompts = [tok.encode(json.loads(l)["question"]) for l in open(f)][:8]
real = CostModel.overhead
def run(method, host):
    memory._shelves.clear()
    CostModel.overhead = real if host else property(lambda self: 0.0)
    t = time.perf_counter()
    res = dasspec.generate_batch(m, prompts, method=method, max_new_tokens=64, eos=False)
    dt = time.perf_counter() - t
    CostModel.overhead = real
    return 8 * 64 / dt, res
run("ar", True); run("auto", True)
rates = {"ar": [], "auto+host": [], "auto-host": []}
toks = None
for r in range(int(sys.argv[2]) if len(sys.argv) > 2 else 5):
    order = [("ar", True), ("auto", True), ("auto", False)]
    if r % 2: order.reverse()
    for meth, host in order:
        v, res = run(meth, host)
        name = meth if meth == "ar" else ("auto+host" if host else "auto-host")
        rates[name].append(v)
        t = [x.tokens for x in res]
        toks = toks or t
        assert t == toks, name
print({k: [round(x, 1) for x in v] for k, v in rates.items()})
for k in ("auto+host", "auto-host"):
    ratios = [a / b for a, b in zip(rates[k], rates["ar"])]
    print(k, "/ AR: median", round(statistics.median(ratios), 3), "range", round(min(ratios), 3), round(max(ratios), 3))
ratios = [a / b for a, b in zip(rates["auto+host"], rates["auto-host"])]
print("with / without host: median", round(statistics.median(ratios), 3), "range", round(min(ratios), 3), round(max(ratios), 3))
