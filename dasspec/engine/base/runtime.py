"""How a generation executes, held in one object the engine consults (never on the model): static shapes,
torch.compile, CUDA graphs, and whether to measure peak memory.

    rt = dasspec.Runtime(static_shapes=True)                   # fixed-shape attention over the whole cache
    rt = dasspec.Runtime(compile=True)                         # + torch.compile of the three primitives
    rt = dasspec.Runtime(cuda_graphs=True)                     # + CUDA graphs (torch.compile "reduce-overhead")
    dasspec.generate(model, ids, method="das-wave", runtime=rt)

Static shapes: every attention call reads all ``capacity`` cache rows under a visibility mask and cache rows are
written through a row-index tensor, so a step's shapes depend only on its width W, and a compiled graph (and its
CUDA graph) is reused at every position instead of being re-specialised per token.  It costs attention over the
whole capacity instead of the filled prefix, which pays on a GPU at batch 1 (latency-bound) and not on a CPU - so
it is off by default.  Graphs are specialised per (W, read depths); the recompile limit is raised for these
functions only (``torch.compile(recompile_limit=...)``), never for the process.  Outputs are the same tokens as
eager execution (tests check this on CPU; CUDA graphs need a GPU).

``track_memory``: start a peak-memory window per request (CUDA's allocator peak, or the process's peak resident set
on Linux, which resets a process-wide counter) - for benchmarks, off for ordinary calls.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ...model.looped import LoopedLM, Recurrence


@dataclass(frozen=True)
class Runtime:
    static_shapes: bool = False
    compile: bool = False
    cuda_graphs: bool = False
    track_memory: bool = False
    _compiled: "weakref.WeakKeyDictionary" = field(default_factory=weakref.WeakKeyDictionary, repr=False,
                                                   compare=False)

    def __post_init__(self) -> None:
        if self.compile or self.cuda_graphs:          # compiled graphs need fixed shapes to be reused
            object.__setattr__(self, "static_shapes", True)

    def __reduce__(self):
        # the options cross a process boundary (``core/remote.py``); compiled graphs are per process, made again there
        return Runtime, (self.static_shapes, self.compile, self.cuda_graphs, self.track_memory)

    @property
    def compiled(self) -> bool:
        return self.compile or self.cuda_graphs

    def primitives(self, model: LoopedLM) -> Recurrence:
        """What a request calls prelude / core_step / readout on: the model itself, or its compiled primitives
        (compiled once per model and kept by this Runtime)."""
        if not self.compiled:
            return model
        if self.cuda_graphs and model.device.type != "cuda":
            raise ValueError("cuda_graphs=True needs the model on a CUDA device")
        prims = self._compiled.get(model)
        if prims is None:
            prims = self._compiled[model] = CompiledPrimitives(model, self.cuda_graphs)
        return prims

    def prepare_cache(self, tensors: tuple[Tensor, ...]) -> None:
        """CUDA graphs replay into fixed storage: mark the request's cache tensors as static addresses."""
        if self.compiled:
            from torch._dynamo import mark_static_address
            for t in tensors:
                mark_static_address(t)


class CompiledPrimitives(Recurrence):
    """torch.compile'd prelude / core_step / readout of one model; ``recur`` and ``full_depth`` compose them."""

    def __init__(self, model: LoopedLM, cuda_graphs: bool):
        self.model = model
        # One graph per (width, read depths): room for R depths x a few widths, for these functions only.
        opts = dict(mode="reduce-overhead" if cuda_graphs else None, dynamic=False,
                    recompile_limit=8 * model.R + 64)
        self.prelude = torch.compile(model.prelude, **opts)
        self.core_step = torch.compile(model.core_step, **opts)
        self.readout = torch.compile(model.readout, **opts)

    @property
    def R(self) -> int:
        return self.model.R


DEFAULT = Runtime()
