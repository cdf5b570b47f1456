"""The bundled model under auto at max_batch 8, T 0.7, 16 GSM8K questions (8 wait at first: an open batch, as a
server's) x 64 tokens, one thread (issue 37): after an AR run of the same batch, every step where some request
drafted - its drafting and step time, the plain-step price, the arms (``*``: a probe), and the measured rates of
the rows a draft adds (ms a row, steps) by width bucket.
    PYTHONPATH=. python docs/performance/auto/bundled_b8_trace.py ROUNDS [DATA]"""
import sys, json, time, torch
torch.set_num_threads(1)
import dasspec
from dasspec.methods import auto as A
model = dasspec.load_model(); tok = dasspec.load_tokenizer()
qs = [json.loads(l)["question"] for l in open((sys.argv[2] if len(sys.argv) > 2 else "../shared/data") + "/gsm8k/test.jsonl")][:16]
prompts = [tok.encode(f"Question: {q}\nAnswer:") for q in qs]
log = []
propose = A.AutoDrafter.propose_batch
def timed(self, sessions):
    t0 = time.perf_counter(); out = propose(self, sessions)
    log.append((t0, time.perf_counter() - t0, [s.arm + ("*" if s.probe else "") for s in sessions],
                {k: (round(v[0] / v[1] * self.sp * 1e3, 3), v[2]) for k, v in self.extra.items()} if self.plain else {}, self.plain and round(self.sp * self.pass_cost(len(sessions)) * 1e3, 1)))
    return out
A.AutoDrafter.propose_batch = timed
def run(m):
    t = time.perf_counter()
    dasspec.generate_batch(model, prompts, m, max_new_tokens=64, max_batch=8, seed=list(range(16)), do_sample=True, temperature=0.7, top_p=0.95)
    return time.perf_counter() - t
run("ar"); run("auto")
for r in range(int(sys.argv[1])):
    t_ar = run("ar"); log.clear(); t_auto = run("auto")
    print(f"round {r}: AR {t_ar:.3f} s auto {t_auto:.3f} s steps {len(log)}")
    for i, (t0, dt, arms, ex, plain) in enumerate(log):
        step = (log[i + 1][0] - t0) * 1e3 if i + 1 < len(log) else float("nan")
        c = {x: arms.count(x) for x in dict.fromkeys(arms)}
        if any(a != "ar" for a in arms):
            print(f"  {i:3d} draft {dt*1e3:5.1f} step {step:6.1f} ms plain-price {plain} {c} rates(ms/row) {ex}")
