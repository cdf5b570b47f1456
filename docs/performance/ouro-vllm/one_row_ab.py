"""Single rows through the packed oneDNN product (ONE_ROW_PACKED, an experiment of 2026-12-03, not kept: add the
flag to dasspec/model/linear.py to rerun) against MKL's, alternating every 4 steps in one engine.
    PYTHONPATH=. python docs/performance/ouro-vllm/one_row_ab.py /tmp/ouro-mid 2 1     # model, threads, B"""
import json, statistics, sys, time
import torch
import dasspec
from decoding import decoding_engine
from dasspec.model import linear as lin
torch.set_num_threads(int(sys.argv[2]))
model = dasspec.load_model(sys.argv[1], dtype=torch.float32)
for B in map(int, sys.argv[3:]):
    eng = decoding_engine(model, B, warm=0)
    for arm in (True, False):
        lin.ONE_ROW_PACKED = arm
        for _ in range(4): eng.step()
    times = {True: [], False: []}
    for i in range(20):
        for arm in ((True, False) if i % 2 == 0 else (False, True)):
            lin.ONE_ROW_PACKED = arm
            t = time.perf_counter()
            for _ in range(4): eng.step()
            times[arm].append((time.perf_counter() - t) / 4)
    r = [a / b for a, b in zip(times[True], times[False])]
    q = statistics.quantiles(r, n=4)
    print(f"B={B}: step ms new {1e3*statistics.median(times[True]):.1f} old {1e3*statistics.median(times[False]):.1f}; new/old per pair median {statistics.median(r):.3f} [{q[0]:.3f}, {q[2]:.3f}]", flush=True)
