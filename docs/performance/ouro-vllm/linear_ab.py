"""Before/after of dasspec/model/linear.py's packed float32 path, in one process: generate_batch AR on /tmp/ouro-mid with
the path on (dnn) and off (mkl: torch's F.linear, the code before), alternating; B = 8 over 8 GSM8K prompts, B = 1 over 2.
Run from the repository root with PYTHONPATH=. (issue 34; docs/performance.md, "Batched AR against vLLM")."""
import json, time, sys, torch
import dasspec
from dasspec.model import linear as lin
torch.set_num_threads(1)
m = dasspec.load_model('/tmp/ouro-mid', dtype=torch.float32)
qs = [json.loads(l)["question"] for l in open('/work/shared/data/gsm8k/test.jsonl')][:8]
prompts = [m.tokenizer.encode(q) for q in qs]
real = lin.onednn_packing
def run(arm, B, P):
    lin.onednn_packing = real if arm == "dnn" else (lambda: False)
    t = time.perf_counter()
    outs = dasspec.generate_batch(m, prompts[:P], "ar", max_new_tokens=32, max_batch=B, eos=False)
    return time.perf_counter() - t, [o.tokens for o in outs]
run("dnn", 8, 8); run("mkl", 8, 8)
res = {}
for rnd in range(3):
    for B, P in ((8, 8), (1, 2)):
        for arm in (("dnn", "mkl") if rnd % 2 == 0 else ("mkl", "dnn")):
            dt, toks = run(arm, B, P)
            res.setdefault((arm, B), []).append(dt)
            res.setdefault(("tok", arm, B), toks)
            print(rnd, arm, B, round(P * 32 / dt, 2), "tok/s", flush=True)
for B in (8, 1):
    print("B", B, "dnn/mkl time ratios", [round(a / b, 3) for a, b in zip(res[("dnn", B)], res[("mkl", B)])],
          "same tokens", res[("tok", "dnn", B)] == res[("tok", "mkl", B)])
print("B8 vs B1 tokens", res[("tok", "dnn", 8)][:2] == res[("tok", "dnn", 1)], res[("tok", "mkl", 8)][:2] == res[("tok", "mkl", 1)])
