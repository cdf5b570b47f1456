"""dasspec's float32 product (``decode_kernel.linear``) per row at 512-4,096 rows on the mid-size Nanbeige's
shapes (gate and up together, down, QKV), 2 threads, best of 5: where a larger step stops paying per row.

    python benchmarks/journal/closed-budget/product_rows.py [--rows 512,1024,2048,4096]"""
import argparse
import time

import torch

from dasspec.model import decode_kernel

p = argparse.ArgumentParser()
p.add_argument("--rows", default="512,1024,2048,4096")
p.add_argument("--threads", type=int, default=2)
a = p.parse_args()
torch.set_num_threads(a.threads)
torch.manual_seed(0)
for K, N in ((512, 6144), (3072, 512), (512, 1536)):
    w = torch.randn(N, K) * 0.02
    for M in map(int, a.rows.split(",")):
        x = torch.randn(M, K)
        decode_kernel.linear(x, w)
        times = []
        for _ in range(5):
            t = time.perf_counter()
            decode_kernel.linear(x, w)
            times.append(time.perf_counter() - t)
        best = min(times)
        print(f"K={K} N={N} M={M}: {best * 1e3:.1f} ms, {2 * M * K * N / best / 1e9:.0f} GFLOP/s, "
              f"{best / M * 1e6:.1f} us/row", flush=True)
