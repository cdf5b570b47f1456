"""Early-exit targets (Ouro): which recurrence step's state each position's logits are read from.

A family with an exit gate (``Family.exit_gate``) scores every step's state with one logit g_t.  As upstream's
``OuroForCausalLM.forward`` does, with T steps (t = 0..T-1, 0-based):

    lambda_t = sigmoid(g_t);   p_t = lambda_t * prod_{j<t} (1 - lambda_j)  for t < T-1,   p_{T-1} = what remains
    exit_threshold tau:  the first t whose cumulative sum of p reaches tau (the last step if none does)
    exit_at_step s:      step s for every position

Every step of every position is still computed (and its K/V stored): the rule only picks whose state the head
reads.  So the target stays a deterministic function of the prefix, and a verifier that computes every step
anyway checks drafts against it unchanged (``Recurrence.full_depth(..., exit=rule)``).  The arithmetic (order,
dtype: the model's) follows upstream's, so a position near the threshold exits where upstream's does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from .layers import sigmoid


@dataclass(frozen=True)
class ExitRule:
    """``threshold`` (tau in [0, 1]) or ``step`` (0-based, as upstream's ``exit_at_step``): exactly one."""

    threshold: float | None = None
    step: int | None = None

    def __post_init__(self):
        if (self.threshold is None) == (self.step is None):
            raise ValueError("give exit_threshold or exit_at_step, not both" if self.step is not None
                             else "an exit rule needs exit_threshold or exit_at_step")
        if self.threshold is not None:
            tau = self.threshold
            if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) \
                    or not 0 <= tau <= 1:
                raise ValueError(f"exit_threshold must be a number in [0, 1], got {tau!r}")
        elif isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ValueError(f"exit_at_step must be a whole number >= 0 (0-based), got {self.step!r}")

    @classmethod
    def of(cls, exit_threshold: float | None = None, exit_at_step: int | None = None) -> "ExitRule | None":
        """The rule the two options ask for; None when neither is given (the last step: the default target)."""
        if exit_threshold is None and exit_at_step is None:
            return None
        return cls(exit_threshold, exit_at_step)

    def check_depth(self, R: int) -> "ExitRule":
        """Refuse a step the call does not run (upstream silently falls back to the threshold rule instead)."""
        if self.step is not None and self.step >= R:
            raise ValueError(f"exit_at_step={self.step} is beyond the {R} recurrence steps of this call "
                             f"(0-based: 0..{R - 1})")
        return self

    def exit_steps(self, gates: list[Tensor]) -> Tensor:
        """Per position, the 0-based step whose state is read: ``gates`` [B, W] per step (the gate logits)."""
        last = len(gates) - 1
        if self.step is not None:
            return torch.full_like(gates[0], self.step, dtype=torch.long)
        remaining = torch.ones_like(gates[0])
        pdf = []
        for t, g in enumerate(gates):
            lam = sigmoid(g)                                   # the kernel's on a CPU: a value's bits its own
            if t < last:
                pdf.append(lam * remaining)
                remaining = remaining * (1.0 - lam)
            else:
                pdf.append(remaining)
        reached = torch.cumsum(torch.stack(pdf, dim=-1), dim=-1) >= self.threshold
        first = reached.float().argmax(dim=-1)                 # the first step that reaches tau
        return torch.where(reached.any(dim=-1), first, last)

    def select(self, states: list[Tensor], gate: Callable[[Tensor], Tensor]) -> Tensor:
        """The state [B, W, d] each position exits with, from every step's state (``gate``: state -> logits)."""
        if self.step is not None:
            return states[self.step]
        steps = self.exit_steps([gate(s) for s in states])
        stacked = torch.stack(states, dim=2)                                     # [B, W, T, d]
        index = steps[:, :, None, None].expand(-1, -1, 1, stacked.shape[-1])
        return stacked.gather(2, index).squeeze(2)
