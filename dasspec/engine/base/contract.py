"""What the scheduler and the executor exchange: a ``StepPlan`` in, a ``StepOutput`` out - plain, picklable values
(ids, token ids, block ids, enums, numbers, a drafter named by its registry key), so the executor can run in
another process (``remote.py``) and a tensor-parallel or GPU runner can take its place.

    plan = scheduler.schedule()            # who starts, who is swapped out / in, per request its work
    out = executor.execute(plan)           # per request what it committed; per step what was measured
    processor.apply(scheduler.update(plan, out), out)    # stop rules, then events, streams, statistics

Nothing here holds a callable or a live object, and nothing a tensor but a trace (a request's (Draft, Verdict)
pairs, when it asked for them).  What the executor measured travels back in the output
(the step's seconds per phase, rows verified and drafted; per request its passes and updates), and only the output
processor (``output.py``) turns it into a request's ``GenerationStats``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ...model.exit import ExitRule
from .sampling import Sampling


class _Name(str, Enum):
    """An enum whose members are their names as strings (``== "eos"`` holds, JSON writes "eos")."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Phase(_Name):
    PREFILL = "prefill"
    DRAFT = "draft"
    VERIFY = "verify"


class Status(_Name):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class StopReason(_Name):
    EOS = "eos"
    STOP_STRING = "stop_string"
    MAX_NEW_TOKENS = "max_new_tokens"
    STOPPING_CRITERIA = "stopping_criteria"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    ERROR = "error"


@dataclass(frozen=True)
class DrafterKey:
    """A drafter by its registry name, knobs (sorted items) and token choice; the executor builds (or keeps) the
    drafter it names.  ``handle`` names a drafter object handed to an in-process engine instead (``DrafterCache``)."""

    method: str
    knobs: tuple[tuple[str, Any], ...] = ()
    sampled: bool = False
    handle: int | None = None


@dataclass
class StartRequest:
    """A request the executor sets up this step: its prompt, how to decode it, and the rows it starts with
    (``cached``: shared prompt blocks already in its first blocks; ``copy``: blocks [a, b) to copy from the prefix
    cache registered as ``copy[0]``; ``window_rows``: in a pool with windowed depths, the shared prompt's last rows
    at depths >= 2, copied into its rings - (depth r, prompt block q, the pool block holding block q at depth r))."""

    id: int
    tokens: list[int]
    drafter: DrafterKey
    width: int                         # the drafter's width (verifier inputs its scratch rows are sized for)
    max_rows: int
    max_new_tokens: int
    init_scale: float = 1.0
    state_seed: int = 0
    sampling: Sampling | None = None   # None: greedy
    exit: ExitRule | None = None
    deadline: float | None = None      # time.monotonic() past which it stops (checked between drafting rounds)
    trace: bool = False
    cached: int = 0
    copy: tuple[int, int, int] | None = None
    window_rows: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class Work:
    """One request's work this step: its table cut to ``keep`` blocks (when set) and ``new_blocks`` appended, then
    either prompt rows [start, end) to prefill (whole blocks, ``end`` may be the prompt's end; or, with ``depths``,
    core steps (r0, r1] of the one block [start, end)) or one drafting + verification round under ``room``
    (tokens it may still commit) and ``cap`` (proposals; 0: a plain AR step)."""

    id: int
    new_blocks: list[int] = field(default_factory=list)
    prefill: tuple[int, int] | None = None
    depths: tuple[int, int] | None = None   # a depth slice of the prefill block: core steps (r0, r1] (None: all)
    room: int = 0
    cap: int | None = None
    keep: int | None = None            # its table keeps only its first ``keep`` blocks (scratch handed back)
    # windowed depths: prompt blocks this step completes whose rings' rows are kept for later requests to share -
    # (depth r, prompt block q, the pool block its rows at depth r are copied to once the step has computed them)
    keep_window: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def most(self) -> int:
        """The most tokens its verification may commit: its room, and at most one past its cap of proposals."""
        return self.room if not self.cap else min(self.room, self.cap + 1)


@dataclass
class StepPlan:
    step: int
    start: list[StartRequest] = field(default_factory=list)
    swap_out: list[int] = field(default_factory=list)     # rows to host memory, blocks released, state kept
    swap_in: list[tuple[int, list[int]]] = field(default_factory=list)   # (id, blocks to restore its rows into)
    rings: dict[int, list[int]] = field(default_factory=dict)   # windowed depths: the rings of requests that start
                                                                # or are swapped in (``core/blocks.py``)
    work: list[Work] = field(default_factory=list)
    release: list[int] = field(default_factory=list)      # finished or aborted since the last plan: state dropped
    closed: bool = False               # a closed batch (``Scheduler.closed``) in which no request waits for a slot

    @property
    def rows(self) -> int:
        return sum(w.prefill[1] - w.prefill[0] for w in self.work if w.prefill)

    @property
    def empty(self) -> bool:
        return not (self.work or self.swap_out or self.swap_in or self.release)


@dataclass(frozen=True)
class PassTiming:
    """What the executor measured of one step's verification pass, handed after the step to every drafter that
    had a draft in it (``Drafter.measured``): the cost model of method auto is fitted on these, never on wall-clock
    gaps between its calls.  Read after the step's one device synchronisation (CUDA events), so no drafter syncs."""

    seconds: float            # the full-depth pass over every draft and the prompt blocks riding along
    rows: int                 # the drafts' verifier inputs (every request's, whatever its drafter)
    requests: int             # requests verified
    prefill_rows: int         # prompt rows that rode in the same pass (their cost is in ``seconds``)
    draft_seconds: float      # the step's drafting, every drafter's (and the sessions' learning from verdicts)
    host_seconds: float = 0.0  # the rest of the executor's step (batching, acceptance, commits; not a prompt's
                               # depth slices run beside the pass): paid once a step


@dataclass
class PhaseSeconds:
    """Seconds spent per phase."""

    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0

    def charge(self, phase: Phase, seconds: float) -> None:
        if phase is Phase.PREFILL:
            self.prefill_time += seconds
        elif phase is Phase.DRAFT:
            self.draft_time += seconds
        else:
            self.verify_time += seconds


@dataclass
class Counts(PhaseSeconds):
    """What one request spent in one step: sequential core passes and position-updates per phase, the seconds of
    the passes it took part in (shared passes are charged to each of their requests), and the arm method auto
    drafted it with."""

    prefill_passes: int = 0
    draft_passes: int = 0
    verify_passes: int = 0
    prefill_updates: int = 0
    draft_updates: int = 0
    verify_updates: int = 0
    choices: dict[str, int] = field(default_factory=dict)

    def count(self, phase: Phase, passes: int, updates: int) -> None:
        if phase is Phase.PREFILL:
            self.prefill_passes += passes
            self.prefill_updates += updates
        elif phase is Phase.DRAFT:
            self.draft_passes += passes
            self.draft_updates += updates
        else:
            self.verify_passes += passes
            self.verify_updates += updates

    def choose(self, arm: str) -> None:
        self.choices[arm] = self.choices.get(arm, 0) + 1


@dataclass
class RequestOutput:
    id: int
    tokens: list[int] = field(default_factory=list)   # committed this step, before the stop rule
    prefilled: int = 0                                # prompt rows materialised this step
    verdict: tuple[int, int, bool] | None = None      # (proposals, accepted, target token committed)
    counts: Counts = field(default_factory=Counts)    # spent this step
    trace: list = field(default_factory=list)         # (Draft, Verdict) of this step, when traced


@dataclass
class StepOutput(PhaseSeconds):
    """Per request what it committed and spent; per step the passes' own seconds (a shared pass counted once) and
    the rows it verified (the drafts' verifier inputs; prompt rows are each request's ``prefilled``) and drafted
    (position-updates)."""

    requests: dict[int, RequestOutput] = field(default_factory=dict)
    failed: list[tuple[int, str]] = field(default_factory=list)   # requests whose setup raised: (id, the error)
    rows_verified: int = 0
    rows_drafted: int = 0
