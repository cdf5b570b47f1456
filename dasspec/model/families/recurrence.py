"""A batched call's core steps in one kernel call, for a family whose core step is its layers then ``ln_f``
(``norm_every_step``, no injection: Ouro's peri-norm layers, Nanbeige's pre-norm ones) or the adapter over
concat[h, e] then its layers (``injected_recurrence``: Huginn's sandwich layers).

``LoopedLM.recur`` asks ``Family.recur_rows`` first; this answers with ``decode_kernel.recur_rows`` - every step's
layers, then ``ln_f``, in ``core_step``'s order, so the same bits - wherever every layer application would take the
block's one-call layer (``NormedBlock.rows``: a batched call in one paged pool, the kernel's products, no gradient)
and nothing whose call it skips is replaced or hooked (the blocks' and ``ln_f``'s methods here, the sublayers' in
``NormedBlock.plain_parts``); None otherwise (the steps go through ``core_step``).  A draft's steps that read the
verified prefix at other depths than they store at (Mature-Spec's Deep K/V, Deep V, explicit depths) run so too, each
step's layers given the prefix's pools beside their own.  It saves the Python around each of the T x N layer calls
of a step, which a batched decode step on a CPU otherwise spends.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .. import decode_kernel
from ..cache import BatchCache, PagedCache
from ..layers import NormedBlock, RMSNorm, bare, skips_nothing
from ..linear import kernel_takes
from . import Family


def own_methods(block: type[NormedBlock]) -> tuple:
    """What the one call stands in for of the blocks (the sublayers' and ``ln_f``'s: ``skips_nothing``): compared
    with the import-time tuple, so a class-level replacement (a wrapper, instrumentation) keeps the per-layer calls."""
    return block.forward, block.rows, block.layer_args


def layer_recurrence(model: nn.Module, h: Tensor, span: Any, cache: Any, steps: range, block: type[NormedBlock],
                     own: tuple, reads: list[tuple[int, int]] | None = None) -> Tensor | None:
    """The core steps ``steps`` of ``model`` (blocks all of class ``block``, whose methods at import were ``own``)
    over a batched call's rows in one kernel call; None where the call does not take it.  ``reads``: a draft's
    prefix depths (kappa, nu) per step, each step storing at its own depth (``LoopedLM.recur``)."""
    ln_f = model.transformer.ln_f
    if (type(ln_f) is not RMSNorm or not skips_nothing(ln_f) or not ln_f.takes_kernel(h)
            or (ln_f.weight.requires_grad and torch.is_grad_enabled())):
        return None
    got = _layers_and_pools(model, h, span, cache, steps, block, own, reads)
    if got is None:
        return None
    B, W, d = h.shape
    layers, pools, prefix = got
    return decode_kernel.recur_rows(h.reshape(B * W, d), len(steps), block.style, layers, pools, ln_f.weight,
                                    ln_f.eps, prefix_pools=prefix).view(B, W, d)


def injected_recurrence(model: nn.Module, h: Tensor, inj: Tensor | None, span: Any, cache: Any, steps: range,
                        block: type[NormedBlock], own: tuple, reads: list[tuple[int, int]] | None = None
                        ) -> Tensor | None:
    """``layer_recurrence`` for a family whose core step injects the prelude's output e (Huginn's): each step the
    adapter over concat[h, e] - a plain ``Linear`` on the kernel's product, e of h's shape - then the layers, no norm
    between steps."""
    adapter = model.transformer.adapter
    if (inj is None or inj.shape != h.shape or inj.dtype != h.dtype or (torch.is_grad_enabled() and inj.requires_grad)
            or not bare(adapter)
            or not kernel_takes(h, adapter.weight) or adapter.weight.stride(-1) != 1 or adapter.bias is not None):
        return None
    got = _layers_and_pools(model, h, span, cache, steps, block, own, reads)
    if got is None:
        return None
    B, W, d = h.shape
    layers, pools, prefix = got
    return decode_kernel.recur_rows(h.reshape(B * W, d), len(steps), block.style, layers, pools,
                                    inj=inj.reshape(B * W, d), adapter=adapter.weight,
                                    prefix_pools=prefix).view(B, W, d)


def _layers_and_pools(model: nn.Module, h: Tensor, span: Any, cache: Any, steps: range, block: type[NormedBlock],
                      own: tuple, reads: list[tuple[int, int]] | None = None) -> tuple[list, list, list | None] | None:
    """Every core layer's one-call arguments (``NormedBlock.layer_args`` at the first step), the (K, V) pools of
    every layer at every step and, with ``reads`` (each step's prefix depths, every one another depth than the
    step's own), the prefix's (K, V) pools likewise (else None), where each block is a plain ``block`` and every
    layer application would take its one-call layer; None otherwise."""
    blocks = list(model.transformer.core_block)
    if (any(type(b) is not block for b in blocks) or own_methods(block) != own
            or type(model.family).core_kv is not Family.core_kv          # (core_step's views are the cache's)
            or any(b._forward_hooks or b._forward_pre_hooks for b in blocks)
            or any(name in vars(b) for b in blocks for name in ("forward", "rows", "layer_args"))):
        return None
    r0 = steps[0]
    two = reads is not None
    step_reads = list(reads) if two else [(r, r) for r in steps]
    layers = []
    for i, b in enumerate(blocks):
        # two sources: a step that reads where it stores (one source) leaves the first layer's prefix pools None
        args = b.layer_args(h, span, cache.core_kv(i, step_reads[0], (r0, r0)), two_source=two)
        if args is None or (two and args[2][14] is None):
            return None
        layers.append(args)
    if not decode_kernel.layers_agree(layers):
        return None
    pools = [a[5:7] for _, _, a, _ in layers]           # the first step's, from its layers' own plans
    prefix = [a[14:16] for _, _, a, _ in layers] if two else None
    later = _later_pools(cache, len(blocks), steps, step_reads, two)
    if later is None:
        return None
    pools += [got[:2] for got in later]
    if two:
        prefix += [got[2:] for got in later]
    return layers, pools, prefix


def _later_pools(cache: Any, L: int, steps: range, step_reads: list[tuple[int, int]], two: bool) -> list | None:
    """The pools of every layer of every step after the first (``DepthCache.step_pools``, kept between calls) for a
    batch of sequences of one pool without windowed depths, whose views at every depth go through one table; None
    for any other batch, or a step that does not suit (its steps then go through ``core_step``)."""
    caches = cache.caches if type(cache) is BatchCache else None      # (a subclass may read other views)
    pool = getattr(caches[0], "pool", None) if caches else None
    if pool is None or not all([type(c) is PagedCache and c.pool is pool and not c.window for c in caches]):
        return None
    return pool.step_pools(L, tuple(steps[1:]), tuple(step_reads[1:]), two)
