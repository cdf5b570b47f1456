"""PrefixCache: a shared prompt prefix's blocks, computed once and pinned, for requests in other engines - each
``dasspec.generate`` call is an engine of its own, so what one call prefilled is gone at the next.

    pc = dasspec.PrefixCache(model, tok.encode(few_shot_exemplars))
    out = dasspec.generate(model, tok.encode(few_shot_exemplars + question), "das-wave", prefix_cache=pc)

Within one engine (``generate_batch``, ``dasspec serve``) nothing needs to be asked: prompt blocks are shared
automatically (``core/blocks.py``).  A ``PrefixCache`` is an engine of its own that prefilled the prefix and holds its
full blocks; a request that starts with them gets copies of their rows in its engine's blocks (registered there for
sharing too) and prefills only the rest.  The rows are computed exactly as a request computes its own prompt blocks
(one attention segment per block), so they are the rows it would have computed: the request's tokens are its own
AR decode.  The cache is tied to the model, depth R, ``init_scale``, ``state_seed``, block size, exit rule, runtime
(static shapes, compiled) and, where torch's kernels compute the rows, the thread count it was built with - each can
change how a row rounds; a request that differs in any of them is refused with a message saying which.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ...model import decode_kernel
from ...model.cache import PagedCache
from ...model.looped import LoopedLM
from ..base.runtime import DEFAULT, Runtime
from ..core.blocks import BLOCK_SIZE, block_keys, prefix_salt
from .engine import Engine
from .options import as_token_list


def _execution(rt: Runtime) -> str:
    """What of a runtime decides how rows are computed (not ``track_memory``)."""
    return ", ".join(f"{k}={getattr(rt, k)}" for k in ("static_shapes", "compile", "cuda_graphs"))


def common_prefix(seqs: Sequence[Sequence[int]]) -> int:
    """Length of the longest token prefix every sequence shares (0 for none)."""
    if not seqs:
        return 0
    first = seqs[0]
    n = min(len(s) for s in seqs)
    return next((i for i in range(n) if any(s[i] != first[i] for s in seqs[1:])), n)


class PrefixCache:
    """The full blocks of ``ids`` at every depth 1..R plus the prelude and coda layers, for reuse across engines."""

    def __init__(self, model: LoopedLM, ids, num_steps: int | None = None, init_scale: float = 1.0,
                 state_seed: int = 0, block_size: int = BLOCK_SIZE, runtime: Runtime | None = None):
        """``runtime``: how the prefix's rows are computed - the requests that use the cache must run the same."""
        tokens = as_token_list(model, ids)
        m = len(tokens)
        if m == 0:
            raise ValueError("empty prefix: a prefix cache needs at least one token")
        if m >= model.config.block_size:
            raise ValueError(f"prefix of {m} tokens does not leave room in the model context of "
                             f"{model.config.block_size}")
        self.R = model.depth(num_steps)
        self.model, self.init_scale, self.state_seed, self.B = model, float(init_scale), int(state_seed), block_size
        self.tokens = tokens
        self.runtime = runtime or DEFAULT
        self.threads = torch.get_num_threads()      # torch's kernels (not ours) may round by thread count
        self.engine = Engine(model, "ar", num_steps=self.R, runtime=self.runtime, max_batch=1,
                             kv_budget=m + 2 * block_size, block_size=block_size, max_step_tokens=max(m, block_size),
                             window_kv=False)        # every depth of every row: what an engine's pool copies
        rid = self.engine.add(tokens, max_new_tokens=1, eos=False, init_scale=init_scale, state_seed=state_seed)
        with torch.inference_mode():
            while self.engine.has_work:
                self.engine.step()
        self.engine.result(rid)
        entry_keys = block_keys(tokens, block_size, self._salt(), m // block_size)
        self.blocks = self.engine.pool.lookup(entry_keys)         # pinned: referenced for the cache's life

    def _salt(self) -> bytes:
        return prefix_salt(self.R, self.init_scale, self.state_seed, None, self.model.dtype, self.B)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return len(self.blocks) * self.engine.pool.bytes_per_block

    def check(self, model: LoopedLM, R: int, init_scale: float, state_seed: int, block_size: int, exit,
              runtime: Runtime | None = None) -> None:
        """Refuse a request whose rows would differ from the cached ones (it runs under ``runtime``, now)."""
        diffs = []
        if model is not self.model:
            diffs.append("another model object")
        elif (model.device, model.dtype) != (self.engine.pool.cache.core_k.device, self.engine.pool.cache.core_k.dtype):
            diffs.append(f"the model now on {model.device} in {model.dtype}")
        if R != self.R:
            diffs.append(f"num_steps {R} (cache: {self.R})")
        if float(init_scale) != self.init_scale:
            diffs.append(f"init_scale {init_scale} (cache: {self.init_scale})")
        if int(state_seed) != self.state_seed:
            diffs.append(f"state_seed {state_seed} (cache: {self.state_seed})")
        if block_size != self.B:
            diffs.append(f"block size {block_size} (cache: {self.B})")
        if exit is not None:
            diffs.append("an early-exit target (the cache holds the last step's coda rows)")
        if _execution(runtime or DEFAULT) != _execution(self.runtime):
            diffs.append(f"runtime {_execution(runtime or DEFAULT)} (cache: {_execution(self.runtime)})")
        if torch.get_num_threads() != self.threads and not decode_kernel.thread_invariant(
                model.device, model.dtype, self.runtime.static_shapes or self.runtime.compile):
            diffs.append(f"{torch.get_num_threads()} torch threads (cache: {self.threads})")
        if diffs:
            raise ValueError("this prefix cache was built for other settings than the request's: "
                             + ", ".join(diffs) + "; build one PrefixCache per (model, num_steps, init_scale, "
                             "state_seed, block size, runtime, thread count)")

    def full_blocks(self, prompt: list[int]) -> int:
        """How many of the cached blocks ``prompt`` starts with."""
        return common_prefix([self.tokens[: len(self.blocks) * self.B], prompt]) // self.B

    def copy_blocks(self, dst: PagedCache, a: int, b: int) -> None:
        """Copy cached blocks [a, b) into blocks a..b-1 of ``dst``'s table (another engine's pool)."""
        B = self.B
        src_pool = self.engine.pool.cache
        dev = src_pool.core_k.device
        src = (torch.tensor(self.blocks[a:b], device=dev)[:, None] * B + torch.arange(B, device=dev)).flatten()
        idx = dst.table.rows[a * B: b * B]
        for t, s in zip(dst.tensors(), src_pool.tensors()):
            t.index_copy_(-2, idx, s.index_select(-2, src))
