"""dasspec's CPU product (``decode_kernel.linear``) against torch's MKL (``F.linear``) and oneDNN's packed product
(``mkldnn._linear_pointwise``), side by side in one run, per row count M, with the weight warm in the cache (the same
weight called again) and cold (a round over enough distinct weights, 120 MB, that each call reads its weight from
memory, as a decode step over a model's layers does).

    python benchmarks/cpu_products.py [--threads 1] [--shapes 1536x512,2816x512,512x1408,49152x512] [--rows 1,4,8,16,64]
        [--against REV [--rounds 9]]

Prints a markdown table of milliseconds per call and ours / best-of-torch.  ``--against REV``: the kernels of git
revision REV built beside today's and the two timed in turn, round after round in one process (outputs checked
equal), for a table of today's speed over REV's, median [range] over the rounds - a kernel change's paired A/B.
A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

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


def build_at(rev: str):
    """The CPU kernels of git revision ``rev``, built (cached by their sources, as today's are) and imported."""
    root = Path(__file__).resolve().parents[1]
    today = decode_kernel.CSRC
    with tempfile.TemporaryDirectory(prefix="dasspec-csrc-") as tmp:    # the build copies them beside itself
        for name in decode_kernel.SOURCES + decode_kernel.HEADERS:
            text = subprocess.run(["git", "show", f"{rev}:dasspec/csrc/{name}"], cwd=root, check=True,
                                  capture_output=True).stdout
            (Path(tmp) / name).write_bytes(text)
        decode_kernel.CSRC = Path(tmp)
        try:
            return decode_kernel._build()
        finally:
            decode_kernel.CSRC = today


def against(old, args) -> None:
    """Today's kernels over ``old``'s: per shape, row count and cache state, both timed in turn each round."""
    new = decode_kernel._load()
    print(f"today's kernels over {args.against}'s, {args.rounds} rounds alternating, {args.threads} thread(s)\n")
    print("| N x K | M | cache | today ms | old ms | today's speed / old, median [range] |")
    print("|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        N, K = map(int, shape.split("x"))
        cold = [torch.randn(N, K) * 0.02 for _ in range(max(2, int(args.cold_mb * 1e6 // (N * K * 4))))]
        for cache, ws in (("warm", cold[:1]), ("cold", cold)):
            for M in map(int, args.rows.split(",")):
                x = torch.randn(M, K)
                if not all(torch.equal(new.linear(x, w, None), old.linear(x, w, None)) for w in ws[:2]):
                    raise SystemExit(f"{N} x {K}, {M} rows: today's kernels and {args.against}'s differ in bits")
                reps = max(2, int(20e6 // (N * K * len(ws))))
                times = {"new": [], "old": []}
                for r in range(args.rounds):
                    for arm in (("new", "old") if r % 2 == 0 else ("old", "new")):
                        mod = new if arm == "new" else old
                        times[arm].append(per_call_ms(lambda x, w: mod.linear(x, w, None), ws, x, reps))
                ratios = [o / n for n, o in zip(times["new"], times["old"])]
                print(f"| {N} x {K} | {M} | {cache} | {statistics.median(times['new']):.3f} | "
                      f"{statistics.median(times['old']):.3f} | {statistics.median(ratios):.3f} "
                      f"[{min(ratios):.3f}, {max(ratios):.3f}] |", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--shapes", default="1536x512,2816x512,512x1408,49152x512", help="N x K of the weights")
    p.add_argument("--rows", default="1,4,8,16,64")
    p.add_argument("--cold-mb", type=float, default=120.0)
    p.add_argument("--against", help="a git revision whose kernels to time beside today's")
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not decode_kernel.available():
        raise SystemExit(f"the CPU kernels are not built: {decode_kernel.error()}")
    if args.against:
        against(build_at(args.against), args)
        return 0
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
