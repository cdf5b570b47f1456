"""dasspec's float32 product (``decode_kernel.linear``) per row at 512-4,096 rows on the mid-size Nanbeige's
shapes (gate and up together, down, QKV), 2 threads, best of 5: where a larger step stops paying per row.

    python benchmarks/journal/closed-budget/product_rows.py"""
import time

import torch

from dasspec.model import decode_kernel

torch.set_num_threads(2)
torch.manual_seed(0)
for K, N in ((512, 6144), (3072, 512), (512, 1536)):
    w = torch.randn(N, K) * 0.02
    for M in (512, 1024, 2048, 4096):
        x = torch.randn(M, K)
        decode_kernel.linear(x, w)
        best = min((lambda t: (decode_kernel.linear(x, w), time.perf_counter() - t)[1])(time.perf_counter())
                   for _ in range(5))
        print(f"K={K} N={N} M={M}: {best * 1e3:.1f} ms, {2 * M * K * N / best / 1e9:.0f} GFLOP/s, "
              f"{best / M * 1e6:.1f} us/row", flush=True)
