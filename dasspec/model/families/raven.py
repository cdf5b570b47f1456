"""The Raven retrofits (McLeish et al. 2025): pretrained models cut into prelude / core / coda, in Huginn's file
format (``huginn.HuginnRavenFamily``) with Huginn's stale ids and ``rope_base`` left in config.json.

* ``raven-llama``  Raven-Llama-3.2 / Raven-TinyLlama: pre-norm blocks, GQA, HF rotate_half RoPE (+ llama3
  scaling), no ``ln_f`` after the loop, untied head.
* ``raven-olmo``   Raven-OLMo-2: post-norm blocks, RMSNorm over the whole q and k projections.
"""

from __future__ import annotations

from torch import Tensor

from ..attention import LayerKV, Span
from ..layers import NormedBlock
from . import register
from .huginn import HuginnRavenFamily

RAVEN_KNOBS = {"self-spec": {"draft_depth": 4, "block": 16}, "mature-spec": {"block": 16},
               "das-wave": {"k": 1}}                                         # the paper's Table 5


class PreNormBlock(NormedBlock):
    """Llama's layer: x = x + attn(n1 x); x = x + mlp(n2 x)."""

    style = "pre"
    norms = 2
    one_call = True

    def forward(self, x: Tensor, span: Span, kv: LayerKV | None) -> Tensor:
        y = self.rows(x, span, kv) if kv is not None else None
        if y is not None:
            return y
        x = x + self.attn(self.norm_1(x), span, kv)
        return x + self.mlp(self.norm_2(x))


class PostNormBlock(PreNormBlock):
    """OLMo-2's layer: x = x + n1(attn(x)); x = x + n2(mlp(x))."""

    style = "post"
    one_call = False

    def forward(self, x: Tensor, span: Span, kv: LayerKV | None) -> Tensor:
        x = x + self.norm_1(self.attn(x, span, kv))
        return x + self.norm_2(self.mlp(x))


class RavenLlama(HuginnRavenFamily):
    name = "raven-llama"
    block = PreNormBlock
    knob_defaults = RAVEN_KNOBS


class RavenOlmo(HuginnRavenFamily):
    name = "raven-olmo"
    block = PostNormBlock
    qk_norm = True
    knob_defaults = RAVEN_KNOBS


register(RavenLlama())
register(RavenOlmo())
