"""Micro-benchmark behind ``dasspec.model.looped.in_major_pays``: CPU time of ``F.linear`` for a few-row activation
with the weight stored [out, in] contiguous (as in the file) versus in-major (the same tensor, strides (1, out)), per
dtype, at the projection shapes of a model (the bundled one, or Huginn-0125's full size), plus SDPA with a boolean
versus an additive float mask.  Prints milliseconds per call and the in-major / contiguous ratio (< 1: in-major
is faster).

    python benchmarks/cpu_layout.py --threads 2                                  # bundled shapes, fp32 + bf16
    python benchmarks/cpu_layout.py --threads 2 --shapes huginn --rows 1,6,25    # Huginn-0125 (needs ~3 GB)
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def projection_shapes(name: str) -> list[tuple[str, int, int]]:
    """(what, out, in) of every distinct Linear of the model: Wqkv, attention proj, MLP fc, MLP proj, adapter,
    head."""
    if name == "huginn":
        d, heads, hd, inter, vocab = 5280, 55, 96, 17920, 65536
        kv = heads
    else:
        from dasspec.model.checkpoint import BUNDLED_DIR, read_json
        from dasspec.model.config import LoopedConfig
        c = LoopedConfig.from_hf(read_json(BUNDLED_DIR / "config.json"), ["transformer.core_block.0.norm_4.weight"])
        d, heads, hd, inter, vocab, kv = c.n_embd, c.n_heads, c.head_dim, c.intermediate_size, c.vocab_size, \
            c.n_kv_heads
    return [("Wqkv", (heads + 2 * kv) * hd, d), ("attn.proj", d, heads * hd), ("mlp.fc", 2 * inter, d),
            ("mlp.proj", d, inter), ("adapter", d, 2 * d), ("head", vocab, d)]


def per_call_ms(fn, budget_s: float = 0.4) -> float:
    """Best of three timings of a repetition count sized so one timing takes about ``budget_s``."""
    fn()
    t = time.perf_counter()
    fn()
    once = time.perf_counter() - t
    reps = max(2, min(300, int(budget_s / max(once, 1e-6))))
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best * 1e3


def linear_table(shapes: list[tuple[str, int, int]], dtypes: list[str], rows: list[int]) -> None:
    for dname in dtypes:
        dtype = DTYPES[dname]
        print(f"\n{dname}: ms per F.linear call, contiguous / in-major (ratio in-major/contiguous)")
        for what, out_f, in_f in shapes:
            w = (torch.randn(out_f, in_f) / in_f ** 0.5).to(dtype)
            w_in_major = w.t().contiguous().t()
            cells = []
            for r in rows:
                x = torch.randn(1, r, in_f).to(dtype)
                a = per_call_ms(lambda: F.linear(x, w))
                b = per_call_ms(lambda: F.linear(x, w_in_major))
                cells.append(f"W={r}: {a:.3g}/{b:.3g} ({b / a:.2f})")
            print(f"  {what} [{out_f}x{in_f}]", " | ".join(cells))
            del w, w_in_major


def attention_table() -> None:
    H, hd = 4, 64
    for T in (200, 1200):
        for rows in (13, 25, 48):
            k, v = torch.randn(1, H, T + rows, hd), torch.randn(1, H, T + rows, hd)
            q = torch.randn(1, H, rows, hd)
            mask = torch.ones(rows, T + rows, dtype=torch.bool).tril(T)
            bias = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
            a = per_call_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
            b = per_call_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias))
            print(f"attention prefix {T}, W={rows}: bool mask {a * 1e3:.0f} us, float mask {b * 1e3:.0f} us")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shapes", choices=("bundled", "huginn"), default="bundled")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16, float16")
    p.add_argument("--rows", default="1,4,13,25,48", help="activation rows W, comma-separated")
    p.add_argument("--no-attention", action="store_true", help="skip the attention-mask comparison")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        p.error(f"unknown dtype(s) {unknown}; choose from {sorted(DTYPES)}")
    print(f"threads {args.threads}, {args.shapes} shapes, torch {torch.__version__}")
    linear_table(projection_shapes(args.shapes), dtypes, [int(r) for r in args.rows.split(",")])
    if not args.no_attention and args.shapes == "bundled":
        print()
        attention_table()


if __name__ == "__main__":
    main()
