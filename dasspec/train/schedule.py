"""What every step draws or reads off the clock: Huginn's random depth, the depth curriculum, the learning rate.

Depth is what the bundled model must learn to use: every step samples a recurrence depth r from Huginn's
log-normal-Poisson scheme and back-propagates through the last k core steps only.  The sampler's mean ramps up
from a few steps over the first part of the run (the Raven retrofit code's ``mean_recurrence_schedule``): shallow
steps are cheap while the model is still learning token statistics, and the flat-depth recipe stalled on the
unigram plateau (model card).  Schedules run on steps when ``max_steps`` is set, so a run is the same on any
machine; only its duration changes.
"""

from __future__ import annotations

import math

import numpy as np

from .config import TrainConfig


def sample_depth(rng: np.random.Generator, mean: float, sigma: float = 0.5, backprop: int = 8,
                 min_depth: int = 1, max_depth: int = 128) -> tuple[int, int]:
    """Huginn's randomised recurrence (research/huginn.md section 1): rate ~ LogNormal(ln(mean) - sigma^2/2,
    sigma), r = Poisson(rate) + 1 (so E[r] ~ mean + 1), clipped to [min_depth, max_depth].
    Returns (n, k): n = max(r - backprop, 0) steps without gradient, then k = min(backprop, r) with gradient."""
    rate = rng.lognormal(math.log(mean) - sigma ** 2 / 2, sigma)
    r = int(min(max(rng.poisson(rate) + 1, min_depth), max_depth))
    k = min(backprop, r)
    return r - k, k


def run_fraction(cfg: TrainConfig, step: int, elapsed: float) -> float:
    """Fraction of the run done: by steps when max_steps is set (machine-independent), else by training time."""
    frac = step / cfg.max_steps if cfg.max_steps is not None else elapsed / cfg.time_budget_s
    return min(max(frac, 0.0), 1.0)


def mean_depth_at(cfg: TrainConfig, frac: float) -> float:
    """The depth sampler's mean at run fraction ``frac``: the curriculum ramp, then mean_recurrence."""
    if cfg.depth_warmup_frac <= 0 or frac >= cfg.depth_warmup_frac:
        return float(cfg.mean_recurrence)
    start = min(cfg.depth_warmup_start, cfg.mean_recurrence)
    return start + (cfg.mean_recurrence - start) * frac / cfg.depth_warmup_frac


def lr_at(cfg: TrainConfig, step: int, elapsed: float) -> float:
    """Linear warmup over steps, then cosine to min_lr_frac * lr over max_steps (or the time budget)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = run_fraction(cfg, step, elapsed)
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))
