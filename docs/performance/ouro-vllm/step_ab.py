"""Decode-step time with dasspec/model/linear.py's packed float32 path on (dnn) and off (mkl: F.linear, the code
before), alternating every 4 steps in one engine (issue 34): B requests already decoding, one thread.
    PYTHONPATH=. python docs/performance/ouro-vllm/step_ab.py /tmp/ouro-mid 1 8"""
import json, statistics, sys, time
import torch
import dasspec
from decoding import decoding_engine
from dasspec.model import linear as lin

torch.set_num_threads(1)
model = dasspec.load_model(sys.argv[1], dtype=torch.float32)
real = lin.onednn_packing
for B in map(int, sys.argv[2:]):
    eng = decoding_engine(model, B)
    times = {"dnn": [], "mkl": []}
    for i in range(24):
        for arm in (("dnn", "mkl") if i % 2 == 0 else ("mkl", "dnn")):
            lin.onednn_packing = real if arm == "dnn" else (lambda: False)
            t = time.perf_counter()
            for _ in range(4):
                eng.step()
            times[arm].append((time.perf_counter() - t) / 4)
    ratios = [a / b for a, b in zip(times["dnn"], times["mkl"])]
    print(f"B={B}: step ms dnn median {1e3 * statistics.median(times['dnn']):.1f} min {1e3 * min(times['dnn']):.1f}; "
          f"mkl median {1e3 * statistics.median(times['mkl']):.1f} min {1e3 * min(times['mkl']):.1f}; "
          f"dnn/mkl per pair median {statistics.median(ratios):.3f} "
          f"[quartiles {statistics.quantiles(ratios, n=4)[0]:.3f}, {statistics.quantiles(ratios, n=4)[2]:.3f}]",
          flush=True)
    lin.onednn_packing = real
