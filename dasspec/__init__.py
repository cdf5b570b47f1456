"""dasspec: lossless fast decoding for looped (recurrent-depth) transformers.

Depth-Asynchronous Self-Speculation (DAS), Mature-Spec and DAS-Wave, with the paper's baselines, benchmarks and
mechanism probes, on Huginn-0125, the Raven checkpoints, and a bundled small looped model.

    dasspec.model    the looped model, its depth cache and read policies, checkpoints, tokenizer
    dasspec.engine   the batched engine (a table of requests, one step), the full-depth verifier, generate():
                     base < drafting (the drafter interface) < dasspec.methods < core < api (Engine, generate)
    dasspec.methods  one module per decoding method (a drafter each) and their typed knobs
    dasspec.eval     tasks, the paired benchmark, the mechanism probes
    dasspec.train    the bundled model's recipe
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# The public names and the module each comes from.  They are imported on first use (PEP 562), so that importing
# dasspec - which every ``dasspec`` command does - does not load torch: ``dasspec --help`` answers at once.
_EXPORTS = {
    "Draft": ".engine.drafting.draft", "Drafter": ".engine.drafting.draft", "Verdict": ".engine.drafting.draft",
    "Session": ".engine.drafting.draft",
    "GenerationResult": ".engine.api.generate", "generate": ".engine.api.generate",
    "generate_batch": ".engine.api.generate",
    "Engine": ".engine.api.engine", "StepEvent": ".engine.api.engine", "SpeculationPolicy": ".engine.core.policy",
    "PrefixCache": ".engine.api.prefix_cache", "Runtime": ".engine.base.runtime",
    "build_drafter": ".methods", "method_names": ".methods",
    "CacheCapacityError": ".model.cache", "DepthCache": ".model.cache",
    "CheckpointError": ".model.checkpoint", "load_checkpoint": ".model.checkpoint",
    "save_checkpoint": ".model.checkpoint",
    "ConfigError": ".model.config", "LoopedConfig": ".model.config", "LoopedLM": ".model.looped",
    "ReadPolicy": ".model.policy", "parse_policy": ".model.policy",
    "Tokenizer": ".model.tokenizer", "load_tokenizer": ".model.tokenizer",
}

if TYPE_CHECKING:
    import torch

    from .engine.drafting.draft import Draft, Drafter, Verdict
    from .engine.drafting.draft import Session
    from .engine.api.engine import Engine, StepEvent
    from .engine.api.generate import GenerationResult, generate, generate_batch
    from .engine.core.policy import SpeculationPolicy
    from .engine.api.prefix_cache import PrefixCache
    from .engine.base.runtime import Runtime
    from .methods import build_drafter, method_names
    from .model.cache import CacheCapacityError, DepthCache
    from .model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from .model.config import ConfigError, LoopedConfig
    from .model.looped import LoopedLM
    from .model.policy import ReadPolicy, parse_policy
    from .model.tokenizer import Tokenizer, load_tokenizer


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dasspec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value                 # later look-ups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


def load_model(source: str | os.PathLike | None = None, device: str | torch.device | None = None,
               dtype: str | torch.dtype | None = None) -> LoopedLM:
    """Load a looped checkpoint folder (HF layout), an HF repo id from the local cache, or (None) the bundled
    model.  device: default CUDA when available; dtype: default bfloat16 on CUDA, float32 on CPU."""
    from .model.checkpoint import load_checkpoint     # lazy: torch; importing dasspec loads none of it

    return load_checkpoint(source, device=device, dtype=dtype)


__all__ = ["load_model", "load_tokenizer", "generate", "GenerationResult", "build_drafter", "Drafter", "Draft",
           "Verdict", "Runtime", "LoopedLM", "LoopedConfig", "DepthCache", "PrefixCache", "ReadPolicy",
           "parse_policy", "Tokenizer", "method_names", "save_checkpoint", "CheckpointError", "ConfigError",
           "CacheCapacityError", "__version__"]
