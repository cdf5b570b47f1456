"""One-row attention of a decode step: the CPU decode kernel for every sequence at once (new) against one SDPA call
per sequence (old), alternating every 4 steps in one engine; B requests already decoding.  The two arms round
differently, so the engine's tokens may part after the first switch; only the step times are compared.
    PYTHONPATH=. python docs/performance/ouro-vllm/kernel_ab.py /tmp/ouro-mid 2 1 8     # model, threads, B..."""
import statistics, sys, time
import torch
import dasspec
from decoding import decoding_engine
from dasspec.model import decode_kernel

torch.set_num_threads(int(sys.argv[2]))
model = dasspec.load_model(sys.argv[1], dtype=torch.float32)
kernel = decode_kernel._load()
assert kernel is not None, "the kernel did not build"

for B in map(int, sys.argv[3:]):
    eng = decoding_engine(model, B)
    times = {"new": [], "old": []}
    for i in range(30):
        for arm in (("new", "old") if i % 2 == 0 else ("old", "new")):
            decode_kernel._module = kernel if arm == "new" else None
            t = time.perf_counter()
            for _ in range(4):
                eng.step()
            times[arm].append((time.perf_counter() - t) / 4)
    decode_kernel._module = kernel
    r = [a / b for a, b in zip(times["new"], times["old"])]
    q = statistics.quantiles(r, n=4)
    print(f"B={B}: step ms new {1e3 * statistics.median(times['new']):.1f} old {1e3 * statistics.median(times['old']):.1f}; "
          f"new/old per pair median {statistics.median(r):.3f} [{q[0]:.3f}, {q[2]:.3f}]", flush=True)
