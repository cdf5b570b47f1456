"""LoopedConfig: the shape of a looped (recurrent-depth) LM, read from a Hugging Face ``config.json``.

One runtime, several families (``dasspec/model/families``; details in ``docs/families.md``).  ``from_hf`` detects
the family from config.json *and* the weight names and lets the family read the file; an unknown layout is an
error, never a guess.  The family-independent checks (sizes, heads, RoPE scaling) are ``validate``.  The field
readers the families share live in ``fields`` (and are importable from here too).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from .families import Family, detect_family, get_family
from .fields import (ConfigError, Fields, check_unread, eos_list, flag, json_type, real,  # noqa: F401  (re-exported)
                     whole)

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass
class LoopedConfig:
    family: str
    vocab_size: int
    n_embd: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    n_prelude: int
    n_core: int
    n_coda: int
    mean_recurrence: int = 32          # R, the full target depth
    norm_eps: float = 1e-6
    qk_bias: bool = False
    qk_norm: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None   # llama3-style {"rope_type": "llama3", "factor", ...}
    tie_embeddings: bool = False
    embed_scale: float = 1.0
    init_std: float = 0.0              # std of the truncated-normal initial state (before embed_scale)
    block_size: int = 4096             # maximum context (positions)
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    loop_window: int = 0               # IQuest-Loop: depths >= 2 attend to their own K/V within this many positions

    # --- the family and its layout switches ------------------------------------------------------------
    @property
    def spec(self) -> Family:
        """The family's definition (``dasspec/model/families``)."""
        return get_family(self.family)

    @property
    def block_style(self) -> str:
        return self.spec.block.style

    @property
    def rope_style(self) -> str:
        return self.spec.rope_style

    @property
    def norm_after_loop(self) -> bool:
        """Huginn applies ln_f to the recurrent state before the coda; Raven does not."""
        return self.spec.norm_after_loop

    @property
    def n_layers(self) -> int:
        return self.n_prelude + self.n_core + self.n_coda

    def validate(self) -> "LoopedConfig":
        self.spec                       # an unknown family is named
        for name in ("vocab_size", "n_embd", "n_heads", "n_kv_heads", "head_dim", "intermediate_size",
                     "n_core", "mean_recurrence", "block_size"):
            if whole(name, getattr(self, name)) < 1:
                raise ConfigError(f"config field {name} must be >= 1, got {getattr(self, name)}")
        for name in ("n_prelude", "n_coda"):
            if whole(name, getattr(self, name)) < 0:
                raise ConfigError(f"config field {name} must be >= 0, got {getattr(self, name)}")
        for name in ("rope_theta", "embed_scale"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ConfigError(f"config field {name} must be a finite number > 0, got {getattr(self, name)!r}")
        for name in ("norm_eps", "init_std"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ConfigError(f"config field {name} must be a finite number >= 0, got {getattr(self, name)!r}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads={self.n_heads} is not a multiple of num_key_value_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.spec.square_heads and self.n_heads * self.head_dim != self.n_embd:
            raise ConfigError(f"n_heads*head_dim must equal n_embd, got {self.n_heads}*{self.head_dim}"
                              f" != {self.n_embd}")
        if self.qk_bias and self.n_kv_heads != self.n_heads:
            raise ConfigError(f"qk_bias needs as many key/value heads as query heads, got num_key_value_heads="
                              f"{self.n_kv_heads} and n_heads={self.n_heads}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("llama3", "default", None):
                raise ConfigError(f"unsupported rope_scaling type {kind!r} (supported: llama3)")
            if kind == "llama3":
                # transformers requires all four keys; defaulting any of them would silently move the RoPE bands
                missing = [k for k in _LLAMA3_KEYS if self.rope_scaling.get(k) is None]
                if missing:
                    raise ConfigError(f"rope_scaling (llama3) is missing {', '.join(missing)}")
                for k in _LLAMA3_KEYS:
                    real(f"rope_scaling.{k}", self.rope_scaling[k])
                lo, hi = float(self.rope_scaling["low_freq_factor"]), float(self.rope_scaling["high_freq_factor"])
                if not (float(self.rope_scaling["factor"]) > 0 and 0 < lo < hi):
                    raise ConfigError(f"rope_scaling (llama3) needs factor > 0 and 0 < low_freq_factor < "
                                      f"high_freq_factor, got {self.rope_scaling}")
        return self

    # --- Hugging Face config.json <-> LoopedConfig -------------------------------------------------
    @classmethod
    def from_hf(cls, cfg: dict[str, Any], weight_names: Iterable[str] | None = None) -> "LoopedConfig":
        """Build from a config.json dict; ``weight_names`` (the checkpoint's tensor names) pin the family, which
        reads the file.  Every field read is type- and range-checked; a bad one is named with its value."""
        if not isinstance(cfg, dict):
            raise ConfigError(f"config.json must be a JSON object, got a JSON {json_type(cfg)}")
        return get_family(detect_family(cfg, weight_names)).read_config(cfg).validate()

    def to_hf(self) -> dict[str, Any]:
        """The config.json a checkpoint of this family carries (the inverse of ``from_hf``)."""
        return self.spec.write_config(self)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
