"""Ouro's core steps in one call (Ouro.recur_rows -> decode_kernel.peri_recur_rows) against the same steps as one
layer call each (PeriNormBlock.rows), in one process: whole generate_batch runs (8 GSM8K prompts of
/tmp/vs/prompts.json on /tmp/ouro-mid, 32 greedy tokens, max_batch 8), the two alternating, tokens checked equal;
prints the per-pair median time ratio with its quartiles (issue 34, 2026-12-04).
    PYTHONPATH=. python docs/performance/ouro-vllm/recur_ab.py THREADS B PAIRS"""
import json, time, statistics, sys, torch, dasspec
from dasspec.model.families import ouro
torch.set_num_threads(int(sys.argv[1]))
B = int(sys.argv[2]); pairs = int(sys.argv[3])
m = dasspec.load_model('/tmp/ouro-mid', dtype=torch.float32)
ids = json.load(open('/tmp/vs/prompts.json'))[:B]
real = ouro.Ouro.recur_rows
def run(fused):
    ouro.Ouro.recur_rows = real if fused else (lambda *a: None)
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
print(f"B={B} threads={sys.argv[1]} steps in one call / layer calls, time: median {statistics.median(ratios):.3f} "
      f"quartiles {statistics.quantiles(ratios, n=4)[0]:.3f} {statistics.quantiles(ratios, n=4)[2]:.3f} (n={pairs})")
