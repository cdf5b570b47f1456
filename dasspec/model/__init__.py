"""The looped model and what it is made of: ``config`` (LoopedConfig, family detection), ``checkpoint`` (Hugging
Face folders in and out), ``layers`` (norms, RoPE, blocks), ``attention`` (the paper's eq. 2-3), ``looped``
(LoopedLM: prelude, core step, readout), ``cache`` (the depth cache), ``policy`` (prefix read policies) and
``tokenizer``."""

# The built-in families register themselves on import, in this order (the order of FAMILIES: detection and messages
# list them so): first, so that any module of dasspec.model finds them.
from .families import huginn, raven, ouro, iquest, nanbeige  # noqa: F401,I001
from .cache import CacheCapacityError, DepthCache
from .config import ConfigError, LoopedConfig
from .looped import LoopedLM
from .policy import ReadPolicy, parse_policy

__all__ = ["LoopedLM", "LoopedConfig", "ConfigError", "DepthCache", "CacheCapacityError", "ReadPolicy",
           "parse_policy"]
