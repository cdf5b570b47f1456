"""auto against AR on the small random Ouro (issue 37), paired in one process: 8 GSM8K prompts x 32 greedy tokens,
generate_batch at max_batch 8, one thread, alternating, tokens checked equal; ARGV: pairs [arms].
    PYTHONPATH=. python docs/performance/auto/auto_pair.py 12 [sam,pld]"""
import json, sys, time, statistics, torch, dasspec
torch.set_num_threads(1)
KN = dict(arms=sys.argv[2]) if len(sys.argv) > 2 else {}
model = dasspec.load_model("/tmp/dasspec-auto-models/ouro-small", dtype=torch.float32)
tok = model.tokenizer
qs = [json.loads(l)["question"] for l in open("/work/shared/data/gsm8k/test.jsonl")][:8]
P = [tok.encode(q) for q in qs]
def run(m):
    t = time.perf_counter(); r = dasspec.generate_batch(model, P, method=("auto" if m == "auto" else m), max_new_tokens=32, eos=False, max_batch=8, **(KN if m == "auto" else {})); return time.perf_counter() - t, [x.tokens for x in r]
run("ar"); run("auto")
rs = []
for i in range(int(sys.argv[1])):
    order = ("ar", "auto") if i % 2 == 0 else ("auto", "ar")
    res = {m: run(m) for m in order}
    assert res["ar"][1] == res["auto"][1]
    rs.append(res["auto"][0] / res["ar"][0])
q = statistics.quantiles(rs, n=4)
print(f"auto/ar time median {statistics.median(rs):.3f} quartiles {q[0]:.3f} {q[2]:.3f} n={len(rs)}")
