"""Where a batched AR decode step goes: B requests already decoding, 20 steps timed, then 10 under torch.profiler.
    python benchmarks/journal/ouro-vllm/step_profile.py /tmp/ouro-mid 2 8     # model, threads, B"""
import statistics, sys, time
sys.path.insert(0, __file__.rsplit("/", 1)[0])
import torch
import dasspec
from decoding import decoding_engine
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
model = dasspec.load_model(sys.argv[1], dtype=torch.float32)
B = int(sys.argv[3]) if len(sys.argv) > 3 else 8
eng = decoding_engine(model, B)
ts = []
for _ in range(20):
    t = time.perf_counter(); eng.step(); ts.append(time.perf_counter() - t)
print(f"B={B} step ms median {1e3*statistics.median(ts):.1f} min {1e3*min(ts):.1f} -> {B/statistics.median(ts):.1f} tok/s")
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(10):
        eng.step()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
