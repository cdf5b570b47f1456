"""Nanbeige4.2 (Nanbeige LLM Lab, July 2026): a Llama-style decoder stack executed ``num_loops`` times over shared
weights, as upstream's ``modeling_nanbeige.py`` (HF remote code) defines it with the options the released checkpoint
uses.

One stack of N pre-norm layers is the whole looped core, applied T = ``num_loops`` times (Nanbeige4.2-3B: 22 layers
x 2 loops): no prelude, no coda, no adapter and no random initial state - loop 1 reads the token embeddings, loop
t+1 reads loop t's output.  ``model.norm`` closes *every* loop (``skip_loop_final_norm = false``) and the head reads
the normed state, so in dasspec's terms this is Ouro's recurrence with Llama's layer; each (loop, layer) pair has its
own K/V, which is the depth cache's depth r = loop.  Attention is GQA with ``head_dim`` independent of
``hidden_size / heads`` (3B: 48 x 128 = 6144 query width over a 3072-wide stream, so q / o are not square) and
rotate-half RoPE with inverse frequencies computed here (upstream keeps ``inv_freq`` as a non-persistent buffer that
a meta-device load leaves at zero; a stored ``*.inv_freq`` is ignored).

The configuration class also defines LoopSplit, (m)HC hyper-connections, depth attention, n-gram embeddings and
per-head q/k norms; the released checkpoint leaves them off and dasspec does not implement them: a config.json that
enables one is refused naming the field, as is any key this module does not know.  What is read and why:
docs/families.md, "Nanbeige4.2".
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..config import LoopedConfig
from ..fields import ConfigError, Fields, eos_list, flag, json_type, real
from . import Family, LayerGroup, Slot, llama_tensor_map, register
from .raven import PreNormBlock
from .recurrence import layer_recurrence, own_methods

_OWN = own_methods(PreNormBlock)     # what ``layer_recurrence`` stands in for

# Options of NanbeigeConfig that change the computation, with the value that leaves each off (upstream's default).
# Any other value is refused with the field's name: silently ignoring one would load another model under this name.
OFF: dict[str, Any] = {
    "qk_layernorm": False,
    # n-gram embeddings (on when emb_neighbor_num, emb_split_num and ngram_vocab_size_ratio are all set)
    "emb_neighbor_num": None, "emb_split_num": None, "ngram_vocab_size_ratio": None,
    "insert_ngram_layer_idx": [], "ngram_insert_all_layers": False, "ngram_compressed_tokenizer": False,
    # LoopSplit
    "enable_double_loop_split": False, "loop_share_kv": False, "mhc_diff_for_loop": False,
    "mhc_double_stream_position_for_loop": None,
    # hyper-connections / mHC
    "enable_hyper_connection": False, "enable_mhc": False, "enable_h_res_identity": False,
    "mhc_identity_nohresparam": False,
    # depth attention
    "enable_depth_attention": False,
    # Llama options the decoder layer reads
    "attention_bias": False, "mlp_bias": False,
}
# Settings of an option above that are read only while it is on (upstream defaults are not "off" values), and
# training / bookkeeping keys: accepted with any value, since with the options off they change nothing.
INERT = frozenset({
    "architectures", "auto_map", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
    "use_cache", "initializer_range", "attention_dropout", "pretraining_tp", "tokenizer_class",
    "kv_channels",                # Megatron's name for head_dim, in the published file; upstream never reads it
    "ngram_mod_force_prime", "ngram_embedding_hidden_size", "ngram_fused_mode", "emb_tp_num", "skip_ngram_for_input",
    "ngram_layer_downproject_size", "loop_middle_layers", "loop_middle_repeats", "num_residual_streams",
    "mhc_sinkhorn_iterations", "mhc_init_gating_factor", "depth_attention_stride", "depth_attention_recent_window",
    "depth_attention_static_anchor_once", "output_attentions", "output_hidden_states", "return_dict",
})
READ = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
    "rope_theta", "rope_scaling", "tie_word_embeddings", "num_loops", "loop_loss_weights", "skip_loop_final_norm",
    "bos_token_id", "eos_token_id", "pad_token_id", "dasspec_family",
})


def _is_off(name: str, value: Any) -> bool:
    off = OFF[name]
    if off is None:
        return value is None
    if isinstance(off, list):
        return value is None or value == []
    return value is None or (type(value) is bool and value == off)


def check_options(cfg: dict[str, Any]) -> None:
    """Refuse every option dasspec does not implement, and every key it does not know, one line naming the field."""
    for name in OFF:
        if name in cfg and not _is_off(name, cfg[name]):
            shown = repr(cfg[name]) if len(repr(cfg[name])) <= 60 else repr(cfg[name])[:57] + "..."
            raise ConfigError(f"config field {name}={shown} enables a Nanbeige option dasspec does not "
                              f"implement (the released Nanbeige4.2 checkpoints leave it off); refusing to load")
    unknown = sorted(k for k in cfg if k not in OFF and k not in INERT and k not in READ)
    if unknown:
        shown = ", ".join(repr(k[:40]) for k in unknown[:4])
        raise ConfigError(f"config.json sets {shown}{' and more' if len(unknown) > 4 else ''}, which dasspec does "
                          "not know for a Nanbeige checkpoint; refusing rather than ignoring it")


def loops(cfg: dict[str, Any]) -> int:
    """The loop count T, as upstream's ``NanbeigeModel._get_num_loops``: ``len(loop_loss_weights) + 1`` when that
    list is non-empty (it then overrides ``num_loops``), else ``num_loops`` (default 1)."""
    weights = cfg.get("loop_loss_weights")
    if weights is not None:
        if not isinstance(weights, list):
            raise ConfigError(f"config field loop_loss_weights must be an array, got a JSON {json_type(weights)}")
        for w in weights:
            real("loop_loss_weights[]", w)
        if weights:
            return len(weights) + 1
    return Fields(cfg).opt_int("num_loops", 1)


class Nanbeige(Family):
    name = "nanbeige"
    model_type = "nanbeige"
    block = PreNormBlock
    rope_style = "half"
    injection = False
    norm_every_step = True
    embedding = "model.embed_tokens.weight"
    layer_groups = (LayerGroup("model.layers", "num_hidden_layers", "n_core"),)
    mlp_probe = (".mlp.gate_proj.weight", 1)
    square_heads = False          # head_dim is its own field: q / o need not be square
    # T = 2 leaves one draft depth: a loop-1 draft (half an AR token) in short blocks; DAS-Wave as for Ouro's T = 4
    # (aligned reads, a few one-step rounds seeded by copy).  docs/families.md, "Nanbeige4.2: what each method earns".
    knob_defaults: dict[str, dict[str, Any]] = {
        "self-spec": {"draft_depth": 1, "block": 2},
        "mature-spec": {"draft_depth": 1, "block": 2},
        "das-wave": {"k": 1, "rounds": 3, "gamma": 8, "w_init": 8, "policy": "aligned", "guesses": "copy",
                     "trim": True, "seed_branch": 8, "copy_run": True, "early_stop": True},
    }
    # ChatML turns end with <|im_end|> (the published eos_token_id 166101); listed so a chat reply stops there even
    # where the tokenizer files name another EOS.
    stop_tokens = ("<|im_end|>",)

    def recur_rows(self, model: Any, h: Tensor, span: Any, cache: Any, steps: range,
                   inj: Tensor | None = None, reads: list[tuple[int, int]] | None = None) -> Tensor | None:
        """The loops ``steps`` of a batched call in one kernel call (``recurrence.layer_recurrence``)."""
        return layer_recurrence(model, h, span, cache, steps, PreNormBlock, _OWN, reads)

    def detect(self, cfg: dict[str, Any], names: set[str] | None) -> str:
        if names is not None and not any(n.startswith("model.layers.") for n in names):
            raise ConfigError("checkpoint has no model.layers.* weights: not a Nanbeige layout")
        return self.name

    def read_config(self, cfg: dict[str, Any]) -> LoopedConfig:
        """Absent fields take upstream NanbeigeConfig's defaults (what transformers would use)."""
        check_options(cfg)
        f = Fields(cfg)
        n_embd = f.need_int("hidden_size")
        n_heads = f.need_int("num_attention_heads")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"config field hidden_act must be 'silu' (Nanbeige's SwiGLU), got {act!r}")
        if flag(cfg, "skip_loop_final_norm", False):
            raise ConfigError("config field skip_loop_final_norm=true (norm only after the last loop) is not "
                              "implemented; the released Nanbeige4.2 checkpoints norm every loop (false)")
        scaling = cfg.get("rope_scaling")
        if scaling is not None and not (isinstance(scaling, dict) and scaling.get("type", scaling.get("rope_type"))
                                        in (None, "default")):
            raise ConfigError(f"config field rope_scaling={scaling!r} is not supported for Nanbeige (upstream knows "
                              "linear and dynamic NTK scaling; the released checkpoints use none)")
        head_dim = f.opt_int("head_dim", None) or n_embd // n_heads
        special = f.special_ids()
        return LoopedConfig(
            family=self.name,
            vocab_size=f.need_int("vocab_size"),
            n_embd=n_embd, n_heads=n_heads,
            n_kv_heads=f.opt_int("num_key_value_heads", n_heads),
            head_dim=head_dim,
            intermediate_size=f.need_int("intermediate_size"),
            n_prelude=0, n_core=f.need_int("num_hidden_layers"), n_coda=0,
            mean_recurrence=loops(cfg),
            norm_eps=real("rms_norm_eps", cfg.get("rms_norm_eps", 1e-6), least=0.0),
            rope_theta=real("rope_theta", cfg.get("rope_theta", 10000.0), positive=True),
            rope_scaling=None,
            tie_embeddings=flag(cfg, "tie_word_embeddings", False),
            block_size=f.opt_int("max_position_embeddings", 2048),
            bos_token_id=special["bos_token_id"],
            eos_token_id=eos_list(special["eos_token_id"]),
            pad_token_id=special["pad_token_id"],
        )

    def write_config(self, cfg: LoopedConfig) -> dict[str, Any]:
        return {
            "architectures": ["NanbeigeForCausalLM"],
            "model_type": "nanbeige",
            "auto_map": {"AutoConfig": "configuration_nanbeige.NanbeigeConfig",
                         "AutoModelForCausalLM": "modeling_nanbeige.NanbeigeForCausalLM"},
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.n_embd,
            "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.n_core,
            "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": cfg.block_size,
            "rope_theta": cfg.rope_theta,
            "rope_scaling": None,
            "attention_bias": False,
            "rms_norm_eps": cfg.norm_eps,
            "num_loops": cfg.mean_recurrence,
            "loop_loss_weights": [],
            "skip_loop_final_norm": False,
            "tie_word_embeddings": cfg.tie_embeddings,
            "bos_token_id": cfg.bos_token_id,
            "eos_token_id": cfg.eos_token_id[0] if len(cfg.eos_token_id) == 1 else cfg.eos_token_id,
            "pad_token_id": cfg.pad_token_id,
        }

    def tensor_map(self, cfg: LoopedConfig, params: dict[str, tuple[int, ...]]) -> dict[str, Slot]:
        return llama_tensor_map(cfg, params, ("input_layernorm", "post_attention_layernorm"))

    def start_state(self, h0: Tensor, inj: Tensor) -> Tensor:
        """Loop 1 reads the token embeddings, not an initial state."""
        return inj


register(Nanbeige())
