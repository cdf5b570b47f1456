"""dasspec: lossless fast decoding for looped (recurrent-depth) transformers.

Depth-Asynchronous Self-Speculation (DAS), Mature-Spec and DAS-Wave, with the paper's baselines, benchmarks and
mechanism probes, on Huginn-0125, the Raven checkpoints, and a bundled small looped model.
"""

from __future__ import annotations

from .accel import optimize
from .model.cache import CacheCapacityError, DepthCache
from .model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .model.config import ConfigError, LoopedConfig
from .generate import GenerationResult, generate
from .methods import method_names
from .model.looped import LoopedLM
from .model.policy import ReadPolicy, parse_policy
from .prefix_cache import PrefixCache
from .model.tokenizer import Tokenizer, load_tokenizer

__version__ = "0.1.0"


def load_model(source=None, device=None, dtype=None) -> LoopedLM:
    """Load a looped checkpoint folder (HF layout), an HF repo id from the local cache, or (None) the bundled
    model.  device: default CUDA when available; dtype: default bfloat16 on CUDA, float32 on CPU."""
    return load_checkpoint(source, device=device, dtype=dtype)


__all__ = ["optimize", "load_model", "load_tokenizer", "generate", "GenerationResult", "LoopedLM", "LoopedConfig",
           "DepthCache", "PrefixCache", "ReadPolicy", "parse_policy", "Tokenizer", "method_names", "save_checkpoint",
           "CheckpointError", "ConfigError", "CacheCapacityError", "__version__"]
