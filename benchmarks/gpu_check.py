"""One short GPU session's worth of checks (issue 8), prepared so a lent GPU's minutes go to measuring.

On a Huginn-0125-shaped model with random weights (d 5280, 55 heads, 2/4/2 layers, vocab 65536, R 32; bf16;
random weights are fine for timing, losslessness is tested elsewhere) it measures:

1. the cost of one full-depth target pass (prelude, R core steps, readout) over W positions after a prefix, for
   W = 1 .. 49, relative to W = 1: the hardware's side of the efficiency (measured / pass-count speedup).  On a
   GPU at batch 1 the ratio should stay near 1 far longer than on a CPU;
2. end-to-end tokens/s of AR and DAS-Wave (paper schedule) in eager mode, with static shapes, and with CUDA graphs
   (torch.compile "reduce-overhead"), plus whether each mode's tokens equal eager AR's (random bf16 weights make
   near-ties likely, so a difference is reported, not asserted);
3. the depth cache's bytes per token and the peak memory.

    python benchmarks/gpu_check.py --out runs/gpu                   # on the GPU machine: eager + static shapes
    python benchmarks/gpu_check.py --out runs/gpu-graphs --modes cuda-graphs --new-tokens 16   # compiles first
    python benchmarks/gpu_check.py --shape tiny --out runs/gpu-cpu  # the same code path on CPU, seconds

Writes gpu_check.md and gpu_check.json into --out.  This is a benchmark: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

HUGINN = dict(vocab_size=65536, n_embd=5280, n_heads=55, n_kv_heads=55, head_dim=96, intermediate_size=17920,
              n_prelude=2, n_core=4, n_coda=2, mean_recurrence=32, block_size=4096,
              embed_scale=math.sqrt(5280), init_std=math.sqrt(2 / (5 * 5280)))
TINY = dict(vocab_size=512, n_embd=64, n_heads=4, n_kv_heads=4, head_dim=16, intermediate_size=128,
            n_prelude=1, n_core=2, n_coda=1, mean_recurrence=8, block_size=1024)


def build(shape: str, device: torch.device, dtype: torch.dtype):
    from dasspec.model.looped import LoopedLM
    from dasspec.testing import tiny_config
    from dasspec.train.objective import init_weights

    cfg = tiny_config("huginn", **(HUGINN if shape == "huginn" else TINY))
    with torch.device("meta"):
        model = LoopedLM(cfg)
    model = model.to_empty(device=device)
    torch.manual_seed(0)
    init_weights(model)                      # Huginn's own ("takase") initialisation, drawn on the device
    model = model.to(dtype)
    from dasspec.model.layers import rope_tables
    cos, sin = rope_tables(cfg, cfg.block_size)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    model.eval().requires_grad_(False)
    if device.type == "cpu":
        model.cpu_weight_layout()
    return model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def pass_costs(model, prompt: list[int], widths: list[int], reps: int) -> dict[int, float]:
    """Seconds per full-depth target pass over W positions after the prompt (scratch rows, nothing committed)."""
    from dasspec.model.cache import DepthCache

    P, R, dev = len(prompt), model.R, model.device
    cache = DepthCache(model.config, R, P + max(widths) + 1, dev, model.dtype)
    extra = (prompt * (max(widths) // P + 1))[: max(widths)]         # the block's tokens: any will do
    ids = torch.tensor([prompt + extra], device=dev)
    h0 = model.initial_state(torch.arange(P + max(widths)), 1.0, 0).unsqueeze(0)
    out = {}
    with torch.inference_mode():
        model.full_depth(ids[:, :P], h0[:, :P], model.span(0, 0, P), cache, R)
        cache.commit(P)
        for W in widths:
            args = (ids[:, P: P + W], h0[:, P: P + W], model.span(P, P, W), cache, R)
            model.full_depth(*args)                         # warm-up (kernel selection, allocator)
            sync(dev)
            t = time.perf_counter()
            for _ in range(reps):
                model.full_depth(*args)
            sync(dev)
            out[W] = (time.perf_counter() - t) / reps
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--shape", choices=["huginn", "tiny"], default="huginn")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--modes", default="eager,static",
                   help="eager, static, cuda-graphs (compiles one graph per width: run it separately, with a timeout)")
    args = p.parse_args(argv)

    import dasspec
    from dasspec.model.cache import bytes_per_token

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    modes = [m for m in args.modes.split(",") if m != "cuda-graphs" or device.type == "cuda"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"shape": args.shape, "device": str(device), "dtype": str(dtype).replace("torch.", ""),
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                    "torch": torch.__version__, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}

    t0 = time.perf_counter()
    model = build(args.shape, device, dtype)
    result["build_s"] = time.perf_counter() - t0
    result["parameters"] = model.num_parameters()
    result["cache_bytes_per_token"] = bytes_per_token(model.config, model.R, dtype)
    prompt = torch.randint(2, model.config.vocab_size, (args.prompt_len,),
                           generator=torch.Generator().manual_seed(1)).tolist()
    print(f"built {result['parameters'] / 1e9:.2f} B parameters in {result['build_s']:.1f}s on {device} ({dtype})",
          flush=True)

    widths = [1, 2, 4, 8, 16, 25, 33, 49]
    costs = pass_costs(model, prompt, widths, args.reps)
    result["pass_seconds"] = costs
    print("full-depth pass cost relative to W=1: " +
          ", ".join(f"W={w}: {costs[w] / costs[1]:.2f}" for w in widths), flush=True)

    schedule = {"gamma": 32, "rounds": 24, "w_init": 2, "k": 2}
    runs = []
    ref_tokens = None
    for mode in modes:
        runtime = dasspec.Runtime(static_shapes=mode != "eager", cuda_graphs=mode == "cuda-graphs")
        for method, knobs in (("ar", {}), ("das-wave", schedule)):
            kw = dict(max_new_tokens=args.new_tokens, eos=False, runtime=runtime, **knobs)
            dasspec.generate(model, prompt, method, **kw)                   # warm-up / compile
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            sync(device)
            r = dasspec.generate(model, prompt, method, **kw)
            if ref_tokens is None:
                ref_tokens = r.tokens
            row = {"mode": mode, "method": method, "tokens_per_second": r.stats.tokens_per_second,
                   "A": r.stats.A, "sequential_passes": r.stats.sequential_passes,
                   "same_tokens_as_eager_ar": r.tokens == ref_tokens,
                   "peak_memory_gib": (torch.cuda.max_memory_allocated(device) / 2**30
                                       if device.type == "cuda" else None)}
            runs.append(row)
            print(json.dumps(row), flush=True)
    result["runs"] = runs

    lines = [f"# GPU check ({result['gpu'] or device}, {result['dtype']}, torch {result['torch']})", "",
             f"Huginn-shaped random model: {result['parameters'] / 1e9:.2f} B parameters; depth cache "
             f"{result['cache_bytes_per_token'] / 2**20:.2f} MiB per token; prompt {args.prompt_len} tokens.", "",
             "| W | full-depth pass (ms) | relative to W = 1 |", "|---|---|---|"]
    lines += [f"| {w} | {costs[w] * 1e3:.2f} | {costs[w] / costs[1]:.2f} |" for w in widths]
    lines += ["", "| mode | method | tok/s | A | sequential passes | tokens = eager AR | peak GiB |",
              "|---|---|---|---|---|---|---|"]
    for r in runs:
        peak = "–" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.1f}"
        lines.append(f"| {r['mode']} | {r['method']} | {r['tokens_per_second']:.1f} | {r['A']:.2f} | "
                     f"{r['sequential_passes']} | {r['same_tokens_as_eager_ar']} | {peak} |")
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
