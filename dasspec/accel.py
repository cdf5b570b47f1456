"""GPU execution options: static shapes, torch.compile and CUDA graphs.

    dasspec.optimize(model, static_shapes=True)                 # fixed-shape attention over the whole cache
    dasspec.optimize(model, compile=True)                       # + torch.compile of the three primitives
    dasspec.optimize(model, cuda_graphs=True)                   # + CUDA graphs (torch.compile "reduce-overhead")

Static shapes: every attention call reads all ``capacity`` cache rows under a visibility mask, cache rows are
written through a row-index tensor, and nothing in a layer depends on a Python position.  A step's shapes then
depend only on its width W, so a compiled graph (and its CUDA graph) is reused at every position instead of being
re-specialised per token.  It costs attention over the whole capacity instead of the filled prefix, which pays on
a GPU at batch 1 (latency-bound) and not on a CPU - so it is off by default.

Graphs are specialised per (W, read depths): AR and verification use one per width and depth, DAS-Wave one per
active width.  The depth cache is marked as a static address so replays write into the same storage.
The outputs are the same tokens as eager execution (tests check this on CPU; CUDA graphs need a GPU).
"""

from __future__ import annotations

import torch

from .model.looped import LoopedLM


def optimize(model: LoopedLM, static_shapes: bool = True, compile: bool = False,
             cuda_graphs: bool = False) -> LoopedLM:
    """Switch ``model`` to static-shape execution and optionally compile its primitives (in place)."""
    if cuda_graphs and model.device.type != "cuda":
        raise ValueError("cuda_graphs=True needs the model on a CUDA device")
    model.static_shapes = bool(static_shapes or compile or cuda_graphs)
    if (compile or cuda_graphs) and not getattr(model, "compiled", False):
        from torch._dynamo import config as dynamo_config
        # One graph per (width, depth) pair: allow enough specialisations for R depths x a few widths.
        dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, 8 * model.R + 64)
        mode = "reduce-overhead" if cuda_graphs else None
        for name in ("prelude", "core_step", "readout"):
            setattr(model, name, torch.compile(getattr(model, name), mode=mode, dynamic=False))
        model.compiled = True
    return model
