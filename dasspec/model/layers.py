"""Building blocks shared by the three looped families: RMSNorm, RoPE, attention with depth-indexed prefix reads,
gated MLP and the three block styles (sandwich / pre-norm / post-norm).

Attention is where the paper's read policy lives (eq. 2-3): the queries of the current computation attend,
under one softmax, to the verified prefix's keys at depth kappa and values at depth nu, and to the draft-side
positions' own keys/values.  The layer never decides depths; it receives a ``LayerKV`` (views of the depth cache
picked by the caller) and a ``Span`` (which rows are queries, which are visible).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import LoopedConfig


class RMSNorm(nn.Module):
    """y = (x / rms(x)) computed in float32, cast back, then times weight (no 1+w offset)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight


# ---------------------------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------------------------

def rope_inv_freq(cfg: LoopedConfig) -> Tensor:
    """Inverse frequencies in float32, with the llama3 remapping when ``rope_scaling`` asks for it."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_ctx / high) & ~(wavelen > old_ctx / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_tables(cfg: LoopedConfig, n_pos: int) -> tuple[Tensor, Tensor]:
    """cos, sin tables [n_pos, head_dim/2] in float32 (Huginn also builds its freqs_cis in float32)."""
    t = torch.arange(n_pos, dtype=torch.float32)
    freqs = torch.outer(t, rope_inv_freq(cfg))
    return freqs.cos(), freqs.sin()


def rope_operands(cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor | tuple[Tensor, Tensor]:
    """Per-call rotation operands from cos/sin [W, hd/2], built once per span and shared by every layer:
    interleaved -> complex e^{i theta} [W, 1, hd/2]; half -> (cat(cos, cos), cat(sin, sin)) [W, 1, hd]."""
    if interleaved:
        return torch.complex(cos, sin).unsqueeze(1)
    return torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((sin, sin), -1).unsqueeze(1)


def apply_rope(x: Tensor, rot: Tensor | tuple[Tensor, Tensor], interleaved: bool) -> Tensor:
    """Rotate x [B, W, heads, hd] by per-position angles; math in float32.

    interleaved: pairs (2j, 2j+1) rotated as complex numbers (Huginn's freqs_cis form);
    otherwise halves: x * cos + rotate_half(x) * sin (HF Llama / OLMo)."""
    xf = x.float()
    if interleaved:
        out = torch.view_as_real(torch.view_as_complex(xf.unflatten(-1, (-1, 2))) * rot).flatten(-2)
    else:
        cos, sin = rot
        a, b = xf.chunk(2, dim=-1)
        out = xf * cos + torch.cat((-b, a), dim=-1) * sin
    return out if out.dtype == x.dtype else out.to(x.dtype)


# ---------------------------------------------------------------------------------------------------------------
# What one model call computes: query rows, their positions, visibility
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class Span:
    """The W query positions of one model call, shared by every layer and every recurrence step of that call.

    Cache rows [0, n) hold the verified prefix; the call's draft-side rows are [n, start + W), of which the last
    W (rows [start, start + W)) are the queries computed now and written now.  ``rot`` holds the RoPE
    rotation of the queries' *positions* (see ``rope_operands``; they equal the rows except for tree drafts and
    probes).  ``mask`` [W, start + W] (bool, True = visible; it may hide prefix rows too) is None when a single
    query sees every row up to its own, or when ``causal`` is set (a block starting at row 0, where top-left and
    bottom-right causal alignment agree)."""

    n: int
    start: int
    W: int
    rot: Tensor | tuple[Tensor, Tensor]
    mask: Tensor | None = None
    causal: bool = False
    bias: Tensor | None = None      # ``mask`` as additive 0 / -inf (CPU SDPA would convert a bool mask per call)
    # Static-shape form (CUDA graphs / torch.compile): the rows to write as a device tensor, and visibility over
    # *every* cache row ([W, capacity]), split into verified-prefix rows and draft-side rows.  Layers then
    # never slice by a Python int, so one compiled graph serves every position.
    rows: Tensor | None = None
    visible: Tensor | None = None
    vis_prefix: Tensor | None = None
    vis_own: Tensor | None = None

    @property
    def end(self) -> int:
        return self.start + self.W


@dataclass
class LayerKV:
    """Views of one layer's cache rows, each [H_kv, capacity, hd]: the verified prefix is read from
    ``k_prefix``/``v_prefix`` (depth kappa / nu), the draft-side rows live in ``k_own``/``v_own``."""

    k_prefix: Tensor
    v_prefix: Tensor
    k_own: Tensor
    v_own: Tensor

    @property
    def contiguous(self) -> bool:
        return self.k_prefix is self.k_own and self.v_prefix is self.v_own


def _two_source_attention(q: Tensor, kp: Tensor, vp: Tensor, mp: Tensor | None, ko: Tensor, vo: Tensor,
                          mo: Tensor | None, scale: float) -> Tensor:
    """Eq. (2)-(3) with the two key/value sources kept apart: [Pi_C, Pi_U] = softmax(q [K_C; K_U]^T / sqrt(d_h)),
    O = Pi_C V_C + Pi_U V_U.  q [1, H, W, hd]; K/V [H_kv, rows, hd]; masks [W, rows] (True = visible) or None."""
    _, H, W, hd = q.shape
    hkv = ko.shape[0]
    g = H // hkv
    qg = q.reshape(hkv, g * W, hd)                                   # GQA: query groups share a kv head
    sp = torch.matmul(qg, kp.transpose(-1, -2))
    so = torch.matmul(qg, ko.transpose(-1, -2))
    if mp is not None:
        sp = sp.masked_fill(~mp.repeat(g, 1), float("-inf"))
    if mo is not None:
        so = so.masked_fill(~mo.repeat(g, 1), float("-inf"))
    p = torch.softmax(torch.cat((sp, so), dim=-1).float() * scale, dim=-1).to(q.dtype)
    m = kp.shape[1]
    out = torch.matmul(p[..., :m], vp) + torch.matmul(p[..., m:], vo)
    return out.reshape(1, H, W, hd)


def _split_softmax_attention(q: Tensor, kv: LayerKV, span: Span, scale: float) -> Tensor:
    """Prefix rows [0, n) from the read depths, draft-side rows [n, end) from the own depths (see above)."""
    n, end, W = span.n, span.end, span.W
    if span.rows is not None:                                        # static shapes: every row, masked
        return _two_source_attention(q, kv.k_prefix, kv.v_prefix, span.vis_prefix, kv.k_own, kv.v_own,
                                     span.vis_own, scale)
    if span.mask is not None:
        mp, mo = span.mask[:, :n], span.mask[:, n:]
    else:
        mp, mo = None, (torch.ones(W, W, dtype=torch.bool, device=q.device).tril() if span.causal else None)
    return _two_source_attention(q, kv.k_prefix[:, :n], kv.v_prefix[:, :n], mp, kv.k_own[:, n:end],
                                 kv.v_own[:, n:end], mo, scale)


# CPU, masked calls of at least this many queries (verification blocks, draft windows, trees, the uncached rest of a
# prompt): two batched GEMMs and a softmax beat torch's CPU flash kernel with an additive mask, 1.4-2x in isolation
# at W = 16-100 over 150-2,000 rows, and 1-6% on whole DAS-Wave requests (benchmarks/cpu_attention.py,
# docs/performance.md).  Below it, and above a score matrix of 2^19 elements (2 MiB in float32), SDPA stays: the
# scores and their softmax are two fresh buffers per call, and from about 128 queries over 1,000 rows glibc's malloc
# often hands such buffers back to the OS and page-faults them in again on the next call, which made the GEMM path
# 2-3x *slower* than SDPA in fresh processes (1.6x faster when it did not; SDPA never loses more than that).
GEMM_ATTENTION_MIN_W = 16
GEMM_ATTENTION_MAX_SCORES = 1 << 19


def gemm_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> Tensor:
    """softmax(q k^T * scale + bias) v with the scores materialised.  q [1, H, W, hd]; k, v [H_kv, rows, hd];
    bias [W, rows], additive (0 / -inf).  Softmax in float32."""
    _, H, W, hd = q.shape
    hkv, rows = k.shape[0], k.shape[1]
    g = H // hkv
    if g == 1:
        s = torch.baddbmm(bias, q[0], k.transpose(1, 2), alpha=scale)
    else:                                             # GQA: a kv head's g query heads form one [g * W] batch
        s = torch.matmul(q[0].reshape(hkv, g * W, hd), k.transpose(1, 2)).view(hkv, g, W, rows)
        s = s.mul_(scale).add_(bias).view(hkv, g * W, rows)
    p = torch.softmax(s.float(), dim=-1).to(v.dtype)
    return torch.bmm(p, v).view(1, H, W, hd)


class Attention(nn.Module):
    def __init__(self, cfg: LoopedConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.interleaved = cfg.rope_style == "interleaved"
        qkv_out = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
        self.Wqkv = nn.Linear(cfg.n_embd, qkv_out, bias=False)
        self.proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.n_embd, bias=False)
        self.qk_bias = nn.Parameter(torch.zeros(2, 1, cfg.n_heads, cfg.head_dim)) if cfg.qk_bias else None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.n_heads * cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.n_kv_heads * cfg.head_dim, cfg.norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.capture: list | None = None       # probes set a list here to receive (q, k, v) of every call

    def forward(self, x: Tensor, span: Span, kv: LayerKV | None) -> Tensor:
        B, W, _ = x.shape
        H, Hkv, hd = self.n_heads, self.n_kv, self.head_dim
        qkv = self.Wqkv(x)
        if self.q_norm is not None:                   # OLMo: norm over the whole q / k projections, pre-RoPE
            q, k, v = qkv.split((H * hd, Hkv * hd, Hkv * hd), dim=-1)
            qkv = torch.cat((self.q_norm(q), self.k_norm(k), v), dim=-1)
        qkv = qkv.view(B, W, H + 2 * Hkv, hd)
        qk = qkv[:, :, : H + Hkv]
        if self.qk_bias is not None:
            qk = qk + self.qk_bias.view(2 * H, hd)
        qk = apply_rope(qk, span.rot, self.interleaved)
        q = qk[:, :, :H].transpose(1, 2)
        k = qk[:, :, H:].transpose(1, 2)
        v = qkv[:, :, H + Hkv:].transpose(1, 2)
        if self.capture is not None:
            self.capture.append((q, k, v))
        if kv is None:                                # full forward without cache
            y = F.scaled_dot_product_attention(q, k, v, is_causal=W > 1, enable_gqa=Hkv != H)
        elif span.rows is not None and kv.contiguous:            # static shapes: attend over every row
            kv.k_own.index_copy_(1, span.rows, k[0])
            kv.v_own.index_copy_(1, span.rows, v[0])
            y = F.scaled_dot_product_attention(q, kv.k_own.unsqueeze(0), kv.v_own.unsqueeze(0),
                                               attn_mask=span.visible, enable_gqa=Hkv != H)
        elif span.rows is not None:
            kv.k_own.index_copy_(1, span.rows, k[0])
            kv.v_own.index_copy_(1, span.rows, v[0])
            y = _split_softmax_attention(q, kv, span, 1.0 / math.sqrt(hd))
        else:
            kv.k_own[:, span.start: span.end] = k[0]
            kv.v_own[:, span.start: span.end] = v[0]
            if kv.contiguous and span.bias is not None and W >= GEMM_ATTENTION_MIN_W \
                    and H * W * span.end <= GEMM_ATTENTION_MAX_SCORES:
                y = gemm_attention(q, kv.k_own[:, : span.end], kv.v_own[:, : span.end], span.bias,
                                   1.0 / math.sqrt(hd))
            elif kv.contiguous:
                K = kv.k_own[:, : span.end].unsqueeze(0)
                V = kv.v_own[:, : span.end].unsqueeze(0)
                y = F.scaled_dot_product_attention(q, K, V, attn_mask=span.mask if span.bias is None else span.bias,
                                                   is_causal=span.causal,
                                                   enable_gqa=Hkv != H)
            else:
                y = _split_softmax_attention(q, kv, span, 1.0 / math.sqrt(hd))
        return self.proj(y.transpose(1, 2).reshape(B, W, H * hd))


class GatedMLP(nn.Module):
    """fc -> (gate, up) halves; proj(silu(gate) * up)."""

    def __init__(self, cfg: LoopedConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 2 * cfg.intermediate_size, bias=False)
        self.proj = nn.Linear(cfg.intermediate_size, cfg.n_embd, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.fc(x).chunk(2, dim=-1)
        return self.proj(F.silu(gate) * up)


class Block(nn.Module):
    """One transformer layer in the family's norm placement.

    sandwich (Huginn): x = n2(x + attn(n1 x)); x = n4(x + mlp(n3 x))
    pre (Raven-Llama): x = x + attn(n1 x);     x = x + mlp(n2 x)
    post (Raven-OLMo): x = x + n1(attn(x));    x = x + n2(mlp(x))"""

    def __init__(self, cfg: LoopedConfig):
        super().__init__()
        self.style = cfg.block_style
        n_norms = 4 if self.style == "sandwich" else 2
        for i in range(1, n_norms + 1):
            setattr(self, f"norm_{i}", RMSNorm(cfg.n_embd, cfg.norm_eps))
        self.attn = Attention(cfg)
        self.mlp = GatedMLP(cfg)

    def forward(self, x: Tensor, span: Span, kv: LayerKV | None) -> Tensor:
        if self.style == "sandwich":
            x = self.norm_2(x + self.attn(self.norm_1(x), span, kv))
            return self.norm_4(x + self.mlp(self.norm_3(x)))
        if self.style == "pre":
            x = x + self.attn(self.norm_1(x), span, kv)
            return x + self.mlp(self.norm_2(x))
        x = x + self.norm_1(self.attn(x, span, kv))
        return x + self.norm_2(self.mlp(x))
