"""Micro-benchmark behind ``LoopedLM.cpu_weight_layout``: CPU time of ``F.linear`` for a few-row activation with the
weight stored [out, in] row-major (as loaded) versus in-major (the same tensor, strides (1, out)), at the bundled
model's projection shapes, plus SDPA with a boolean versus an additive float mask.  Prints microseconds per call.

    python benchmarks/cpu_layout.py --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def per_call_us(fn, reps: int = 300) -> float:
    for _ in range(30):
        fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}; microseconds per call (row-major / in-major)")
    for out_f, in_f in [(768, 256), (1408, 256), (256, 704), (256, 512), (4096, 256)]:
        w = torch.randn(out_f, in_f)
        w_in_major = w.t().contiguous().t()
        cells = []
        for rows in (1, 4, 13, 25, 48):
            x = torch.randn(1, rows, in_f)
            a = per_call_us(lambda: F.linear(x, w))
            b = per_call_us(lambda: F.linear(x, w_in_major))
            cells.append(f"W={rows}: {a:.0f}/{b:.0f}")
        print(f"[{out_f}x{in_f}]", " | ".join(cells))
    H, hd = 4, 64
    for T in (200, 1200):
        for rows in (13, 25, 48):
            k, v = torch.randn(1, H, T + rows, hd), torch.randn(1, H, T + rows, hd)
            q = torch.randn(1, H, rows, hd)
            mask = torch.ones(rows, T + rows, dtype=torch.bool).tril(T)
            bias = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
            a = per_call_us(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
            b = per_call_us(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias))
            print(f"attention prefix {T}, W={rows}: bool mask {a:.0f} us, float mask {b:.0f} us")


if __name__ == "__main__":
    main()
