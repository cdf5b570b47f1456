"""DepthCache: preallocated K/V of the verified prefix for every core layer at every recurrence depth r = 1..R,
plus the (depth-free) prelude and coda K/V.

Layout (batch 1): ``core_k[l, r-1]`` is a [H_kv, capacity, hd] tensor, one row per position.  Rows [0, n) are
the materialised, verified prefix.  Rows >= n are scratch: draft and verification passes write their own K/V
there and attend to it, and only ``commit`` turns rows into prefix (an index bump, no copy).  Tree verification
commits a non-contiguous set of rows with ``compact``.

A pool (``dasspec.engine.pool``) is one DepthCache allocated once; ``view(base, rows)`` is a DepthCache over rows
[base, base + rows) of it (the same storage), which a sequence uses exactly like a cache of its own.  A
``BatchCache`` hands the layers every running sequence's views at once (one batched call).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .config import LoopedConfig
from .attention import BatchKV, LayerKV


class CacheCapacityError(RuntimeError):
    """The requested generation does not fit in the context or in memory."""


def bytes_per_token(cfg: LoopedConfig, R: int, dtype: torch.dtype) -> int:
    """Bytes of K+V one position occupies: every core layer at every depth, plus prelude and coda layers."""
    per_layer = 2 * cfg.n_kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()
    return per_layer * (cfg.n_core * R + cfg.n_prelude + cfg.n_coda)


class DepthCache:
    def __init__(self, cfg: LoopedConfig, R: int, capacity: int, device: torch.device | str,
                 dtype: torch.dtype, zeroed: bool = False):
        self.R, self.capacity = R, capacity
        hkv, hd = cfg.n_kv_heads, cfg.head_dim
        shape = (hkv, capacity, hd)
        # Static-shape attention reads every row (masked); rows never written must hold finite values, since a
        # masked weight of 0 times a garbage NaN is still NaN.
        new = torch.zeros if zeroed else torch.empty
        try:
            self.core_k = new(cfg.n_core, R, *shape, device=device, dtype=dtype)
            self.core_v = new(cfg.n_core, R, *shape, device=device, dtype=dtype)
            self.pre_k = new(cfg.n_prelude, *shape, device=device, dtype=dtype)
            self.pre_v = new(cfg.n_prelude, *shape, device=device, dtype=dtype)
            self.coda_k = new(cfg.n_coda, *shape, device=device, dtype=dtype)
            self.coda_v = new(cfg.n_coda, *shape, device=device, dtype=dtype)
        except (RuntimeError, MemoryError) as err:  # torch.OutOfMemoryError subclasses RuntimeError
            need = bytes_per_token(cfg, R, dtype) * capacity
            raise CacheCapacityError(
                f"cannot allocate the depth cache: {capacity} positions x {bytes_per_token(cfg, R, dtype)} B/token"
                f" = {need / 2**20:.1f} MiB on {device} ({err})") from err
        self.bytes_per_token = bytes_per_token(cfg, R, dtype)
        self.n = 0
        self.base = 0                            # first row in the storage (a view of a pool: its range's start)
        self.storage = self
        self._views: dict[tuple, LayerKV] = {}   # LayerKV objects are reused: built once per (layer, depths)

    def view(self, base: int, rows: int) -> "DepthCache":
        """A cache over rows [base, base + rows) of this one's storage, empty (n = 0)."""
        if not (0 <= base and rows >= 1 and base + rows <= self.capacity):
            raise ValueError(f"rows [{base}, {base + rows}) are outside this cache's {self.capacity} rows")
        v = object.__new__(DepthCache)
        v.R, v.capacity, v.bytes_per_token = self.R, rows, self.bytes_per_token
        part = slice(base, base + rows)
        v.core_k, v.core_v, v.pre_k, v.pre_v, v.coda_k, v.coda_v = (t[..., part, :] for t in self.tensors())
        v.n, v.base, v._views = 0, self.base + base, {}
        v.storage = self.storage                 # the cache that owns the storage (union calls read it whole)
        return v

    def tensors(self) -> tuple[Tensor, ...]:
        return self.core_k, self.core_v, self.pre_k, self.pre_v, self.coda_k, self.coda_v

    @property
    def nbytes(self) -> int:
        return self.bytes_per_token * self.capacity

    # --- per-layer views handed to attention ---------------------------------------------------------
    def prelude_kv(self, layer: int) -> LayerKV:
        kv = self._views.get(("prelude", layer))
        if kv is None:
            k, v = self.pre_k[layer], self.pre_v[layer]
            kv = self._views[("prelude", layer)] = LayerKV(k, v, k, v)
        return kv

    def coda_kv(self, layer: int) -> LayerKV:
        kv = self._views.get(("coda", layer))
        if kv is None:
            k, v = self.coda_k[layer], self.coda_v[layer]
            kv = self._views[("coda", layer)] = LayerKV(k, v, k, v)
        return kv

    def core_kv(self, layer: int, read: tuple[int, int], own: tuple[int, int]) -> LayerKV:
        """Prefix keys from depth kappa, values from depth nu (``read``); draft-side rows stored at the depths in
        ``own``.  Depths are 1-based recurrence steps."""
        key = (layer, read, own)
        kv = self._views.get(key)
        if kv is None:
            (kappa, nu), (ok, ov) = read, own
            for depth in (kappa, nu, ok, ov):
                if not 1 <= depth <= self.R:
                    raise ValueError(f"read/store depth {depth} outside 1..R={self.R}")
            K, V = self.core_k[layer], self.core_v[layer]
            kp, vp = K[kappa - 1], V[nu - 1]
            ko = kp if ok == kappa else K[ok - 1]
            vo = vp if ov == nu else V[ov - 1]
            kv = self._views[key] = LayerKV(kp, vp, ko, vo)
        return kv

    # --- bookkeeping ---------------------------------------------------------------------------------
    def commit(self, m: int) -> None:
        """Rows [n, n + m) become verified prefix."""
        if self.n + m > self.capacity:
            raise CacheCapacityError(f"commit past capacity {self.capacity}")
        self.n += m

    def load_prefix(self, src: "DepthCache", m: int) -> None:
        """Make ``src``'s first ``m`` verified rows this (empty) cache's verified prefix: a copy at every depth and
        in prelude/coda.  ``src`` must hold the same depths R (a ``PrefixCache``)."""
        if self.n:
            raise ValueError("load_prefix needs an empty cache")
        if src.R != self.R or src.core_k.shape[:3] != self.core_k.shape[:3]:
            raise ValueError(f"prefix cache of R={src.R} does not fit a depth cache of R={self.R}")
        if not 0 <= m <= min(src.n, self.capacity):
            raise ValueError(f"cannot load {m} prefix rows (source holds {src.n}, capacity {self.capacity})")
        for dst, s in zip(self.tensors(), src.tensors()):
            dst[..., :m, :] = s[..., :m, :]
        self.commit(m)

    def compact(self, rows: Tensor) -> None:
        """Commit scratch rows ``rows`` (ascending, each >= n): copy them to [n, n + len(rows)) at every depth
        and in prelude/coda, then advance n.  Used after tree verification."""
        m = int(rows.numel())
        n = self.n
        for t in (self.core_k, self.core_v):
            t[..., n: n + m, :] = t.index_select(-2, rows)
        for t in (self.pre_k, self.pre_v, self.coda_k, self.coda_v):
            t[..., n: n + m, :] = t.index_select(-2, rows)
        self.commit(m)


class BatchCache:
    """The caches of the sequences of one batched call (``attention.RaggedSpan``), in segment order: each layer
    view is a ``BatchKV`` of their per-sequence views (built once per call and key), with the same view of the
    storage they share, if they share one (ranges of one pool)."""

    def __init__(self, caches: list[DepthCache]):
        self.caches = caches
        storage = caches[0].storage
        self.storage = storage if all(c.storage is storage for c in caches) else None
        self._kv: dict[tuple, BatchKV] = {}

    def _get(self, key: tuple, make) -> BatchKV:
        kv = self._kv.get(key)
        if kv is None:
            kv = self._kv[key] = BatchKV([make(c) for c in self.caches],
                                         make(self.storage) if self.storage is not None else None)
        return kv

    def prelude_kv(self, layer: int) -> BatchKV:
        return self._get(("prelude", layer), lambda c: c.prelude_kv(layer))

    def coda_kv(self, layer: int) -> BatchKV:
        return self._get(("coda", layer), lambda c: c.coda_kv(layer))

    def core_kv(self, layer: int, read: tuple[int, int], own: tuple[int, int]) -> BatchKV:
        return self._get((layer, read, own), lambda c: c.core_kv(layer, read, own))
