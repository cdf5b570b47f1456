"""Huginn-0125, and the ``huginn_raven`` checkpoint format it shares with the Raven retrofits.

Every Huginn and Raven file says ``model_type: huginn_raven`` and ``block_class_name: SandwichBlock``; the Raven
``config.json`` files are Huginn's with some keys overwritten, so they carry stale Huginn values.  The tensor names
tell the layouts apart (``HuginnRavenFamily.detect``), and each family reads only the fields that are its own.

Huginn: prelude P, core F (adapter on cat[h, e], then sandwich blocks), coda C; embedding x ``embed_scale``,
``qk_bias`` before interleaved RoPE, ``ln_f`` after the loop *and* after the coda, tied head.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..attention import LayerKV, Span
from ..config import LoopedConfig
from ..fields import ConfigError, Fields, check_unread, eos_list, flag, real
from ..layers import NormedBlock
from . import Family, LayerGroup, register
from .recurrence import injected_recurrence, own_methods

# Huginn's <|begin_text|>, <|end_text|>, <|end_turn|>, <|pad|>.  The Raven converters copied Huginn's config.json,
# so every Raven config.json carries these ids although they mean nothing (or ordinary words) in its vocabulary.
HUGINN_SPECIAL_IDS = frozenset({65504, 65505, 65508, 65509})


class HuginnRavenFamily(Family):
    """The ``huginn_raven`` format: prelude / core / coda layer groups under ``transformer.*``, an adapter."""

    model_type = "huginn_raven"
    layer_groups = (LayerGroup("transformer.prelude", "n_layers_in_prelude", "n_prelude"),
                    LayerGroup("transformer.core_block", "n_layers_in_recurrent_block", "n_core"),
                    LayerGroup("transformer.coda", "n_layers_in_coda", "n_coda"))
    rope_key = "rope_theta"             # the config field holding the RoPE base
    keeps_special_ids = False           # False: the config's Huginn ids are stale copies, dropped
    qk_norm = False

    def detect(self, cfg: dict[str, Any], names: set[str] | None) -> str:
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
        # Without weights: Raven configs also say block_class_name "SandwichBlock", and nothing in config.json
        # tells OLMo from Llama, so only Huginn (rope_base, no rope_theta) is decidable here.
        if "rope_theta" not in cfg and "rope_base" in cfg:
            return "huginn"
        raise ConfigError("cannot tell the layout from config.json alone; the weight names decide it")

    def context(self, f: Fields) -> int:
        """The maximum context.  Raven computes RoPE on the fly; block_size is only its training context."""
        return max(f.opt_int("block_size", 0, least=0), f.opt_int("max_position_embeddings", 0, least=0)) or 4096

    def read_config(self, cfg: dict[str, Any]) -> LoopedConfig:
        f = Fields(cfg)
        n_embd = f.need_int("n_embd", "hidden_size")
        n_heads = f.need_int("n_heads", "num_attention_heads")
        n_kv = f.opt_int("num_key_value_heads", n_heads)
        head_dim = f.opt_int("head_dim", None) or n_embd // n_heads
        n_prelude = f.need_int("n_layers_in_prelude", least=0)
        n_core = f.need_int("n_layers_in_recurrent_block")
        n_coda = f.need_int("n_layers_in_coda", least=0)
        layers_key = "n_layers" if cfg.get("n_layers") is not None else "num_hidden_layers"
        n_layers = f.opt_int(layers_key, None)
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
        rope_theta = real(*f.need(self.rope_key), positive=True)
        norm_key = "norm_eps" if "norm_eps" in cfg else "rms_norm_eps"
        norm_eps = real(norm_key, cfg.get(norm_key, 1e-6), least=0.0)
        special = f.special_ids()
        if not self.keeps_special_ids:      # stale copies of Huginn's ids; the tokenizer files give the real ones
            special = {k: ([i for i in v if i not in HUGINN_SPECIAL_IDS] if isinstance(v, list)
                           else (None if v in HUGINN_SPECIAL_IDS else v)) for k, v in special.items()}
        vocab_size = f.opt_int("padded_vocab_size", None) or f.need_int("vocab_size")
        check_unread(cfg, vocab_size)
        return LoopedConfig(
            family=self.name,
            vocab_size=vocab_size,
            n_embd=n_embd, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
            intermediate_size=f.need_int("intermediate_size"),
            n_prelude=n_prelude, n_core=n_core, n_coda=n_coda,
            mean_recurrence=f.need_int("mean_recurrence"),
            norm_eps=norm_eps,
            qk_bias=flag(cfg, "qk_bias", False),
            qk_norm=self.qk_norm,
            rope_theta=rope_theta,
            rope_scaling=f.rope_scaling(),
            tie_embeddings=flag(cfg, "tie_embeddings", flag(cfg, "tie_word_embeddings", False)),
            embed_scale=embed_scale,
            init_std=init_std,
            block_size=self.context(f),
            bos_token_id=special["bos_token_id"],
            eos_token_id=eos_list(special["eos_token_id"]),
            pad_token_id=special["pad_token_id"],
        )

    def write_config(self, cfg: LoopedConfig) -> dict[str, Any]:
        out: dict[str, Any] = {
            "architectures": ["RavenForCausalLM"],
            "model_type": "huginn_raven",
            "n_embd": cfg.n_embd,
            "n_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim,
            "intermediate_size": cfg.intermediate_size,
            "n_layers": cfg.n_layers,
            "n_layers_in_prelude": cfg.n_prelude,
            "n_layers_in_recurrent_block": cfg.n_core,
            "n_layers_in_coda": cfg.n_coda,
            "mean_recurrence": cfg.mean_recurrence,
            "norm_eps": cfg.norm_eps,
            "vocab_size": cfg.vocab_size,
            "padded_vocab_size": cfg.vocab_size,
            "block_size": cfg.block_size,
            "bias": False,
            "qk_bias": cfg.qk_bias,
            "tie_embeddings": cfg.tie_embeddings,
            "init_values": {"std": cfg.init_std, "embed_scale": cfg.embed_scale},
            "bos_token_id": cfg.bos_token_id,
            "eos_token_id": cfg.eos_token_id[0] if len(cfg.eos_token_id) == 1 else cfg.eos_token_id,
            "pad_token_id": cfg.pad_token_id,
        }
        out.update(self.own_fields(cfg))
        return out

    def own_fields(self, cfg: LoopedConfig) -> dict[str, Any]:
        """The config.json keys only this family writes."""
        return {"rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
                "max_position_embeddings": cfg.block_size, "tie_word_embeddings": cfg.tie_embeddings}


class SandwichBlock(NormedBlock):
    """Huginn's layer: x = n2(x + attn(n1 x)); x = n4(x + mlp(n3 x)) (the second norm of each pair acts on the
    residual sum)."""

    style = "sandwich"
    one_call = True

    def forward(self, x: Tensor, span: Span, kv: LayerKV | None) -> Tensor:
        y = self.rows(x, span, kv) if kv is not None else None
        if y is not None:
            return y
        x = self.norm_2(x + self.attn(self.norm_1(x), span, kv))
        return self.norm_4(x + self.mlp(self.norm_3(x)))


_OWN = own_methods(SandwichBlock)     # what ``injected_recurrence`` stands in for


class Huginn(HuginnRavenFamily):
    name = "huginn"
    block = SandwichBlock
    rope_style = "interleaved"
    rope_key = "rope_base"
    keeps_special_ids = True
    norm_after_loop = True
    knob_defaults = {"self-spec": {"draft_depth": 8, "block": 8}, "mature-spec": {"block": 8},
                     "das-wave": {"k": 2}}                                  # the paper's Table 5

    def context(self, f: Fields) -> int:
        return f.need_int("block_size")     # the RoPE table Huginn ships has block_size rows: a hard context cap

    def recur_rows(self, model: Any, h: Tensor, span: Any, cache: Any, steps: range,
                   inj: Tensor | None = None, reads: list[tuple[int, int]] | None = None) -> Tensor | None:
        """The core steps ``steps`` of a batched call in one kernel call: each step the adapter over concat[h, e],
        then the sandwich layers (``recurrence.injected_recurrence``)."""
        return injected_recurrence(model, h, inj, span, cache, steps, SandwichBlock, _OWN, reads)

    def own_fields(self, cfg: LoopedConfig) -> dict[str, Any]:
        return {"block_class_name": "SandwichBlock", "rope_base": cfg.rope_theta, "injection_type": "linear",
                "mlp_class_name": "GatedMLP", "norm_class_name": "RMSNorm_llama", "state_init": "like-init"}


register(Huginn())
