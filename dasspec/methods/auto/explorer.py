"""One request's choice for a step: exploit the arm with the most expected tokens per second, or explore - each
way of deciding a named rule, a plain function of what the request sees (``Situation``) and of the drafter-wide
exploration budget (``Budget``), tested alone (tests/test_auto.py).  ``choose`` tries them in a fixed order and
returns a ``Choice`` that names the rule that decided and the estimates it compared (the trace shows both).

Exploring is bounded by ``explore``: a probe is taken only while the probes' losses, its own estimated one
included, stay within that share of the decoded time, and once its step is measured it is charged what it lost
(``AutoDrafter.measured``; a first-measure probe, taken before anything is priced, only then).  At most one request
probes an arm per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .costs import LOOKUP
from .tuning import TUNING, Tuning

Value = tuple[float, float, float]      # a step's (tokens per second, seconds, tokens) with the request on an arm


@dataclass(frozen=True)
class Choice:
    arm: str
    probe: bool
    rule: str                                   # the rule that decided (``RULES``)
    plan: str | None = None                     # the batch planner's rule when it overrode the request's choice


@dataclass
class Situation:
    """What one request's choice sees: the step's size B, its room, whether the batch is closed, per arm the value
    of the step with it on that arm (None: unpriced), the arms it has measured itself, per model arm the steps since
    it last measured it and its own tokens per step, the lookups' best acceptance, the level of its last hinted probe,
    the model arms whose seeds come from the text, whether drafted passes are priced yet, and ``hope(arm)``: the
    value with the arm's own rows at the lower of the measured rate and the calibration's shape."""

    B: int
    room: int
    closed: bool
    values: dict[str, Value | None]
    measured: frozenset[str]
    since: dict[str, int] = field(default_factory=dict)
    own: dict[str, float] = field(default_factory=dict)
    look: float = 0.0
    hint_level: float = 0.0
    seeded: frozenset[str] = frozenset()
    rows_priced: bool = False
    hope: Callable[[str], Value | None] = lambda arm: None


class Budget:
    """The drafter-wide exploration state: decoded seconds (measured passes and drafting), what the probes so far
    cost over the best arm (estimated when taken, measured once their step is), the arms probed this step, when
    each arm last drafted, and the price probes per lookup arm."""

    def __init__(self, explore: float):
        self.explore = explore
        self.elapsed = 0.0
        self.explored = 0.0
        self.probed: set[str] = set()
        self.drafted: dict[str, float] = {}
        self.price_probes: dict[str, int] = {}

    def may_probe(self, loss: float) -> bool:
        """Whether a probe estimated to cost ``loss`` seconds keeps every probe so far within ``explore`` of the
        decoded time; takes it if so."""
        if self.explored + loss > self.explore * self.elapsed:
            return False
        self.explored += loss
        return True


def _probe(budget: Budget, arm: str, rule: str) -> Choice:
    budget.probed.add(arm)
    return Choice(arm, True, rule)


def _loss(sit: Situation, t_a: float, tok_a: float, j_best: float, t_best: float, t: Tuning) -> float:
    """What one probe of an arm is estimated to cost against the best arm (at least ``probe_loss_floor`` of the
    best step's time per request)."""
    return max(t_a - tok_a / j_best, t.probe_loss_floor * t_best / sit.B)


# --- the rules, in the order ``choose`` tries them --------------------------------------------------------------

def one_to_go(sit: Situation, budget: Budget, t: Tuning) -> Choice | None:
    """One token to go: a draft cannot commit more, a probe would measure nothing."""
    return Choice("ar", False, "one-to-go") if sit.room <= 1 else None


def unpriced(sit: Situation, budget: Budget, t: Tuning) -> Choice | None:
    """No pass measured yet (no calibration): a plain step measures one."""
    return Choice("ar", False, "unpriced") if sit.values.get("ar") is None else None


def first_measure(sit: Situation, budget: Budget, t: Tuning) -> Choice | None:
    """A model-drafting arm nobody has measured: probed at once, by one request a step (charged to the budget
    what it lost, once measured)."""
    for arm, v in sit.values.items():
        if arm != "ar" and arm not in LOOKUP and v is None and arm not in budget.probed:
            return _probe(budget, arm, "first-measure")
    return None


def exploit(sit: Situation, t: Tuning) -> Choice:
    """The arm of the most tokens per second among AR, the lookups and what this request measured; a drafter must
    beat AR by ``margin`` (AR's value is certain, the others' estimated)."""
    mine = {a: v for a, v in sit.values.items() if v is not None and (a == "ar" or a in LOOKUP or a in sit.measured)}
    best = max(mine, key=lambda a: mine[a][0])
    if best != "ar" and mine[best][0] < (1.0 + t.margin) * mine["ar"][0]:
        return Choice("ar", False, "margin")
    return Choice(best, False, "best")


def trusted_prior(sit: Situation, best: Choice, budget: Budget, t: Tuning) -> Choice | None:
    """An arm this request has not measured that the other requests' average says wins by ``prior_trust``: used
    outright (a batch pays one forced probe, not one each)."""
    j_best = sit.values[best.arm][0]
    for arm, v in sit.values.items():
        if v is not None and arm not in sit.measured and arm != "ar" and arm not in LOOKUP \
                and v[0] > t.prior_trust * j_best:
            return Choice(arm, False, "trusted-prior")
    return None


def prior_probe(sit: Situation, best: Choice, budget: Budget, t: Tuning) -> Choice | None:
    """An arm this request has not measured that the average says wins by less: a budgeted probe (charged as if it
    committed one token)."""
    j_best, t_best, _ = sit.values[best.arm]
    others_tok = sit.values["ar"][2] - 1.0
    for arm, v in sit.values.items():
        if v is None or arm in sit.measured or arm == "ar" or arm in LOOKUP or arm in budget.probed:
            continue
        j_a, t_a, _ = v
        if j_a > (1.0 + t.margin) * j_best and \
                budget.may_probe(max(t_a - (others_tok + 1.0) / j_best, t.probe_loss_floor * t_best / sit.B)):
            return _probe(budget, arm, "prior-probe")
    return None


def price_probe(sit: Situation, best: Choice, budget: Budget, t: Tuning) -> Choice | None:
    """A lookup arm's acceptance is measured every step, the price of its rows only when it drafts: one that would
    win were its own rows as cheap as the calibration says is tried now and then - one probe losing x seconds per
    x / ``explore`` decoded seconds, ``confirm`` in the drafter's life.  Not in a closed batch (its horizon is the
    budgets, too short to repay them); not before drafted passes are priced (until then they are priced so)."""
    if not sit.rows_priced or (sit.B > 1 and sit.closed):
        return None
    j_best, t_best, _ = sit.values[best.arm]
    t_ar = sit.values["ar"][1]
    for arm in LOOKUP:
        v = sit.values.get(arm)
        if v is None or arm == best.arm or arm in budget.probed or budget.price_probes.get(arm, 0) >= t.confirm:
            continue
        _, t_a, tok_a = v
        if tok_a <= (1.0 + t.margin) * j_best * t_ar:
            continue                                  # no hope at any price
        loss = _loss(sit, t_a, tok_a, j_best, t_best, t)
        if budget.elapsed - budget.drafted.get(arm, 0.0) < loss / budget.explore:
            continue
        hope = sit.hope(arm)
        if hope is None or hope[0] <= (1.0 + t.margin) * j_best or t_a <= hope[1]:
            continue                                  # no hope, or already priced at its best
        if budget.may_probe(loss):
            return _probe(budget, arm, "price-probe")
    return None


def hint_probe(sit: Situation, best: Choice, budget: Budget, t: Tuning) -> Choice | None:
    """The lookups now accept more than a seeded model arm did when last measured, and it would be the best arm if
    it accepted that much too (its seeds come from the same text): measured again soon, once per such rise."""
    j_best, t_best, _ = sit.values[best.arm]
    for arm in _switched_off(sit, best, budget):
        _, t_a, tok_a = sit.values[arm]
        own = sit.own.get(arm, 0.0)
        if arm in sit.seeded and sit.since.get(arm, 0) >= t.hint_every \
                and sit.look > max(own + t.hint_rise, sit.hint_level + t.hint_rise) \
                and (tok_a - own + sit.look) / t_a > j_best \
                and budget.may_probe(_loss(sit, t_a, tok_a, j_best, t_best, t)):
            return _probe(budget, arm, "hint-probe")
    return None


def interval_probe(sit: Situation, best: Choice, budget: Budget, t: Tuning) -> Choice | None:
    """A switched-off model arm is re-measured every ``interval`` steps, the interval that keeps B requests' probes
    within ``explore`` of the step time (a probe of an arm losing x seconds every B x / (explore * step time))."""
    j_best, t_best, _ = sit.values[best.arm]
    for arm in _switched_off(sit, best, budget):
        _, t_a, tok_a = sit.values[arm]
        loss = _loss(sit, t_a, tok_a, j_best, t_best, t)
        interval = min(max(loss * sit.B / (budget.explore * t_best), t.min_interval), t.max_interval)
        if sit.since.get(arm, 0) >= interval and budget.may_probe(loss):
            return _probe(budget, arm, "interval-probe")
    return None


def _switched_off(sit: Situation, best: Choice, budget: Budget) -> list[str]:
    """Model arms this request measured, not chosen, not probed this step."""
    return [a for a, v in sit.values.items() if v is not None and a != "ar" and a not in LOOKUP and a != best.arm
            and a in sit.measured and a not in budget.probed]


BEFORE = (one_to_go, unpriced, first_measure)                       # decide before any estimate is compared
EXPLORE = (trusted_prior, prior_probe, price_probe, hint_probe, interval_probe)
RULES = tuple(r.__name__.replace("_", "-") for r in BEFORE) + ("margin", "best") + \
    tuple(r.__name__.replace("_", "-") for r in EXPLORE)


def choose(sit: Situation, budget: Budget, t: Tuning = TUNING) -> Choice:
    for rule in BEFORE:
        got = rule(sit, budget, t)
        if got is not None:
            return got
    best = exploit(sit, t)
    if budget.explore <= 0:
        return best
    for rule in EXPLORE:
        got = rule(sit, best, budget, t)
        if got is not None:
            return got
    return best
