"""auto against AR on a random Ouro (issue 37), paired in one process: 8 GSM8K prompts x 32 greedy tokens,
generate_batch at max_batch 8, one thread, alternating, tokens checked equal.
    PYTHONPATH=. python docs/performance/auto/auto_pair.py --pairs 12 [--arms sam,pld] [--model DIR]"""
import argparse, json, os, statistics, time, torch, dasspec
p = argparse.ArgumentParser()
p.add_argument("--pairs", type=int, default=12)
p.add_argument("--arms", default=None, help="auto's arms (default: all)")
p.add_argument("--model", default="/tmp/dasspec-auto-models/ouro-small")
p.add_argument("--data", default=os.environ.get("DASSPEC_DATA", "../shared/data"))
a = p.parse_args()
torch.set_num_threads(1)
KN = dict(arms=a.arms) if a.arms else {}
model = dasspec.load_model(a.model, dtype=torch.float32)
tok = model.tokenizer
qs = [json.loads(l)["question"] for l in open(os.path.join(a.data, "gsm8k", "test.jsonl"))][:8]
P = [tok.encode(q) for q in qs]
def run(m):
    t = time.perf_counter(); r = dasspec.generate_batch(model, P, method=m, max_new_tokens=32, eos=False, max_batch=8, **(KN if m == "auto" else {})); return time.perf_counter() - t, [x.tokens for x in r]
run("ar"); run("auto")
rs = []
for i in range(a.pairs):
    order = ("ar", "auto") if i % 2 == 0 else ("auto", "ar")
    res = {m: run(m) for m in order}
    assert res["ar"][1] == res["auto"][1]
    rs.append(res["auto"][0] / res["ar"][0])
q = statistics.quantiles(rs, n=4)
print(f"{a.model}: auto/ar time median {statistics.median(rs):.3f} quartiles {q[0]:.3f} {q[2]:.3f} n={len(rs)}")
