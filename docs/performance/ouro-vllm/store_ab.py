"""K/V stores of a batched step: one indexed copy per layer for all segments in one pool (new) against one slice
copy per segment (old), alternating every 4 steps in one engine; B requests already decoding.
    PYTHONPATH=. python docs/performance/ouro-vllm/store_ab.py /tmp/ouro-mid 2 8     # model, threads, B"""
import statistics, sys, time
import torch
import dasspec
from decoding import decoding_engine
from dasspec.model import attention as att

torch.set_num_threads(int(sys.argv[2]))
model = dasspec.load_model(sys.argv[1], dtype=torch.float32)
new = att.BatchKV.store


def old(self, span, k, v):
    for i, a, b, part in span.segments():
        self.parts[i].store(part, k[:, a:b], v[:, a:b])


for B in map(int, sys.argv[3:]):
    eng = decoding_engine(model, B)
    times = {"new": [], "old": []}
    for i in range(30):
        for arm in (("new", "old") if i % 2 == 0 else ("old", "new")):
            att.BatchKV.store = new if arm == "new" else old
            t = time.perf_counter()
            for _ in range(4):
                eng.step()
            times[arm].append((time.perf_counter() - t) / 4)
    att.BatchKV.store = new
    r = [a / b for a, b in zip(times["new"], times["old"])]
    q = statistics.quantiles(r, n=4)
    print(f"B={B}: step ms new {1e3 * statistics.median(times['new']):.1f} old {1e3 * statistics.median(times['old']):.1f}; "
          f"new/old per pair median {statistics.median(r):.3f} [{q[0]:.3f}, {q[2]:.3f}]", flush=True)
