"""DepthCache: preallocated K/V of the verified prefix for every core layer at every recurrence depth r = 1..R,
plus the (depth-free) prelude and coda K/V.

Layout (batch 1): ``core_k[l, r-1]`` is a [H_kv, capacity, hd] tensor, one row per position.  Rows [0, n) are
the materialised, verified prefix.  Rows >= n are scratch: draft and verification passes write their own K/V
there and attend to it, and only ``commit`` turns rows into prefix (an index bump, no copy).  Tree verification
commits a non-contiguous set of rows with ``compact``.

The engine's pool (``dasspec.engine.core.blocks``) is one DepthCache allocated once and cut into blocks of B rows; a
sequence holds a ``BlockTable`` (its blocks, and the pool row of each of its rows) and reads and writes the pool
through a ``PagedCache``, which it uses exactly like a cache of its own.  A ``BatchCache`` hands the layers every
sequence's views at once (one batched call).

Windowed depths (``window``: IQuest-Loop, whose depths r >= 2 read their own K/V only within the last ``window``
positions).  A position's depth-r rows then matter to the next ``window`` positions only, so the pool keeps one
depth per row (``slots`` = 1): a sequence's depth-1 rows (and prelude / coda rows) lie in its ``BlockTable`` as
above, and each depth r >= 2 in a ``RingTable`` of a few blocks that position p reuses modulo their rows - as many
as the window and the widest call's rows need.  Reads of the verified prefix at another depth than the call's own
are then aligned (``PagedCache.core_kv``): the rows they would read past the window are gone.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .config import LoopedConfig
from .attention import BatchKV, LayerKV, PagedKV


class CacheCapacityError(RuntimeError):
    """The requested generation does not fit in the context or in memory."""


def bytes_per_token(cfg: LoopedConfig, R: int, dtype: torch.dtype, window: int | None = None) -> int:
    """Bytes of K+V one pool row occupies: every core layer at every depth (at one depth with ``window``: a row
    then holds one depth of a position), plus prelude and coda layers."""
    per_layer = 2 * cfg.n_kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()
    return per_layer * (cfg.n_core * (1 if window else R) + cfg.n_prelude + cfg.n_coda)


class DepthCache:
    def __init__(self, cfg: LoopedConfig, R: int, capacity: int, device: torch.device | str,
                 dtype: torch.dtype, zeroed: bool = False, window: int | None = None):
        self.R, self.capacity, self.window = R, capacity, window
        self.slots = 1 if window else R        # depths a row holds (windowed: depth r's rows are rows of its ring)
        hkv, hd = cfg.n_kv_heads, cfg.head_dim
        shape = (hkv, capacity, hd)
        # Static-shape attention reads every row (masked); rows never written must hold finite values, since a
        # masked weight of 0 times a garbage NaN is still NaN.
        new = torch.zeros if zeroed else torch.empty
        try:
            self.core_k = new(cfg.n_core, self.slots, *shape, device=device, dtype=dtype)
            self.core_v = new(cfg.n_core, self.slots, *shape, device=device, dtype=dtype)
            self.pre_k = new(cfg.n_prelude, *shape, device=device, dtype=dtype)
            self.pre_v = new(cfg.n_prelude, *shape, device=device, dtype=dtype)
            self.coda_k = new(cfg.n_coda, *shape, device=device, dtype=dtype)
            self.coda_v = new(cfg.n_coda, *shape, device=device, dtype=dtype)
        except (RuntimeError, MemoryError) as err:  # torch.OutOfMemoryError subclasses RuntimeError
            per = bytes_per_token(cfg, R, dtype, window)
            raise CacheCapacityError(
                f"cannot allocate the depth cache: {capacity} positions x {per} B/token"
                f" = {per * capacity / 2**20:.1f} MiB on {device} ({err})") from err
        self.bytes_per_token = bytes_per_token(cfg, R, dtype, window)
        self.n = 0
        self._views: dict[tuple, LayerKV] = {}   # LayerKV objects are reused: built once per (layer, depths)
        self._step_pools: dict[tuple, list[tuple] | None] = {}     # ``step_pools``, per key

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
            slot = (lambda d: 0) if self.slots == 1 else (lambda d: d - 1)   # windowed: the table picks the depth
            kp, vp = K[slot(kappa)], V[slot(nu)]
            ko = kp if ok == kappa else K[slot(ok)]
            vo = vp if ov == nu else V[slot(ov)]
            kv = self._views[key] = LayerKV(kp, vp, ko, vo)
        return kv

    def step_pools(self, layers: int, steps: tuple, reads: tuple, two_source: bool) -> list[tuple] | None:
        """Per step of ``steps`` (reading the prefix at ``reads``, one (kappa, nu) per step, storing at its own
        depth), per core layer: (K, V) - with ``two_source`` (K, V, prefix K, prefix V) - the tensors that step's
        layer views store into and read, for the sequences of this pool without windowed depths (their views at
        every depth go through one table); None where a step's view has another number of sources than asked.
        Built once per key: a one-call recurrence asks every step."""
        key = (layers, steps, reads, two_source)
        if key not in self._step_pools:
            if len(self._step_pools) >= 4096:     # keys are (steps, reads) a drafter repeats: a bound, not an LRU
                self._step_pools.clear()
            self._step_pools[key] = self._pools_of(layers, steps, reads, two_source)
        return self._step_pools[key]

    def _pools_of(self, layers: int, steps: tuple, reads: tuple, two_source: bool) -> list[tuple] | None:
        out = []
        for r, read in zip(steps, reads):
            for i in range(layers):
                kv = self.core_kv(i, read, (r, r))
                if kv.one_source == two_source:   # (a prefix depth: a slice of the own's tensor, same rows and strides)
                    return None
                out.append((kv.k_own, kv.v_own, kv.k_prefix, kv.v_prefix) if two_source else (kv.k_own, kv.v_own))
        return out

    # --- bookkeeping ---------------------------------------------------------------------------------
    def commit(self, m: int) -> None:
        """Rows [n, n + m) become verified prefix."""
        if self.n + m > self.capacity:
            raise CacheCapacityError(f"commit past capacity {self.capacity}")
        self.n += m

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


class BlockTable:
    """A sequence's blocks of a paged pool, in order, and the pool row of each of its rows (``rows`` [max_rows]:
    row i lies in block ``blocks[i // B]`` at offset i % B; rows not yet backed by a block point into the pool's
    null block 0, which is never handed out).  ``base``: the pool row of the sequence's row 0 when its blocks are
    consecutive (reads are then a slice, not a gather); None otherwise, and always with ``static`` (static shapes read
    all ``max_rows`` rows, through ``rows``)."""

    def __init__(self, block_size: int, max_rows: int, device: torch.device | str, static: bool = False):
        self.B, self.static = block_size, static
        self.blocks: list[int] = []
        self.rows = torch.arange(max_rows, device=device) % block_size       # all in the null block
        self.base: int | None = None

    @property
    def backed(self) -> int:
        """Rows backed by blocks."""
        return len(self.blocks) * self.B

    @property
    def capacity(self) -> int:
        """Rows a static-shape read covers (every row the sequence may ever use)."""
        return self.rows.numel()

    def append(self, blocks: list[int]) -> None:
        B, i = self.B, len(self.blocks)
        if (i + len(blocks)) * B > self.rows.numel():
            raise ValueError(f"{i + len(blocks)} blocks of {B} exceed the sequence's {self.rows.numel()} rows")
        if blocks:
            ids = torch.tensor(blocks, dtype=torch.long)
            self.rows[i * B: (i + len(blocks)) * B] = (ids[:, None] * B + torch.arange(B)).flatten().to(self.rows.device)
        self.blocks.extend(blocks)
        first = self.blocks[0] if self.blocks else None
        self.base = None if self.static or first is None or any(
            b != first + j for j, b in enumerate(self.blocks)) else first * B

    def truncate(self, k: int) -> None:
        """Keep the first ``k`` blocks (rows past them point into the null block again)."""
        B = self.B
        self.rows[k * B: len(self.blocks) * B] = torch.arange(k * B, len(self.blocks) * B,
                                                              device=self.rows.device) % B
        del self.blocks[k:]
        if not self.blocks:
            self.base = None

    def clear(self) -> list[int]:
        """Drop every block (returned, in order); rows point into the null block again."""
        blocks, self.blocks, self.base = self.blocks, [], None
        self.rows.copy_(torch.arange(self.rows.numel(), device=self.rows.device) % self.B)
        return blocks


class RingTable(BlockTable):
    """One windowed depth's rows of a sequence (``DepthCache.window``): a few blocks that position p reuses, row p
    in block ``blocks[(p // B) % len(blocks)]`` at offset p % B.  Every position is "backed"; two positions share a
    row when they are a multiple of the ring's rows apart, so the ring must hold every position a call may read or
    write at that depth (``BlockPool.ring_blocks``).  Reads go through ``rows`` (a gather, never a slice)."""

    def __init__(self, block_size: int, max_rows: int, device: torch.device | str, static: bool = False):
        super().__init__(block_size, max_rows, device, static)
        self._max_rows = max_rows

    @property
    def backed(self) -> int:
        return self._max_rows if self.blocks else 0

    def append(self, blocks: list[int]) -> None:
        if self.blocks:
            raise ValueError("a ring's blocks are given once (clear it first)")
        B = self.B
        ids = torch.tensor(blocks, dtype=torch.long)
        p = torch.arange(self._max_rows)
        self.rows.copy_((ids[(p // B) % len(blocks)] * B + p % B).to(self.rows.device))
        self.blocks, self.base = list(blocks), None

    def truncate(self, k: int) -> None:
        raise ValueError("a ring is kept whole while its sequence runs")

    def span_rows(self) -> int:
        """Positions the ring holds apart (a call may touch at most this many consecutive positions)."""
        return len(self.blocks) * self.B


class PagedCache:
    """A sequence's depth cache in a paged pool (a ``DepthCache`` cut into blocks): the interface of a
    ``DepthCache`` of its own - ``n`` verified rows, ``commit``, ``compact``, per-layer views - over the rows its
    ``BlockTable`` names.  ``capacity``: the rows backed by its blocks now (the engine adds blocks before a step
    writes past them).  ``rings`` (a pool with windowed depths): depth r >= 2's ``RingTable``, r = 2..R."""

    def __init__(self, pool: DepthCache, table: BlockTable, rings: list[RingTable] | None = None):
        self.pool, self.table = pool, table
        self.R, self.bytes_per_token = pool.R, pool.bytes_per_token
        self.window = pool.window
        if self.window and (rings is None or len(rings) != pool.R - 1):
            raise ValueError(f"a pool with windowed depths needs one ring per depth 2..{pool.R}")
        self.rings = rings or []
        self.n = 0
        self._views: dict[tuple, PagedKV] = {}

    @property
    def capacity(self) -> int:
        return self.table.backed

    def tensors(self) -> tuple[Tensor, ...]:
        return self.pool.tensors()

    def table_of(self, depth: int) -> BlockTable:
        """The table of a core depth's rows."""
        return self.rings[depth - 2] if self.window and depth > 1 else self.table

    def _paged(self, key: tuple, pool_kv: LayerKV, table: BlockTable | None = None) -> PagedKV:
        """The pool's view of a layer and depths, read and written through this sequence's table (built once)."""
        kv = self._views.get(key)
        if kv is None:
            p = pool_kv
            kv = self._views[key] = PagedKV(p.k_prefix, p.v_prefix, p.k_own, p.v_own, table or self.table)
        return kv

    def prelude_kv(self, layer: int) -> PagedKV:
        return self._paged(("prelude", layer), self.pool.prelude_kv(layer))

    def coda_kv(self, layer: int) -> PagedKV:
        return self._paged(("coda", layer), self.pool.coda_kv(layer))

    def core_kv(self, layer: int, read: tuple[int, int], own: tuple[int, int]) -> PagedKV:
        if self.window and (read != own or own[0] != own[1]) and max(*read, *own) > 1:
            # Windowed depths keep only the window's rows: a call reads the prefix at the depth it stores at (a
            # Deep K/V draft at depth 1 reads depth 1, the target's own loop-1 rows), keys and values alike.
            read = own = (own[0], own[0])
        key = (layer, read, own)
        kv = self._views.get(key)
        if kv is None:
            kv = self._paged(key, self.pool.core_kv(layer, read, own), self.table_of(own[0]))
        return kv

    def commit(self, m: int) -> None:
        if self.n + m > self.capacity:
            raise CacheCapacityError(f"commit past the {self.capacity} rows backed by blocks")
        self.n += m

    def _depth_tables(self) -> list[tuple[list[Tensor], BlockTable]]:
        """(pool tensors, the table their rows go through): one pair, or depth 1 and each ring apart."""
        pool = self.pool
        if not self.window:
            return [(list(pool.tensors()), self.table)]
        return [([pool.core_k, pool.core_v, pool.pre_k, pool.pre_v, pool.coda_k, pool.coda_v], self.table)] + [
            ([pool.core_k, pool.core_v], ring) for ring in self.rings]

    def compact(self, rows: Tensor) -> None:
        """Commit scratch rows ``rows`` (ascending, each >= n) as rows [n, n + len(rows)) at every depth."""
        m = int(rows.numel())
        n = self.n
        for tensors, table in self._depth_tables():
            src, dst = table.rows[rows], table.rows[n: n + m]
            for t in tensors:
                t.index_copy_(-2, dst, t.index_select(-2, src))
        self.commit(m)

    def ring_rows(self, depth: int, block: int) -> Tensor:
        """The pool rows of prompt block ``block``'s positions at windowed depth ``depth`` (its ring's rows)."""
        B = self.table.B
        return self.rings[depth - 2].rows[block * B: (block + 1) * B]

    def copy_core_rows(self, dst: Tensor, src: Tensor) -> None:
        """Pool rows ``src`` to pool rows ``dst`` in every core layer (a windowed pool's row holds one depth)."""
        for t in (self.pool.core_k, self.pool.core_v):
            t.index_copy_(-2, dst, t.index_select(-2, src))

    def clear_rings(self) -> None:
        """Zeros in every row of the rings (rows it has not written are read, masked, by torch's attention)."""
        for ring in self.rings:
            for t in (self.pool.core_k, self.pool.core_v):
                t.index_fill_(-2, ring.rows[: ring.span_rows()], 0)

    def check_ring(self, end: int) -> None:
        """A call over rows up to ``end`` must find every row it reads or writes at a windowed depth in the rings:
        rows [n - window + 1, end) in one ring's span (else two of them share a row)."""
        if end - self._kept(self.n) > self.rings[0].span_rows():
            raise CacheCapacityError(
                f"rows [{self._kept(self.n)}, {end}) of a windowed depth do not fit its ring of "
                f"{self.rings[0].span_rows()} rows (the engine sizes rings for its steps' widest calls)")

    def _kept(self, n: int) -> int:
        """The first verified row a windowed depth still needs (rows before it are never read again)."""
        return max(0, n - self.window + 1)

    def _ring_saved(self, n: int) -> int:
        """The first row a swap saves of a ring: its whole span, so that every ring row holds again what it held
        (attention on torch's path reads every ring row up to a call's end and masks the window: a row left with
        another request's values - a NaN - would reach the sum)."""
        return max(0, n - self.rings[0].span_rows())

    def save(self, device: torch.device | str = "cpu") -> list[Tensor]:
        """The verified rows [0, n) at every depth (a windowed depth's ring: the rows of its span), copied off the
        pool (a preempted sequence swapped out)."""
        out = []
        for i, (tensors, table) in enumerate(self._depth_tables()):
            idx = table.rows[(self._ring_saved(self.n) if i else 0): self.n]
            out += [t.index_select(-2, idx).to(device) for t in tensors]
        return out

    def restore(self, saved: list[Tensor]) -> None:
        """Write rows saved by ``save`` back as this (empty) cache's verified prefix (rings: as many of their last
        rows as the rings it has now hold - they may be shorter than those it was swapped out with)."""
        m = saved[0].shape[-2]
        if m > self.table.backed:
            raise ValueError(f"{m} saved rows do not fit the {self.table.backed} rows its blocks back")
        at = 0
        for i, (tensors, table) in enumerate(self._depth_tables()):
            count = min(saved[at].shape[-2], m - (self._ring_saved(m) if i else 0))
            idx = table.rows[m - count: m]
            for t in tensors:
                if i:         # ring rows not restored (a longer ring than it left with) hold zeros, not a stranger's
                    t.index_fill_(-2, table.rows[: table.span_rows()], 0)
                t.index_copy_(-2, idx, saved[at][..., saved[at].shape[-2] - count:, :].to(t.device))
                at += 1
        self.n = m


class BatchCache:
    """The caches of the sequences of one batched call (``attention.RaggedSpan``), in segment order: each layer
    view is a ``BatchKV`` of their per-sequence views (built once per call and key)."""

    def __init__(self, caches: list):
        self.caches = caches
        self._kv: dict[tuple, BatchKV] = {}

    def _get(self, key: tuple, make) -> BatchKV:
        kv = self._kv.get(key)
        if kv is None:
            kv = self._kv[key] = BatchKV([make(c) for c in self.caches])
        return kv

    def prelude_kv(self, layer: int) -> BatchKV:
        return self._get(("prelude", layer), lambda c: c.prelude_kv(layer))

    def coda_kv(self, layer: int) -> BatchKV:
        return self._get(("coda", layer), lambda c: c.coda_kv(layer))

    def core_kv(self, layer: int, read: tuple[int, int], own: tuple[int, int]) -> BatchKV:
        return self._get((layer, read, own), lambda c: c.core_kv(layer, read, own))
