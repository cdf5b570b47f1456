"""Sequential self-speculation (draft depth d, block b) and Mature-Spec.

Each block drafts b tokens one after another, each with d core steps from its own initial state; step j reads the
verified prefix at depths (kappa, nu) = policy(j, R) and the earlier drafts of this block at depth j (their K/V
from the same draft step, stored in scratch rows).  Self-speculation uses Aligned reads (kappa = nu = j);
Mature-Spec uses Deep K/V (kappa = nu = R); Deep V (Mature-V), Deep K or explicit depths are knobs.
The b proposals go to the independent full-depth verifier as a chain (the paper's, without bonus token).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import Tensor

from ..engine.draft import Draft, Drafter
from ..engine.request import Request
from ..model.policy import ReadPolicy, parse_policy
from . import Method, register
from .knobs import FAMILY, Knobs, positive_int, knob


@dataclass(frozen=True)
class SequentialKnobs(Knobs):
    draft_depth: int = knob(FAMILY, "sequential draft depth d", short="-d")
    block: int = knob(FAMILY, "sequential draft block length b", short="-b")
    policy: str | ReadPolicy = knob("aligned", "prefix read policy: aligned | deep-v (mature-v) | deep-k | "
                                    "deep-kv | k=..,v=..", parse=str)

    @classmethod
    def fit(cls, values: dict, explicit: set, R: int) -> dict:
        # A default draft depth must not exceed a shallower call (num_steps): draft at most R - 1 deep.
        if "draft_depth" not in explicit and isinstance(values["draft_depth"], int) and R > 1:
            values["draft_depth"] = min(values["draft_depth"], R - 1)
        return values

    def validate(self, R: int) -> "SequentialKnobs":
        positive_int(self, "draft_depth", "block")
        if self.draft_depth >= R:
            raise ValueError(f"draft_depth must be < R (num_steps={R}), got {self.draft_depth}")
        policy = parse_policy(self.policy)
        policy.depths(self.draft_depth, R)          # explicit depths must lie in 1..R
        return replace(self, policy=policy)


@dataclass(frozen=True)
class SelfSpecKnobs(SequentialKnobs):
    method = "self-spec"


@dataclass(frozen=True)
class MatureSpecKnobs(SequentialKnobs):
    method = "mature-spec"
    draft_depth: int = knob(4, "sequential draft depth d", short="-d")
    policy: str | ReadPolicy = knob("deep-kv", "prefix read policy: aligned | deep-v (mature-v) | deep-k | "
                                    "deep-kv | k=..,v=..", parse=str)


def propose_sequential(req: Request, d: int, b: int, policy: ReadPolicy) -> Tensor:
    """Draft b tokens after the anchor at depth d, in place in the token scratch; returns them."""
    n, R = req.n, req.R
    tokens = req.scratch(b)
    reads = [policy.depths(j, R) for j in range(1, d + 1)]       # hoisted out of the token loop
    for i in range(b):
        row = n + i
        span = req.span(row, 1)
        inj = req.prelude(req.tokens[row: row + 1].unsqueeze(0), span)
        h = req.h0[:, row: row + 1]
        for j, read in enumerate(reads, 1):
            h = req.core_step(h, inj, span, read, own=(j, j))
        tokens[i] = req.choose(req.readout(h, span)[0], row)[-1]
    req.stats.count("draft", b * d, b * d)
    return tokens


class SequentialDrafter(Drafter):
    width_knobs = ("block",)
    def __init__(self, knobs: SequentialKnobs):
        self.knobs = knobs
        self.name = knobs.method
        self.width = knobs.block

    def propose(self, req: Request) -> Draft:
        k = self.knobs
        return Draft(propose_sequential(req, k.draft_depth, min(k.block, req.budget), k.policy))


register(Method("self-spec", SelfSpecKnobs, SequentialDrafter))
register(Method("mature-spec", MatureSpecKnobs, SequentialDrafter))
