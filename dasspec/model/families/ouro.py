"""ByteDance Ouro (Ouro-1.4B / 2.6B and the -Thinking variants), as upstream's ``modeling_ouro.py`` defines it.

One stack of N layers is the whole looped core, applied T = ``total_ut_steps`` times: no prelude, no coda, no
adapter (no input injection) and no random initial state - step 1 reads the token embeddings, step t+1 reads step
t's output.  ``model.norm`` closes *every* step, and the normed state is what the next step and the head read.
Each layer is a "peri-norm" sandwich: a norm before and after attention and before and after the MLP, both
inside the residual branch.  A per-step gate (Linear d -> 1, with bias) gives the early-exit probabilities that
``exit_threshold`` / ``exit_at_step`` read (``dasspec/model/exit.py``).

Checkpoints name tensors as upstream does (``model.layers.N.self_attn.q_proj`` ...); q/k/v go into the rows of the
fused ``attn.Wqkv`` and gate/up into the fused ``mlp.fc`` (``tensor_map``).  What is read and why:
docs/families.md, "Ouro".
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ..attention import LayerKV, Span
from ..config import LoopedConfig
from ..fields import ConfigError, Fields, eos_list, flag, real
from ..layers import NormedBlock
from . import Family, LayerGroup, Slot, llama_tensor_map, register
from .recurrence import layer_recurrence, own_methods

# The checkpoint's four norms of a layer, in the order of the block's norm_1..norm_4.
NORMS = ("input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2")


class PeriNormBlock(NormedBlock):
    """Ouro's layer: x = x + n2(attn(n1 x)); x = x + n4(mlp(n3 x)) (both norms of a pair inside the residual
    branch, unlike Huginn's sandwich, which normalises the residual sum)."""

    style = "peri"
    one_call = True

    def forward(self, x: Tensor, span: Span, kv: LayerKV | None) -> Tensor:
        y = self.rows(x, span, kv) if kv is not None else None
        if y is not None:
            return y
        x = x + self.norm_2(self.attn(self.norm_1(x), span, kv))
        return x + self.norm_4(self.mlp(self.norm_3(x)))


_OWN = own_methods(PeriNormBlock)     # what ``layer_recurrence`` stands in for


class Ouro(Family):
    name = "ouro"
    model_type = "ouro"
    block = PeriNormBlock
    rope_style = "half"
    injection = False
    norm_every_step = True
    exit_gate = True
    embedding = "model.embed_tokens.weight"
    layer_groups = (LayerGroup("model.layers", "num_hidden_layers", "n_core"),)
    mlp_probe = (".mlp.gate_proj.weight", 1)
    # T = 4 leaves draft depths 1..3 and verifying costs the 4 passes of one AR token, so drafts must stay cheap:
    # depth-1 drafts in short blocks; DAS-Wave a few one-step rounds over a window seeded from earlier text, read
    # with aligned depths (deep values did not agree with shallow states).  Chosen on development prompts of a
    # random-weight Ouro: docs/families.md, "Default knobs"; a trained checkpoint's generation_config.json overrides.
    knob_defaults: dict[str, dict[str, Any]] = {
        "self-spec": {"draft_depth": 1, "block": 2},
        "mature-spec": {"draft_depth": 1, "block": 2},
        "das-wave": {"k": 1, "rounds": 3, "gamma": 8, "w_init": 8, "policy": "aligned", "guesses": "copy",
                     "trim": True, "seed_branch": 8, "copy_run": True, "early_stop": True},
    }
    # ChatML turns end with <|im_end|>; the published base configs give EOS id 0 (<|endoftext|>), so without this
    # stop a chat reply would run on into the next turn.
    stop_tokens = ("<|im_end|>",)

    def recur_rows(self, model: nn.Module, h: Tensor, span: Span, cache: Any, steps: range,
                   inj: Tensor | None = None, reads: list[tuple[int, int]] | None = None) -> Tensor | None:
        """The core steps ``steps`` of a batched call in one kernel call (``recurrence.layer_recurrence``)."""
        return layer_recurrence(model, h, span, cache, steps, PeriNormBlock, _OWN, reads)

    def detect(self, cfg: dict[str, Any], names: set[str] | None) -> str:
        if names is not None and not any(n.startswith("model.layers.") for n in names):
            raise ConfigError("checkpoint has no model.layers.* weights: not an Ouro layout")
        return self.name

    def read_config(self, cfg: dict[str, Any]) -> LoopedConfig:
        """Absent fields take upstream OuroConfig's defaults (what transformers would use)."""
        f = Fields(cfg)
        n_embd = f.need_int("hidden_size")
        n_heads = f.need_int("num_attention_heads")
        n_layers = f.need_int("num_hidden_layers")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"config field hidden_act must be 'silu' (Ouro's SwiGLU), got {act!r}")
        kinds = cfg.get("layer_types")
        if kinds is None:       # upstream derives them: sliding layers from max_window_layers on, when enabled
            sliding = flag(cfg, "use_sliding_window", False) and f.opt_int("max_window_layers", 28, least=0) < n_layers
        else:
            if not isinstance(kinds, list):
                raise ConfigError(f"config field layer_types must be a list, got {kinds!r}")
            sliding = any(k != "full_attention" for k in kinds)
        if sliding:
            raise ConfigError("sliding-window attention layers (layer_types / use_sliding_window) are not "
                              "supported; every Ouro checkpoint published uses full attention")
        special = f.special_ids()
        return LoopedConfig(
            family=self.name,
            vocab_size=f.need_int("vocab_size"),
            n_embd=n_embd, n_heads=n_heads,
            n_kv_heads=f.opt_int("num_key_value_heads", n_heads),
            head_dim=f.opt_int("head_dim", None) or n_embd // n_heads,
            intermediate_size=f.need_int("intermediate_size"),
            n_prelude=0, n_core=n_layers, n_coda=0,
            mean_recurrence=f.opt_int("total_ut_steps", 4),
            norm_eps=real("rms_norm_eps", cfg.get("rms_norm_eps", 1e-6), least=0.0),
            rope_theta=real("rope_theta", cfg.get("rope_theta", 10000.0), positive=True),
            rope_scaling=f.rope_scaling(),
            tie_embeddings=flag(cfg, "tie_word_embeddings", False),
            block_size=f.opt_int("max_position_embeddings", 32768),
            bos_token_id=special["bos_token_id"],
            eos_token_id=eos_list(special["eos_token_id"]),
            pad_token_id=special["pad_token_id"],
        )

    def write_config(self, cfg: LoopedConfig) -> dict[str, Any]:
        return {
            "architectures": ["OuroForCausalLM"],
            "model_type": "ouro",
            "hidden_size": cfg.n_embd,
            "num_hidden_layers": cfg.n_core,
            "intermediate_size": cfg.intermediate_size,
            "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim,
            "hidden_act": "silu",
            "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.block_size,
            "rope_theta": cfg.rope_theta,
            "rope_scaling": cfg.rope_scaling,
            "rms_norm_eps": cfg.norm_eps,
            "tie_word_embeddings": cfg.tie_embeddings,
            "total_ut_steps": cfg.mean_recurrence,
            "early_exit_threshold": 1.0,
            "use_sliding_window": False,
            "bos_token_id": cfg.bos_token_id,
            "eos_token_id": cfg.eos_token_id[0] if len(cfg.eos_token_id) == 1 else cfg.eos_token_id,
            "pad_token_id": cfg.pad_token_id,
        }

    def tensor_map(self, cfg: LoopedConfig, params: dict[str, tuple[int, ...]]) -> dict[str, Slot]:
        out = llama_tensor_map(cfg, params, NORMS)
        for name in ("weight", "bias"):
            out[f"model.early_exit_gate.{name}"] = Slot(f"transformer.exit_gate.{name}",
                                                        params[f"transformer.exit_gate.{name}"])
        return out

    def start_state(self, h0: Tensor, inj: Tensor) -> Tensor:
        """Step 1 reads the token embeddings (the prelude's output), not an initial state."""
        return inj


register(Ouro())
