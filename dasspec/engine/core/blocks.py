"""BlockPool: the engine's depth cache, allocated once and handed out in blocks of B positions - each block holds
its B positions at every depth 1..R, in the prelude and in the coda - with prompt blocks shared across requests.

A request holds a ``BlockTable`` (``model/cache.py``): the blocks it has written, taken as its tokens are computed
(plus the draft scratch of the current step), returned when it ends.  Nothing is reserved for its worst case.

Prefix sharing.  A full prompt block is keyed by everything that decides its rows: the tokens of the block and of
every block before it (a chain of SHA-256 digests) and the request's ``salt`` - depth R, the initial states'
``init_scale`` and ``state_seed``, the target's exit rule, the model's dtype.  A block whose rows are complete is
registered under its key; a later request whose prompt starts with the same blocks takes references to them and
skips their prefill.  The rows are the ones it would have computed: the engine prefills every prompt block as its
own attention segment (``executor.py``), so a block's rows depend on its key alone (docs/architecture.md).  A block
nobody references stays cached, keyed, until its memory is needed (least recently freed first).

Block 0 is the null block: never handed out, zeroed, where rows not yet backed point (static-shape reads).

Windowed depths (``window``; ``model/cache.py``): a block then holds its B positions at one depth.  A request's
depth-1 blocks are handed out as above; each depth r >= 2 takes a ring of ``ring_blocks`` blocks when the request
starts (or is swapped back in) and returns it when it ends - what the window and its widest call need, however long
the request grows (or, when those do not fit, what the window and a prompt chunk need: the request then takes AR
steps, as a request whose draft scratch does not fit does).  Prompt blocks are shared then as well: a request that
completes a prompt block also copies the block's rows at each depth r >= 2 out of its ring, into a block keyed by the
block's key and r (``window_key``; taken only from blocks that are free, or cached and unreferenced, and left cached,
unreferenced: memory no running request needs).  A later request shares the longest run of prompt blocks whose
depth-1 blocks and, at every depth r >= 2, the blocks of the window before the run's end are cached
(``window_blocks``): it references the depth-1 blocks as above and copies the others' rows into its rings, holding
those blocks for the step (where they do not fit beside its own, it starts unshared).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch

from ...model.cache import DepthCache, bytes_per_token
from ...model.looped import LoopedLM
from ...model.memory import check_cache_fits, format_bytes

BLOCK_SIZE = 16     # positions per block (docs/performance-journal.md, "Choosing the block size")
# Prompt rows a ring is sized to take a step beside the window before them (a request whose depths are windowed
# prefills no more a step than its rings hold: these, or its whole prompt where its rings never wrap); a longer
# chunk would cost ring memory for every running request (docs/families.md).
WINDOW_PREFILL_ROWS = 64


def call_rows(B: int, width: int) -> int:
    """The most rows one step writes for a request whose depths are windowed: a prompt chunk
    (``WINDOW_PREFILL_ROWS``, whole blocks), or its anchor and its drafter's scratch (width 0: AR steps)."""
    return max(-(-WINDOW_PREFILL_ROWS // B) * B, 1 + width)


def ring_blocks(window: int | None, R: int | None, B: int, call_rows: int, max_rows: int | None = None) -> int:
    """Blocks of a request's rings (every windowed depth's; 0 without windowed depths) when no call of it writes
    more than ``call_rows`` rows: a call at position n reads depth r's rows from n - window + 1 and writes up to
    n + call_rows - 1, so a ring must hold window - 1 + call_rows positions apart - or, for a request of at most
    ``max_rows`` rows, those rows (its ring then never wraps)."""
    if not window:
        return 0
    per = -(-(window - 1 + call_rows) // B)
    if max_rows is not None:
        per = min(per, -(-max_rows // B))
    return (R - 1) * per


def prefix_salt(R: int, init_scale: float, state_seed: int, exit, dtype, B: int) -> bytes:
    """What decides a prompt block's rows besides its tokens (``block_keys``)."""
    return hashlib.sha256(repr((R, float(init_scale), int(state_seed), repr(exit), str(dtype), B)).encode()).digest()


def window_key(key: bytes, depth: int) -> bytes:
    """The key of a prompt block's rows at windowed depth ``depth`` (the block's own key is its depth-1 rows')."""
    return hashlib.sha256(key + b"depth" + depth.to_bytes(4, "little")).digest()


def window_blocks(j: int, B: int, window: int) -> range:
    """The prompt blocks a request sharing the first ``j`` reads at a windowed depth: those holding the window
    before row j * B (a call at position n reads depth r's rows from n - window + 1)."""
    return range(max(0, j * B - window + 1) // B, j)


def block_keys(tokens: list[int], B: int, salt: bytes, count: int) -> list[bytes]:
    """The keys of the first ``count`` full blocks of ``tokens``: key j digests key j-1 and block j's tokens."""
    keys, h = [], hashlib.sha256(salt).digest()
    for j in range(count):
        block = tokens[j * B: (j + 1) * B]
        h = hashlib.sha256(h + b"".join(int(t).to_bytes(4, "little", signed=True) for t in block)).digest()
        keys.append(h)
    return keys


class BlockPool:
    def __init__(self, model: LoopedLM, R: int, positions: int, block_size: int = BLOCK_SIZE,
                 window: int | None = None):
        """``positions``: pool rows (with ``window``, rows of one depth: a request's depth-1 rows and its rings)."""
        window = window if window and R > 1 else None
        self._books(positions, block_size, bytes_per_token(model.config, R, model.dtype, window), R, window)
        check_cache_fits(model, R, self.num_blocks * block_size,
                         "lower kv_budget (positions kept for running requests) or use bfloat16", window)
        self.cache = DepthCache(model.config, R, self.num_blocks * block_size, model.device, model.dtype,
                                window=window)
        for t in self.cache.tensors():
            t[..., :block_size, :].zero_()                          # the null block

    @classmethod
    def accounting(cls, positions: int, block_size: int, bytes_per_token: int, R: int | None = None,
                   window: int | None = None) -> "BlockPool":
        """A pool that keeps the books only - no depth cache, no model: the scheduler runs on it unchanged
        (``benchmarks/sched_sim.py`` simulates a GPU's pool with it).  ``tensors`` raises."""
        pool = cls.__new__(cls)
        pool._books(positions, block_size, bytes_per_token, R, window if window and (R or 0) > 1 else None)
        pool.cache = None
        return pool

    def _books(self, positions: int, block_size: int, bytes_per_token: int, R: int | None,
               window: int | None) -> None:
        for name, v in (("kv_budget", positions), ("block_size", block_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {v!r}")
        self.R, self.window = R, window
        self.B = block_size
        self.num_blocks = -(-positions // block_size) + 1          # + the null block
        self.bytes_per_block = bytes_per_token * block_size
        self._free: set[int] = set(range(1, self.num_blocks))      # unreferenced, unkeyed
        self._ref = [0] * self.num_blocks
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()          # unreferenced, keyed: evicted oldest first
        self.evictions = 0

    # --- sizes ------------------------------------------------------------------------------------------------
    @property
    def capacity_blocks(self) -> int:
        """Blocks a request may ever hold (all but the null block)."""
        return self.num_blocks - 1

    @property
    def available(self) -> int:
        """Blocks that can be handed out now (free, or cached and unreferenced)."""
        return len(self._free) + len(self._lru)

    @property
    def in_use(self) -> int:
        return self.capacity_blocks - self.available

    @property
    def cached(self) -> int:
        return len(self._lru)

    def blocks_for(self, rows: int) -> int:
        return -(-rows // self.B)

    def ring_blocks(self, call_rows: int, max_rows: int | None = None) -> int:
        return ring_blocks(self.window, self.R, self.B, call_rows, max_rows)

    def describe(self) -> str:
        what = (f"{self.capacity_blocks} blocks of {self.B} positions "
                f"({self.capacity_blocks * self.B} positions, {format_bytes(self.num_blocks * self.bytes_per_block)})")
        if self.window:
            depths = "depth 2" if self.R == 2 else f"depths 2..{self.R}"
            what += f"; a row holds one depth, {depths} in rings per request (a window of {self.window} positions)"
        return what

    # --- taking and returning blocks ----------------------------------------------------------------------------
    def allocate(self, n: int, after: int | None = None, tail: bool = False) -> list[int] | None:
        """``n`` blocks, or None when fewer are available.  Free blocks first - ``after + 1``, ``after + 2``, ...
        while free (a sequence's blocks in order read as a slice, not a gather), else from the middle of the
        longest free run, so requests that grow side by side each have room to grow in order - then the least
        recently freed cached ones (their keys forgotten).  ``tail``: the last free blocks (a ring, read through
        its table whatever its order: kept out of the runs sequences grow in)."""
        if n > self.available:
            return None
        out: list[int] = []
        if tail and n <= len(self._free):
            out = sorted(self._free)[len(self._free) - n:]
            self._free.difference_update(out)
            for b in out:
                self._ref[b] = 1
            return out
        nxt = after + 1 if after is not None and after + 1 in self._free else self._room_start(n)
        while len(out) < n and nxt is not None and nxt in self._free:
            out.append(nxt)
            nxt += 1
        self._free.difference_update(out)
        if len(out) < n and self._free:
            rest = sorted(self._free)[: n - len(out)]
            self._free.difference_update(rest)
            out += rest
        while len(out) < n:
            b, _ = self._lru.popitem(last=False)
            del self._block_of[self._key_of.pop(b)]
            self.evictions += 1
            out.append(b)
        for b in out:
            self._ref[b] = 1
        return out

    def _room_start(self, n: int) -> int | None:
        """Where a sequence that cannot continue in place starts (``n`` blocks now): in the longest run of free
        blocks, at its start when nothing before it can grow into it (the pool's start, a cached block), else
        halfway - leaving the first half to the sequence that ends before it - or as far in as ``n`` blocks in
        order allow."""
        best, best_len, start, prev = None, 0, None, None
        for b in sorted(self._free):
            if prev is None or b != prev + 1:
                start = b
            if b - start + 1 > best_len:
                best, best_len = start, b - start + 1
            prev = b
        if best is None or best == 1 or self._ref[best - 1] <= 0:
            return best
        return best + min(best_len // 2, max(0, best_len - n))

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; an unreferenced keyed block stays cached (most recent last)."""
        for b in blocks:
            if self._ref[b] <= 0:
                raise RuntimeError(f"block {b} freed more often than taken")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if b in self._key_of:
                    self._lru[b] = None
                else:
                    self._free.add(b)

    # --- prefix sharing -------------------------------------------------------------------------------------
    def lookup(self, keys: list[bytes]) -> list[int]:
        """The cached blocks of the longest run of ``keys`` from the first, each now referenced once more."""
        out = []
        for k in keys:
            b = self._block_of.get(k)
            if b is None:
                break
            if self._ref[b] == 0:
                del self._lru[b]
            self._ref[b] += 1
            out.append(b)
        return out

    def cached_run(self, keys: list[bytes]) -> int:
        """How many of ``keys``, from the first, name cached blocks (no reference taken)."""
        n = 0
        while n < len(keys) and keys[n] in self._block_of:
            n += 1
        return n

    def register(self, block: int, key: bytes) -> None:
        """Block ``block`` now holds the complete rows of the prompt block keyed ``key`` (kept if none does yet)."""
        if key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = key

    def tensors(self) -> tuple[torch.Tensor, ...]:
        if self.cache is None:
            raise RuntimeError("an accounting-only pool (BlockPool.accounting) holds no tensors")
        return self.cache.tensors()
