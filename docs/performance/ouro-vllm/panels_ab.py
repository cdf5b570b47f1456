"""Products of few rows through the weights' panels (decode_kernel.register_panels: oneDNN's arithmetic, a
streaming kernel) against oneDNN's packed product alone, in one process: whole generate_batch runs (8 GSM8K prompts
of /tmp/vs/prompts.json on /tmp/ouro-mid, 32 greedy tokens, max_batch 8), the two alternating (the panels dropped
and registered again between runs, outside the timing), tokens checked equal; prints the per-pair median time
ratio with its quartiles (issue 34, 2026-12-04).
    PYTHONPATH=. python docs/performance/ouro-vllm/panels_ab.py THREADS B PAIRS"""
import json, time, statistics, sys, torch, dasspec
from dasspec.model import linear as lin, decode_kernel as dk
torch.set_num_threads(int(sys.argv[1]))
B = int(sys.argv[2]); pairs = int(sys.argv[3])
m = dasspec.load_model('/tmp/ouro-mid', dtype=torch.float32)
ids = json.load(open('/tmp/vs/prompts.json'))[:B]
dasspec.generate_batch(m, ids, 'ar', max_new_tokens=4, eos=False, max_batch=8)       # packs every weight
weights = {id(p): w for p in m.parameters() for w in [p]}
def panels(on):
    for key, hit in lin._PACKS.table.items():
        if hit:
            dk.unregister_panels(hit[0])
            if on:
                assert dk.register_panels(hit[0], weights[key].detach()) > 0
def run(on):
    panels(on)
    t = time.perf_counter()
    r = dasspec.generate_batch(m, ids, 'ar', max_new_tokens=32, eos=False, max_batch=8)
    return time.perf_counter() - t, [x.tokens for x in r]
run(True); run(False)
ratios = []
for i in range(pairs):
    order = (True, False) if i % 2 == 0 else (False, True)
    res = {f: run(f) for f in order}
    assert res[True][1] == res[False][1]
    ratios.append(res[True][0] / res[False][0])
q = statistics.quantiles(ratios, n=4)
print(f"B={B} threads={sys.argv[1]} panels / oneDNN alone, time: median {statistics.median(ratios):.3f} "
      f"quartiles {q[0]:.3f} {q[2]:.3f} (n={pairs})")
