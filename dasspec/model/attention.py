"""Attention over the depth cache: the paper's eq. (2)-(3), and the one place that picks a kernel for it.

A call computes W query positions (a ``Span``).  Their keys and values are stored into the cache at the call's own
depth (``LayerKV.store``); then the queries attend, under one softmax, to two sources:

    C = the verified prefix, rows [0, n), read with keys from depth kappa and values from depth nu;
    U = the call's own rows [n, start + W) (earlier draft positions and the queries themselves), at their depth.

    [Pi_C, Pi_U] = softmax(q [K_C ; K_U]^T / sqrt(d_h) + mask),    O = Pi_C V_C + Pi_U V_U          (eq. 2-3)

When kappa and nu equal the call's own depth (AR, verification, prefill, a DAS-Wave round that stores its rows at
the depth it reads), C and U are consecutive rows of one tensor and the call is ordinary attention over rows
[0, start + W): ``dense_attention`` runs it with whatever kernel suits the hardware.  Otherwise the two sources are
kept apart (``two_source_attention``), which needs no copy of the prefix.

Static shapes (``Span.rows`` set; CUDA graphs / torch.compile): every cache row is read under a visibility mask and
rows are written through an index tensor, so nothing depends on a Python position.

Several sequences in one call (the batched engine): a ``RaggedSpan`` lays their query rows end to end (segment i
is rows [offsets[i], offsets[i+1]) of the call, each with its own ``Span`` over its own cache) and a ``BatchKV``
holds each sequence's ``LayerKV``.  The linear layers see one flat [1, T, d] tensor, so a weight is read once for
every sequence; attention stays per sequence (``ragged_attention`` picks how to run it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class Span:
    """The W query positions of one model call, shared by every layer and every recurrence step of that call.

    Cache rows [0, n) hold the verified prefix; the call's own rows are [n, start + W), of which the last W (rows
    [start, start + W)) are the queries, computed and stored now.  ``rot`` is the RoPE rotation of the queries'
    positions (the rows, except for tree drafts and probes).  ``mask`` [W, keys] (True = visible; it may hide
    prefix rows too) is None when every query sees every row up to its own, or when ``causal`` is set (a block
    starting at row 0).  ``bias`` is ``mask`` as an additive 0 / -inf float tensor, for CPU kernels.  ``rows``: the
    static-shape form (the stored rows as a tensor; ``mask`` then covers every cache row)."""

    n: int
    start: int
    W: int
    rot: Tensor | tuple[Tensor, Tensor]
    mask: Tensor | None = None
    causal: bool = False
    bias: Tensor | None = None
    rows: Tensor | None = None
    _split: tuple | None = field(default=None, repr=False)

    @property
    def end(self) -> int:
        return self.start + self.W

    def source_masks(self) -> tuple[Tensor | None, Tensor | None]:
        """Visibility of C and U for ``two_source_attention`` (built once per call, shared by every layer)."""
        if self._split is None:
            if self.rows is not None:                    # static: both sources span every row; split at n
                prefix = torch.arange(self.mask.shape[1], device=self.mask.device) < self.n
                self._split = (self.mask & prefix, self.mask & ~prefix)
            elif self.mask is not None:
                self._split = (self.mask[:, : self.n], self.mask[:, self.n:])
            elif self.causal:
                self._split = (None, torch.ones(self.W, self.W, dtype=torch.bool, device=_device(self.rot)).tril())
            else:
                self._split = (None, None)
        return self._split


def _device(rot) -> torch.device:
    return (rot[0] if isinstance(rot, tuple) else rot).device


@dataclass
class LayerKV:
    """One layer's cache tensors [H_kv, capacity, hd]: the prefix is read from ``k_prefix`` / ``v_prefix`` (depth
    kappa / nu) and the call's own rows live in ``k_own`` / ``v_own``."""

    k_prefix: Tensor
    v_prefix: Tensor
    k_own: Tensor
    v_own: Tensor

    @property
    def one_source(self) -> bool:
        """The prefix is read at the depth the call stores at: C and U are one tensor."""
        return self.k_prefix is self.k_own and self.v_prefix is self.v_own

    def store(self, span: Span, k: Tensor, v: Tensor) -> None:
        """Write the queries' keys and values [H_kv, W, hd] into their rows."""
        if span.rows is not None:
            self.k_own.index_copy_(1, span.rows, k)
            self.v_own.index_copy_(1, span.rows, v)
        else:
            self.k_own[:, span.start: span.end] = k
            self.v_own[:, span.start: span.end] = v


def attend(q: Tensor, kv: "LayerKV | BatchKV", span: "Span | RaggedSpan") -> Tensor:
    """Eq. (2)-(3) for queries q [1, H, W, hd] over the verified prefix and the call's own rows -> [1, H, W, hd]."""
    if isinstance(span, RaggedSpan):
        return ragged_attention(q, kv, span)
    scale = 1.0 / math.sqrt(q.shape[-1])
    if kv.one_source:
        keys = slice(None) if span.rows is not None else slice(0, span.end)
        return dense_attention(q, kv.k_own[:, keys], kv.v_own[:, keys], span, scale)
    mc, mu = span.source_masks()
    if span.rows is not None:
        return two_source_attention(q, kv.k_prefix, kv.v_prefix, mc, kv.k_own, kv.v_own, mu, scale)
    n, end = span.n, span.end
    return two_source_attention(q, kv.k_prefix[:, :n], kv.v_prefix[:, :n], mc, kv.k_own[:, n:end],
                                kv.v_own[:, n:end], mu, scale)


def two_source_attention(q: Tensor, kc: Tensor, vc: Tensor, mc: Tensor | None, ku: Tensor, vu: Tensor,
                         mu: Tensor | None, scale: float) -> Tensor:
    """Eq. (2)-(3) written out: q [1, H, W, hd]; K/V [H_kv, rows, hd]; masks [W, rows] (True = visible) or None."""
    _, H, W, hd = q.shape
    g = H // ku.shape[0]
    qg = q.reshape(ku.shape[0], g * W, hd)                           # GQA: query groups share a kv head
    sc = torch.matmul(qg, kc.transpose(-1, -2))
    su = torch.matmul(qg, ku.transpose(-1, -2))
    if mc is not None:
        sc = sc.masked_fill(~mc.repeat(g, 1), float("-inf"))
    if mu is not None:
        su = su.masked_fill(~mu.repeat(g, 1), float("-inf"))
    p = torch.softmax(torch.cat((sc, su), dim=-1).float() * scale, dim=-1).to(q.dtype)
    m = kc.shape[1]
    return (torch.matmul(p[..., :m], vc) + torch.matmul(p[..., m:], vu)).reshape(1, H, W, hd)


def dense_attention(q: Tensor, k: Tensor, v: Tensor, span: Span, scale: float) -> Tensor:
    """softmax(q k^T * scale + mask) v over rows k, v [H_kv, rows, hd]: the hardware's choice of kernel."""
    H, hkv = q.shape[1], k.shape[0]
    if span.bias is not None and use_cpu_gemm(H, span.W, k.shape[1]):
        return cpu_gemm_attention(q, k, v, span.bias, scale)
    mask = span.mask if span.bias is None else span.bias
    return F.scaled_dot_product_attention(q, k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, is_causal=span.causal,
                                          enable_gqa=hkv != H)                 # its default scale is 1/sqrt(hd)


# The CPU shortcut for wide masked calls (verification blocks, draft windows, trees): two batched GEMMs and a
# softmax beat torch's CPU flash kernel with an additive mask.  Capped in size: above it the score buffers trip the
# allocator's trimming (docs/performance.md, "Wide masked attention as two GEMMs").
GEMM_ATTENTION_MIN_W = 16
GEMM_ATTENTION_MAX_SCORES = 1 << 19


def use_cpu_gemm(heads: int, W: int, rows: int) -> bool:
    return W >= GEMM_ATTENTION_MIN_W and heads * W * rows <= GEMM_ATTENTION_MAX_SCORES


def cpu_gemm_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> Tensor:
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


# ---------------------------------------------------------------------------------------------------------------
# Several sequences in one call
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class UnionRows:
    """A ragged call run as one attention over the storage rows [lo, hi) that hold every segment's keys (the
    sequences' caches are ranges of one pool): ``rows`` [T], the storage row each query's K/V is stored at;
    ``span``, the whole call's visibility over [lo, hi) (each query sees only its own sequence's rows) with its
    CPU bias; ``prefix`` [hi - lo], which of those rows are their sequence's verified prefix."""

    rows: Tensor
    lo: int
    hi: int
    span: Span
    prefix: Tensor
    _split: tuple | None = field(default=None, repr=False)

    def source_masks(self) -> tuple[Tensor, Tensor]:
        if self._split is None:
            m = self.span.mask
            self._split = (m & self.prefix, m & ~self.prefix)
        return self._split


# When a ragged call's attention runs as one call over the union of its sequences' rows rather than one call per
# sequence (``union_pays``): the union computes T x (hi - lo) scores, most of them masked, for one kernel call
# instead of B.  On a GPU a call's launch outweighs masked scores at any size a batch reaches; on a CPU a call costs
# about as much as UNION_CALL_FLOPS multiply-adds of scores (docs/performance.md, "Batched attention").  A CPU
# union in a half dtype would compute its scores as a half-precision GEMM (rounded before the softmax, and no
# faster without matrix units), where the per-sequence kernel accumulates in float32: per sequence there.
UNION_CALL_FLOPS = 140_000


def union_pays(device: torch.device, width: int, union_scores: int, own_scores: int, calls_saved: int,
               dtype: torch.dtype = torch.float32) -> bool:
    """Whether one attention over the union of the sequences' rows costs less than one call per sequence;
    ``width``: heads x head dim of the queries (the multiply-adds per score)."""
    if device.type != "cpu":
        return True
    if dtype != torch.float32:
        return False
    return (union_scores - own_scores) * width <= calls_saved * UNION_CALL_FLOPS


@dataclass
class RaggedSpan:
    """The query rows of several sequences laid end to end: segment i is rows [offsets[i], offsets[i+1]) of the
    call and is described by ``parts[i]`` (a ``Span`` over sequence i's own cache).  ``rot``: the rows' RoPE
    operands, concatenated in the same order.  ``union``: set when the call runs as one attention over the pool
    rows (``UnionRows``)."""

    parts: list[Span]
    offsets: list[int]
    rot: Tensor | tuple[Tensor, Tensor]
    union: UnionRows | None = None

    @classmethod
    def of(cls, parts: list[Span], bases: list[int] | None = None, width: int | None = None,
           force_union: bool | None = None, dtype: torch.dtype = torch.float32) -> "RaggedSpan":
        """``bases``: the storage row where each sequence's cache starts, when all are ranges of one storage (then
        the call may run as one attention over them: ``force_union``, or ``union_pays`` for queries of ``width``
        = heads x head dim; ``dtype``: the activations', which a CPU kernel's additive mask must match)."""
        offsets = [0]
        for p in parts:
            offsets.append(offsets[-1] + p.W)
        rots = [p.rot for p in parts]
        if isinstance(rots[0], tuple):
            rot = (torch.cat([r[0] for r in rots]), torch.cat([r[1] for r in rots]))
        else:
            rot = torch.cat(rots)
        span = cls(parts, offsets, rot)
        if bases is not None and all(p.rows is None for p in parts):
            lo = min(bases)
            hi = max(b + p.end for b, p in zip(bases, parts))
            T = offsets[-1]
            own_scores = sum(p.W * p.end for p in parts)
            if force_union or (force_union is None and union_pays(
                    _device(rot), width or 1, T * (hi - lo), own_scores, len(parts) - 1, dtype)):
                span.union = _union(parts, offsets, bases, lo, hi, dtype)
        return span

    @property
    def W(self) -> int:
        return self.offsets[-1]

    def segments(self):
        """(i, first row, end row, span) per sequence."""
        o = self.offsets
        return ((i, o[i], o[i + 1], p) for i, p in enumerate(self.parts))


def _union(parts: list[Span], offsets: list[int], bases: list[int], lo: int, hi: int,
           dtype: torch.dtype) -> UnionRows:
    """The visibility of every query over storage rows [lo, hi): its own sequence's rows as its span shows them."""
    dev = _device(parts[0].rot)
    T = offsets[-1]
    mask = torch.zeros(T, hi - lo, dtype=torch.bool, device=dev)
    prefix = torch.zeros(hi - lo, dtype=torch.bool, device=dev)
    rows = []
    for p, a, b in zip(parts, offsets, bases):
        c = b - lo
        if p.mask is not None:
            mask[a: a + p.W, c: c + p.end] = p.mask
        else:
            mask[a: a + p.W, c: c + p.end] = torch.ones(p.W, p.end, dtype=torch.bool, device=dev).tril(p.start)
        prefix[c: c + p.n] = True
        rows.append(torch.arange(b + p.start, b + p.end, device=dev))
    bias = None
    if dev.type == "cpu":
        bias = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
    return UnionRows(torch.cat(rows), lo, hi, Span(n=0, start=0, W=T, rot=parts[0].rot, mask=mask, bias=bias), prefix)


@dataclass
class BatchKV:
    """One layer's ``LayerKV`` of every sequence of a ``RaggedSpan`` (same order); ``whole``: the same layer and
    depths over the whole storage their caches are ranges of (for union calls)."""

    parts: list[LayerKV]
    whole: LayerKV | None = None

    def store(self, span: RaggedSpan, k: Tensor, v: Tensor) -> None:
        """k, v [H_kv, T, hd]: each segment's rows into its own cache."""
        if span.union is not None:
            self.whole.k_own.index_copy_(1, span.union.rows, k)
            self.whole.v_own.index_copy_(1, span.union.rows, v)
            return
        for i, a, b, part in span.segments():
            self.parts[i].store(part, k[:, a:b], v[:, a:b])


def ragged_attention(q: Tensor, kv: BatchKV, span: RaggedSpan) -> Tensor:
    """Each segment's queries attend within their own sequence's cache (eq. 2-3 per sequence): one call per
    sequence, or one call over the union of their rows under a mask that keeps each to its own."""
    u = span.union
    if u is None:
        return torch.cat([attend(q[:, :, a:b], kv.parts[i], part) for i, a, b, part in span.segments()], dim=2)
    w, scale = kv.whole, 1.0 / math.sqrt(q.shape[-1])
    if w.one_source:
        return dense_attention(q, w.k_own[:, u.lo: u.hi], w.v_own[:, u.lo: u.hi], u.span, scale)
    mc, mu = u.source_masks()
    return two_source_attention(q, w.k_prefix[:, u.lo: u.hi], w.v_prefix[:, u.lo: u.hi], mc,
                                w.k_own[:, u.lo: u.hi], w.v_own[:, u.lo: u.hi], mu, scale)
