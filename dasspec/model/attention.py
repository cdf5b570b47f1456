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
every sequence; attention runs per segment, each over its own sequence's rows, so a row's value never depends on
what else is in the call.

A sequence's rows may live in blocks of a paged pool (``model/cache.py``, ``PagedCache``): its ``LayerKV`` then
reads them through the sequence's block table (``PagedKV``: a slice when its blocks lie in order, else a gather)
and writes them through it.  Either way attention sees the same values in the same order, so the result does not
depend on where the blocks lie.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from . import decode_kernel


@dataclass
class Span:
    """The W query positions of one model call, shared by every layer and every recurrence step of that call.

    Cache rows [0, n) hold the verified prefix; the call's own rows are [n, start + W), of which the last W (rows
    [start, start + W)) are the queries, computed and stored now.  ``rot`` is the RoPE rotation of the queries'
    positions (the rows, except for tree drafts and probes).  ``mask`` [W, keys] (True = visible; it may hide
    prefix rows too) is None when every query sees every row up to its own, or when ``causal`` is set (a block
    starting at row 0).  ``bias`` is ``mask`` as an additive 0 / -inf float tensor, for CPU kernels.  ``rows``: the
    static-shape form (the stored rows as a tensor; ``mask`` then covers every cache row).  ``causal_rows``: query
    j sees exactly rows [0, start + j] (whatever ``mask`` says, it says that)."""

    n: int
    start: int
    W: int
    rot: Tensor | tuple[Tensor, Tensor]
    mask: Tensor | None = None
    causal: bool = False
    bias: Tensor | None = None
    rows: Tensor | None = None
    causal_rows: bool = False
    lo: int = 0                # rows before it are visible to no query (a sliding window): not read at all
    _split: tuple | None = field(default=None, repr=False)
    _rows_cache: dict = field(default_factory=dict, repr=False)

    @property
    def end(self) -> int:
        return self.start + self.W

    def from_lo(self) -> "Span":
        """This span over rows [lo, end) only (``mask`` / ``bias`` cut to them; built once)."""
        got = self._rows_cache.get("from_lo")
        if got is None:
            lo = self.lo
            got = self._rows_cache["from_lo"] = replace(
                self, mask=self.mask[:, lo:], bias=None if self.bias is None else self.bias[:, lo:], lo=0,
                _split=None, _rows_cache={})
        return got

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

    def own(self, lo: int, hi: int | None) -> tuple[Tensor, Tensor]:
        """Keys and values of the call's depth at rows [lo, hi) (hi None: every row)."""
        return self.k_own[:, lo:hi], self.v_own[:, lo:hi]

    def prefix(self, lo: int, hi: int | None) -> tuple[Tensor, Tensor]:
        """Prefix keys (depth kappa) and values (depth nu) at rows [lo, hi)."""
        return self.k_prefix[:, lo:hi], self.v_prefix[:, lo:hi]


def attend(q: Tensor, kv: "LayerKV | BatchKV", span: "Span | RaggedSpan") -> Tensor:
    """Eq. (2)-(3) for queries q [1, H, W, hd] over the verified prefix and the call's own rows -> [1, H, W, hd]."""
    if isinstance(span, RaggedSpan):
        return ragged_attention(q, kv, span)
    if kernel_rows(q, kv, span):
        return kernel_attention(q, [kv], [span], span._rows_cache)
    scale = 1.0 / math.sqrt(q.shape[-1])
    if kv.one_source:
        if span.lo and span.rows is None:            # a window: read its rows, not the whole prefix
            k, v = kv.own(span.lo, span.end)
            return dense_attention(q, k, v, span.from_lo(), scale)
        k, v = kv.own(0, None if span.rows is not None else span.end)
        return dense_attention(q, k, v, span, scale)
    mc, mu = span.source_masks()
    if span.rows is not None:
        (kc, vc), (ku, vu) = kv.prefix(0, None), kv.own(0, None)
    else:
        (kc, vc), (ku, vu) = kv.prefix(0, span.n), kv.own(span.n, span.end)
    return two_source_attention(q, kc, vc, mc, ku, vu, mu, scale)


def kernel_attention(q: Tensor, kvs: list["LayerKV"], parts: list[Span], cache: dict) -> Tensor:
    """Every query row of q [1, H, T, hd] (the segments' rows end to end) over its own row list
    (``row_lists``), in one ``rows_attention`` call: ``kvs`` share their tensors (``kernel_group``)."""
    kv = kvs[0]
    rows, starts, lengths, prefix = row_lists(kvs, parts, cache)
    q3 = q[0].transpose(0, 1)
    scale = 1.0 / math.sqrt(q.shape[-1])
    if prefix is None:
        out = decode_kernel.rows_attention(q3, kv.k_own, kv.v_own, rows, starts, lengths, scale)
    else:
        out = decode_kernel.rows_attention(q3, kv.k_own, kv.v_own, rows, starts, lengths, scale, kv.k_prefix,
                                           kv.v_prefix, prefix)
    return out.transpose(0, 1)[None]


def causal_self_attention(q: Tensor, k: Tensor, v: Tensor, window: int | None = None) -> Tensor:
    """A forward without cache (``model(ids)``, training, scoring): each of q [B, H, T, hd]'s rows over the call's
    own keys k, v [B, H_kv, T, hd] up to its own row (``window``: only the last ``window`` of them, its own
    included) - on CPU in float32 or bfloat16 the row kernel (the bits a cached decode of the same row gets),
    elsewhere SDPA."""
    B, H, T, hd = q.shape
    hkv = k.shape[1]
    if not (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
            and decode_kernel.available()):
        if window is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=hkv != H)
        d = torch.arange(T, device=q.device)
        d = d[:, None] - d[None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(d >= 0) & (d < window), enable_gqa=hkv != H)
    k2 = k.transpose(0, 1).reshape(hkv, B * T, hd)
    v2 = v.transpose(0, 1).reshape(hkv, B * T, hd)
    j = torch.arange(T)
    lo = torch.zeros_like(j) if window is None else (j - window + 1).clamp(min=0)     # each row's first key
    starts = (torch.arange(B)[:, None] * T + lo).reshape(-1)
    lengths = (j - lo + 1).repeat(B)
    out = decode_kernel.rows_attention(q.transpose(1, 2).reshape(B * T, H, hd), k2, v2, torch.arange(B * T), starts,
                                       lengths, 1.0 / math.sqrt(hd))
    return out.view(B, T, H, hd).transpose(1, 2)


_UNBUILT = object()


class _BuiltOnRead:
    """A ``CausalSpan`` field that its ``_build`` computes on the first read (until then ``_UNBUILT``)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.key = "_" + name

    def __get__(self, span: "CausalSpan | None", owner: type | None = None):
        if span is None:
            return self
        if span.__dict__[self.key] is _UNBUILT:
            span._build()
        return span.__dict__[self.key]

    def __set__(self, span: "CausalSpan", value: Tensor | None) -> None:
        span.__dict__[self.key] = value


class CausalSpan(Span):
    """A span whose query j sees rows [0, start + j] (``causal_rows``; rows are positions), cut to the last ``window``
    positions when ``window`` > 0 - rows [max(0, start + j - window + 1), start + j] (IQuest-Loop's loop 2,
    ``families/iquest.py``).  The row kernel's lists follow from that (``row_lists``); ``mask`` and ``bias``, which
    only torch's paths read, are built on first use - a call on the row kernel builds neither.  A copy by
    ``dataclasses.replace`` is a plain span with its mask given (``window`` 0)."""

    window = 0
    mask = _BuiltOnRead()
    bias = _BuiltOnRead()

    @classmethod
    def of(cls, n: int, start: int, W: int, rot: Tensor | tuple[Tensor, Tensor], dtype: torch.dtype,
           window: int = 0) -> "CausalSpan":
        out = cls(n=n, start=start, W=W, rot=rot, mask=_UNBUILT, causal=False, bias=_UNBUILT,
                  causal_rows=not window, lo=max(0, n - window + 1) if window else 0)
        out.window, out.dtype = window, dtype
        return out

    def _build(self) -> None:
        """Visible: a row at or before the query's (and, in a window, after its position less the window); the bias
        on a CPU only (``LoopedLM.span``'s rule)."""
        dev = _device(self.rot)
        if self.window:
            cols = torch.arange(self.end, device=dev)
            qpos = torch.arange(self.start, self.end, device=dev)
            mask = (cols[None, :] <= qpos[:, None]) & (cols[None, :] > qpos[:, None] - self.window)
        else:
            mask = torch.ones(self.W, self.end, dtype=torch.bool, device=dev).tril(self.start)
        self.__dict__["_mask"] = mask
        self.__dict__["_bias"] = (torch.zeros(mask.shape, dtype=self.dtype).masked_fill_(~mask, float("-inf"))
                                  if dev.type == "cpu" else None)


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
# allocator's trimming (docs/performance-journal.md, "Wide masked attention as two GEMMs").
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
class RaggedSpan:
    """The query rows of several sequences laid end to end: segment i is rows [offsets[i], offsets[i+1]) of the
    call and is described by ``parts[i]`` (a ``Span`` over sequence i's own cache).  ``rot``: the rows' RoPE
    operands, concatenated in the same order."""

    parts: list[Span]
    offsets: list[int]
    rot: Tensor | tuple[Tensor, Tensor]
    _rows_cache: dict = field(default_factory=dict, repr=False)     # row index tensors of this call (stores, reads)
    no_static_rows: bool = field(init=False, repr=False)            # no segment in the static-shape form

    def __post_init__(self) -> None:
        self.no_static_rows = all(p.rows is None for p in self.parts)

    def pool_rows(self, kvs: list["PagedKV"]) -> Tensor:
        """The pool row of every query row of the call, segment after segment (``kvs``: each segment's ``PagedKV``;
        built once per call and block tables, shared by every layer and depth)."""
        key = ("store",) + tuple([id(kv.table) for kv in kvs])
        rows = self._rows_cache.get(key)
        if rows is None:
            for kv, p in zip(kvs, self.parts):        # rows past its blocks would land in the null block (or worse)
                if not 0 <= p.start <= p.end <= kv.table.backed:
                    raise IndexError(f"rows [{p.start}, {p.end}) are outside the sequence's {kv.table.backed} "
                                     "backed rows")
            rows = self._rows_cache[key] = torch.cat([kv.table.rows[p.start: p.end] for kv, p in zip(kvs, self.parts)])
        return rows

    @staticmethod
    def one_pool(kvs: list["LayerKV"]) -> bool:
        """Every segment's view is a ``PagedKV`` storing into the same pool tensors: one call for all.  Asked per
        layer and depth (the views are), in a few identity tests."""
        k, v = kvs[0].k_own, kvs[0].v_own
        return all([isinstance(p, PagedKV) and p.k_own is k and p.v_own is v for p in kvs])

    def kernel_segments(self, q: Tensor) -> bool:
        """Whether every segment's span suits the row kernel (``kernel_rows`` less its per-layer cache test),
        decided once per call and query dtype."""
        key = ("kernel", q.dtype, q.device, q.requires_grad, torch.compiler.is_compiling())
        got = self._rows_cache.get(key)
        if got is None:
            got = self._rows_cache[key] = all(span_suits_kernel(q, p) for p in self.parts)
        return got

    @classmethod
    def of(cls, parts: list[Span]) -> "RaggedSpan":
        offsets = [0]
        for p in parts:
            offsets.append(offsets[-1] + p.W)
        rots = [p.rot for p in parts]
        if isinstance(rots[0], tuple):
            rot = (torch.cat([r[0] for r in rots]), torch.cat([r[1] for r in rots]))
        else:
            rot = torch.cat(rots)
        return cls(parts, offsets, rot)

    @property
    def W(self) -> int:
        return self.offsets[-1]

    def segments(self):
        """(i, first row, end row, span) per sequence."""
        o = self.offsets
        return ((i, o[i], o[i + 1], p) for i, p in enumerate(self.parts))


@dataclass
class BatchKV:
    """One layer's ``LayerKV`` of every sequence of a ``RaggedSpan`` (same order)."""

    parts: list[LayerKV]

    def store(self, span: RaggedSpan, k: Tensor, v: Tensor) -> None:
        """k, v [H_kv, T, hd]: each segment's rows into its own cache (every segment's before any attends, so a
        sequence's later segments see its earlier ones).  Segments in one paged pool: one indexed copy for all."""
        first = self.parts[0]
        if span.no_static_rows and span.one_pool(self.parts):
            store_rows(first.k_own, first.v_own, span.pool_rows(self.parts), k, v)
            return
        for i, a, b, part in span.segments():
            self.parts[i].store(part, k[:, a:b], v[:, a:b])


def store_rows(k_dst: Tensor, v_dst: Tensor, idx: Tensor, k: Tensor, v: Tensor) -> None:
    """k_dst[:, idx] = k, v_dst[:, idx] = v: on CPU one kernel call (a copy per row and head), else index_copy_."""
    if (k_dst.device.type == "cpu" and k.dtype == k_dst.dtype and v.dtype == v_dst.dtype and k.stride(-1) == 1
            and v.stride(-1) == 1 and not (k.requires_grad or v.requires_grad)
            and not torch.compiler.is_compiling() and decode_kernel.available()):
        decode_kernel.store_rows(k_dst, v_dst, idx, k, v)
    else:
        k_dst.index_copy_(1, idx, k)
        v_dst.index_copy_(1, idx, v)


def row_plan(x: Tensor, kv: "LayerKV | BatchKV", span: "Span | RaggedSpan", two_source: bool = False
             ) -> tuple | None:
    """For a batched call (a decode step, a prefill, a verification, a draft) whose every segment suits the row
    kernel and lies in one pool: (K pool, V pool, each query row's pool row, and ``row_lists``' rows, starts,
    lengths), all built once per call; None otherwise.  Without ``two_source`` only a call that reads the prefix at
    the depth it stores at; with it, also one that reads it at another depth (a draft's Deep K/V reads: one prefix
    pool pair for every segment), and three more entries: the prefix's K and V pools and each query's count of
    prefix rows (None, None, None where the call reads one source).  x: the call's queries or its input (dtype and
    device)."""
    if not isinstance(span, RaggedSpan) or not span.no_static_rows or not span.kernel_segments(x):
        return None
    kvs = kv.parts
    if not span.one_pool(kvs):
        return None
    p0 = kvs[0]
    if all([p.one_source for p in kvs]):
        plan = (p0.k_own, p0.v_own, span.pool_rows(kvs)) + row_lists(kvs, span.parts, span._rows_cache)[:3]
        return plan + (None, None, None) if two_source else plan
    kp, vp = p0.k_prefix, p0.v_prefix
    if not (two_source and prefix_like_own(p0) and all([p.k_prefix is kp and p.v_prefix is vp for p in kvs])):
        return None
    rows, starts, lengths, prefix = row_lists(kvs, span.parts, span._rows_cache)
    return p0.k_own, p0.v_own, span.pool_rows(kvs), rows, starts, lengths, kp, vp, prefix


def pools_like(kv: "LayerKV | BatchKV", first: "LayerKV | BatchKV") -> tuple[Tensor, Tensor] | None:
    """The (K, V) pool of layer view ``kv`` where its segments store and read through ``first``'s tables in one
    pool, at the depth they store at: ``row_plan`` would then give ``kv`` ``first``'s rows and lists (they follow
    from the span and the tables alone) with these pools.  None otherwise.  Another layer's or depth's share of a
    call's plan, without rebuilding its keys."""
    parts, firsts = getattr(kv, "parts", None), getattr(first, "parts", None)
    if parts is None or firsts is None or len(parts) != len(firsts):
        return None
    p0 = parts[0]
    k, v = p0.k_own, p0.v_own
    for p, f in zip(parts, firsts):
        if not (isinstance(p, PagedKV) and p.table is f.table and p.k_own is k and p.v_own is v
                and p.k_prefix is k and p.v_prefix is v):
            return None
    return k, v


def ragged_attention(q: Tensor, kv: BatchKV, span: RaggedSpan) -> Tensor:
    """Each segment's queries attend within their own sequence's cache (eq. 2-3 per segment); the segments that
    share their tensors and suit the row kernel (``kernel_rows``) in one kernel call per group."""
    plan = row_plan(q, kv, span, two_source=True)
    if plan is not None:             # every segment in one call, without the per-segment loop
        k, v, _, rows, starts, lengths, kp, vp, prefix = plan
        return decode_kernel.rows_attention(q[0].transpose(0, 1), k, v, rows, starts, lengths,
                                            1.0 / math.sqrt(q.shape[-1]), kp, vp, prefix).transpose(0, 1)[None]
    out: list[Tensor | None] = [None] * len(span.parts)
    groups: dict[tuple, list[int]] = {}
    for i, a, b, part in span.segments():
        if kernel_rows(q, kv.parts[i], part):
            groups.setdefault(kernel_group(kv.parts[i]), []).append(i)
        else:
            out[i] = attend(q[:, :, a:b], kv.parts[i], part)
    o = span.offsets
    for idx in groups.values():
        qi = q[:, :, [r for i in idx for r in range(o[i], o[i + 1])]]
        res = kernel_attention(qi, [kv.parts[i] for i in idx], [span.parts[i] for i in idx], span._rows_cache)
        at = 0
        for i in idx:
            w = o[i + 1] - o[i]
            out[i] = res[:, :, at: at + w]
            at += w
    return torch.cat(out, dim=2)


# On CPU in float32 every query row takes the row kernel (``decode_kernel.rows_attention``): a decode row, a prompt
# block, a verification chain, a tree, a draft window, a prefix read at another depth - each query over its own list
# of visible rows in position order, so a row's bits follow from its rows alone, whatever the call's shape, the
# block layout or the batch.  bfloat16 rows take it too (keys and values widened exactly, float32 sums, the output
# rounded once), so a bfloat16 model on a CPU is batch-invariant as well.

def kernel_rows(q: Tensor, kv: LayerKV, span: Span) -> bool:
    return span_suits_kernel(q, span) and prefix_like_own(kv)


def prefix_like_own(kv: LayerKV) -> bool:
    """Whether the row kernel reads ``kv``'s prefix tensors through the own tensors' row indices: one source, or
    prefix tensors of the own ones' shape and row stride."""
    return kv.one_source or (
        kv.k_prefix.stride(1) == kv.k_own.stride(1) and kv.v_prefix.stride(1) == kv.v_own.stride(1)
        and kv.k_prefix.shape == kv.k_own.shape and kv.v_prefix.shape == kv.v_own.shape)


def kernel_group(kv: LayerKV) -> tuple:
    """Segments whose ``LayerKV`` read the same tensors share one kernel call."""
    return (id(kv.k_own), id(kv.v_own), id(kv.k_prefix), id(kv.v_prefix))


def span_suits_kernel(q: Tensor, span: Span) -> bool:
    """``kernel_rows``' tests of the span and the queries (the same for every layer and depth of a call)."""
    return (span.rows is None and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
            and not q.requires_grad and not torch.compiler.is_compiling() and decode_kernel.available())


def row_lists(kvs: list[LayerKV], parts: list[Span], cache: dict) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Each query row's visible rows as rows of its tensors, segment after segment: (rows, where each query's list
    starts, how many rows it sees, and how many of them are verified-prefix rows read from the prefix tensors -
    None when every segment reads one source).  Query j of a segment sees rows [0, start + j] (``causal_rows``),
    else the rows its mask shows, in position order.  Built once per call and caches, shared by every layer and
    depth."""
    two = not all([kv.one_source for kv in kvs])
    key = ("read", two) + tuple([(id(kv.table) if isinstance(kv, PagedKV) else None, p.start, p.end,
                                  -p.window if isinstance(p, CausalSpan) and p.window
                                  else 0 if p.causal_rows else id(p.mask),         # (causal: the mask is not read)
                                  p.n if two else None) for kv, p in zip(kvs, parts)])
    got = cache.get(key)
    if got is None:
        rows, starts, lengths, prefix, at = [], [], [], [], 0
        for kv, p in zip(kvs, parts):
            pool = kv.table.rows[: p.end] if isinstance(kv, PagedKV) else None
            if p.causal_rows:
                rows.append(pool if pool is not None else torch.arange(p.end))
                starts += [at] * p.W
                lengths += range(p.start + 1, p.end + 1)
                prefix += [min(p.n, r) for r in range(p.start + 1, p.end + 1)]
                at += p.end
            elif isinstance(p, CausalSpan) and p.window:   # the causal lists, each from its window's first row
                rows.append(pool if pool is not None else torch.arange(p.end))
                for q in range(p.start, p.end):
                    lo = max(0, q - p.window + 1)
                    starts.append(at + lo)
                    lengths.append(q + 1 - lo)
                    prefix.append(max(0, min(p.n, q + 1) - lo))
                at += p.end
            else:
                mask = p.mask[:, : p.end]
                logical = mask.nonzero()[:, 1]
                counts = mask.sum(1).tolist()
                rows.append(pool[logical] if pool is not None else logical)
                for c in counts:
                    starts.append(at)
                    at += c
                lengths += counts
                prefix += mask[:, : p.n].sum(1).tolist()
        got = cache[key] = (rows[0] if len(rows) == 1 else torch.cat(rows), torch.tensor(starts, dtype=torch.long),
                            torch.tensor(lengths, dtype=torch.long),
                            torch.tensor(prefix, dtype=torch.long) if two else None)
    return got


class PagedKV(LayerKV):
    """A ``LayerKV`` over a sequence's rows in a paged pool: ``k_*`` / ``v_*`` are the pool's tensors of this layer
    and depth [H_kv, pool rows, hd], and ``table.rows`` [capacity] the pool row of each of the sequence's rows
    (``PagedCache``).  Reads are a slice of the pool when the sequence's blocks lie in order (``table.base``), else
    a gather; writes go through the table."""

    def __init__(self, k_prefix: Tensor, v_prefix: Tensor, k_own: Tensor, v_own: Tensor, table):
        super().__init__(k_prefix, v_prefix, k_own, v_own)
        self.table = table

    def _read(self, k: Tensor, v: Tensor, lo: int, hi: int | None) -> tuple[Tensor, Tensor]:
        t = self.table
        hi = t.capacity if hi is None else hi
        if t.base is not None:
            if not 0 <= lo <= hi <= t.backed:      # a slice past its blocks would read another request's rows
                raise IndexError(f"rows [{lo}, {hi}) are outside the sequence's {t.backed} backed rows")
            return k[:, t.base + lo: t.base + hi], v[:, t.base + lo: t.base + hi]
        idx = t.rows[lo:hi]
        return k.index_select(1, idx), v.index_select(1, idx)

    def own(self, lo: int, hi: int | None) -> tuple[Tensor, Tensor]:
        return self._read(self.k_own, self.v_own, lo, hi)

    def prefix(self, lo: int, hi: int | None) -> tuple[Tensor, Tensor]:
        return self._read(self.k_prefix, self.v_prefix, lo, hi)

    def store(self, span: Span, k: Tensor, v: Tensor) -> None:
        t = self.table
        if span.rows is not None:
            idx = t.rows.index_select(0, span.rows)
        elif t.base is not None:
            if not 0 <= span.start <= span.end <= t.backed:     # ... or overwrite them
                raise IndexError(f"rows [{span.start}, {span.end}) are outside the sequence's {t.backed} backed rows")
            self.k_own[:, t.base + span.start: t.base + span.end] = k
            self.v_own[:, t.base + span.start: t.base + span.end] = v
            return
        else:
            idx = t.rows[span.start: span.end]
        store_rows(self.k_own, self.v_own, idx, k, v)
