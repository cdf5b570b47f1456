"""IQuest-Coder-V1-Loop (IQuestLab's 40B-Loop coder, ``model_type: "iquestloopcoder"``), as its HF remote code
(``modeling_iquestloopcoder.py``) and vLLM's ``iquest_loopcoder.py`` define it.

One stack of N Llama layers (pre-norm, GQA, rotate-half RoPE, SwiGLU) is applied T = ``loop_num`` times over shared
weights: no prelude, no coda, no input injection, no norm between loops; ``model.norm`` and the untied head read
the last loop's state.  What differs from a plain loop is attention at loops t >= 2 (depth r >= 2 here):

    q, k, v  = the layer's projections of the depth-r input (the same weights at every depth)
    A        = attention of q over depth 1's keys/values (K1, V1) of every visible row           ("global")
    B        = attention of q over depth r's own keys/values, rows within the last ``loop_window_size``
               positions (the query's own row included)                                             ("local")
    g        = sigmoid(<q_h, w_h> + b_h) per head h (``model.gate_projections.{layer}``, from q after RoPE)
    out      = o_proj(g * A + (1 - g) * B)

so a position's depth-r K/V matter only to the next ``loop_window_size`` positions at that depth, while K1/V1 are
read by every later position at every depth.  The depth cache keeps both in their ordinary places (depth 1 and
depth r of the layer); the block gets them through ``LoopKV``, which ``IQuestLoop.core_kv`` builds for every layer
call.  Attention is composed from ``attention.attend`` (a windowed copy of the call's ``Span``); on a CPU in float32 a
batched call's loops are one kernel call (``IQuestLoop.recur_rows``), or where that does not apply its mixed step is
(``LoopCoderBlock.mixed_rows``), as depth 1's attention is.
What is read and why: docs/families.md, "IQuest-Coder-V1-Loop".
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from .. import decode_kernel
from ..attention import (BatchKV, LayerKV, CausalSpan, RaggedSpan, Span, attend, causal_self_attention, pools_like,
                         row_plan)
from ..config import LoopedConfig
from ..fields import ConfigError, Fields, eos_list, flag, real
from ..layers import NormedBlock, sigmoid, skipped, skips_nothing
from ..linear import linear
from . import Family, LayerGroup, Slot, llama_tensor_map, register

# config.json keys that do not change the computation (bookkeeping, training-only settings, HF defaults).
_INERT = frozenset({
    "architectures", "auto_map", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
    "use_cache", "initializer_range", "attention_dropout", "return_dict", "output_hidden_states",
    "output_attentions", "torchscript", "use_bfloat16", "tf_legacy_loss", "pruned_heads", "chunk_size_feed_forward",
    "is_encoder_decoder", "is_decoder", "add_cross_attention", "tie_encoder_decoder", "id2label", "label2id",
    "problem_type", "tokenizer_class", "prefix", "task_specific_params", "finetuning_task", "max_window_layers",
    "bos_token_id", "eos_token_id", "pad_token_id"})
# Keys read below (each type- and range-checked there).
_READ = frozenset({
    "dasspec_family", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_theta",
    "rope_scaling", "attention_bias", "mlp_bias", "tie_word_embeddings", "loop_num", "loop_window_size",
    "dual_chunk_attention_config", "is_causal", "sliding_window", "use_sliding_window", "pretraining_tp"})


@dataclass
class LoopKV:
    """What an IQuest layer reads at one depth: ``local``, the view ``cache.core_kv`` gives for the call's depths
    (where the depth's own K/V are stored and read), and ``glob``, depth 1's aligned view (K1, V1); both None in a
    forward without cache.  ``depth``: the depth the call computes (its ``own`` key depth)."""

    depth: int
    local: "LayerKV | BatchKV | None"
    glob: "LayerKV | BatchKV | None"


class LoopGate(nn.Module):
    """g = sigmoid(q_h . w_h + b_h) for each query head h: weight [H, hd], bias [H] (``gate_projections.{i}``).

    The dot products are one product of the rows' queries [W, H * hd] by the block-diagonal [H, H * hd] (head h's
    weight in its own columns, zeros elsewhere), so they take dasspec's product like every other layer's: a row's
    gate is the same bits in a call of one row or of many (torch's einsum is not: its kernel changes with the row
    count).  The zeros add exact zeros to each head's sum, in the lanes its own columns would use; the sigmoid is the
    kernel's too (``layers.sigmoid``)."""

    def __init__(self, heads: int, head_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(heads, head_dim))
        self.bias = nn.Parameter(torch.zeros(heads))
        self._blocks: tuple | None = None

    def block_diagonal(self) -> Tensor:
        w = self.weight
        if torch.is_grad_enabled() and w.requires_grad:
            return torch.block_diag(*w.unsqueeze(1).unbind(0))
        key = (w.data_ptr(), w._version, w.dtype, w.device)
        if self._blocks is None or self._blocks[0] != key:
            self._blocks = (key, torch.block_diag(*w.detach().unsqueeze(1).unbind(0)))
        return self._blocks[1]

    def forward(self, q: Tensor) -> Tensor:
        """q [B, H, W, hd] -> gate [B, H, W, 1]."""
        B, H, W, hd = q.shape
        x = q.transpose(1, 2).reshape(B * W, H * hd)
        s = linear(x, self.block_diagonal(), self.bias).view(B, W, H).transpose(1, 2)
        return sigmoid(s).unsqueeze(-1)


skipped(LoopGate, "forward")


class LoopCoderBlock(NormedBlock):
    """A Llama layer (x += A(n1 x); x += M(n2 x)) whose attention at depth >= 2 is the gated global/local mix."""

    style = "loopcoder"
    norms = 2

    def __init__(self, cfg: LoopedConfig):
        super().__init__(cfg)
        self.gate = LoopGate(cfg.n_heads, cfg.head_dim)
        self.window = cfg.loop_window

    def forward(self, x: Tensor, span: Span, kv: LoopKV | None) -> Tensor:
        depth = kv.depth if kv is not None else 1
        h = self.norm_1(x)
        if depth == 1:
            a = self.attn(h, span, kv.local) if kv is not None and kv.local is not None else self.loop1_bare(h, span)
        else:
            a = self.mixed(h, span, kv)
        x = x + a
        return x + self.mlp(self.norm_2(x))

    # --- depth 1 ----------------------------------------------------------------------------------------------
    def loop1_bare(self, h: Tensor, span: Span) -> Tensor:
        """Depth 1 without a cache (``model(ids)``): causal attention over the call's rows, keeping K1/V1 on the
        span for the later depths of the same call."""
        attn = self.attn
        q, k, v = attn.qkv(h, span)
        _k1v1(span)[id(self)] = (k, v)
        return self._out(causal_self_attention(q, k, v))

    # --- depth >= 2 -------------------------------------------------------------------------------------------
    def mixed(self, h: Tensor, span: "Span | RaggedSpan", kv: LoopKV) -> Tensor:
        if kv.local is not None:
            out = self.mixed_rows(h, span, kv)
            if out is not None:
                return out
        q, k, v = self.attn.qkv(h, span)
        g = self.gate(q)
        if kv.local is None:                                         # no cache: this call's own rows only
            k1, v1 = _k1v1(span)[id(self)]
            a = causal_self_attention(q, k1, v1)
            b = causal_self_attention(q, k, v, window=self.window)
        else:
            kv.local.store(span, k[0], v[0])
            b = attend(q, kv.local, windowed(span, self.window, q.dtype))
            a = attend(q, kv.glob, span)
        return self._out(g * a + (1 - g) * b)

    def mixed_rows(self, h: Tensor, span: "Span | RaggedSpan", kv: LoopKV) -> Tensor | None:
        """``mixed`` as one kernel call (``decode_kernel.loop_mix_rows``, which mirrors it op for op: the same bits
        without a Python call per op) where ``mix_args`` applies; None otherwise (``mixed``'s own ops run)."""
        args = self.mix_args(h, span, kv)
        if args is None:
            return None
        B, W, d = h.shape
        return decode_kernel.loop_mix_rows(h.reshape(B * W, d), *args).view(B, W, -1)

    def mix_args(self, h: Tensor, span: "Span | RaggedSpan", kv: LoopKV) -> tuple | None:
        """``loop_mix_rows``' arguments after the rows where both reads take the row kernel in one pool (as
        ``Attention.rows``) and the gate is a plain ``LoopGate`` (``plain_gate``); None otherwise."""
        if not plain_gate(self.gate):
            return None
        gate = self.gate
        local = self.attn.row_args(h, windowed(span, self.window, h.dtype), kv.local)
        if local is None:
            return None
        glob = row_plan(h, kv.glob, span)
        if glob is None:
            return None
        k1, v1, _, rows, starts, lengths = glob
        return (*local, k1, v1, rows, starts, lengths, gate.block_diagonal(), gate.bias)

    def _out(self, y: Tensor) -> Tensor:
        B, H, W, hd = y.shape
        return self.attn.proj(y.transpose(1, 2).reshape(B, W, H * hd))


def _k1v1(span: Any) -> dict:
    """The per-call store of K1/V1 of a forward without cache (the span is the call's one object)."""
    store = getattr(span, "_loop_k1v1", None)
    if store is None:
        store = {}
        setattr(span, "_loop_k1v1", store)
    return store


def plain_gate(gate: nn.Module) -> bool:
    """A ``LoopGate`` a one-call path may stand in for: its own forward, no hooks (``skips_nothing``), no gradient to
    keep."""
    return (type(gate) is LoopGate and skips_nothing(gate)
            and not (torch.is_grad_enabled() and (gate.weight.requires_grad or gate.bias.requires_grad)))


def windowed(span: "Span | RaggedSpan", window: int, dtype: torch.dtype) -> "Span | RaggedSpan":
    """The call's span with visibility cut to the sliding window by *position*: a key is visible iff the span shows
    it and its position is > the query's - window.  Prefix rows and chain rows sit at their row's position; a
    masked call's query (a tree node) sits at n + (its visible own rows) - 1, which a tree's ancestor mask gives.
    Built once per call (kept on the span)."""
    memo = getattr(span, "_loop_window", None)
    if memo is not None and memo[0] == (window, dtype):
        return memo[1]
    if isinstance(span, RaggedSpan):
        out: Span | RaggedSpan = RaggedSpan([windowed(p, window, dtype) for p in span.parts], span.offsets, span.rot)
    else:
        out = _window_part(span, window, dtype)
    setattr(span, "_loop_window", ((window, dtype), out))
    return out


def _window_part(span: Span, window: int, dtype: torch.dtype) -> Span:
    if span.rows is None and (span.causal_rows or span.mask is None):
        # causal: the lists by arithmetic, the mask when asked
        return CausalSpan.of(span.n, span.start, span.W, span.rot, dtype, window)
    dev = span.rot[0].device if isinstance(span.rot, tuple) else span.rot.device
    width = span.end if span.mask is None else span.mask.shape[1]
    cols = torch.arange(width, device=dev)
    if span.mask is None:                   # every query sees rows [0, its own]
        qpos = torch.arange(span.start, span.end, device=dev)
        visible = cols[None, :] <= qpos[:, None]
        kpos = cols
    else:
        visible = span.mask
        qpos = span.n + visible[:, span.n:].sum(-1) - 1
        kpos = cols.clone()
        kpos[span.rows if span.rows is not None else slice(span.start, span.end)] = qpos
    mask = visible & (kpos[None, :] > qpos[:, None] - window)
    bias = None
    if dev.type == "cpu":
        bias = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
    # every query sits at position n or later: no row before n - window + 1 is visible to any (read from there on)
    lo = max(0, span.n - window + 1) if span.rows is None else 0
    return replace(span, mask=mask, causal=False, bias=bias, causal_rows=False, lo=lo, _split=None, _rows_cache={})


def _own_methods() -> tuple:
    return LoopCoderBlock.forward, LoopCoderBlock.mixed, LoopCoderBlock.mixed_rows, LoopCoderBlock.mix_args


# what ``IQuestLoop.recur_rows`` stands in for of the blocks (the sublayers' and the gate's: ``skips_nothing``): a
# class-level replacement keeps the calls
_OWN = _own_methods()


class IQuestLoop(Family):
    name = "iquest-loop"
    model_type = "iquestloopcoder"
    block = LoopCoderBlock
    rope_style = "half"
    injection = False
    embedding = "model.embed_tokens.weight"
    layer_groups = (LayerGroup("model.layers", "num_hidden_layers", "n_core"),
                    LayerGroup("model.gate_projections", "num_hidden_layers", "n_core"))
    mlp_probe = (".mlp.gate_proj.weight", 1)
    # T = 2: a draft is depth 1 (half a token's layers) and verifying costs the 2 passes of one AR token.  Chosen
    # like Ouro's (docs/families.md, "IQuest-Coder-V1-Loop"); a checkpoint's generation_config.json overrides.
    knob_defaults: dict[str, dict[str, Any]] = {
        "self-spec": {"draft_depth": 1, "block": 3},
        "mature-spec": {"draft_depth": 1, "block": 3},
        "das-wave": {"k": 1, "rounds": 3, "gamma": 8, "w_init": 8, "policy": "aligned", "guesses": "copy",
                     "trim": True, "seed_branch": 8, "copy_run": True, "early_stop": True},
    }
    stop_tokens = ("<|im_end|>",)
    # Depth r >= 2 reads depth 1's rows of the call's own positions.  A target call (AR, verification, prefill, a
    # depth slice of one) computed them earlier in the call or in an earlier slice; a DAS-Wave round that carries
    # states past depth 1 reads whatever an earlier call left there (even uninitialised memory) - a draft only.

    def recur_rows(self, model: nn.Module, h: Tensor, span: Any, cache: Any, steps: range,
                   inj: Tensor | None = None, reads: list[tuple[int, int]] | None = None) -> Tensor | None:
        """The loops ``steps`` of a batched call in one kernel call (``decode_kernel.loop_recur_rows``: each loop's
        layer calls in ``core_step``'s order - depth 1 Llama's, past it the mixed attention's - so the same bits),
        where every layer application would take the one-call sublayers (``Attention.row_args``, ``mix_args``, the
        MLP's) and nothing whose call it skips is replaced or hooked; None otherwise.  Saves the Python around the
        T x N layer calls: each layer's weights and checks are taken once, a later depth asks only for its pools."""
        if reads is not None:           # a draft reading the prefix at another depth: its layer calls
            return None
        blocks = list(model.transformer.core_block)
        steps = list(steps)
        if (steps != list(range(steps[0], steps[0] + len(steps))) or any(type(b) is not LoopCoderBlock for b in blocks)
                or _own_methods() != _OWN or type(self).core_kv is not IQuestLoop.core_kv
                or any(b._forward_hooks or b._forward_pre_hooks for b in blocks)
                or any(name in vars(b) for b in blocks for name in ("forward", "mixed", "mixed_rows", "mix_args"))):
            return None
        layers, per_step, glob = [], [], None
        for r in steps:
            read = span if r == 1 else windowed(span, blocks[0].window, h.dtype)     # depth r's own row lists
            pools, lists, first = [], None, None
            for i, b in enumerate(blocks):
                kv = self.core_kv(cache, i, (r, r), (r, r), span)
                if kv.local is None:
                    return None
                if i < len(layers) and first is not None:        # known weights, and this depth's lists: its pools
                    got = pools_like(kv.local, first)
                    if got is None:
                        return None
                    pools.append(got)
                    continue
                if i < len(layers):              # the layer's weights are known: its pools at this depth
                    plan = row_plan(h, kv.local, read)
                    if plan is None:
                        return None
                    first = kv.local
                else:                            # its weights, checks and depth 1's pools, once per call
                    a = b.attn.row_args(h, read, kv.local)
                    if a is None:
                        g = None
                    elif kv.glob is kv.local and read is span:       # depth 1: the plan row_args just made
                        g = a[5:11]
                    else:
                        g = row_plan(h, kv.glob, span)
                    gate = b.gate
                    if g is None or not plain_gate(gate) or b.window != blocks[0].window:
                        return None
                    weights = b.plain_parts(h)
                    m = b.mlp.row_args(h) if weights is not None else None
                    if m is None:
                        return None
                    shared = (a[3], a[4], a[11], a[12], a[13], *g[3:])     # RoPE, scale, heads, depth 1's lists
                    glob = shared if glob is None else glob
                    if any(not decode_kernel.same(x, y) for x, y in zip(shared, glob)):
                        return None
                    layers.append((weights, b.norm_1.eps, a[0], a[1], a[2], m[0], m[1], g[0], g[1],
                                   gate.block_diagonal(), gate.bias))
                    plan = a[5:11]
                lists = plan[2:] if lists is None else lists
                if any(x is not y for x, y in zip(plan[2:], lists)):
                    return None
                pools.append(plan[:2])
            per_step.append((*lists, pools))
        rows, starts, lengths = glob[5:]
        B, W, d = h.shape
        return decode_kernel.loop_recur_rows(h.reshape(B * W, d), steps[0], layers, per_step,
                                             (rows, starts, lengths, *glob[:5])).view(B, W, d)

    def core_kv(self, cache: Any, layer: int, read: tuple[int, int], own: tuple[int, int], span: Any) -> LoopKV:
        """Each layer call's ``LoopKV``: the call's own view and depth 1's."""
        if cache is None:
            return LoopKV(own[0], None, None)
        return LoopKV(own[0], cache.core_kv(layer, read, own), cache.core_kv(layer, (1, 1), (1, 1)))

    def kv_window(self, cfg: LoopedConfig) -> int | None:
        return cfg.loop_window

    def detect(self, cfg: dict[str, Any], names: set[str] | None) -> str:
        if names is not None and not any(n.startswith("model.gate_projections.") for n in names):
            raise ConfigError("checkpoint has no model.gate_projections.* weights: not an IQuest-Loop layout")
        return self.name

    def read_config(self, cfg: dict[str, Any]) -> LoopedConfig:
        """Absent fields take IQuestLoopCoderConfig's defaults (what the remote code would use).  A field that
        would change the computation away from what is implemented, or a field not known at all, is refused."""
        unknown = sorted(k for k in cfg if k not in _READ and k not in _INERT)
        if unknown:
            raise ConfigError(f"config field {unknown[0]} is not an IQuest-Coder-V1-Loop field dasspec implements "
                              f"(refused rather than ignored)")
        f = Fields(cfg)
        n_embd = f.need_int("hidden_size")
        n_heads = f.need_int("num_attention_heads")
        if cfg.get("head_dim") is None and n_embd // n_heads != 128:
            raise ConfigError("config field head_dim is absent: the remote code then uses 128, vLLM hidden_size / "
                              f"num_attention_heads = {n_embd // n_heads}; state it")
        for name, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False),
                           ("rope_scaling", None), ("dual_chunk_attention_config", None), ("is_causal", True),
                           ("sliding_window", None), ("use_sliding_window", False), ("pretraining_tp", 1)):
            if name in cfg and cfg[name] is not None and cfg[name] != want:
                raise ConfigError(f"config field {name}={cfg[name]!r} is not implemented (only {want!r})")
        special = f.special_ids()
        eos = special["eos_token_id"] if "eos_token_id" in cfg else 2
        return LoopedConfig(
            family=self.name,
            vocab_size=f.need_int("vocab_size"),
            n_embd=n_embd, n_heads=n_heads,
            n_kv_heads=f.opt_int("num_key_value_heads", n_heads),
            head_dim=f.opt_int("head_dim", 128),
            intermediate_size=f.need_int("intermediate_size"),
            n_prelude=0, n_core=f.need_int("num_hidden_layers"), n_coda=0,
            mean_recurrence=f.opt_int("loop_num", 2),
            loop_window=f.opt_int("loop_window_size", 64),
            norm_eps=real("rms_norm_eps", cfg.get("rms_norm_eps", 1e-5), least=0.0),
            rope_theta=real("rope_theta", cfg.get("rope_theta", 500000.0), positive=True),
            tie_embeddings=flag(cfg, "tie_word_embeddings", False),
            block_size=f.opt_int("max_position_embeddings", 8192),
            bos_token_id=special["bos_token_id"] if "bos_token_id" in cfg else 1,
            eos_token_id=eos_list(eos),
            pad_token_id=special["pad_token_id"],
        )

    def write_config(self, cfg: LoopedConfig) -> dict[str, Any]:
        return {
            "architectures": ["IQuestLoopCoderForCausalLM"],
            "model_type": "iquestloopcoder",
            "auto_map": {"AutoConfig": "configuration_iquestloopcoder.IQuestLoopCoderConfig",
                         "AutoModelForCausalLM": "modeling_iquestloopcoder.IQuestLoopCoderForCausalLM"},
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.n_embd,
            "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.n_core,
            "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": cfg.block_size,
            "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta,
            "rope_scaling": None,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": cfg.tie_embeddings,
            "loop_num": cfg.mean_recurrence,
            "loop_window_size": cfg.loop_window,
            "bos_token_id": cfg.bos_token_id,
            "eos_token_id": cfg.eos_token_id[0] if len(cfg.eos_token_id) == 1 else cfg.eos_token_id,
            "pad_token_id": cfg.pad_token_id,
        }

    def tensor_map(self, cfg: LoopedConfig, params: dict[str, tuple[int, ...]]) -> dict[str, Slot]:
        out = llama_tensor_map(cfg, params, ("input_layernorm", "post_attention_layernorm"))
        for i in range(cfg.n_core):
            dst = f"transformer.core_block.{i}."
            out[f"model.gate_projections.{i}.weight"] = Slot(dst + "gate.weight", params[dst + "gate.weight"])
            out[f"model.gate_projections.{i}.bias"] = Slot(dst + "gate.bias", params[dst + "gate.bias"])
        return out

    def start_state(self, h0: Tensor, inj: Tensor) -> Tensor:
        """Loop 1 reads the token embeddings."""
        return inj


register(IQuestLoop())
