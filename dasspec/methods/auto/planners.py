"""The batch planners: the requests choose as if each drafted alone beside the others' last step, and a planner
revalues the step as a whole.  Two small parts, each a function of the cost model and the requests' earnings:

* ``together`` (a server's batch, B > 1): a model-drafting arm's rounds run for all its requests at once, so a
  request weighing it alone undervalues it; and a request weighing its draft beside the others' drafted rows can
  find it within the margin, step plain, and so make drafting pay again for the next (the batch alternates).  So
  the step with every request on one arm - and for a lookup arm, with only the requests whose drafts add tokens
  faster than a plain step - is valued against the requests' own choices and taken when it wins by ``margin``
  (but see below); and where the own choices lose to plain steps all at once, the batch steps plain (probes apart).
* ``closed_plan`` (``DraftContext.closed``: generate_batch once nobody waits for a slot): the caller waits for the
  last request, so a step's tokens per second is the wrong measure.  The plans weighed - every request plain, every
  request on one drafter, each request's own choice - are timed until every request has used its budget
  (``batch_time``) with each request's *sustained* tokens per step; the quickest is taken if it beats plain steps by
  ``margin`` (but see below), and a batch all on one drafter that some request has measured fewer than
  ``hold_below`` times stays on it unless plain steps win by the margin.

A plan that puts requests on a drafter they have not measured prices them at the drafter's average over its
requests (``Priors``), which early on may be one request's lucky block.  While fewer than ``prior_requests``
requests stand behind that average such a plan is taken outright only where it wins by ``prior_trust``, as a
request's own choice is (``explorer.trusted_prior``); where it wins by less it is a probe of those requests (rule
``...-probe``), taken when its loss against the plan it displaces, were each of them to commit one token, fits the
exploration budget.  Probes, and requests with one token to go, keep their arm in both.  Each returns the step's
choices and the rule that decided the plan (None: the requests' own choices stand).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from .costs import LOOKUP, CostModel
from .earnings import Earnings
from .explorer import Budget, Choice
from .tuning import Tuning


def batch_step(costs: CostModel, earnings: Sequence[Earnings], arms: Sequence[str]
               ) -> tuple[float, float, float, float] | None:
    """What the cost model expects of a step with request i on ``arms[i]``: (tokens, verifier rows, seconds of the
    one pass over them, seconds of the groups' drafting); None while any part is unmeasured."""
    tok = rows = 0.0
    groups: dict[str, int] = {}
    for e, arm in zip(earnings, arms):
        t, r = e.tok_rows(arm)
        if t is None:
            return None
        tok, rows = tok + t, rows + r
        groups[arm] = groups.get(arm, 0) + 1
    verify = costs.verify_time(rows, len(earnings))
    if verify is None:
        return None
    drafting = 0.0
    for arm, m in groups.items():
        d = costs.draft_time(arm, m)
        if d is None:
            return None
        drafting += d * m
    return tok, rows, verify, drafting


def batch_value(costs: CostModel, earnings: Sequence[Earnings], arms: Sequence[str]) -> float | None:
    """Expected tokens per second of a step with request i on ``arms[i]``."""
    step = batch_step(costs, earnings, arms)
    if step is None:
        return None
    tok, _, verify, drafting = step
    total = verify + drafting + costs.overhead
    return tok / total if total > 0 else None


def batch_time(costs: CostModel, plan: Sequence[tuple[str, float, float]], memo: dict | None = None) -> float | None:
    """Seconds until the last request has used its budget when request j stays on ``plan[j]`` = (arm, steps, rows
    per step): each step costs one pass over the rows of the requests still decoding plus each arm's drafting for
    its group then (None while a cost is unmeasured).  ``memo``: drafting times by (arm, group) shared by the plans
    of one step."""
    if costs.verify_time(1, 1) is None:
        return None
    memo = {} if memo is None else memo
    rows = sum(r for _, _, r in plan)
    group: dict[str, int] = {}
    for arm, _, _ in plan:
        group[arm] = group.get(arm, 0) + 1
    total = done = 0.0
    n = len(plan)
    for steps, arm, r in sorted((s, arm, r) for arm, s, r in plan):
        if steps > done:
            step = costs.verify_time(rows, n) + costs.overhead
            for a, m in group.items():
                if m and a != "ar":
                    if (a, m) not in memo:
                        memo[a, m] = costs.draft_time(a, m)
                    d = memo[a, m]
                    if d is None:
                        return None
                    step += d * m
            total += (steps - done) * step
            done = steps
        rows -= r
        n -= 1
        group[arm] -= 1
    return total


def _fixed(p: Choice) -> bool:
    """A choice no plan moves: a probe, or a request with one token to go."""
    return p.probe or p.rule == "one-to-go"


def _keep_probes(picks: Sequence[Choice], arms: Sequence[str], rule: str) -> list[Choice]:
    """The planner's arms, ``_fixed`` choices kept; a choice it changed names the plan's rule."""
    return [p if _fixed(p) or p.arm == a else replace(p, arm=a, plan=rule) for p, a in zip(picks, arms)]


def _untried(earnings: Sequence[Earnings], arms: Sequence[str], picks: Sequence[Choice], t: Tuning
             ) -> list[tuple[Earnings, str]]:
    """The requests a plan puts on a drafter they have not measured while fewer than ``prior_requests`` requests
    stand behind its average (a probe's own arm and a request with one token to go aside)."""
    return [(e, a) for e, a, p in zip(earnings, arms, picks)
            if a != "ar" and not _fixed(p) and e.arms[a].n == 0
            and e.priors.requests.get(a, 0) < t.prior_requests]


def _probed(costs: CostModel, earnings: Sequence[Earnings], arms: Sequence[str], picks: Sequence[Choice],
            rate: float | None, budget: Budget | None, t: Tuning) -> bool:
    """Whether a step with request i on ``arms[i]`` fits ``budget`` as a probe of its untried requests (takes it if
    so): its loss is its seconds less what the plan it displaces (``rate`` tokens/s) takes for its tokens, were each
    of them to commit one token - at least ``probe_loss_floor`` of the step per untried request, as a request's own
    probe is charged."""
    untried = _untried(earnings, arms, picks, t)
    step = batch_step(costs, earnings, arms)
    if budget is None or budget.explore <= 0 or not untried or step is None or not rate:
        return False
    seconds = step[2] + step[3]
    low = step[0] - sum(e.tok_rows(a)[0] - 1.0 for e, a in untried)
    floor = t.probe_loss_floor * seconds * len(untried) / len(earnings)
    return budget.may_probe(max(seconds - low / rate, floor))


def closed_plan(costs: CostModel, earnings: Sequence[Earnings], picks: Sequence[Choice], subs: Sequence[str],
                budgets: Sequence[int], prev: Sequence[str], t: Tuning, budget: Budget | None = None
                ) -> tuple[list[Choice], str]:
    """The arms of a closed batch's step (module docstring; ``budget``: the explorer's, for a plan that probes)."""
    B = len(earnings)
    plans = [("closed-plain", ["ar"] * B)] + [(f"closed-all-{arm}", [arm] * B) for arm in subs] + \
        [("closed-own", [p.arm for p in picks])]
    held = prev[0] if all(p == prev[0] for p in prev) else "ar"
    best = best_time = plain = held_time = None
    memo: dict = {}

    def timed(arms: Sequence[str]) -> float | None:
        plan = []
        for e, b, arm in zip(earnings, budgets, arms):
            tok, rows = e.tok_rows(arm, sustained=True)
            if tok is None or rows is None:
                return None
            plan.append((arm, max(b, 1) / max(tok, 1.0), rows))
        return batch_time(costs, plan, memo)

    probe = None
    for rule, arms in plans:
        got = timed(arms)
        if got is None:
            continue
        if plain is None:
            plain = got
        if held != "ar" and arms == [held] * B:
            held_time = got
        if got * t.prior_trust > plain and _untried(earnings, arms, picks, t):
            if got < (1.0 - t.margin) * plain and (probe is None or got < probe[2]):
                probe = (rule + "-probe", arms, got)       # the drafter's average alone must win by far
            continue
        if best_time is None or got < best_time:
            best, best_time = (rule, arms), got
    if best is None or plain is None or best_time >= (1.0 - t.margin) * plain:
        keep = held_time is not None and plain is not None and held_time < (1.0 + t.margin) * plain \
            and min(e.arms[held].n for e in earnings) < t.hold_below
        best = ("closed-hold", [held] * B) if keep else ("closed-plain", ["ar"] * B)
        if probe is not None and _probed(costs, earnings, probe[1], picks, batch_value(costs, earnings, best[1]),
                                         budget, t):
            best = probe[:2]
    rule, arms = best
    return _keep_probes(picks, arms, rule), rule


def together(costs: CostModel, earnings: Sequence[Earnings], picks: Sequence[Choice], subs: Sequence[str],
             t: Tuning, budget: Budget | None = None) -> tuple[list[Choice], str | None]:
    """The arms of a server batch's step (module docstring; ``budget``: the explorer's, for a plan that probes)."""
    picks = list(picks)
    if len(earnings) < 2:
        return picks, None
    mine = [p.arm for p in picks]
    own = batch_value(costs, earnings, mine)
    if own is None:
        return picks, None
    B = len(earnings)
    plain = batch_value(costs, earnings, ["ar"] * B)
    rule = None
    if plain is not None and plain > (1.0 + t.margin) * own and any(p.arm != "ar" for p in picks if not p.probe):
        # each request chose as if the others stepped as last step; all of them drafting at once loses
        rule = "all-plain"
        picks = _keep_probes(picks, ["ar"] * B, rule)
        mine = [p.arm for p in picks]
        own = batch_value(costs, earnings, mine)
        if own is None:
            return picks, rule
    candidates = []
    for arm in subs:
        plans = [(f"together-{arm}", [p.arm if _fixed(p) else arm for p in picks])]
        if arm in LOOKUP and plain:
            # only the requests whose drafts add tokens faster than a plain step does: their extra tokens against
            # their extra rows at what the candidates' rows together cost a row
            stats = [e.tok_rows(arm) for e in earnings]
            extra = sum(r - 1.0 for tk, r in stats if tk is not None and tk > 1.0 and r > 1.0)
            if extra > 0:
                row = (costs.verify_time(B + extra, B) - costs.verify_time(B, B)) / extra
                plans.append((f"together-{arm}-matching",
                              [p.arm if _fixed(p) else arm if tk is not None and tk - 1.0 > plain * row * (r - 1.0)
                               else "ar" for (tk, r), p in zip(stats, picks)]))
        candidates += [(name, arms) for name, arms in plans if arms != mine and arm in arms]
    wins = (1.0 + t.margin) * own
    best, best_value, probe = None, wins, None
    for name, arms in candidates:                   # (the requests' own choices, or nobody drafting: left out)
        v = batch_value(costs, earnings, arms)
        if v is None or v <= wins:
            continue
        if v <= t.prior_trust * own and _untried(earnings, arms, picks, t):
            if probe is None or v > probe[2]:
                probe = (name + "-probe", arms, v)      # the drafter's average alone must win by far
            continue
        if v > best_value:
            best, best_value = (name, arms), v
    if best is None and probe is not None and _probed(costs, earnings, probe[1], picks, own, budget, t):
        best = probe[:2]
    if best is None:
        return picks, rule
    name, arms = best
    return _keep_probes(picks, arms, name), name
