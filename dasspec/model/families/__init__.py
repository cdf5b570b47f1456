"""Model families: everything that differs between the looped checkpoints dasspec runs, one entry each.

A family says how to recognise its checkpoints, how to read (and write) their ``config.json``, where each of its
checkpoint tensors goes in ``LoopedLM``, which block it stacks, the specifics of the three primitives (input
injection, where the final norm sits, the initial state, an early-exit gate) and its default knobs per decoding
method.  ``LoopedLM``, the loader and the methods ask the family; none of them switch on a family's name.

    huginn.py   Huginn-0125 (and the huginn_raven config format the Raven files share)
    raven.py    Raven-Llama (Raven-Llama-3.2, Raven-TinyLlama) and Raven-OLMo
    ouro.py     ByteDance Ouro (Ouro-1.4B / 2.6B and their -Thinking variants)
    iquest.py   IQuest-Coder-V1-Loop (IQuestLab's 40B-Loop coder)
    nanbeige.py Nanbeige4.2 (Nanbeige4.2-3B: 22 Llama layers looped twice)

A new family is one new module here that subclasses ``Family`` and calls ``register``, imported by
``dasspec/model/__init__.py`` (which runs before any module of ``dasspec.model``, so every lookup finds the
families registered).  This module is the registry and imports no family: the families build on ``config``,
``layers`` and ``attention``, and ``config`` looks families up here, so the imports point one way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

from ..fields import ConfigError

if TYPE_CHECKING:
    from torch import Tensor, nn

    from ..config import LoopedConfig


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor goes: a ``LoopedLM`` state-dict entry, or rows ``[start, start + shape[0])``
    of one when the family stores parts of a fused weight apart (Ouro's q/k/v and gate/up projections)."""

    param: str
    shape: tuple[int, ...]
    start: int | None = None

    def view(self, tensor: Tensor) -> Tensor:
        """The part of the parameter ``tensor`` this checkpoint tensor fills."""
        return tensor if self.start is None else tensor[self.start: self.start + self.shape[0]]


def llama_tensor_map(cfg: "LoopedConfig", params: dict[str, tuple[int, ...]],
                     norms: tuple[str, ...]) -> dict[str, Slot]:
    """The upstream Llama-style names of a looped checkpoint whose layers all sit in the core block
    (``model.layers.N``): the embedding, the final norm, an untied head, each layer's q/k/v and gate/up into rows of
    the fused weights, and its norms ``norms[k]`` into ``norm_{k + 1}`` (Ouro, IQuest-Loop, Nanbeige4.2)."""
    d, hd, inter = cfg.n_embd, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd

    def whole(name: str) -> Slot:
        return Slot(name, params[name])

    out = {"model.embed_tokens.weight": whole("transformer.wte.weight"),
           "model.norm.weight": whole("transformer.ln_f.weight")}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = whole("lm_head.weight")
    for i in range(cfg.n_core):
        src, dst = f"model.layers.{i}.", f"transformer.core_block.{i}."
        qkv, fc = dst + "attn.Wqkv.weight", dst + "mlp.fc.weight"
        out[src + "self_attn.q_proj.weight"] = Slot(qkv, (q, d), 0)
        out[src + "self_attn.k_proj.weight"] = Slot(qkv, (kv, d), q)
        out[src + "self_attn.v_proj.weight"] = Slot(qkv, (kv, d), q + kv)
        out[src + "self_attn.o_proj.weight"] = whole(dst + "attn.proj.weight")
        out[src + "mlp.gate_proj.weight"] = Slot(fc, (inter, d), 0)
        out[src + "mlp.up_proj.weight"] = Slot(fc, (inter, d), inter)
        out[src + "mlp.down_proj.weight"] = whole(dst + "mlp.proj.weight")
        for k, norm in enumerate(norms, 1):
            out[f"{src}{norm}.weight"] = whole(f"{dst}norm_{k}.weight")
    return out


@dataclass(frozen=True)
class LayerGroup:
    """A stack of layers as the checkpoint names it: tensors ``{prefix}.{i}.*``, counted by config field
    ``field`` and by the LoopedConfig attribute ``attr``."""

    prefix: str
    field: str
    attr: str


class Family:
    """One looped layout.  Class attributes describe it; the methods read and write its files."""

    name: str = ""
    model_type: str = ""                # config.json's model_type for this family's checkpoints
    block: "type[nn.Module]"            # one layer: block(cfg) -> module(x, span, kv) -> x, with a ``style`` name
    rope_style: str = "half"            # "interleaved" (pairs 2j, 2j+1) or "half" (HF rotate_half)
    square_heads: bool = True           # n_heads * head_dim == n_embd (False: head_dim is free, q / o not square)

    # --- the three primitives' specifics ---------------------------------------------------------------------
    injection: bool = True              # a core step reads adapter(cat[h, e]); False: h alone
    norm_after_loop: bool = False       # ln_f on the last state before the coda
    norm_every_step: bool = False       # ln_f closes every core step (the next step reads the normed state), so
                                        # the head reads the state as is
    exit_gate: bool = False             # a per-step early-exit gate, Linear(d -> 1) on the state

    # --- checkpoint names the loader checks sizes against ---------------------------------------------------
    embedding: str = "transformer.wte.weight"
    head: str = "lm_head.weight"
    layer_groups: tuple[LayerGroup, ...] = ()
    mlp_probe: tuple[str, int] = (".mlp.fc.weight", 2)   # (a name suffix, its rows per intermediate unit)

    # --- decoding ----------------------------------------------------------------------------------------------
    knob_defaults: dict[str, dict[str, Any]] = {}     # method -> {knob: default}: required for knobs declared per
                                                      # family, and replacing the method's default for any other
    stop_tokens: tuple[str, ...] = ()   # tokens that end a reply besides the tokenizer files' EOS (a chat turn's end)

    def detect(self, cfg: dict[str, Any], names: set[str] | None) -> str:
        """The family (of those sharing this ``model_type``) a config.json and its tensor names describe."""
        return self.name

    def read_config(self, cfg: dict[str, Any]) -> "LoopedConfig":
        """LoopedConfig from a config.json dict, every field read type- and range-checked."""
        raise NotImplementedError

    def write_config(self, cfg: "LoopedConfig") -> dict[str, Any]:
        """The config.json this family's checkpoints carry (the inverse of ``read_config``)."""
        raise NotImplementedError

    def tensor_map(self, cfg: "LoopedConfig", params: dict[str, tuple[int, ...]]) -> dict[str, Slot]:
        """Checkpoint tensor name -> where it goes, for a model whose state dict has ``params`` (name -> shape).
        A tied head is left out (it is the embedding).  Default: the state-dict names themselves."""
        tied = {"lm_head.weight"} if cfg.tie_embeddings else set()
        return {name: Slot(name, shape) for name, shape in params.items() if name not in tied}

    def core_kv(self, cache: Any, layer: int, read: tuple[int, int], own: tuple[int, int], span: Any) -> Any:
        """What core layer ``layer`` of a step reads its K/V through (its block's ``kv`` argument): the cache's view
        for the step's depths, None without a cache.  A family whose layers read other depths too (IQuest-Loop's
        depth-1 K/V) returns its own object."""
        return cache.core_kv(layer, read, own) if cache is not None else None

    def kv_window(self, cfg: "LoopedConfig") -> int | None:
        """Positions within which depths r >= 2 read their own K/V (None: every depth reads every row).  Given, the
        engine's pool keeps only those rows of depths >= 2 (``engine/core/blocks.py``)."""
        return None

    def start_state(self, h0: Tensor, inj: Tensor) -> Tensor:
        """The state the first core step reads: the position's initial state ``h0`` (Huginn, Raven)."""
        return h0

    def recur_rows(self, model: "nn.Module", h: Tensor, span: Any, cache: Any, steps: range,
                   inj: Tensor | None = None, reads: list[tuple[int, int]] | None = None) -> Tensor | None:
        """``model``'s core steps ``steps`` over a batched call's rows in one kernel call (aligned reads, with the
        call's cache; ``inj``: the prelude's output, for a family that injects it; ``reads``: a draft's prefix depths
        per step instead, each step storing at its own depth), with the bits of ``core_step``'s; None where the
        family has none or this call does not take it (``LoopedLM.recur`` then steps through ``core_step``)."""
        return None

    def __repr__(self) -> str:
        return f"<family {self.name}>"


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    if family.name in FAMILIES:
        raise ValueError(f"model family {family.name!r} is already registered")
    FAMILIES[family.name] = family
    return family


def get_family(name: str) -> Family:
    family = FAMILIES.get(name)
    if family is None:
        raise ConfigError(f"unknown family {name!r}; expected one of {tuple(FAMILIES)}")
    return family


def stop_tokens(model_type: Any) -> tuple[str, ...]:
    """The extra stop tokens of the families that read ``model_type`` checkpoints (``Family.stop_tokens``)."""
    found = (t for f in FAMILIES.values() if f.model_type == model_type for t in f.stop_tokens)
    return tuple(dict.fromkeys(found))


def detect_family(cfg: dict[str, Any], weight_names: Iterable[str] | None = None) -> str:
    """The family of a config.json dict and (when given) the checkpoint's tensor names.  ``model_type`` picks the
    families that read such files; their format decides between them (Huginn and Raven share one)."""
    model_type = cfg.get("model_type")
    candidates = [f for f in FAMILIES.values() if f.model_type == model_type]
    if "dasspec_family" in cfg:         # written only by dasspec's own tools: a choice among those candidates
        name = cfg["dasspec_family"]
        if name not in [f.name for f in candidates]:
            raise ConfigError(f"unknown dasspec_family {name!r} for model_type {model_type!r}; expected one of "
                              f"{tuple(f.name for f in candidates)}")
        return name
    if not candidates:
        known = ", ".join(sorted({repr(f.model_type) for f in FAMILIES.values()}))
        raise ConfigError(f"unsupported model_type {model_type!r}: dasspec loads looped checkpoints of model_type "
                          f"{known} (Huginn-0125, Raven-Llama/OLMo/TinyLlama, Ouro, IQuest-Coder-V1-Loop, "
                          f"Nanbeige4.2)")
    return candidates[0].detect(cfg, set(weight_names) if weight_names is not None else None)
