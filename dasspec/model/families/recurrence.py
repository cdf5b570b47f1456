"""A batched call's core steps in one kernel call, for a family whose core step is its layers then ``ln_f``
(``norm_every_step``, no injection: Ouro's peri-norm layers, Nanbeige's pre-norm ones) or the adapter over
concat[h, e] then its layers (``injected_recurrence``: Huginn's sandwich layers).

``LoopedLM.recur`` asks ``Family.recur_rows`` first; this answers with ``decode_kernel.recur_rows`` - every step's
layers, then ``ln_f``, in ``core_step``'s order, so the same bits - wherever every layer application would take the
block's one-call layer (``NormedBlock.rows``: a batched call in one paged pool, the kernel's products, no gradient)
and nothing whose call it skips is replaced or hooked (the blocks' and ``ln_f``'s methods here, the sublayers' in
``NormedBlock.plain_parts``); None otherwise (the steps go through ``core_step``).  It saves
the Python around each of the T x N layer calls of a step, which a batched decode step on a CPU otherwise spends.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .. import decode_kernel
from ..attention import pools_like
from ..layers import NormedBlock, RMSNorm, bare, skips_nothing
from ..linear import kernel_takes


def own_methods(block: type[NormedBlock]) -> tuple:
    """What the one call stands in for of the blocks (the sublayers' and ``ln_f``'s: ``skips_nothing``): compared
    with the import-time tuple, so a class-level replacement (a wrapper, instrumentation) keeps the per-layer calls."""
    return block.forward, block.rows, block.layer_args


def layer_recurrence(model: nn.Module, h: Tensor, span: Any, cache: Any, steps: range, block: type[NormedBlock],
                     own: tuple) -> Tensor | None:
    """The core steps ``steps`` of ``model`` (blocks all of class ``block``, whose methods at import were ``own``)
    over a batched call's rows in one kernel call; None where the call does not take it."""
    ln_f = model.transformer.ln_f
    if (type(ln_f) is not RMSNorm or not skips_nothing(ln_f) or not ln_f.takes_kernel(h)
            or (ln_f.weight.requires_grad and torch.is_grad_enabled())):
        return None
    got = _layers_and_pools(model, h, span, cache, steps, block, own)
    if got is None:
        return None
    B, W, d = h.shape
    return decode_kernel.recur_rows(h.reshape(B * W, d), len(steps), block.style, *got, ln_f.weight,
                                    ln_f.eps).view(B, W, d)


def injected_recurrence(model: nn.Module, h: Tensor, inj: Tensor | None, span: Any, cache: Any, steps: range,
                        block: type[NormedBlock], own: tuple) -> Tensor | None:
    """``layer_recurrence`` for a family whose core step injects the prelude's output e (Huginn's): each step the
    adapter over concat[h, e] - a plain ``Linear`` on the kernel's product, e of h's shape - then the layers, no norm
    between steps."""
    adapter = model.transformer.adapter
    if (inj is None or inj.shape != h.shape or inj.dtype != h.dtype or (torch.is_grad_enabled() and inj.requires_grad)
            or not bare(adapter)
            or not kernel_takes(h, adapter.weight) or adapter.weight.stride(-1) != 1 or adapter.bias is not None):
        return None
    got = _layers_and_pools(model, h, span, cache, steps, block, own)
    if got is None:
        return None
    B, W, d = h.shape
    return decode_kernel.recur_rows(h.reshape(B * W, d), len(steps), block.style, *got, inj=inj.reshape(B * W, d),
                                    adapter=adapter.weight).view(B, W, d)


def _layers_and_pools(model: nn.Module, h: Tensor, span: Any, cache: Any, steps: range, block: type[NormedBlock],
                      own: tuple) -> tuple[list, list] | None:
    """Every core layer's one-call arguments (``NormedBlock.layer_args`` at the first step) and the (K, V) pools of
    every layer at every step, where each block is a plain ``block`` and every layer application would take its
    one-call layer; None otherwise."""
    blocks = list(model.transformer.core_block)
    if (any(type(b) is not block for b in blocks) or own_methods(block) != own
            or any(b._forward_hooks or b._forward_pre_hooks for b in blocks)
            or any(name in vars(b) for b in blocks for name in ("forward", "rows", "layer_args"))):
        return None
    r0 = steps[0]
    layers = []
    for i, b in enumerate(blocks):
        args = b.layer_args(h, span, cache.core_kv(i, (r0, r0), (r0, r0)))
        if args is None:
            return None
        layers.append(args)
    if not decode_kernel.layers_agree(layers):
        return None
    pools = [a[5:7] for _, _, a, _ in layers]            # the first step's, from its layers' own plans
    first = cache.core_kv(0, (r0, r0), (r0, r0))         # whose plan (rows and lists) every layer's agreed with
    for r in steps[1:]:
        for i in range(len(blocks)):
            got = pools_like(cache.core_kv(i, (r, r), (r, r)), first)
            if got is None:
                return None
            pools.append(got)
    return layers, pools
