"""Per-generation statistics: verification events, accepted lengths (A, eq. 9), committed progress (G, eq. 10),
sequential core passes and position-updates spent drafting and verifying, and draft / verify / prefill time."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..base.contract import Counts


@dataclass
class GenerationStats:
    method: str = "ar"
    prompt_tokens: int = 0
    cached_tokens: int = 0       # prompt rows copied from a prefix cache instead of prefilled
    new_tokens: int = 0
    accepted: list[int] = field(default_factory=list)   # a_b: draft tokens retained per verification event
    target_tokens: list[int] = field(default_factory=list)  # u_b: 1 if the target's correction/bonus was retained
    proposed: list[int] = field(default_factory=list)   # w_b: proposals handed to the verifier
    prefill_passes: int = 0      # sequential core passes (each = one core_step call) in prefill
    draft_passes: int = 0
    verify_passes: int = 0
    draft_updates: int = 0       # core position-updates (sum of W over core_step calls)
    verify_updates: int = 0
    prefill_updates: int = 0
    prefill_time: float = 0.0    # seconds
    draft_time: float = 0.0
    verify_time: float = 0.0
    wall_time: float = 0.0
    stop_reason: str = ""
    cache_bytes: int = 0                 # the depth cache allocated for this request
    peak_memory: int | None = None       # CUDA: peak allocated; CPU: peak resident set of the process
    choices: dict[str, int] = field(default_factory=dict)   # method auto: steps per drafter it chose

    def add(self, c: Counts) -> None:
        """What the request spent in a step (``contract.Counts``, as the executor reported it)."""
        self.prefill_passes += c.prefill_passes
        self.draft_passes += c.draft_passes
        self.verify_passes += c.verify_passes
        self.prefill_updates += c.prefill_updates
        self.draft_updates += c.draft_updates
        self.verify_updates += c.verify_updates
        self.prefill_time += c.prefill_time
        self.draft_time += c.draft_time
        self.verify_time += c.verify_time
        for arm, n in c.choices.items():
            self.choices[arm] = self.choices.get(arm, 0) + n

    def record(self, proposed: int, accepted: int, target_token: bool) -> None:
        """One verification event: w_b proposals, a_b accepted (and kept), u_b."""
        self.proposed.append(proposed)
        self.accepted.append(accepted)
        self.target_tokens.append(int(target_token))

    @property
    def verify_events(self) -> int:
        return len(self.accepted)

    @property
    def A(self) -> float:
        """Mean accepted draft tokens per verification (eq. 9)."""
        return sum(self.accepted) / len(self.accepted) if self.accepted else 0.0

    @property
    def G(self) -> float:
        """Mean committed tokens per verification, target correction/bonus included (eq. 10)."""
        if not self.accepted:
            return 0.0
        return (sum(self.accepted) + sum(self.target_tokens)) / len(self.accepted)

    @property
    def sequential_passes(self) -> int:
        """Sequential core passes for the whole request (prefill + drafting + verification)."""
        return self.prefill_passes + self.draft_passes + self.verify_passes

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "method": self.method, "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
            "new_tokens": self.new_tokens,
            "verify_events": self.verify_events, "A": self.A, "G": self.G,
            "accepted": self.accepted, "target_tokens": self.target_tokens, "proposed": self.proposed,
            "prefill_passes": self.prefill_passes, "draft_passes": self.draft_passes,
            "verify_passes": self.verify_passes, "sequential_passes": self.sequential_passes,
            "draft_updates": self.draft_updates, "verify_updates": self.verify_updates,
            "prefill_updates": self.prefill_updates,
            "prefill_time": self.prefill_time, "draft_time": self.draft_time, "verify_time": self.verify_time,
            "wall_time": self.wall_time, "tokens_per_second": self.tokens_per_second,
            "stop_reason": self.stop_reason, "cache_bytes": self.cache_bytes, "peak_memory": self.peak_memory,
            "choices": dict(self.choices),
        }
