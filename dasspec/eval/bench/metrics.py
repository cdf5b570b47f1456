"""The paper's metrics (Appendix A.3) and their bootstrap confidence intervals, as pure functions.

    S_a = (1/N) sum_p (n_{p,a} / t_{p,a}) / (n_{p,AR} / t_{p,AR})        eq. (8)  mean of per-prompt ratios
    A_p = sum_b a_b / B_p,              A = mean_p A_p                     eq. (9)  (prompts with B_p > 0)
    G_p = (1/B_p) sum_b (a_b + u_b),    G = mean_p G_p                     eq. (10)

n: retained output tokens; t: elapsed time including prefill; a_b: draft tokens accepted at verification b;
u_b: 1 if the target's correction / bonus token was retained; B_p: verification events of prompt p.

Confidence intervals: percentile intervals from resampling *prompts* (each prompt's ratio already pairs the
method with AR on that prompt, so resampling prompts is a paired bootstrap).  Methods whose drafter state
persists across requests (Token Recycling; ``MethodSpec.stateful``) use a moving-block bootstrap over the request
stream - contiguous blocks of 5 requests - so the resamples keep the stream's local dependence.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

N_RESAMPLES = 10_000
STATEFUL_BLOCK = 5


def throughput_ratios(n_a: Sequence[float], t_a: Sequence[float], n_ar: Sequence[float],
                      t_ar: Sequence[float]) -> np.ndarray:
    """Per-prompt throughput ratio (n_a/t_a) / (n_AR/t_AR), the summand of eq. (8)."""
    n_a, t_a, n_ar, t_ar = (np.asarray(x, dtype=np.float64) for x in (n_a, t_a, n_ar, t_ar))
    if not n_a.shape == t_a.shape == n_ar.shape == t_ar.shape:
        raise ValueError("throughput_ratios: n and t of both arms must have one entry per prompt")
    if (t_a <= 0).any() or (t_ar <= 0).any():
        raise ValueError("elapsed times must be > 0")
    if (n_ar <= 0).any():
        raise ValueError("AR produced no tokens on some prompt; its throughput ratio is undefined")
    return (n_a / t_a) / (n_ar / t_ar)


def speedup(ratios: Sequence[float]) -> float:
    """S, eq. (8): the mean of the per-prompt ratios (not a ratio of mean throughputs)."""
    r = np.asarray(ratios, dtype=np.float64)
    if r.size == 0:
        raise ValueError("speedup of zero prompts")
    return float(r.mean())


def accepted_length(accepted: Sequence[int]) -> float | None:
    """A_p, eq. (9): mean accepted draft tokens per verification of one prompt; None when B_p = 0."""
    return sum(accepted) / len(accepted) if len(accepted) else None


def committed_progress(accepted: Sequence[int], target: Sequence[int]) -> float | None:
    """G_p, eq. (10): mean committed tokens (accepted drafts + retained target token) per verification."""
    if len(accepted) != len(target):
        raise ValueError(f"a_b and u_b must have one entry per verification ({len(accepted)} vs {len(target)})")
    return (sum(accepted) + sum(target)) / len(accepted) if len(accepted) else None


def mean_over_prompts(per_prompt: Sequence[float | None]) -> float | None:
    """A or G: the mean of the per-prompt values over prompts that had a verification (B_p > 0)."""
    vals = [v for v in per_prompt if v is not None]
    return sum(vals) / len(vals) if vals else None


def bootstrap_indices(n: int, n_resamples: int, rng: np.random.Generator, block: int = 1) -> np.ndarray:
    """[n_resamples, n] indices into n items.  block=1: i.i.d. resampling.  block>1: moving-block bootstrap
    (Kunsch 1989) - ceil(n/block) blocks of ``block`` consecutive items, each starting uniformly in
    [0, n - block], concatenated and cut to n.  With n <= block the only block is the whole stream."""
    if n < 1:
        raise ValueError("bootstrap of zero items")
    if block <= 1:
        return rng.integers(0, n, size=(n_resamples, n))
    block = min(block, n)
    k = math.ceil(n / block)
    starts = rng.integers(0, n - block + 1, size=(n_resamples, k))
    idx = (starts[:, :, None] + np.arange(block)[None, None, :]).reshape(n_resamples, k * block)
    return idx[:, :n]


def bootstrap_ci(values: Sequence[float], n_resamples: int = N_RESAMPLES, seed: int = 0, block: int = 1,
                 level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of the mean of ``values`` (in request order when block > 1)."""
    v = np.asarray(values, dtype=np.float64)
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    idx = bootstrap_indices(v.size, n_resamples, np.random.default_rng(seed), block)
    means = v[idx].mean(axis=1)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(means, [alpha, 1 - alpha])
    return float(lo), float(hi)


def summarize_speedup(ratios: Sequence[float], stateful: bool = False, n_resamples: int = N_RESAMPLES,
                      seed: int = 0) -> dict:
    """S with its 95% CI; ``ratios`` in request order.  Stateful methods: moving blocks of 5 requests, shrunk to
    n // 2 for short streams (with fewer than two blocks every resample is the whole stream and the interval
    collapses to a point); the block used is in the label."""
    block = min(STATEFUL_BLOCK, max(1, len(ratios) // 2)) if stateful else 1
    lo, hi = bootstrap_ci(ratios, n_resamples, seed, block)
    return {"S": speedup(ratios), "lo": lo, "hi": hi, "n": len(ratios),
            "bootstrap": f"moving-block({block})" if stateful else "paired"}
