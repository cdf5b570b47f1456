"""Request: the state of one generation - one row of the engine's table - shared by the engine, the verifier and
the request's drafting session.

Holds its depth cache (a range of the engine's pool, or a cache of its own), the token buffer, the per-position
initial states, the stop rule, the token choice and the statistics, and exposes the model's three primitives bound
to this request's cache:

    e = req.prelude(ids, span)                     # writes prelude K/V at the span's rows
    h = req.core_step(h, e, span, read, own=None)  # one recurrence; prefix read at (kappa, nu) = read
    z = req.readout(h, span)                       # coda + head, float32 logits

Invariant between steps: the committed tokens are ``tokens[:L]`` with ``L = cache.n + 1``; the last committed
token (the *anchor*, at position ``n``) has been emitted but not yet materialised - the next target pass does
that.  Rows and token slots at or beyond ``L`` are scratch for drafts: ``scratch(w)`` hands out the token slots,
checked against the capacity the drafter's ``width`` reserved.  What a drafting session may read and the one
budget rule (``room``) are stated in ``draft.py``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

from ..model.attention import Span
from ..model.cache import CacheCapacityError, DepthCache
from ..model.looped import LoopedLM
from .memory import check_cache_fits, peak_memory, reset_peak_memory
from .runtime import DEFAULT, Runtime
from .stats import GenerationStats, PhaseTimer
from .stopping import StopRule

if TYPE_CHECKING:
    from ..model.exit import ExitRule
    from .prefix_cache import PrefixCache

# (logits [W, V], positions: the first row's position or a tensor of every row's) -> chosen tokens [W]
TokenChoice = Callable[[Tensor, "int | Tensor"], Tensor]


def greedy(logits: Tensor, positions: "int | Tensor") -> Tensor:
    return logits.argmax(-1)


class DraftCapacityError(CacheCapacityError):
    """A draft needs more verifier rows than its drafter's declared ``width`` reserved."""


def rows_needed(block_size: int, prompt: int, max_new_tokens: int, width: int) -> int:
    """Cache rows one request can ever touch: its prompt and output, plus the scratch its drafter's widest draft
    writes past the last committed token (a verifier block of ``width`` inputs plus its last proposal)."""
    return min(prompt + max_new_tokens + width + 1, block_size + width + 1)


class Request:
    def __init__(self, model: LoopedLM, prompt: list[int], stop: StopRule, num_steps: int | None = None,
                 init_scale: float = 1.0, seed: int = 0, width: int = 1, method: str = "ar",
                 streamer=None, prefix_cache: "PrefixCache | None" = None, runtime: Runtime = DEFAULT,
                 choose: TokenChoice = greedy, cache: DepthCache | None = None, exit: "ExitRule | None" = None):
        cfg = model.config
        self.model = model
        self.R = model.depth(num_steps)
        P = len(prompt)
        if P == 0:
            raise ValueError("empty prompt: give at least one token (most tokenizers add BOS)")
        self.P = P
        self.prompt = prompt
        self.stop = stop
        if prefix_cache is not None:
            prefix_cache.check(model, self.R, init_scale, seed)
        self.prefix_cache = prefix_cache
        need_ctx = P + stop.max_new_tokens
        if need_ctx > cfg.block_size:
            raise ValueError(f"prompt ({P} tokens) + max_new_tokens ({stop.max_new_tokens}) = {need_ctx} exceeds the "
                             f"model context of {cfg.block_size} positions")
        self.width = width
        self.capacity = rows_needed(cfg.block_size, P, stop.max_new_tokens, width)
        device, dtype = model.device, model.dtype
        self.runtime = runtime
        if cache is None:                   # a request of its own (not the engine's pool)
            check_cache_fits(model, self.R, self.capacity, "lower max_new_tokens or num_steps, or use bfloat16")
            if runtime.track_memory:
                reset_peak_memory(device)
            cache = DepthCache(cfg, self.R, self.capacity, device, dtype, zeroed=runtime.static_shapes)
            runtime.prepare_cache(cache.tensors())
        elif cache.capacity < self.capacity or cache.R != self.R or cache.n:
            raise ValueError(f"a request needs an empty cache of {self.capacity} rows at R={self.R}")
        self.cache = cache
        self.net = runtime.primitives(model)
        self.tokens = torch.zeros(self.capacity + 1, dtype=torch.long, device=device)
        self.tokens[:P] = torch.as_tensor(prompt, dtype=torch.long, device=device)
        positions = torch.arange(self.capacity, device=device)
        self.h0 = model.initial_state(positions, init_scale, seed).unsqueeze(0)   # [1, capacity, d]
        self.choose = choose
        self.generated: list[int] = []
        self.done = False
        self.prefilled = 0                  # prompt rows materialised (the engine prefills in chunks)
        self.cancelled = False              # set by Engine.cancel: stops at the next step (or drafting round)
        self.deadline: float | None = None  # time.monotonic() after which the request stops ("timeout")
        self.streamer = streamer
        self.trace: list | None = None      # (Draft, Verdict) per block, when asked for
        self.exit = exit                    # the target's exit rule (Ouro's early exit; None: the last step)
        self.stats = GenerationStats(method=method, prompt_tokens=P, cache_bytes=cache.bytes_per_token * self.capacity)
        self.timer = PhaseTimer(self.stats, device)
        self._t0 = time.perf_counter()

    # --- positions -----------------------------------------------------------------------------------
    @property
    def n(self) -> int:
        """Materialised (verified) rows; also the position of the anchor."""
        return self.cache.n

    @property
    def budget(self) -> int:
        """Tokens still allowed by max_new_tokens."""
        return self.stop.max_new_tokens - len(self.generated)

    @property
    def room(self) -> int:
        """The most tokens the next verification may commit (the one budget rule, ``draft.py``): a verifier input
        at depth D below the anchor yields the token after it, so inputs lie at depths <= room - 1."""
        return self.budget

    @property
    def depth_limit(self) -> int:
        """The deepest a draft node may lie below the anchor: its position must be inside the model context."""
        return self.model.config.block_size - 1 - self.n

    @property
    def static_shapes(self) -> bool:
        """Model calls run with fixed shapes (compiled / CUDA graphs): host-side shortcuts that depend on values
        (a window recomputed from its first changed guess) are off."""
        return self.runtime.static_shapes

    def draft_slots(self, w: int) -> Tensor:
        """The anchor's token slot followed by w scratch slots (``tokens[n : n + 1 + w]``): a draft's nodes, written
        in place (node 0, the anchor, must stay)."""
        self.check_fits(w + 1, w + 1)
        return self.tokens[self.n: self.n + 1 + w]

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def stopping(self) -> str | None:
        """Why this request must stop now (cancelled, past its deadline), or None - asked between steps and between
        a drafter's rounds."""
        if self.cancelled:
            return "cancelled"
        if self.deadline is not None and time.monotonic() > self.deadline:
            return "timeout"
        return None

    def scratch(self, w: int) -> Tensor:
        """The token slots of w proposals after the anchor (``tokens[n + 1 : n + 1 + w]``), for drafters that
        write their proposals in place."""
        self.check_fits(w + 1, w + 1)
        return self.tokens[self.n + 1: self.n + 1 + w]

    def check_fits(self, rows: int, slots: int) -> None:
        """A draft of ``rows`` verifier inputs and ``slots`` token slots (anchor included) must fit the cache:
        the prompt + max_new_tokens rows, plus the drafter's declared ``width`` of scratch."""
        n = self.n
        if n + rows > self.capacity or n + slots > self.capacity + 1:
            raise DraftCapacityError(
                f"a draft of {max(rows, slots)} positions at row {n} does not fit the request's {self.capacity} "
                f"cache rows (prompt + max_new_tokens + the drafter's width {self.width}); a drafter must declare "
                "a width that covers its drafts beyond the remaining budget")

    def span(self, start: int, W: int, positions: Tensor | None = None, mask: Tensor | None = None) -> Span:
        """The model span for queries at rows [start, start+W) over the current verified prefix (the static-shape
        form when the runtime asks for it)."""
        return self.model.span(self.cache.n, start, W, positions=positions, mask=mask,
                               static_capacity=self.cache.capacity if self.runtime.static_shapes else None)

    def initial(self, start: int, W: int, positions: Tensor | None = None) -> Tensor:
        """The target's initial states of rows [start, start + W) (or of ``positions``): [1, W, d]."""
        return self.h0[:, start: start + W] if positions is None else self.h0[:, positions]

    # --- the three primitives on this request's cache -------------------------------------------------
    def prelude(self, ids: Tensor, span: Span) -> Tensor:
        return self.net.prelude(ids, span, self.cache)

    def core_step(self, h: Tensor, inj: Tensor, span: Span, read: tuple[int, int],
                  own: tuple[int, int] | None = None) -> Tensor:
        return self.net.core_step(h, inj, span, self.cache, read=read, own=own)

    def readout(self, h: Tensor, span: Span, rows: slice | None = None) -> Tensor:
        return self.net.readout(h, span, self.cache, rows=rows)

    # --- the full-depth target pass --------------------------------------------------------------------
    def target_pass(self, start: int, W: int, positions: Tensor | None = None,
                    mask: Tensor | None = None, logit_rows: slice | None = None, phase: str = "verify") -> Tensor:
        """Run the target at full depth on token slots [start, start+W) over the verified prefix: prelude, R
        aligned core steps from the target's own initial states (never draft states), readout.  Writes the
        block's K/V at every depth into scratch rows [start, start+W).  Returns float32 logits [W', V].
        Counts R sequential core passes and R*W position-updates for ``phase`` (verify or prefill)."""
        self.stats.count(phase, self.R, self.R * W)
        span = self.span(start, W, positions=positions, mask=mask)
        ids = self.tokens[start: start + W].unsqueeze(0)
        return self.net.full_depth(ids, self.initial(start, W, positions), span, self.cache, self.R, logit_rows,
                                   exit=self.exit)[0]

    def load_prefix(self) -> int:
        """Copy the prompt's longest common prefix with the prefix cache (if any) into this cache: the rows a
        prefill need not compute (``stats.cached_tokens``)."""
        m = self.prefix_cache.reusable(self.prompt) if self.prefix_cache is not None else 0
        if m:
            self.cache.load_prefix(self.prefix_cache.cache, m)
            self.stats.cached_tokens = m
        self.prefilled = m
        return m

    def prefill(self) -> None:
        """Materialise the whole prompt at every depth in one pass and emit the first token.  With a prefix cache,
        the rows of the prompt's longest common prefix with it are copied and only the rest is run."""
        with self.timer("prefill"):
            m = self.load_prefix()
            logits = self.target_pass(m, self.P - m, logit_rows=slice(-1, None), phase="prefill")
            self.prefilled_chunk(self.P - m, logits)

    def prefilled_chunk(self, c: int, logits: Tensor | None) -> None:
        """Prompt rows [prefilled, prefilled + c) were materialised; ``logits``: the last prompt row's (when this
        chunk ends the prompt), from which the first token is chosen and emitted."""
        self.cache.commit(c)
        self.prefilled += c
        if self.prefilled == self.P:
            first = int(self.choose(logits, self.P - 1)[-1])
            self.tokens[self.P] = first
            self.emit([first])

    # --- committing ------------------------------------------------------------------------------------
    def emit(self, chunk: list[int]) -> int:
        """Append committed tokens, applying the stop rule inside the chunk; returns how many were kept."""
        start = len(self.generated)
        self.generated.extend(chunk)
        hit = self.stop.scan(self.generated, start)
        if hit is not None:
            keep, reason = hit
            del self.generated[keep:]
            self.done = True
            self.stats.stop_reason = reason
        kept = len(self.generated) - start
        if self.streamer is not None and kept:
            self.streamer.put(torch.tensor([chunk[:kept]]))
        return kept

    def end(self, reason: str) -> None:
        """Stop here (cancelled, timeout): what was committed stays."""
        self.done = True
        self.stats.stop_reason = reason

    def finish(self) -> GenerationStats:
        self.timer.finish()
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()
        self.stats.wall_time = time.perf_counter() - self._t0
        self.stats.new_tokens = len(self.generated)
        if self.runtime.track_memory:
            self.stats.peak_memory = peak_memory(self.model.device)
        if self.streamer is not None:
            self.streamer.end()
        return self.stats
