"""The auto drafter: sub-drafters for DAS-Wave, SAM and PLD, the cost model, the earnings and the explorer,
composed per step:

    costs.add_pass(...)              # ``measured``: the executor's timing of the last pass, the drafting laps
    choice = explorer.choose(situation)   per request (the estimates and the rule that decided)
    planners.together / closed_plan  the batch as a whole
    sub.propose_batch(group)         per arm, timed by a ``Lap`` (read after the step's synchronisation)
    earnings.verdict / resolve       per request, from its verdict; the lookups scored off-policy

Each draft's notes carry the arm (``auto``), the rule, the batch plan when it overrode the request, a probe flag,
and the estimates compared (tokens per second of the step per arm) - a trace explains every decision.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

from ...engine.drafting import Draft, Drafter, Lap, PassTiming, Session, Verdict
from .. import build_drafter, resolve_knobs
from . import memory
from .calibrate import Sizing, calibration
from .costs import LOOKUP, CostModel
from .earnings import Earnings, Priors
from .explorer import Budget, Choice, Situation, choose
from .knobs import AutoKnobs
from .planners import closed_plan, together
from .tuning import TUNING, Tuning

if TYPE_CHECKING:
    from ...model.looped import LoopedLM


@dataclass
class StepProbes:
    """One step's probing requests (a probe's own, or put on a drafter by a batch plan that probes): the exploration
    budget charged before the step, the probers per arm, and their tokens, verifier rows and count (from their
    verdicts)."""

    explored: float
    arms: dict[str, int]
    tok: int = 0
    rows: int = 0
    n: int = 0

    def add(self, tok: int, rows: int) -> None:
        self.tok += tok
        self.rows += rows
        self.n += 1


class AutoSession(Session):
    """One request: a session of every sub-drafter (they keep their own text indexes; only the chosen one proposes),
    its earnings per arm and its exploration clock."""

    def __init__(self, drafter: "AutoDrafter", req):
        super().__init__(drafter, req)
        self.subs: dict[str, Session] = {arm: sub.start(req) for arm, sub in drafter.subs.items()}
        self.earnings = Earnings(drafter.subs, drafter.priors, drafter.tuning)
        self.steps = 0
        self.choice = Choice("ar", False, "start")
        self.prev = "ar"                   # the last step's arm
        self.hint_level = 0.0              # the lookup acceptance that triggered the last hinted probe
        self.seen: dict = {}               # the estimates this step's choice compared (for the trace)

    @property
    def arm(self) -> str:
        return self.choice.arm

    @property
    def probe(self) -> bool:
        return self.choice.probe

    @property
    def arms(self):
        return self.earnings.arms

    def tok_rows(self, arm: str, sustained: bool = False):
        return self.earnings.tok_rows(arm, sustained)

    def values(self, B: int, arms=None, hoped: bool = False) -> dict[str, tuple[float, float, float] | None]:
        """arm -> (the step's tokens per second, its seconds, its tokens) with this request on ``arm`` and the others
        as last step, or None while unknown.  ``hoped``: its own rows past its first at the lower of the measured
        rate and the calibration's shape."""
        d = self.drafter
        others = d.others(B)
        out = {}
        for arm in (("ar", *d.subs) if arms is None else arms):
            tok, rows = self.tok_rows(arm)
            m = d.groups_last.get(arm, 0) + (self.prev != arm)        # the group it would draft in
            t = d.step_time(arm, rows, others, m, B, hoped) if tok is not None else None
            out[arm] = None if t is None else ((others[0] + tok) / t, t, others[0] + tok)
        return out

    def situation(self, B: int) -> Situation:
        d = self.drafter
        look = max([self.tok_rows(a)[0] or 0.0 for a in LOOKUP if a in d.subs] or [0.0])
        return Situation(
            B=B, room=self.ctx.room, closed=self.ctx.closed,
            values=self.values(B) if self.ctx.room > 1 else {},
            measured=frozenset(a for a, st in self.arms.items() if st.n),
            since={a: self.steps - st.last for a, st in self.arms.items()},
            own={a: self.tok_rows(a)[0] or 0.0 for a in d.subs if a not in LOOKUP},
            look=look, hint_level=self.hint_level, seeded=frozenset(a for a in d.subs if d.seeded(a)),
            rows_priced=bool(d.costs.extra), hope=lambda arm: self.values(B, [arm], hoped=True)[arm])

    def choose(self, B: int) -> Choice:
        sit = self.situation(B)
        d = self.drafter
        got = choose(sit, d.budget, d.tuning)
        if got.rule == "hint-probe":
            self.hint_level = sit.look
        elif got.rule in ("best", "margin") and d.budget.explore > 0 and sit.look < self.hint_level - d.tuning.hint_fall:
            self.hint_level = sit.look                 # the lookups fell back: a new rise may hint again
        self.seen = sit.values
        return got

    def observe(self, verdict: Verdict) -> None:
        d, arm = self.drafter, self.arm
        tok, rows = len(verdict.tokens), int(verdict.pred.shape[0])
        d.step_tok += tok
        d.step_rows += rows
        d.step_n += 1
        if d.probes is not None and probing(self.choice):
            d.probes.add(tok, rows)
        if arm != "ar":
            self.earnings.verdict(arm, tok, rows, self.steps)
            if arm in LOOKUP and self.probe and rows > 1:       # a price probe that measured rows
                d.budget.price_probes[arm] = d.budget.price_probes.get(arm, 0) + 1
            self.subs[arm].observe(verdict)
        self.earnings.resolve(self.ctx.generated, self.steps)
        self.prev = arm
        self.steps += 1


class AutoDrafter(Drafter):
    """Sub-drafters (built with the model's knobs for each, by ``bind``), the cost model, the drafter-wide averages
    of what each arm earns and the exploration budget.  ``tuning``: the constants (``tuning.py``)."""

    name = "auto"
    session = AutoSession
    width_knobs = ("arms",)
    stateful = True           # its cost model and averages carry over from request to request

    def __init__(self, knobs: AutoKnobs, tuning: Tuning = TUNING, clock: Callable[[], float] = time.perf_counter):
        """``clock``: the host clock of the drafting laps (tests pass a simulated one)."""
        self.knobs, self.tuning, self.clock = knobs, tuning, clock
        self.subs: dict[str, Drafter] = {}
        self.width = 1
        self.costs = CostModel(None, tuning)
        self.priors = Priors(tuning)
        self.budget = Budget(knobs.explore)
        self.groups_last: dict[str, int] = {}    # sessions that drafted with each arm last step
        self.step_tok = self.step_rows = self.step_n = 0     # the step being verified (from the verdicts)
        self.last: tuple[int, int, int, float] | None = None   # the last step: sessions, tokens, rows, drafting s
        self._laps: list[tuple[str, int, Lap]] = []          # this step's drafting, per arm and group
        self.probes: StepProbes | None = None    # this step's probes, charged as measured
        self.bound = False
        self.device = None                       # the model's: drafting laps are timed on it
        self.kept: tuple[LoopedLM, str] | None = None    # (model, key): where ``remember`` keeps the outcomes

    # -- building --
    def bind(self, model, num_steps: int | None = None, sampled: bool = False) -> None:
        """Build the sub-drafters on ``model`` and size DAS-Wave's window from the calibration."""
        self.device = model.device
        R = model.depth(num_steps)
        sizing = None
        if self.knobs.calibrate:
            sizing = Sizing.of(calibration(model, tuning=self.tuning), R, self.tuning.wide_round)
        self.costs = CostModel(sizing, self.tuning)
        for arm in self.knobs.arm_list:
            user = self.wave_window(model, R, sampled) if arm == "das-wave" else {}
            self.subs[arm] = build_drafter(model, arm, user, num_steps, sampled)
        self.adopt(self.subs)

    def adopt(self, subs: dict[str, Drafter]) -> None:
        """Take ``subs`` as the sub-drafters (``bind``; tests pass their own)."""
        self.subs = subs
        self.costs.wave = {a: getattr(s, "knobs", None) for a, s in subs.items() if a not in LOOKUP}
        self.width = max([1] + [d.width for d in subs.values()])
        # the longest chain a sub-drafter may propose (DAS-Wave's copy runs reach past its width): without it the
        # engine would back only ``width`` rows and cut those runs short
        reach = max([self.width] + [getattr(d, "reach", None) or d.width for d in subs.values()])
        self.reach = reach if reach > self.width else None
        self.bound = True

    def recall(self, model, R: int, call: tuple) -> None:
        """Start from what the last call with the same key left (``memory.py``; ``generate`` calls this on the
        drafter it built, ``call`` its own part of the key), unless the ``recall`` knob is off."""
        if not self.knobs.recall:
            return
        subs = sorted((arm, repr(kn)) for arm, kn in self.costs.wave.items())
        self.kept = model, memory.memory_key(model, R, self.knobs, self.tuning, (call, subs))
        got = memory.recall(*self.kept)
        if got is not None and got[0].sizing == self.costs.sizing:   # (a calibration measured again: afresh)
            self.costs, self.priors = got

    def remember(self) -> None:
        """Keep the prices and the average earnings for the next call's drafter (after ``recall``)."""
        if self.kept is not None:
            memory.keep(*self.kept, (self.costs, self.priors), self.tuning.kept_keys)

    def wave_window(self, model, R: int, sampled: bool) -> dict:
        """DAS-Wave knobs the calibration lowers: gamma = W_init to the widest nearly-free window, the rounds so a
        block's rounds cost at most one full-depth one-row pass; knobs the model's generation_config.json sets are
        kept."""
        s = self.sizing
        if s is None or s.window is None:
            return {}
        kn = resolve_knobs(model, "das-wave", {}, R, sampled)
        gd = model.generation_defaults if isinstance(model.generation_defaults, dict) else {}
        section = gd.get("dasspec") if isinstance(gd.get("dasspec"), dict) else {}
        given = set(section.get("das-wave") or {})
        if sampled:
            given |= set(section.get("das-wave:sampled") or {})
        out: dict[str, Any] = {}
        if not given & {"gamma", "w_init"} and s.window < kn.gamma:
            out.update(gamma=s.window, w_init=min(kn.w_init, s.window))
        if "rounds" not in given:
            g, w0 = out.get("gamma", kn.gamma), out.get("w_init", kn.w_init)
            J, spent = 0, 0.0
            while J < kn.rounds:
                c = s.round_cost(min(g, w0 + J), kn.k)
                if J and spent + c > s.full1:
                    break
                spent += c
                J += 1
            if J < kn.rounds:
                out["rounds"] = J
        return out

    def seeded(self, arm: str) -> bool:
        kn = getattr(self.subs.get(arm), "knobs", None)
        return getattr(kn, "guesses", "anchor") != "anchor"

    def start(self, req) -> AutoSession:
        if not self.bound:
            raise RuntimeError("the auto drafter is built by dasspec.build_drafter (it needs the model)")
        return AutoSession(self, req)

    @property
    def sizing(self) -> Sizing | None:
        """The calibration's implications (None: not calibrated)."""
        return self.costs.sizing

    @sizing.setter
    def sizing(self, s: Sizing | None) -> None:
        self.costs.sizing = s

    # -- what a step is expected to cost --
    def pass_cost(self, rows: float) -> float:
        return self.costs.pass_cost(rows)

    def others(self, B: int) -> tuple[float, float, float]:
        """What the other B - 1 requests of this step are expected to bring: tokens, rows, drafting seconds (the
        last step's totals, scaled to B - 1 of its sessions)."""
        if B <= 1:
            return 0.0, 0.0, 0.0
        if self.last is None or not self.last[0]:
            return float(B - 1), float(B - 1), 0.0
        n, tok, rows, dt = self.last
        f = (B - 1) / n
        return tok * f, rows * f, dt * f

    def step_time(self, arm: str, rows: float | None, others: tuple[float, float, float], m: int,
                  B: int, hoped: bool = False) -> float | None:
        """Seconds of a step with one request drafting with ``arm`` (``rows`` verifier rows, in a group of m) beside
        ``others`` (B - 1 requests)."""
        if rows is None:
            return None
        v = self.costs.verify_time(others[1] + rows, B, rows - 1.0 if hoped else 0.0)
        d = self.costs.draft_time(arm, m)
        if v is None or d is None:
            return None
        return d + others[2] + v + self.costs.overhead

    # -- the step --
    def measured(self, timing: PassTiming) -> None:
        """The executor's timing of the pass that verified this step's drafts: the prices learn from it (not from a
        pass that carried prompt rows: that time is not the drafts'), and the drafting laps are read now that the
        device has passed them."""
        probes, self.probes = self.probes, None
        spent = probed = 0.0
        for arm, m, lap in self._laps:
            dt = lap.seconds()
            spent += dt
            if probes is not None:
                probed += dt * probes.arms.get(arm, 0) / m
            self.costs.add_draft(arm, dt, m)
        self._laps = []
        self.budget.elapsed += timing.seconds + timing.draft_seconds
        self.costs.add_host(timing.host_seconds)
        if self.step_n:
            self.last = (self.step_n, self.step_tok, self.step_rows, spent)
            # fitted only on a pass of auto's own requests alone: prices are asked of auto's rows (``others``)
            alone = not timing.prefill_rows and timing.requests == self.step_n and timing.rows == self.step_rows
            priced = None
            if probes is not None and probes.n:         # this step's prices, before this pass moves them
                priced = (self.costs.verify_time(self.step_rows, self.step_n),
                          self.costs.verify_time(self.step_rows - probes.rows + probes.n, self.step_n))
            if alone:
                self.costs.add_pass(timing.seconds, timing.rows, timing.requests)
            if priced is not None:
                self._charge_probes(probes, timing.seconds if alone else None, spent, probed, *priced)
        self.step_tok = self.step_rows = self.step_n = 0

    def _charge_probes(self, probes: StepProbes, seconds: float | None, spent: float, probed: float,
                       v_step: float | None, v_plain: float | None) -> None:
        """A probe is charged to the exploration budget when taken by its estimated loss (none for a first-measure
        probe: nothing is priced yet); once measured, the step's charge becomes what its probes lost, so that
        ``explore`` bounds what probing cost, not what it was expected to.  The step is compared with the same step
        with the probing requests plain (a row and a token each, the others as they were): its seconds -
        ``seconds``, the pass, where it carried auto's rows alone, else ``v_step``, their price (until a drafted
        pass is measured that prices a draft's rows at the calibration's shape, so probes riding beside other rows
        are charged low) - and its drafting (``spent``, ``probed`` of it the probes'), less the step's tokens at the
        alternative's rate; at least the probe floor per prober.  ``v_step`` / ``v_plain``: the prices of the
        step's rows and of the alternative's."""
        if not v_step or v_plain is None:
            return
        seconds = v_step if seconds is None else seconds
        alt = seconds * v_plain / v_step + spent - probed              # the alternative step's seconds
        lost = seconds + spent - self.step_tok * alt / (self.step_tok - probes.tok + probes.n)
        self.budget.explored = probes.explored + max(lost, self.tuning.probe_loss_floor * alt * probes.n / self.step_n)

    def propose_batch(self, sessions: list[AutoSession]) -> list[Draft]:
        t = self.tuning
        self.budget.probed = set()
        self._laps = []                                  # (a step that never reached ``measured``: its own are lost)
        self.step_tok = self.step_rows = self.step_n = 0
        B = len(sessions)
        explored = self.budget.explored
        picks = [s.choose(B) for s in sessions]
        if B > 1 and sessions[0].ctx.closed:            # alone, the step's tokens per second is its end
            picks, _ = closed_plan(self.costs, [s.earnings for s in sessions], picks, list(self.subs),
                                   [s.ctx.budget for s in sessions], [s.prev for s in sessions], t, self.budget)
        else:
            picks, _ = together(self.costs, [s.earnings for s in sessions], picks, list(self.subs), t, self.budget)
        picks = [Choice("ar", False, "one-to-go") if s.ctx.room <= 1 else p for s, p in zip(sessions, picks)]
        probers = Counter(p.arm for p in picks if probing(p))
        self.probes = StepProbes(explored, dict(probers)) if probers else None
        groups: dict[str, list[int]] = {}
        for i, (s, pick) in enumerate(zip(sessions, picks)):
            s.choice = pick
            s.ctx.count_choice(pick.arm)
            groups.setdefault(pick.arm, []).append(i)
        drafts: list[Draft] = [Draft()] * B
        for arm, idx in groups.items():
            if arm == "ar":
                continue
            subs = [sessions[i].subs[arm] for i in idx]
            for i, sub in zip(idx, subs):
                if sessions[i].prev != arm and hasattr(sub, "copying"):
                    sub.copying = False           # DAS-Wave's copy run follows its own last block only
            self.budget.drafted[arm] = self.budget.elapsed
            lap = Lap(None if arm in LOOKUP else self.device, self.clock).start()    # a lookup's drafting is host work
            got = self.subs[arm].propose_batch(subs)
            self._laps.append((arm, len(idx), lap.stop()))
            for i, dr in zip(idx, got):
                drafts[i] = dr
        out = []
        for s, dr in zip(sessions, drafts):
            s.earnings.shadow(s.subs, s.arm, len(s.ctx.generated), s.ctx.room, self.costs.add_draft, self.clock)
            out.append(replace(dr, notes={**(dr.notes or {}), **_notes(s.choice, s.seen)}))
        self.groups_last = {arm: len(idx) for arm, idx in groups.items()}
        return out


def probing(c: Choice) -> bool:
    """Whether a request's step is a probe: its own, or a batch plan's that probes (``planners``)."""
    return c.probe or (c.plan or "").endswith("-probe")


def _notes(c: Choice, values: dict) -> dict:
    """What a trace shows of a choice: the arm, the rule, the plan that overrode it, and the estimates compared
    (the step's tokens per second per arm; absent: unpriced)."""
    notes: dict[str, Any] = {"auto": c.arm, "rule": c.rule}
    if c.plan:
        notes["plan"] = c.plan
    if c.probe:
        notes["probe"] = True
    est = {a: round(v[0], 3) for a, v in (values or {}).items() if v is not None}
    if est:
        notes["estimates"] = est
    return notes
