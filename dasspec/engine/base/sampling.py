"""Sampling that stays lossless: the token after position t is the argmax of the filtered, tempered logits plus
Gumbel noise drawn from (seed, t) alone (``model.noise.gumbel_noise``).

    token_t = argmax_v ( warp(logits_t)(v) + g_t(v) ),   warp = temperature, then top-k, top-p, min-p

* Gumbel-max: since g_t does not depend on the prefix, the token follows softmax(warp(logits_t)) given the prefix -
  real sampling, not a heuristic.
* The full-depth target is then a deterministic function of the prefix and the seed, so Proposition 1 applies as
  for greedy decoding: every method emits exactly the tokens AR sampling emits, seed for seed.  The verifier and
  every drafter that reads the model choose through the same function, with the noise of the position they
  propose for (coupled drafting: where the shallow distribution is close to the target's, they agree).
* The noise is keyed by absolute position, so it is the same whether a position is computed alone or inside a wide
  block, on CPU and CUDA.

The warpers follow Hugging Face's order and definitions (``TemperatureLogitsWarper`` then ``TopK``, ``TopP``,
``MinP``): top-k keeps the logits >= the k-th largest, top-p the smallest top set whose probability reaches p (at
least one token), min-p the tokens with probability >= min_p x the largest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ...model import decode_kernel
from ...model.noise import gumbel_noise


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"temperature must be a finite number > 0 when sampling, got {t!r} (for greedy "
                             "decoding leave do_sample off)")
        k = self.top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"top_k must be an integer >= 1, got {k!r}")
        p = self.top_p
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1):
            raise ValueError(f"top_p must be a number in (0, 1], got {p!r}")
        m = self.min_p
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m < 1):
            raise ValueError(f"min_p must be a number in [0, 1), got {m!r}")
        s = self.seed
        if isinstance(s, bool) or not isinstance(s, int):
            raise ValueError(f"seed must be an integer, got {s!r}")

    def warp(self, logits: Tensor) -> Tensor:
        """Tempered and filtered logits [W, V] (filtered entries -inf): what the sample's softmax is taken of.

        The row maximum is subtracted before dividing, so every positive temperature gives finite logits <= 0 with
        0 at the maximum: a tiny T sends the rest to -inf (the T -> 0 limit, greedy up to exact ties) instead of
        overflowing to inf - inf = NaN.  The maximum itself stays 0 even where 0 / T is computed as 0 x (1 / T) =
        0 x inf."""
        z = logits.float()
        z = z - z.amax(-1, keepdim=True)
        z = torch.where(z == 0, z, z / self.temperature)
        if self.top_k is not None and self.top_k < z.shape[-1]:
            kth = torch.topk(z, self.top_k, dim=-1).values[..., -1:]
            z = z.masked_fill(z < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1:
            ascending, order = torch.sort(z, dim=-1, stable=True)    # ties: the same tokens dropped every call
            drop = ascending.softmax(-1).cumsum(-1) <= 1 - self.top_p
            drop[..., -1] = False                       # the most likely token always stays
            z = z.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        if self.min_p:
            probs = z.softmax(-1)
            z = z.masked_fill(probs < self.min_p * probs.amax(-1, keepdim=True), float("-inf"))
        return z

    def __call__(self, logits: Tensor, positions: "int | Tensor") -> Tensor:
        """The sampled token after each of the logits' rows [W, V]; ``positions``: the first row's absolute
        position (rows are consecutive) or every row's."""
        if isinstance(positions, int):
            positions = torch.arange(positions, positions + logits.shape[0], device=logits.device)
        return decode_kernel.argmax(self.warp(logits) + gumbel_noise(positions, logits.shape[-1], self.seed))
