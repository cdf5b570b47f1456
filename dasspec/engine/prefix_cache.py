"""PrefixCache: the depth cache of a shared prompt prefix, computed once and reused by every request that starts
with it (few-shot exemplars, a system prompt) - prefix caching as inference servers do it, at every depth.

    pc = dasspec.PrefixCache(model, tok.encode(few_shot_exemplars))
    out = dasspec.generate(model, tok.encode(few_shot_exemplars + question), "das-wave", prefix_cache=pc)

A request copies the cached rows of its longest common prefix with the cached tokens into its own depth cache and
prefills only the rest (at least its last prompt token, which yields the first logits).  Prefill is the one cost
every method pays in full - R core passes over the whole prompt - so on few-shot prompts it is also the part of a
fast decoder's time that no decoding idea touches (a 4-shot MATH-500 prompt: ~900 shared tokens).

Exactness.  A row of a causal model depends only on the tokens up to it and on the initial states of its positions
(a pure function of position, ``init_scale`` and ``seed``), so the copied rows are the rows a full prefill writes,
up to floating-point blocking: a GEMM over the P - m uncached rows may round differently from one over all P.
Every method reads the same copied rows and is verified by the same target, so under one prefix cache each
method's tokens equal AR's (tests check this); against a run without the cache, tokens agree except where such
rounding flips a near-tie.  The cache is tied to the model, depth R, ``init_scale`` and ``seed`` it was built
with, and a request that differs in any of them is refused with a message saying which.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..model.cache import DepthCache
from ..model.looped import LoopedLM
from .generate import as_token_list
from .memory import check_cache_fits


def common_prefix(seqs: Sequence[Sequence[int]]) -> int:
    """Length of the longest token prefix every sequence shares (0 for none)."""
    if not seqs:
        return 0
    first = seqs[0]
    n = min(len(s) for s in seqs)
    return next((i for i in range(n) if any(s[i] != first[i] for s in seqs[1:])), n)


class PrefixCache:
    """K/V of ``ids`` at every core depth 1..R plus the prelude and coda layers, for reuse across requests."""

    def __init__(self, model: LoopedLM, ids, num_steps: int | None = None, init_scale: float = 1.0,
                 seed: int = 0):
        tokens = as_token_list(model, ids)
        m = len(tokens)
        if m == 0:
            raise ValueError("empty prefix: a prefix cache needs at least one token")
        if m > model.config.block_size:
            raise ValueError(f"prefix of {m} tokens exceeds the model context of {model.config.block_size}")
        self.R = model.depth(num_steps)
        self.model, self.init_scale, self.seed = model, float(init_scale), int(seed)
        self.tokens = tokens
        check_cache_fits(model, self.R, m, "cache a shorter prefix, or use bfloat16")
        self.cache = DepthCache(model.config, self.R, m, model.device, model.dtype)
        with torch.inference_mode():
            h = model.initial_state(torch.arange(m), self.init_scale, self.seed).unsqueeze(0)
            ids_t = torch.tensor([tokens], dtype=torch.long, device=model.device)
            model.full_depth(ids_t, h, model.span(0, 0, m), self.cache, self.R, rows=slice(m - 1, m))
        self.cache.commit(m)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    def check(self, model: LoopedLM, R: int, init_scale: float, seed: int) -> None:
        """Refuse a request whose rows would differ from the cached ones."""
        diffs = []
        if model is not self.model:
            diffs.append("another model object")
        elif (model.device, model.dtype) != (self.cache.core_k.device, self.cache.core_k.dtype):
            diffs.append(f"the model now on {model.device} in {model.dtype} (cache: {self.cache.core_k.device}, "
                         f"{self.cache.core_k.dtype})")
        if R != self.R:
            diffs.append(f"num_steps {R} (cache: {self.R})")
        if float(init_scale) != self.init_scale:
            diffs.append(f"init_scale {init_scale} (cache: {self.init_scale})")
        if int(seed) != self.seed:
            diffs.append(f"seed {seed} (cache: {self.seed})")
        if diffs:
            raise ValueError("this prefix cache was built for other settings than the request's: "
                             + ", ".join(diffs) + "; build one PrefixCache per (model, num_steps, init_scale, seed)")

    def reusable(self, prompt: list[int]) -> int:
        """Rows a request with ``prompt`` can copy: the common prefix with the cached tokens, at most len - 1."""
        return common_prefix([self.tokens, prompt[:-1]])
