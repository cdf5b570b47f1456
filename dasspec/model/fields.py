"""Reading a Hugging Face ``config.json``: ``ConfigError``, typed field access (``Fields``, ``whole``, ``real``,
``flag``, ...) and the huginn_raven keys its family does not read (``check_unread``).

The lowest layer of the configuration: the families (``dasspec/model/families``) read their formats with these,
and ``config.LoopedConfig`` checks its fields with them; this module imports neither.
"""

from __future__ import annotations

import math
import warnings
from typing import Any


class ConfigError(ValueError):
    """config.json is missing a field, has an inconsistent one, or describes an unknown layout."""


# config.json keys of the huginn_raven layout that its family does not read.  These change the computation: any value
# but the one dasspec implements is refused (ignoring it would load another model under this one's name).
_FIXED = {"injection_type": ("linear",), "mlp_class_name": ("GatedMLP",), "nonlin_name": ("SiLU",),
          "hidden_act": ("silu",), "norm_class_name": ("RMSNorm_llama",), "state_init": ("like-init",),
          "bias": (False,), "attention_bias": (False,), "mlp_bias": (False,), "sliding_window": (None,),
          "use_sliding_window": (False,), "partial_rotary_factor": (1,), "attn_logit_softcapping": (None,),
          "final_logit_softcapping": (None,)}
# These do not (training settings, bookkeeping, a Raven converter's stale Huginn leftovers): ignored quietly.
_INERT = frozenset({
    "architectures", "auto_map", "architecture_class_name", "transformers_version", "torch_dtype", "_name_or_path",
    "use_cache", "initializer_range", "attention_dropout", "activation_checkpoint_impl", "effective_expected_depth",
    "init_orthogonal", "init_strategy", "mean_backprop_depth", "padding_multiple", "sampling_scheme",
    "test_time_noise_type", "block_class_name", "rope_base", "rope_theta", "max_position_embeddings", "vocab_size",
    "num_hidden_layers", "n_layers", "hidden_size", "num_attention_heads", "rms_norm_eps", "norm_eps",
    "tie_word_embeddings", "tie_embeddings"})


def json_type(value: Any) -> str:
    """JSON's name for the type of a parsed value, for messages."""
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def whole(name: str, value: Any, least: int | None = None) -> int:
    """A config.json integer field: a JSON integer (or a float with no fraction), never a string, boolean or a
    truncated fraction."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not value.is_integer()):
        raise ConfigError(f"config field {name} must be a whole number, got {value!r}")
    if least is not None and value < least:
        raise ConfigError(f"config field {name} must be >= {least}, got {value!r}")
    return int(value)


def real(name: str, value: Any, least: float | None = None, positive: bool = False) -> float:
    """A config.json number field: finite, never a string or boolean; ``positive``: > 0, ``least``: >= least."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"config field {name} must be a finite number, got {value!r}")
    if positive and not value > 0:
        raise ConfigError(f"config field {name} must be > 0, got {value!r}")
    if least is not None and value < least:
        raise ConfigError(f"config field {name} must be >= {least}, got {value!r}")
    return float(value)


def flag(cfg: dict[str, Any], name: str, default: bool) -> bool:
    """A config.json boolean field (absent or null -> ``default``); a string such as "false" is refused, since
    ``bool("false")`` is True."""
    value = cfg.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"config field {name} must be true or false, got {value!r}")
    return value


def check_unread(cfg: dict[str, Any], vocab_size: int) -> None:
    """The huginn_raven keys its family does not read (``families/huginn.py``): a value that would change the model is refused, a number that
    names a size is checked as one (a ``vocab_size`` of 1e400 beside ``padded_vocab_size``), and keys dasspec does
    not know are named in one warning - ignored, never silently."""
    for name, allowed in _FIXED.items():
        if name in cfg and cfg[name] not in allowed and not (isinstance(cfg[name], str) and any(
                isinstance(a, str) and cfg[name].lower() == a.lower() for a in allowed)):
            raise ConfigError(f"config field {name} is {cfg[name]!r}, but dasspec implements only "
                              f"{' / '.join(map(repr, allowed))}: loading it would compute another model")
    for name in ("vocab_size", "max_position_embeddings", "num_hidden_layers", "n_layers", "hidden_size",
                 "num_attention_heads"):
        if cfg.get(name) is not None:
            whole(name, cfg[name], least=0)
    if cfg.get("vocab_size") is not None and int(cfg["vocab_size"]) > vocab_size:
        raise ConfigError(f"config field vocab_size={int(cfg['vocab_size'])} exceeds padded_vocab_size={vocab_size}")
    for a, b in (("n_embd", "hidden_size"), ("n_heads", "num_attention_heads")):
        if cfg.get(a) is not None and cfg.get(b) is not None and whole(a, cfg[a]) != whole(b, cfg[b]):
            raise ConfigError(f"config fields {a}={cfg[a]} and {b}={cfg[b]} disagree")
    unknown = sorted(k for k in cfg if k not in _READ and k not in _FIXED and k not in _INERT)
    if unknown:
        shown = ", ".join(k if len(k) <= 40 else k[:37] + "..." for k in unknown[:8])
        more = f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""
        warnings.warn(f"config.json sets {shown}{more}, which dasspec does not know; ignored (should one change the "
                      "computation, the outputs will not be the reference model's)", UserWarning, stacklevel=4)


# The keys from_hf reads (each type- and range-checked there).
_READ = frozenset({
    "dasspec_family", "model_type", "n_embd", "hidden_size", "n_heads", "num_attention_heads",
    "num_key_value_heads", "head_dim", "n_layers_in_prelude", "n_layers_in_recurrent_block", "n_layers_in_coda",
    "n_layers", "num_hidden_layers", "init_values", "test_time_noise", "rope_base", "rope_theta", "norm_eps",
    "rms_norm_eps", "rope_scaling", "bos_token_id", "eos_token_id", "pad_token_id", "block_size",
    "max_position_embeddings", "padded_vocab_size", "vocab_size", "intermediate_size", "mean_recurrence",
    "qk_bias", "tie_embeddings", "tie_word_embeddings"})


# --- readers shared by the families' config.json formats ---------------------------------------------------------

class Fields:
    """Typed access to a config.json dict: every value read is checked and a bad one named."""

    def __init__(self, cfg: dict[str, Any]):
        self.cfg = cfg

    def need(self, *names: str) -> tuple[str, Any]:
        """(the first of ``names`` present and not null, its value); none present is an error naming them."""
        for n in names:
            if n in self.cfg and self.cfg[n] is not None:
                return n, self.cfg[n]
        raise ConfigError(f"config.json is missing required field {' / '.join(names)}")

    def need_int(self, *names: str, least: int = 1) -> int:
        return whole(*self.need(*names), least=least)

    def opt_int(self, name: str, default: int | None, least: int = 1) -> int | None:
        return default if self.cfg.get(name) is None else whole(name, self.cfg[name], least=least)

    def rope_scaling(self) -> dict | None:
        value = self.cfg.get("rope_scaling") or None
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"config field rope_scaling must be an object (or null), got {value!r}")
        return value

    def special_ids(self) -> dict[str, Any]:
        """bos / eos / pad ids as stored (eos may be a list), each checked to be a whole number >= 0."""
        special = {k: self.cfg.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        for k, v in special.items():
            for i in (v if isinstance(v, list) and k == "eos_token_id" else [v]):
                if i is not None:
                    whole(k, i, least=0)
        return special


def eos_list(eos: Any, name: str = "eos_token_id") -> list[int]:
    """An eos_token_id value (None, an id or a list of ids) as a list, each a whole number >= 0 (``name``: the
    field as an error names it)."""
    return [] if eos is None else [whole(name, e, least=0) for e in (eos if isinstance(eos, list) else [eos])]
