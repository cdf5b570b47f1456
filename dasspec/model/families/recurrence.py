"""A batched call's core steps in one kernel call, for a family whose core step is its layers then ``ln_f``
(``norm_every_step``, no injection: Ouro's peri-norm layers, Nanbeige's pre-norm ones).

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
from ..layers import NormedBlock, RMSNorm, skips_nothing


def own_methods(block: type[NormedBlock]) -> tuple:
    """What the one call stands in for of the blocks (the sublayers' and ``ln_f``'s: ``skips_nothing``): compared
    with the import-time tuple, so a class-level replacement (a wrapper, instrumentation) keeps the per-layer calls."""
    return block.forward, block.rows, block.layer_args


def layer_recurrence(model: nn.Module, h: Tensor, span: Any, cache: Any, steps: range, block: type[NormedBlock],
                     own: tuple) -> Tensor | None:
    """The core steps ``steps`` of ``model`` (blocks all of class ``block``, whose methods at import were ``own``)
    over a batched call's rows in one kernel call; None where the call does not take it."""
    t = model.transformer
    blocks, ln_f = list(t.core_block), t.ln_f
    if (type(ln_f) is not RMSNorm or not skips_nothing(ln_f) or any(type(b) is not block for b in blocks)
            or own_methods(block) != own or any(b._forward_hooks or b._forward_pre_hooks for b in blocks)
            or any(name in vars(b) for b in blocks for name in ("forward", "rows", "layer_args"))
            or not ln_f.takes_kernel(h) or (ln_f.weight.requires_grad and torch.is_grad_enabled())):
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
    B, W, d = h.shape
    return decode_kernel.recur_rows(h.reshape(B * W, d), len(steps), block.style, layers, pools, ln_f.weight,
                                    ln_f.eps).view(B, W, d)
