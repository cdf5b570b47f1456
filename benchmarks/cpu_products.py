"""dasspec's CPU product (``decode_kernel.linear``) against torch's MKL (``F.linear``) and oneDNN's packed product
(``mkldnn._linear_pointwise``), side by side in one run, per row count M, with the weight warm in the cache (the same
weight called again) and cold (a round over enough distinct weights, 120 MB, that each call reads its weight from
memory, as a decode step over a model's layers does).

    python benchmarks/cpu_products.py [--threads 1] [--shapes 1536x512,2816x512,512x1408,49152x512] [--rows 1,4,8,16,64]

Prints a markdown table of milliseconds per call and ours / best-of-torch.  A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from dasspec.model import decode_kernel


def per_call_ms(fn, weights: list[torch.Tensor], x: torch.Tensor, reps: int) -> float:
    for w in weights:
        fn(x, w)
    t = time.perf_counter()
    for _ in range(reps):
        for w in weights:
            fn(x, w)
    return (time.perf_counter() - t) / (reps * len(weights)) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--shapes", default="1536x512,2816x512,512x1408,49152x512", help="N x K of the weights")
    p.add_argument("--rows", default="1,4,8,16,64")
    p.add_argument("--cold-mb", type=float, default=120.0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not decode_kernel.available():
        raise SystemExit(f"the CPU kernels are not built: {decode_kernel.error()}")
    onednn = hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    print(f"ISA path {decode_kernel.isa()}, {args.threads} thread(s), torch {torch.__version__}\n")
    print("| N x K | M | cache | ours ms | MKL ms | oneDNN ms | ours / best |")
    print("|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        N, K = map(int, shape.split("x"))
        n_cold = max(2, int(args.cold_mb * 1e6 // (N * K * 4)))
        cold = [torch.randn(N, K) * 0.02 for _ in range(n_cold)]
        for cache, ws in (("warm", cold[:1]), ("cold", cold)):
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws] if onednn else []
            for M in map(int, args.rows.split(",")):
                x = torch.randn(M, K)
                reps = max(2, int(40e6 // (N * K * len(ws))))
                ours = per_call_ms(lambda x, w: decode_kernel.linear(x, w, None), ws, x, reps)
                mkl = per_call_ms(lambda x, w: F.linear(x, w), ws, x, reps)
                dnn = (per_call_ms(lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
                                   packed, x, reps) if onednn else float("nan"))
                best = min(mkl, dnn) if onednn else mkl
                print(f"| {N} x {K} | {M} | {cache} | {ours:.3f} | {mkl:.3f} | {dnn:.3f} | {ours / best:.2f} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
