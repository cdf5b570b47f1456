"""dasspec's generate_batch split into prefill and decode as vllm_split.py splits vLLM's: 4 rounds of the 8 prompts of
/tmp/vs/prompts.json with 1, 2 and 32 new tokens on /tmp/ouro-mid, 2 threads (lines "@@ round new_tokens seconds").
    PYTHONPATH=. python docs/performance/ouro-vllm/dasspec_split.py"""
import json, sys, time, torch, dasspec
torch.set_num_threads(2)
model = dasspec.load_model("/tmp/ouro-mid", dtype=torch.float32)
P = json.load(open("/tmp/vs/prompts.json"))
dasspec.generate_batch(model, P[:2], method="ar", max_new_tokens=4, eos=False)
for r in range(4):
    for n in (1, 2, 32):
        t = time.perf_counter(); dasspec.generate_batch(model, P, method="ar", max_new_tokens=n, eos=False, max_batch=8); dt = time.perf_counter() - t
        print("@@", r, n, f"{dt:.3f}", flush=True)
