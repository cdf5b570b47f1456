"""LoopedConfig: the shape of a looped (recurrent-depth) LM, read from a Hugging Face ``config.json``.

Three families share one runtime (details in ``docs/families.md``):

* ``huginn``      Huginn-0125 layout: sandwich blocks (4 norms), fused Wqkv + qk_bias, interleaved RoPE,
                  embedding x sqrt(d), ``ln_f`` after the loop *and* after the coda, tied head.
* ``raven-llama`` Raven-Llama-3.2 / Raven-TinyLlama: pre-norm blocks, GQA, half-rotation RoPE (+ llama3
                  scaling), no ``ln_f`` after the loop, untied head.
* ``raven-olmo``  Raven-OLMo-2: post-norm blocks with RMSNorm over the whole q and k projections.

The family is detected from config.json *and* the weight names (``detect_family``); an unknown layout is an
error, never a guess.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

FAMILIES = ("huginn", "raven-llama", "raven-olmo")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# Huginn's <|begin_text|>, <|end_text|>, <|end_turn|>, <|pad|>.  The Raven converters copied Huginn's config.json,
# so every Raven config.json carries these ids although they mean nothing (or ordinary words) in its vocabulary.
HUGINN_SPECIAL_IDS = frozenset({65504, 65505, 65508, 65509})


class ConfigError(ValueError):
    """config.json is missing a field, has an inconsistent one, or describes an unknown layout."""


# config.json keys of the huginn_raven layout that from_hf does not read.  These change the computation: any value
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

    # --- derived layout switches -------------------------------------------------------------------
    @property
    def block_style(self) -> str:
        return {"huginn": "sandwich", "raven-llama": "pre", "raven-olmo": "post"}[self.family]

    @property
    def rope_style(self) -> str:
        return "interleaved" if self.family == "huginn" else "half"

    @property
    def norm_after_loop(self) -> bool:
        """Huginn applies ln_f to the recurrent state before the coda; Raven does not."""
        return self.family == "huginn"

    @property
    def n_layers(self) -> int:
        return self.n_prelude + self.n_core + self.n_coda

    def validate(self) -> "LoopedConfig":
        if self.family not in FAMILIES:
            raise ConfigError(f"unknown family {self.family!r}; expected one of {FAMILIES}")
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
        if self.n_heads * self.head_dim != self.n_embd:
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
        """Build from a config.json dict; ``weight_names`` (the checkpoint's tensor names) pin the family.
        Every field read is type- and range-checked; a bad one is named with its value."""
        if not isinstance(cfg, dict):
            raise ConfigError(f"config.json must be a JSON object, got a JSON {json_type(cfg)}")
        family = detect_family(cfg, weight_names)

        def need(*names: str) -> tuple[str, Any]:
            for n in names:
                if n in cfg and cfg[n] is not None:
                    return n, cfg[n]
            raise ConfigError(f"config.json is missing required field {' / '.join(names)}")

        def need_int(*names: str, least: int = 1) -> int:
            return whole(*need(*names), least=least)

        def opt_int(name: str, default: int | None, least: int = 1) -> int | None:
            return default if cfg.get(name) is None else whole(name, cfg[name], least=least)

        n_embd = need_int("n_embd", "hidden_size")
        n_heads = need_int("n_heads", "num_attention_heads")
        n_kv = opt_int("num_key_value_heads", n_heads)
        head_dim = opt_int("head_dim", None) or n_embd // n_heads
        n_prelude = need_int("n_layers_in_prelude", least=0)
        n_core = need_int("n_layers_in_recurrent_block")
        n_coda = need_int("n_layers_in_coda", least=0)
        layers_key = "n_layers" if cfg.get("n_layers") is not None else "num_hidden_layers"
        n_layers = opt_int(layers_key, None)
        if n_layers is not None and n_layers != n_prelude + n_core + n_coda:
            raise ConfigError(f"n_layers={n_layers} != prelude {n_prelude} + core {n_core} + coda {n_coda}")
        # Read, never derive: Raven keeps Huginn's std but sets embed_scale 1.0, which sqrt(n_embd) would break.
        init_values = cfg.get("init_values")
        if init_values is None:
            raise ConfigError("config.json is missing required field init_values (with std and embed_scale)")
        if not isinstance(init_values, dict):
            raise ConfigError(f"config field init_values must be an object with std and embed_scale, got "
                              f"{init_values!r}")
        for key in ("std", "embed_scale"):
            if init_values.get(key) is None:
                raise ConfigError(f"config.json is missing required field init_values.{key}")
        embed_scale = real("init_values.embed_scale", init_values["embed_scale"], positive=True)
        init_std = real("init_values.std", init_values["std"], least=0.0)
        if real("test_time_noise", cfg.get("test_time_noise") or 0.0) != 0.0:
            raise ConfigError("test_time_noise != 0 makes the target non-deterministic; set it to 0")
        # Huginn's RoPE base is `rope_base`; Raven's is `rope_theta` (its `rope_base` is a stale Huginn leftover).
        rope_theta = real(*need("rope_base" if family == "huginn" else "rope_theta"), positive=True)
        norm_key = "norm_eps" if "norm_eps" in cfg else "rms_norm_eps"
        norm_eps = real(norm_key, cfg.get(norm_key, 1e-6), least=0.0)
        rope_scaling = cfg.get("rope_scaling") or None
        if rope_scaling is not None and not isinstance(rope_scaling, dict):
            raise ConfigError(f"config field rope_scaling must be an object (or null), got {rope_scaling!r}")
        special = {k: cfg.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        for k, v in special.items():
            for i in (v if isinstance(v, list) and k == "eos_token_id" else [v]):
                if i is not None:
                    whole(k, i, least=0)
        if family != "huginn":   # stale copies of Huginn's ids; the tokenizer files give the real ones
            special = {k: ([i for i in v if i not in HUGINN_SPECIAL_IDS] if isinstance(v, list)
                           else (None if v in HUGINN_SPECIAL_IDS else v)) for k, v in special.items()}
        eos = special["eos_token_id"]
        eos_list = [] if eos is None else ([int(e) for e in eos] if isinstance(eos, list) else [int(eos)])
        if family == "huginn":  # the RoPE table Huginn ships has block_size rows: a hard context cap
            block_size = need_int("block_size")
        else:                   # Raven computes RoPE on the fly; block_size is only the training context
            block_size = max(opt_int("block_size", 0, least=0), opt_int("max_position_embeddings", 0, least=0)) \
                or 4096
        vocab_size = opt_int("padded_vocab_size", None) or need_int("vocab_size")
        _check_unread(cfg, vocab_size)
        out = cls(
            family=family,
            vocab_size=vocab_size,
            n_embd=n_embd, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
            intermediate_size=need_int("intermediate_size"),
            n_prelude=n_prelude, n_core=n_core, n_coda=n_coda,
            mean_recurrence=need_int("mean_recurrence"),
            norm_eps=norm_eps,
            qk_bias=flag(cfg, "qk_bias", False),
            qk_norm=family == "raven-olmo",
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_embeddings=flag(cfg, "tie_embeddings", flag(cfg, "tie_word_embeddings", False)),
            embed_scale=embed_scale,
            init_std=init_std,
            block_size=block_size,
            bos_token_id=special["bos_token_id"],
            eos_token_id=eos_list,
            pad_token_id=special["pad_token_id"],
        )
        return out.validate()

    def to_hf(self) -> dict[str, Any]:
        """The config.json a checkpoint of this family carries (the inverse of ``from_hf``)."""
        cfg: dict[str, Any] = {
            "architectures": ["RavenForCausalLM"],
            "model_type": "huginn_raven",
            "n_embd": self.n_embd,
            "n_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "n_layers": self.n_layers,
            "n_layers_in_prelude": self.n_prelude,
            "n_layers_in_recurrent_block": self.n_core,
            "n_layers_in_coda": self.n_coda,
            "mean_recurrence": self.mean_recurrence,
            "norm_eps": self.norm_eps,
            "vocab_size": self.vocab_size,
            "padded_vocab_size": self.vocab_size,
            "block_size": self.block_size,
            "bias": False,
            "qk_bias": self.qk_bias,
            "tie_embeddings": self.tie_embeddings,
            "init_values": {"std": self.init_std, "embed_scale": self.embed_scale},
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id[0] if len(self.eos_token_id) == 1 else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.family == "huginn":
            cfg.update(block_class_name="SandwichBlock", rope_base=self.rope_theta, injection_type="linear",
                       mlp_class_name="GatedMLP", norm_class_name="RMSNorm_llama", state_init="like-init")
        else:
            cfg.update(rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
                       max_position_embeddings=self.block_size, tie_word_embeddings=self.tie_embeddings)
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_unread(cfg: dict[str, Any], vocab_size: int) -> None:
    """The huginn_raven keys from_hf does not read: a value that would change the model is refused, a number that
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
        import warnings
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


def detect_family(cfg: dict[str, Any], weight_names: Iterable[str] | None = None) -> str:
    """Decide huginn / raven-llama / raven-olmo from config.json and (when given) the tensor names."""
    if "dasspec_family" in cfg:
        fam = cfg["dasspec_family"]
        if fam not in FAMILIES:
            raise ConfigError(f"unknown dasspec_family {fam!r}; expected one of {FAMILIES}")
        return fam
    model_type = cfg.get("model_type")
    if model_type != "huginn_raven":
        raise ConfigError(f"unsupported model_type {model_type!r}: dasspec loads looped 'huginn_raven' checkpoints "
                          "(Huginn-0125, Raven-Llama/OLMo/TinyLlama)")
    names = set(weight_names) if weight_names is not None else None
    if names is not None:
        if not any(n.startswith("transformer.core_block.") for n in names):
            raise ConfigError("checkpoint has no transformer.core_block.* weights: not a looped layout")
        sandwich = any(n.endswith(".norm_4.weight") for n in names)
        qk_norm = any(n.endswith(".attn.q_norm.weight") for n in names)
        if sandwich and qk_norm:
            raise ConfigError("unknown layout: sandwich norms (norm_4) together with q_norm weights")
        if sandwich:
            return "huginn"
        return "raven-olmo" if qk_norm else "raven-llama"
    # Without weights: Raven configs also say block_class_name "SandwichBlock", and nothing in config.json tells
    # OLMo from Llama, so only Huginn (rope_base, no rope_theta) is decidable here.
    if "rope_theta" not in cfg and "rope_base" in cfg:
        return "huginn"
    raise ConfigError("cannot tell the layout from config.json alone; the weight names decide it")
