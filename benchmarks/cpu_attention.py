"""Wide masked attention on CPU: torch's SDPA against ``attention.cpu_gemm_attention`` (scores materialised), in isolation
and inside whole DAS-Wave requests.

    python benchmarks/cpu_attention.py --threads 2                                   # both parts
    python benchmarks/cpu_attention.py --threads 2 --tasks math500 --prompts 5 --reps 3 --prefix-cache

Part 1 times one attention call (4 heads of 48, the bundled model's) for W queries over n prefix rows with an
additive causal-block mask.  Part 2 runs DAS-Wave on development prompts with the GEMM path on and off
(``attention.GEMM_ATTENTION_MIN_W``), alternating the order per prompt, and prints the ratio of total wall time.
A benchmark, not a test: it asserts nothing about speed (it does check that both settings give the same tokens).
"""

from __future__ import annotations

import argparse
import math
import sys
import time


def best_time(fn, n: int = 60, repeats: int = 5) -> float:
    for _ in range(5):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best


def isolated(widths: list[int], prefixes: list[int]) -> None:
    import torch
    import torch.nn.functional as F

    from dasspec.model.attention import cpu_gemm_attention as gemm_attention

    print("| n (prefix rows) | W (queries) | SDPA (µs) | GEMM (µs) | SDPA / GEMM |\n|---|---|---|---|---|")
    for n in prefixes:
        for W in widths:
            q, k, v = torch.randn(1, 4, W, 48), torch.randn(4, n + W, 48), torch.randn(4, n + W, 48)
            mask = torch.ones(W, n + W, dtype=torch.bool).tril(n)
            bias = torch.zeros(W, n + W).masked_fill_(~mask, float("-inf"))
            a = best_time(lambda: F.scaled_dot_product_attention(q, k.unsqueeze(0), v.unsqueeze(0), attn_mask=bias))
            b = best_time(lambda: gemm_attention(q, k, v, bias, 1 / math.sqrt(48)))
            print(f"| {n} | {W} | {a * 1e6:.0f} | {b * 1e6:.0f} | {a / b:.2f}× |")


def end_to_end(tasks: str, prompts: int, reps: int, cap: int, shots: list[str], prefix_cache: bool,
               data: str | None) -> None:
    import dasspec
    from dasspec.engine.api.prefix_cache import common_prefix
    from dasspec.eval.bench.runner import dev_prompts
    from dasspec.model import attention as layers

    model = dasspec.load_model()
    on = layers.GEMM_ATTENTION_MIN_W
    for task in tasks.split(","):
        ps = dev_prompts(model, task, prompts, cap, shots, data)
        shared = common_prefix([p.ids for p in ps]) if len(ps) > 1 else 0
        pc = dasspec.PrefixCache(model, ps[0].ids[:shared]) if prefix_cache and shared >= 16 else None
        total = {True: 0.0, False: 0.0}
        for rep in range(reps):
            for i, p in enumerate(ps):
                tokens = {}
                for gemm in ((True, False) if (i + rep) % 2 else (False, True)):
                    layers.GEMM_ATTENTION_MIN_W = on if gemm else 1 << 30
                    out = dasspec.generate(model, p.ids, "das-wave", max_new_tokens=cap, stop=list(p.task.stop),
                                           prefix_cache=pc)
                    total[gemm] += out.stats.wall_time
                    tokens[gemm] = out.tokens
                if tokens[True] != tokens[False]:
                    raise AssertionError(f"{task} prompt {i}: the GEMM path changed the tokens")
        layers.GEMM_ATTENTION_MIN_W = on
        print(f"{task}: {len(ps)} prompts x {reps}, cached prefix {shared if pc else 0} tokens: SDPA "
              f"{total[False]:.2f} s, GEMM {total[True]:.2f} s, SDPA / GEMM {total[False] / total[True]:.3f}×")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--widths", default="8,16,26,48,72")
    p.add_argument("--prefixes", default="300,1000")
    p.add_argument("--tasks", default="gsm8k,math500,humaneval", help="'' skips the end-to-end part")
    p.add_argument("--prompts", type=int, default=5, help="development prompts per task")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--shots", action="append", default=["gsm8k=2"], metavar="TASK=N")
    p.add_argument("--prefix-cache", action="store_true", help="reuse each task's shared few-shot prefix")
    p.add_argument("--data", default=None)
    args = p.parse_args(argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    isolated([int(w) for w in args.widths.split(",")], [int(n) for n in args.prefixes.split(",")])
    if args.tasks:
        end_to_end(args.tasks, args.prompts, args.reps, args.max_new_tokens, args.shots, args.prefix_cache, args.data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
