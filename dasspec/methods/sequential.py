"""Sequential self-speculation (draft depth d, block b) and Mature-Spec.

Each block drafts b tokens one after another, each with d core steps from its own initial state; step j reads the
verified prefix at depths (kappa, nu) = policy(j, R) and the earlier drafts of this block at depth j (their K/V
from the same draft step, stored in scratch rows).  Self-speculation uses Aligned reads (kappa = nu = j);
Mature-Spec uses Deep K/V (kappa = nu = R); Deep V (Mature-V), Deep K or explicit depths are knobs.
The b proposals go to the independent full-depth verifier as a chain (the paper's, without bonus token).  All
requests drafting in a step draft together: token i of every request is one batched pass.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import Tensor

from ..engine.drafting import Batch, Draft, DraftContext, Drafter, Session, greedy
from ..model import decode_kernel
from ..model.policy import ReadPolicy, parse_policy
from . import Method, register
from .knobs import FAMILY, Knobs, Most, knob, positive_int

DRAFT_DEPTH = Most("R - 1", "a draft as deep as the target would be the target itself", lambda kn, s: s.R - 1)


@dataclass(frozen=True)
class SequentialKnobs(Knobs):
    draft_depth: int = knob(FAMILY, "sequential draft depth d", short="-d", most=DRAFT_DEPTH)
    block: int = knob(FAMILY, "sequential draft block length b", short="-b",
                      most=Most("the context - 1", "a block and its anchor are verified in one pass",
                                lambda kn, s: s.context - 1))
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
    draft_depth: int = knob(4, "sequential draft depth d", short="-d", most=DRAFT_DEPTH)
    policy: str | ReadPolicy = knob("deep-kv", "prefix read policy: aligned | deep-v (mature-v) | deep-k | "
                                    "deep-kv | k=..,v=..", parse=str)


def propose_sequential(reqs: list[DraftContext], d: int, blocks: list[int], policy: ReadPolicy) -> list[Tensor]:
    """Draft ``blocks[i]`` tokens after request i's anchor at depth d, in place in each token scratch, all requests
    in one batched pass per token; returns each request's drafted tokens.  A request that must stop
    (``stopping``) leaves the batch at the next token."""
    R = reqs[0].R
    slots = [r.scratch(b) for r, b in zip(reqs, blocks)]
    reads = [policy.depths(j, R) for j in range(1, d + 1)]       # hoisted out of the token loop
    live = list(range(len(reqs)))
    for i in range(max(blocks, default=0)):
        live = [q for q in live if blocks[q] > i and reqs[q].stopping() is None]
        if not live:
            break
        group = [reqs[q] for q in live]
        batch = Batch(group, [r.n + i for r in group], [1] * len(group))
        inj = batch.prelude(batch.ids())
        h = batch.start_state(batch.initial(), inj)
        h = batch.recur(h, inj, range(1, d + 1), reads)     # the d steps in one call where the family has one
        logits = batch.readout(h)[0]
        if all(r.choose is greedy for r in group):
            chosen = decode_kernel.argmax(logits)
            for k, q in enumerate(live):
                slots[q][i] = chosen[k]
        else:
            for k, q in enumerate(live):
                slots[q][i] = reqs[q].choose(logits[k: k + 1], reqs[q].n + i)[-1]
        for r in group:
            r.count(d, d)
    return slots


class SequentialDrafter(Drafter):
    width_knobs = ("block",)

    def __init__(self, knobs: SequentialKnobs):
        self.knobs = knobs
        self.name = knobs.method
        self.width = knobs.block

    def propose_batch(self, sessions: list[Session]) -> list[Draft]:
        k = self.knobs
        reqs = [s.ctx for s in sessions]
        tokens = propose_sequential(reqs, k.draft_depth, [min(k.block, r.room) for r in reqs], k.policy)
        return [Draft(t, in_place=True) for t in tokens]


register(Method("self-spec", SelfSpecKnobs, SequentialDrafter))
register(Method("mature-spec", MatureSpecKnobs, SequentialDrafter))
