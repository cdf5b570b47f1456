"""``auto``: choose, per request and per step, among DAS-Wave, SAM-Decoding, prompt lookup and plain AR, from a cost
model measured while decoding - so the default is never meaningfully slower than AR and as fast as the drafter that
pays where one does.  Every choice is verified by the same full-depth target, so the tokens are AR's whatever it
chooses (greedy, sampled per seed, batched); only the speed depends on the measurements.

The cost model, per step (one ``propose_batch`` call to the next = drafting + one verification pass):

* **what a pass costs**: the step's time minus the sub-drafters' drafting time is the verification (and engine)
  time V; it is modelled as ``V = scale * full(rows)`` over the step's verifier rows, where ``full(W)`` is the
  calibrated model time of a full-depth pass over W rows (below; without a calibration ``DEFAULT_K + W``) and
  ``scale`` is fitted online (a ratio of moving averages: load and the engine's own overhead fold into it).  Once
  plain steps (a row per request) are measured, a pass over n requests' rows is priced in two parts: the n plain
  rows at the plain steps' scale, the e rows past them at a rate per row measured on drafted steps, by width
  (powers of two of e; a width not measured takes its measured neighbours', so rows are priced linearly from the
  nearest; a width measured on one step only at most ``OUTLIER`` x its nearest neighbour's) - the calibration's
  rows are one sequence's own, while a drafted step's extra rows each read a request's cached prefix beside the
  others', and can cost far more than the calibration's shape says (docs/performance-journal.md, "Pricing the rows a
  draft adds" and "Per-width rates and price probes").  Drafted steps measured before the first plain one (the
  first probe) count once it is, so the probe also prices the extra rows.
* **what drafting costs**: each sub-drafter's ``propose_batch`` is timed (CUDA: synchronised after it) and modelled
  per group of m requests drafting together (``draft_units``: DAS-Wave's rounds over m windows, a lookup's host work
  per request), with a fitted scale per drafter and size of group (powers of two of m: the calibration's shape of
  m windows can be far off; its cost is a property of the model and the machine, shared by its requests).
* **what drafts earn**: each request keeps a moving average of tokens committed per step and of verifier rows per
  arm, from its verdicts (``len(verdict.tokens)``).  The lookup arms (SAM, PLD) are also scored *off-policy* every
  step they are not used: their draft costs no model pass, and since the committed tokens do not depend on the
  draft, the tokens the chain would have committed (its longest prefix that matches what was committed, plus one)
  are known exactly once the next tokens are.  So a lookup drafter that starts paying (text turning repetitive) is
  noticed within a few steps without spending a step on it.  What its rows cost is known only from steps it
  drafts: one that would win were its own rows as cheap as the calibration says is tried now and then (a *price
  probe*: one request; per lookup arm at most one losing x seconds per x / ``explore`` seconds, ``CONFIRM`` in a
  drafter's life, all probes within the ``explore`` budget; not in a closed batch, whose horizon is its budgets),
  so one noisy drafted step does not price it out of a server for good.
* **the choice**: per request the arm that gives the step the most tokens per second, the other requests taken as
  they were last step (B = 1: the request's own tokens per second; AR: one token per step, no drafting cost, one
  row); a drafter replaces a plain step only when it wins by ``MARGIN`` (AR's value is certain, the others' are
  estimates).  DAS-Wave, which needs model passes to draft, is re-measured by *probes*: one block every
  ``interval`` steps, where the interval keeps the expected cost of probing under ``explore`` (a fraction of the
  step time over the batch: a probe of an arm that loses by x seconds is made every B x / (explore * step time)
  steps, at most one request probes an arm per step, and every probe after the first is refused while the probes'
  estimated losses would exceed ``explore`` of the time decoded so far), and soon
  (at most every few steps) when a lookup arm's acceptance overtakes DAS-Wave's last measured one (its seeds come
  from the same text).  A request with no measurement of an arm starts from the drafter's running average over its
  earlier requests: a model-drafting arm that average says wins by ``PRIOR_TRUST`` is used at once, one that wins
  by less is tried as a budgeted probe, so a batch of requests pays one forced probe, not one each.
* **drafting together** (B > 1): a model-drafting arm's rounds run for all its requests at once, so a request
  weighing it alone undervalues it; and a request weighing its draft beside the others' drafted rows of the last
  step can find it within the margin, step plain, and so make drafting pay again for the next (the batch
  alternates).  So the step with every request on one arm (each at its own, or the drafter's average, tokens and
  rows; the group's measured drafting cost; one pass over all rows) - and for a lookup arm, the step with only the
  requests whose drafts add tokens faster than a plain step - is valued against the requests' own choices and
  taken when it wins by ``MARGIN``; and where the requests' own choices, each made as if drafting alone, lose to
  plain steps all at once, the batch steps plain (probes apart).
* **a closed batch** (``DraftContext.closed``: generate_batch with more than one request decoding, once none waits
  for a slot or prefills): the caller waits for the last request, so tokens per second of a step is the wrong
  measure - a request whose drafts let it finish early while the others keep the batch going saves only its own
  rows.  There the step's arms come from the time until every request has used its budget (``batch_time``: request
  j on an arm for the rest of its budget takes budget / tokens steps; each step costs one pass over the rows of the
  requests still decoding plus the drafting of each arm's group), weighed for every request plain, every request
  on one drafter, and each request's own choice; the quickest is taken if it beats plain steps by ``MARGIN``
  (probes keep their arm), and a batch all on one drafter that a request has measured once only stays on it
  unless plain steps beat it by ``MARGIN``.  Such a plan holds for the rest of the budgets, so it takes each
  request's *sustained* tokens per step of a lookup arm (the lower of its moving average and a slower one): a single
  long match among misses does not put the batch on a drafter.
* a request with one token to go takes a plain step: a draft cannot commit more, a probe would measure nothing.

Calibration (``calibrate``, on by default; cached per model and machine in ``~/.cache/dasspec/calibration.json``
(``$DASSPEC_CACHE``) and on the model object for the process, bounded to about ``CALIBRATION_BUDGET_S`` seconds):
the prelude, one core step and the readout at widths 1..32 (the minimum of repetitions taken round the widths, so a
burst of load cannot make one width look dear; a width measured dearer than a wider one takes the wider one's
time), from
which (a) ``full(W)`` above, and (b) DAS-Wave's window for this model: gamma = W_init = the
widest window whose round costs at most ``WIDE_ROUND`` times a one-row round (wider rows stop being nearly free), and
the rounds J cut so a block's rounds cost at most one full-depth one-row pass (an AR step), so a block that gains a
token already pays - both only ever lowering the model's own DAS-Wave defaults, and never knobs given in the
model's generation_config.json.  ``benchmarks/tune_wave.py`` stays the way to tune a schedule explicitly.

What was chosen: each draft's ``notes["auto"]`` (the arm; ``probe`` when it was an exploration) in a trace, and
``stats.choices`` (arm -> steps) per request.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import math
import os
import platform
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from ..engine.draft import Draft, Drafter, Session, Verdict
from ..model import decode_kernel
from . import Method, build_drafter, register
from .knobs import Knobs, Most, boolean, brief, knob

ARMS = ("das-wave", "sam", "pld")        # the drafters auto may use besides AR
LOOKUP = ("sam", "pld")                   # drafters that need no model pass: scored off-policy every step
CALIBRATION_BUDGET_S = 3.0
CAL_WIDTHS = (1, 8, 32, 2, 4, 16)       # the most telling first: a slow model measures only what the budget allows
WIDE_ROUND = 1.5          # a window is "nearly free" while a round over it costs at most this x a one-row round
DEFAULT_K = 4.0           # the fixed part of a pass in row units, without a calibration
CAL_VERSION = 3
CAL_REPS = 4               # passes round the widths (each width's minimum is kept)


@dataclass(frozen=True)
class AutoKnobs(Knobs):
    method = "auto"
    arms: str = knob(",".join(ARMS), "auto: the drafters it chooses among besides AR, comma-separated (of "
                     + ", ".join(ARMS) + ")", parse=str)
    explore: float = knob(0.05, "auto: the most of the step time re-measuring switched-off drafters may cost",
                          most=Most("1", "it is a fraction of the step time", lambda kn, s: 1.0))
    calibrate: bool = knob(True, "auto: measure pass costs when the drafter is built (cached per model and "
                           "machine) and size DAS-Wave's window from them")

    def validate(self, R: int) -> "AutoKnobs":
        arms = self.arms
        if isinstance(arms, (list, tuple)):
            arms = ",".join(map(str, arms))
        if not isinstance(arms, str):
            raise ValueError(f"arms must be a comma-separated list of {', '.join(ARMS)}, got {brief(arms)}")
        names = [a.strip() for a in arms.split(",") if a.strip()]
        bad = [a for a in names if a not in ARMS]
        if bad or len(set(names)) != len(names):
            raise ValueError(f"arms must name each of {', '.join(ARMS)} at most once, got {brief(self.arms)}")
        e = self.explore
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not 0 <= e <= 1:
            raise ValueError(f"explore must be a number in [0, 1], got {brief(e)}")
        boolean(self, "calibrate")
        return replace(self, arms=",".join(names), explore=float(e))

    @property
    def arm_list(self) -> list[str]:
        return [a for a in self.arms.split(",") if a]


# --- calibration -------------------------------------------------------------------------------------------------

def _cache_file() -> Path:
    root = os.environ.get("DASSPEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dasspec")
    return Path(root) / "calibration.json"


def _keys(model) -> tuple[str, str]:
    cfg = model.config
    shape = {k: v for k, v in sorted(vars(cfg).items()) if isinstance(v, (int, float, str, bool))}
    shape.update(dtype=str(model.dtype), device=str(model.device))
    mkey = hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:16]
    machine = f"{platform.node()}|{platform.machine()}|{platform.processor()}|{os.cpu_count()}|" \
              f"threads={torch.get_num_threads()}|torch={torch.__version__}"
    if model.device.type == "cuda":
        machine += "|" + torch.cuda.get_device_name(model.device)
    elif decode_kernel.available():                 # pass costs follow the kernels' build and path
        machine += f"|kernels={decode_kernel.build_tag()}:{decode_kernel.isa()}"
    return mkey, hashlib.sha256(machine.encode()).hexdigest()[:16]


def measure_costs(model, budget_s: float = CALIBRATION_BUDGET_S, widths=CAL_WIDTHS) -> dict[str, dict[int, float]]:
    """Seconds of the prelude, one core step and the readout over W rows (no cache: own rows only), for each W in
    ``widths`` while the budget lasts: a first pass over the widths (the most telling first, while half the budget
    lasts), then up to ``CAL_REPS - 1`` more passes round the widths it reached, keeping each width's minimum - a
    burst of load then touches every width alike instead of corrupting the one being measured."""
    cuda = model.device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(model.device)

    def once(W: int) -> tuple[float, float, float]:
        ids = torch.zeros(1, W, dtype=torch.long, device=model.device)
        span = model.span(0, 0, W)
        h0 = model.initial_state(torch.arange(W, device=model.device)).unsqueeze(0)
        sync()
        t0 = time.perf_counter()
        e = model.prelude(ids, span)
        sync()
        t1 = time.perf_counter()
        h = model.core_step(model.start_state(h0, e), e, span)
        sync()
        t2 = time.perf_counter()
        model.readout(h, span)
        sync()
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    t_start = time.perf_counter()
    out: dict[str, dict[int, float]] = {"prelude": {}, "core": {}, "head": {}}

    def keep(W: int, got: tuple[float, float, float]) -> None:
        for name, t in zip(out, got):
            out[name][W] = min(out[name].get(W, math.inf), t)

    with torch.no_grad():
        once(widths[0])                                  # warms up
        reached = []
        for W in widths:
            if reached and time.perf_counter() - t_start > budget_s * 0.5:
                break
            keep(W, once(W))
            reached.append(W)
        for _ in range(CAL_REPS - 1):
            for W in reached:
                if time.perf_counter() - t_start > budget_s:
                    return out
                keep(W, once(W))
    return out


def calibration(model, use_cache: bool = True) -> dict[str, dict[int, float]]:
    """``measure_costs`` for this model on this machine, from the model's own copy or the JSON cache when they
    have them (the copy kept on the model: a server builds an auto drafter per set of request knobs, and a
    read-only home must not cost a measurement each)."""
    mkey, machine = _keys(model)
    key = f"v{CAL_VERSION}:{mkey}:{machine}"
    kept: dict[str, dict] = model.__dict__.setdefault("_auto_calibrations", {})
    if use_cache and key in kept:
        return {name: dict(part) for name, part in kept[key].items()}
    path = _cache_file()
    table: dict[str, Any] = {}
    if use_cache:
        try:
            table = json.loads(path.read_text())
            hit = table.get(key)
            if hit:
                kept[key] = {name: {int(w): float(t) for w, t in part.items()} for name, part in hit.items()}
                return {name: dict(part) for name, part in kept[key].items()}
        except (OSError, ValueError, AttributeError):
            table = {}
    costs = measure_costs(model)
    if costs["core"]:
        kept[key] = {name: dict(part) for name, part in costs.items()}
    if use_cache and costs["core"]:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            table = table if isinstance(table, dict) else {}
            table[key] = {name: {str(w): t for w, t in part.items()} for name, part in costs.items()}
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(table, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass                                        # a read-only home: measured again by the next process
    return costs


class Curve:
    """A table of seconds by width as a function of width: piecewise linear, extrapolated along the last two
    widths (one width: in proportion past it)."""
    __slots__ = ("ws", "ts")

    def __init__(self, table: dict[int, float]):
        self.ws = sorted(table)
        self.ts = [table[w] for w in self.ws]

    def __call__(self, W: float) -> float:
        ws, ts = self.ws, self.ts
        if len(ws) == 1:
            return ts[0] * W / ws[0] if W > ws[0] else ts[0]
        if W <= ws[0]:
            return ts[0]
        i = min(bisect.bisect_left(ws, W), len(ws) - 1)
        lo, hi = ws[i - 1], ws[i]
        if W > hi:
            return ts[i] + max(ts[i] - ts[i - 1], 0.0) * (W - hi) / (hi - lo)
        return ts[i - 1] + (ts[i] - ts[i - 1]) * (W - lo) / (hi - lo)


def monotone(table: dict[int, float]) -> dict[int, float]:
    """``table`` (width -> seconds) with each width's time at most every wider one's: a pass over more rows never
    costs less, so a narrower width measured dearer was measured under load."""
    out, low = {}, math.inf
    for W in sorted(table, reverse=True):
        low = min(low, table[W])
        out[W] = low
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class Sizing:
    """What the calibration implies: the model time of a full-depth pass over W rows (``full(W)``, seconds), of a
    DAS-Wave round, and DAS-Wave's window for this model."""
    costs: dict[str, dict[int, float]]
    R: int
    window: int | None          # the widest nearly-free window (None: only one width measured)

    def __post_init__(self) -> None:       # the cost model asks these per request and step: built once
        parts = {name: Curve(part) for name, part in self.costs.items()}
        widths = sorted(set().union(*(part.ws for part in parts.values())))
        object.__setattr__(self, "_parts", parts)
        object.__setattr__(self, "_full", Curve({W: self._sum(parts, W, self.R) for W in widths}))
        object.__setattr__(self, "_units", {})

    @staticmethod
    def _sum(parts: dict[str, Curve], W: float, k: int) -> float:
        return parts["prelude"](W) + k * parts["core"](W) + parts["head"](W)

    @classmethod
    def of(cls, costs: dict[str, dict[int, float]], R: int) -> "Sizing | None":
        if 1 not in costs.get("core", {}):
            return None
        costs = {name: monotone(part) for name, part in costs.items()}
        core = costs["core"]
        s = cls(costs, R, None)
        if max(core) > 1:
            window = max(W for W in sorted(core) if s.round_cost(W, 1) <= WIDE_ROUND * s.round_cost(1, 1))
            s = cls(costs, R, window)
        return s

    def full(self, W: float) -> float:
        return self._full(W)

    def round_cost(self, W: float, k: int) -> float:
        return self._sum(self._parts, W, k)

    def wave_units(self, gamma: int, w_init: int, k: int, rounds: int, m: int) -> float:
        """A DAS-Wave block's rounds over m windows (growing from W_init to gamma), in seconds; kept per schedule."""
        key = (gamma, w_init, k, rounds, m)
        if key not in self._units:
            self._units[key] = sum(self.round_cost(min(gamma, w_init + j) * m, k) for j in range(rounds))
        return self._units[key]

    @property
    def full1(self) -> float:
        return self.full(1)


# --- the drafter ---------------------------------------------------------------------------------------------------

def _ema(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else old + alpha * (new - old)


def _ema2(old: tuple[float, float] | None, v: float, f: float) -> tuple[float, float]:
    """Moving averages of a measured time and its modelled cost (their ratio: a fitted scale)."""
    return (v, f) if old is None else (_ema(old[0], v, STEP_ALPHA), _ema(old[1], f, STEP_ALPHA))


def _bucket(e: float) -> int:
    """The width bucket of e rows past the plain ones: 1, 2-3, 4-7, 8-15, ... (powers of two)."""
    return max(int(e), 1).bit_length() - 1


def _rate(got: tuple) -> float:
    return max(got[0] / got[1], 0.0)


def _by_width(table: dict[int, tuple], b: int, outlier: float | None = None) -> float:
    """A table by width bucket of (a time, what it is per, ...) at bucket b: b's own ratio, between measured
    buckets interpolated, outside them the nearest one's.  ``outlier``: entries carry their steps third, and a width
    measured on one step only is taken at most ``outlier`` x the nearest other width's ratio (a pause in that step
    must not price it out: drafting there again measures it)."""
    if b in table:
        got = _rate(table[b])
        if outlier is not None and table[b][2] < 2 and len(table) > 1:
            near = min((k for k in table if k != b), key=lambda k: (abs(k - b), k))
            got = min(got, outlier * _rate(table[near]))
        return got
    lo = max((k for k in table if k < b), default=None)
    hi = min((k for k in table if k > b), default=None)
    if lo is None or hi is None:
        return _rate(table[hi if lo is None else lo])
    w = (b - lo) / (hi - lo)
    return (1.0 - w) * _rate(table[lo]) + w * _rate(table[hi])


def _even_then_ema(old: tuple[float, float, int] | None, y: float, e: float) -> tuple[float, float, int]:
    """Moving averages of a drafted step's time past the plain part and its extra rows, and the steps so far: the
    first few averaged evenly (so a noisy first step weighs a third after three), then at ``STEP_ALPHA``."""
    if old is None:
        return y, e, 1
    a = max(STEP_ALPHA, 1.0 / (old[2] + 1))
    return old[0] + a * (y - old[0]), old[1] + a * (e - old[1]), old[2] + 1


class ArmStats:
    __slots__ = ("tok", "slow", "rows", "n", "last")   # per request and arm

    def __init__(self):
        self.tok: float | None = None      # tokens committed per step (moving average)
        self.slow: float | None = None     # the same, averaged over more steps (``SLOW_ALPHA``)
        self.rows: float | None = None     # verifier rows per step
        self.n = 0
        self.last = 0                      # the step of the last measurement (the session's start: none yet)

    def add(self, tok: float, rows: float, step: int, alpha: float, slow_alpha: float | None = None) -> None:
        """One measurement at moving-average weight ``alpha`` (``slow_alpha``: the slower average's, default the
        same)."""
        self.tok = _ema(self.tok, tok, alpha)
        self.slow = _ema(self.slow, tok, alpha if slow_alpha is None else slow_alpha)
        self.rows = _ema(self.rows, rows, alpha)
        self.n += 1
        self.last = step

    @property
    def sustained(self) -> float | None:
        """Tokens per step to expect for the rest of a budget: the lower of the two averages, so one lucky step
        (one long match among misses of a lookup drafter, scored every step) does not commit a whole batch, while a
        fall is followed at the faster one's pace.  A model drafter's probes are rare and weighed as they come."""
        return None if self.tok is None else min(self.tok, self.slow)


PROBE_ALPHA = 0.5          # a probe is rare: weigh it heavily
STEP_ALPHA = 0.3           # per-step measurements (the chosen arm, off-policy lookups)
SLOW_ALPHA = 0.1           # the slower average of a lookup's tokens per step, for plans over the rest of a budget
PRIOR_ALPHA = 0.1          # the drafter's running average over its requests
MIN_INTERVAL, MAX_INTERVAL = 2, 256
PRIOR_TRUST = 1.5         # an arm this request has not measured is used outright when the average says it wins by 1.5x
MARGIN = 0.05             # a drafter replaces plain steps only when its estimated value is this much higher
HINT_EVERY = 4             # re-probe DAS-Wave at most this often when a lookup arm overtakes it
OUTLIER = 3.0             # a width's rate from one drafted step, at most this x its nearest measured neighbour's
CONFIRM = 3               # the most price probes of a lookup arm (that drafted) in a drafter's life
EARLY_RESOLVE = 4          # an off-policy lookup draft whose first 4 tokens matched counts as 5 tokens at once


class AutoSession(Session):
    """One request: a session of every sub-drafter (they keep their own text indexes; only the chosen one proposes),
    the request's per-arm measurements and its exploration clock."""

    def __init__(self, drafter: "AutoDrafter", req):
        super().__init__(drafter, req)
        self.serial = next(drafter.serials)          # which requests a step shares with the last (not id(): reused)
        self.subs: dict[str, Session] = {arm: sub.start(req) for arm, sub in drafter.subs.items()}
        self.arms = {arm: ArmStats() for arm in drafter.subs}
        self.steps = 0
        self.arm = "ar"                    # this step's arm
        self.prev = "ar"                   # the last step's
        self.probe = False
        self.pending: dict[str, tuple[int, list[int]]] = {}   # lookup arm -> (generated length, its draft then)
        self.last_hint = 0
        self.hint_level = 0.0              # the lookup acceptance that triggered the last hinted probe

    # -- estimates --
    def tok_rows(self, arm: str, sustained: bool = False) -> tuple[float | None, float | None]:
        """Tokens and verifier rows per step of ``arm`` for this request (the drafter's average over its requests
        while this one has not measured it; None when nobody has).  ``sustained``: the tokens to expect over the
        rest of the budget (``ArmStats.sustained``) rather than next step."""
        if arm == "ar":
            return 1.0, 1.0
        st = self.arms[arm]
        if st.n:
            return (st.sustained if sustained else st.tok), st.rows
        prior = self.drafter.prior.get(arm)
        return (prior[0], prior[1]) if prior is not None else (None, None)

    def values(self, B: int, arms=None, hoped: bool = False) -> dict[str, tuple[float, float, float] | None]:
        """arm -> (the step's tokens per second, its seconds, its tokens) with this request on ``arm`` (each of
        ``arms``, default AR and every sub-drafter) and the others as last step, or None while unknown.
        ``hoped``: this request's own rows past its first priced at the lower of the measured rate and the
        calibration's shape (``verify_time``'s ``hoped_rows``)."""
        d = self.drafter
        others = d.others(B)
        out = {}
        for arm in (("ar", *d.subs) if arms is None else arms):
            tok, rows = self.tok_rows(arm)
            m = d.groups_last.get(arm, 0) + (self.prev != arm)        # the group it would draft in
            t = d.step_time(arm, rows, others, m, B, hoped) if tok is not None else None
            out[arm] = None if t is None else ((others[0] + tok) / t, t, others[0] + tok)
        return out

    def choose(self, B: int) -> tuple[str, bool]:
        d = self.drafter
        if self.ctx.room <= 1:             # one token to go: nothing to gain, no probe charged (propose_batch too)
            return "ar", False
        vals = self.values(B)
        if vals["ar"] is None:             # no pass measured yet (no calibration): a plain step measures one
            return "ar", False
        for arm in d.subs:                 # a model-drafting arm nobody has measured yet: probe it (one request)
            if arm not in LOOKUP and vals[arm] is None and arm not in d.probed:
                d.probed.add(arm)
                return arm, True
        known = {a: v for a, v in vals.items() if v is not None}
        # exploited: AR, the lookups (measured off-policy every few steps) and what this request has measured; a
        # model-drafting arm known only from other requests' averages is tried as a (budgeted) probe
        mine = {a: v for a, v in known.items() if a == "ar" or a in LOOKUP or self.arms[a].n}
        best = max(mine, key=lambda a: mine[a][0])
        if best != "ar" and known[best][0] < (1.0 + MARGIN) * known["ar"][0]:
            best = "ar"                    # AR's value is certain, the others' estimated: a drafter must win clearly
        if d.knobs.explore <= 0:
            return best, False
        j_best, t_best, others_tok = known[best][0], known[best][1], known["ar"][2] - 1.0
        for arm, (j_a, t_a, _) in known.items():
            if arm not in mine and j_a > PRIOR_TRUST * j_best:
                return arm, False          # the other requests' average says it wins by far: use it
            if arm not in mine and arm not in d.probed and j_a > (1.0 + MARGIN) * j_best \
                    and d.may_probe(max(t_a - (others_tok + 1.0) / j_best, 0.05 * t_best / B)):
                d.probed.add(arm)          # charged as if it committed one token
                return arm, True
        # a lookup arm's acceptance is measured every step, but the price of its rows only when it drafts: one that
        # would win were its own rows as cheap as the calibration says is tried now and then, ``CONFIRM`` times at
        # most (a noisy drafted step must not price it out of a server for good).  Not in a closed batch: its
        # horizon is the batch's budgets, too short to repay them; before a drafted step is measured the rows are
        # priced so already.
        if d.extra and not (B > 1 and self.ctx.closed):
            t_ar = known["ar"][1]               # a step with the arm's rows costs about this at least
            for arm in LOOKUP:
                if arm not in known or arm == best or arm in d.probed or d.price_probes.get(arm, 0) >= CONFIRM:
                    continue
                _, t_a, tok_a = known[arm]
                if tok_a <= (1.0 + MARGIN) * j_best * t_ar:
                    continue                    # no hope at any price
                # the price is the drafter's, not the request's: one probe losing x seconds per x / explore seconds
                loss = max(t_a - tok_a / j_best, 0.05 * t_best / B)
                if d.elapsed - d.drafted.get(arm, 0.0) < loss / d.knobs.explore:
                    continue
                hope = self.values(B, [arm], hoped=True)[arm]
                if hope is None or hope[0] <= (1.0 + MARGIN) * j_best or t_a <= hope[1]:
                    continue                    # no hope, or already priced at its best
                if d.may_probe(loss):
                    d.probed.add(arm)
                    return arm, True
        look = max([self.tok_rows(a)[0] or 0.0 for a in LOOKUP if a in d.subs] or [0.0])
        for arm in d.subs:
            if arm in LOOKUP or arm == best or arm not in mine or arm in d.probed:    # one probe a step
                continue
            _, t_a, tok_a = known[arm]
            since = self.steps - self.arms[arm].last
            # the lookup drafters now accept more than this arm did when last measured, and it would be the best
            # arm if it accepted that much too (its seeds come from the same text): measure it again soon, once
            # per such rise
            # what one probe costs against the best arm
            loss = max(t_a - tok_a / j_best, 0.05 * t_best / B)
            own = self.tok_rows(arm)[0] or 0.0
            if d.seeded(arm) and since >= HINT_EVERY and look > max(own + 0.5, self.hint_level + 0.5) \
                    and (tok_a - own + look) / t_a > j_best and d.may_probe(loss):
                self.hint_level = look
                d.probed.add(arm)
                return arm, True
            # the interval that keeps B requests' probes within ``explore`` of the step time
            interval = min(max(loss * B / (d.knobs.explore * t_best), MIN_INTERVAL), MAX_INTERVAL)
            if since >= interval and d.may_probe(loss):
                d.probed.add(arm)
                return arm, True
        if look < self.hint_level - 1.0:
            self.hint_level = look
        return best, False

    # -- off-policy scoring of lookup drafts --
    def shadow(self) -> None:
        """Ask each lookup arm not used this step for its draft (host work only) and keep it, to score once the
        next tokens are committed."""
        gen = len(self.ctx.generated)
        if self.ctx.room <= 1:             # an empty draft would score as a miss
            return
        for arm in LOOKUP:
            if arm not in self.subs or arm == self.arm or arm in self.pending:
                continue
            t0 = time.perf_counter()
            draft = self.subs[arm].propose()
            self.drafter.add_draft_cost(arm, time.perf_counter() - t0)
            if draft.layout is not None:              # a tree (SAM's static corpus): not scored off-policy
                continue
            toks = draft.tokens
            toks = toks.tolist() if hasattr(toks, "tolist") else list(toks)
            self.pending[arm] = (gen, [int(t) for t in toks][: max(self.ctx.room - 1, 0)])

    def resolve(self) -> None:
        """Score the pending lookup drafts whose outcome the committed tokens now decide: the chain would have
        committed its longest prefix that matches them, plus the target's token (a lower bound once the first
        ``EARLY_RESOLVE`` matched, so a run of matches counts at once)."""
        gen = self.ctx.generated
        for arm, (at, toks) in list(self.pending.items()):
            seen = gen[at: at + len(toks)]
            m = 0
            while m < len(seen) and seen[m] == toks[m]:
                m += 1
            if m < len(seen) or m == len(toks) or m >= EARLY_RESOLVE:
                del self.pending[arm]
                rows = len(toks) + 1 if toks else 1
                self.arms[arm].add(m + 1, rows, self.steps, STEP_ALPHA, SLOW_ALPHA)
                self.drafter.add_prior(arm, m + 1, rows)

    def observe(self, verdict: Verdict) -> None:
        arm = self.arm
        tok, rows = len(verdict.tokens), int(verdict.pred.shape[0])
        self.drafter.step_tok += tok
        self.drafter.step_rows += rows
        self.drafter.step_n += 1
        if arm != "ar":
            if arm in LOOKUP:
                self.arms[arm].add(tok, rows, self.steps, STEP_ALPHA, SLOW_ALPHA)
                if self.probe and rows > 1:     # a price probe that measured rows
                    self.drafter.price_probes[arm] = self.drafter.price_probes.get(arm, 0) + 1
            else:
                self.arms[arm].add(tok, rows, self.steps, PROBE_ALPHA)
            self.drafter.add_prior(arm, tok, rows)
            self.subs[arm].observe(verdict)
            self.pending.pop(arm, None)
        self.resolve()
        self.prev = arm
        self.steps += 1


class AutoDrafter(Drafter):
    """Sub-drafters for DAS-Wave, SAM and PLD (built with the model's knobs for each, by ``bind``), the shared cost
    model and the drafter-wide averages of what each arm earns.  ``clock``: the time source (tests pass their
    own)."""

    name = "auto"
    session = AutoSession
    width_knobs = ("arms",)
    stateful = True           # its cost model and acceptance averages carry over from request to request

    def __init__(self, knobs: AutoKnobs, clock: Callable[[], float] = time.perf_counter):
        self.knobs = knobs
        self.subs: dict[str, Drafter] = {}
        self.width = 1
        self.clock = clock
        self.sizing: Sizing | None = None
        # verification (+ engine) seconds per step and the model's pass cost of its rows: ``scale``, which prices
        # passes until plain steps are measured (then ``plain`` and ``extra``: ``sp`` and ``extra_rate``)
        self.ema_v: float | None = None
        self.ema_f: float | None = None
        self.plain: tuple[float, float] | None = None   # the same over plain steps (a row per request) only
        # drafted steps, by ``_bucket`` of their rows past the plain ones: that time in the plain scale's units, those
        # rows (moving averages: their ratio is what one such row costs), and how many steps were measured
        self.extra: dict[int, tuple[float, float, int]] = {}
        self.early: list[tuple[float, int, int]] = []   # drafted steps before the first plain one: v, rows, n
        # per arm and ``_bucket`` of the group drafting together: drafting seconds and ``draft_units`` (moving averages)
        self.dcost: dict[str, dict[int, tuple[float, float]]] = {}
        self.groups_last: dict[str, int] = {}    # sessions that drafted with each arm last step
        self.probed: set[str] = set()            # arms probed this step (one request each)
        self.drafted: dict[str, float] = {}      # per arm: ``elapsed`` when a request last drafted with it
        self.price_probes: dict[str, int] = {}   # per lookup arm: its price probes that drafted
        self.elapsed = 0.0                       # seconds of the steps measured so far
        self.explored = 0.0                      # what the probes so far were estimated to cost over the best arm
        self.prior: dict[str, tuple[float, float]] = {}
        self.step_tok = self.step_rows = 0       # the step being verified: tokens, rows (from the verdicts)
        self.step_n = 0                          # and its verified requests
        self.last: tuple[int, int, int, float] | None = None    # the last step: sessions, tokens, rows, drafting s
        self._t_prev: float | None = None
        self._gap = 0.0                          # the last interval between steps a request decoded through
        self._d_prev = 0.0
        self._ids_prev: set[int] = set()
        self.serials = itertools.count()
        self.bound = False
        self.cuda = False

    # -- building --
    def bind(self, model, num_steps: int | None = None, sampled: bool = False) -> None:
        """Build the sub-drafters on ``model`` (each method's knobs as ``build_drafter`` resolves them) and size
        DAS-Wave's window from the calibration."""
        self.cuda = model.device.type == "cuda"
        R = model.depth(num_steps)
        if self.knobs.calibrate:
            self.sizing = Sizing.of(calibration(model), R)
        if self.sizing is not None:
            self.ema_v = self.ema_f = self.sizing.full1        # the first estimate: the calibrated pass
        for arm in self.knobs.arm_list:
            user = self.wave_window(model, R, sampled) if arm == "das-wave" else {}
            self.subs[arm] = build_drafter(model, arm, user, num_steps, sampled)
        self.width = max([1] + [d.width for d in self.subs.values()])
        # the longest chain a sub-drafter may propose (DAS-Wave's copy runs reach past its width): without it the
        # engine would back only ``width`` rows and cut those runs short, so auto ran below DAS-Wave where it pays
        reach = max([self.width] + [getattr(d, "reach", None) or d.width for d in self.subs.values()])
        self.reach = reach if reach > self.width else None
        self.bound = True

    def wave_window(self, model, R: int, sampled: bool) -> dict:
        """DAS-Wave knobs the calibration lowers: gamma = W_init to the widest nearly-free window, the rounds so a
        block's rounds cost at most one full-depth one-row pass; knobs the model's generation_config.json sets are
        kept."""
        from . import resolve_knobs                  # lazy: the registry imports its methods (a circle)
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

    # -- the cost model --
    def pass_cost(self, rows: float) -> float:
        """The model's cost of one verification pass over ``rows`` rows, in the calibration's seconds (without
        one: a fixed part of ``DEFAULT_K`` rows plus one per row)."""
        return self.sizing.full(rows) if self.sizing is not None else DEFAULT_K + rows

    @property
    def scale(self) -> float | None:
        """Measured verification seconds per unit of ``pass_cost`` (engine overhead and load included)."""
        return None if self.ema_v is None else self.ema_v / self.ema_f

    @property
    def sp(self) -> float:
        """The plain steps' measured seconds per unit of ``pass_cost`` (needs ``plain``)."""
        return self.plain[0] / self.plain[1]

    def extra_rate(self, e: float) -> float | None:
        """What one of e rows past the plain ones costs, in the plain scale's units, as measured on drafted steps
        (``_by_width``: so the rows are priced linearly from the nearest measured width); None while no drafted
        step is measured."""
        return _by_width(self.extra, _bucket(e), OUTLIER) if self.extra else None

    def verify_time(self, rows: float, n: int, hoped_rows: float = 0.0) -> float | None:
        """Expected seconds of a verification pass over ``rows`` rows of n >= 1 requests: once plain steps are
        measured, ``sp * (full(n) + e * extra_rate(e))`` for the e = rows - n rows past the plain ones - the
        calibration's rows are one sequence's own, a drafted step's extra rows each read a request's cached prefix
        beside the others', and cost about the same each whatever the calibration's shape says (docs/performance-journal.md,
        "Pricing the rows a draft adds"); until a drafted step is measured, the calibration's shape
        ``full(rows) - full(n)``.  Load moves ``sp`` where plain steps come often; where nearly every step drafts
        (a model DAS-Wave pays on) ``sp`` is refreshed rarely and load lands in the rates.  Before plain steps,
        every row at the one scale fitted over all steps (``scale``).  ``hoped_rows``: that many of the extra rows (one
        request's draft) at the lower of the measured rate and what the calibration's shape says they add - what a
        lookup's price probe hopes for."""
        if self.plain is None:
            scale = self.scale
            return None if scale is None else scale * self.pass_cost(rows)
        base = self.pass_cost(n)
        e = rows - n
        if e <= 0:
            return self.sp * base
        rate = self.extra_rate(e)
        if rate is None:
            return self.sp * (base + max(self.pass_cost(rows) - base, 0.0))
        extra = e * rate
        if hoped_rows > 0:
            h = min(hoped_rows, e)
            extra -= max(h * rate - max(self.pass_cost(rows) - self.pass_cost(rows - h), 0.0), 0.0)
        return self.sp * (base + extra)

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

    def draft_units(self, arm: str, m: int) -> float:
        """The model's cost of ``arm`` drafting for m requests at once, in the calibration's seconds: DAS-Wave's
        rounds over m windows (without a calibration: a fixed part of one request plus one per request); a lookup
        drafter's host work, one unit per request."""
        if arm in LOOKUP:
            return float(m)
        kn = getattr(self.subs.get(arm), "knobs", None)
        if self.sizing is None or kn is None or not hasattr(kn, "w"):
            return 1.0 + m
        return self.sizing.wave_units(kn.gamma, kn.w_init, kn.k, kn.rounds, m)

    def draft_time(self, arm: str, m: int) -> float | None:
        """Expected drafting seconds per request of ``arm`` in a group of m requests (None: never measured)."""
        if arm == "ar":
            return 0.0
        table = self.dcost.get(arm)
        if not table:
            return None
        m = max(m, 1)
        return _by_width(table, _bucket(m)) * self.draft_units(arm, m) / m

    def step_time(self, arm: str, rows: float | None, others: tuple[float, float, float], m: int,
                  B: int, hoped: bool = False) -> float | None:
        """Seconds of a step with one request drafting with ``arm`` (``rows`` verifier rows, in a group of m
        requests drafting with it) beside ``others`` (B - 1 requests); ``hoped``: its own rows past its first
        priced as ``verify_time``'s ``hoped_rows``."""
        if rows is None:
            return None
        v = self.verify_time(others[1] + rows, B, rows - 1.0 if hoped else 0.0)
        d = self.draft_time(arm, m)
        if v is None or d is None:
            return None
        return d + others[2] + v

    def may_probe(self, loss: float) -> bool:
        """Whether a probe estimated to cost ``loss`` seconds over the best arm keeps every probe so far within
        ``explore`` of the time decoded so far (whatever triggered them, over all requests); takes it if so."""
        if self.explored + loss > self.knobs.explore * self.elapsed:
            return False
        self.explored += loss
        return True

    def add_draft_cost(self, arm: str, seconds: float, m: int = 1) -> None:
        """Fold ``arm``'s drafting for a group of m requests into its measured cost at that group size: the
        calibration's shape of m windows (``draft_units``) can be far off, as that of the rows a draft adds."""
        table = self.dcost.setdefault(arm, {})
        b = _bucket(m)
        table[b] = _ema2(table.get(b), seconds, self.draft_units(arm, m))

    def add_prior(self, arm: str, tok: float, rows: float) -> None:
        old = self.prior.get(arm)
        self.prior[arm] = (tok, rows) if old is None else (_ema(old[0], tok, PRIOR_ALPHA),
                                                           _ema(old[1], rows, PRIOR_ALPHA))

    def _step_time(self, sessions: list[AutoSession]) -> None:
        """Fold the last step (its interval minus its drafting = verification and engine time) into ``scale``."""
        now = self.clock()
        ids = {s.serial for s in sessions}
        if self._t_prev is not None:
            gap = now - self._t_prev
            if ids & self._ids_prev:                     # a request decoded on: the interval was decoding (a
                self._gap = gap                          # joining prompt's prefill included)
            else:       # every request is new: the interval may hold an idle server's wait, which is not decoding time
                gap = min(gap, 3.0 * self._gap)         # (nor an explore budget: probes are paid in decoding time)
            self.elapsed += gap
        if self._t_prev is not None and self.step_rows:
            self.last = (self.step_n, self.step_tok, self.step_rows, self._d_prev)
            if ids <= self._ids_prev:             # no request joined (its prefill rode in that pass)
                v = max(now - self._t_prev - self._d_prev, 0.0)
                rows, n = self.step_rows, self.step_n
                f = self.pass_cost(rows)
                expected = self.verify_time(rows, n)
                # a step that also prefilled a waiting prompt, or a pause: clipped to 3x its price where that was
                # measured, 10x where it comes from other widths; not while only the calibration's shape prices the
                # rows a draft adds (often far too low)
                if expected is not None and (rows <= n or self.extra):
                    v = min(v, (3.0 if rows <= n or _bucket(rows - n) in self.extra else 10.0) * expected)
                self.ema_v = _ema(self.ema_v, v, STEP_ALPHA)
                self.ema_f = _ema(self.ema_f, f, STEP_ALPHA)
                if rows <= n:
                    self.plain = _ema2(self.plain, v, f)
                    for early in self.early:      # drafted steps measured before any plain one (the first probe)
                        self._add_extra(*early)
                    self.early = []
                elif self.plain is not None:
                    self._add_extra(v, rows, n)
                elif len(self.early) < 4:
                    self.early.append((v, rows, n))
        self._t_prev, self._ids_prev = now, ids
        self.step_tok = self.step_rows = self.step_n = 0

    def _add_extra(self, v: float, rows: int, n: int) -> None:
        """Fold a drafted step (``v`` seconds, ``rows`` verifier rows of n requests) into the rate of its rows past
        the plain ones: its time past the plain part in the plain scale's units (signed, so noise averages out
        rather than ratchets up).  A width's first steps are averaged evenly, so one noisy step (a pause, a
        prompt's chunk riding along) prices it high until drafted steps there are measured again - for the lookup
        arms, by the price probes of ``AutoSession.choose``."""
        if rows > n and self.sp > 0:
            b = _bucket(rows - n)
            self.extra[b] = _even_then_ema(self.extra.get(b), v / self.sp - self.pass_cost(n), float(rows - n))

    def batch_step(self, sessions: list[AutoSession], arms: list[str]) -> tuple[float, float, float, float] | None:
        """What the cost model expects of a step with session i on ``arms[i]``: (tokens, verifier rows, seconds of
        the one pass over them, seconds of the groups' drafting); None while any part is unmeasured."""
        tok = rows = 0.0
        groups: dict[str, int] = {}
        for s, arm in zip(sessions, arms):
            t, r = s.tok_rows(arm)
            if t is None:
                return None
            tok, rows = tok + t, rows + r
            groups[arm] = groups.get(arm, 0) + 1
        verify = self.verify_time(rows, len(sessions))
        if verify is None:
            return None
        drafting = 0.0
        for arm, m in groups.items():
            d = self.draft_time(arm, m)
            if d is None:
                return None
            drafting += d * m
        return tok, rows, verify, drafting

    def batch_value(self, sessions: list[AutoSession], arms: list[str]) -> float | None:
        """Expected tokens per second of a step with session i on ``arms[i]`` (``batch_step``: every session's
        tokens over the groups' drafting and one pass over every session's rows; None while any part is unmeasured)."""
        step = self.batch_step(sessions, arms)
        if step is None:
            return None
        tok, _, verify, drafting = step
        return tok / (verify + drafting) if verify + drafting > 0 else None

    def batch_time(self, plan: list[tuple[str, float, float]], memo: dict | None = None) -> float | None:
        """Seconds until the last request has used its budget (``max_new_tokens``: an end of sequence may come
        sooner) when request j stays on ``plan[j]`` = (arm, steps, rows per step): each step costs one pass over the
        rows of the requests still decoding plus each arm's drafting for its group then (None while a cost is
        unmeasured).  ``memo``: drafting times by (arm, group) shared by the plans of one step."""
        if self.verify_time(1, 1) is None:
            return None
        memo = {} if memo is None else memo
        rows = sum(r for _, _, r in plan)
        group: dict[str, int] = {}
        for arm, _, _ in plan:
            group[arm] = group.get(arm, 0) + 1
        total = done = 0.0
        n = len(plan)
        for steps, arm, r in sorted((t, arm, r) for arm, t, r in plan):
            if steps > done:
                step = self.verify_time(rows, n)
                for a, m in group.items():
                    if m and a != "ar":
                        if (a, m) not in memo:
                            memo[a, m] = self.draft_time(a, m)
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

    def closed_plan(self, sessions: list[AutoSession], picks: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
        """The arms of a closed batch's step (``DraftContext.closed``): the caller waits for the last request, so
        what counts is the time until then (``batch_time``, bounded by the budgets), not this step's tokens per
        second - drafts that let one request finish early while the others keep the batch going save nothing.  The
        plans weighed: every request plain, every request on one drafter, and each request's own choice; the
        quickest is taken if it beats plain steps by ``MARGIN``, and a batch whose every request drafted with one
        arm last step, some after one measurement of it, keeps it unless plain steps beat it by ``MARGIN``.  Probes
        keep their arm."""
        B = len(sessions)
        budgets = [max(s.ctx.budget, 1) for s in sessions]
        plans = [["ar"] * B] + [[arm] * B for arm in self.subs] + [[a for a, _ in picks]]
        best, best_time, plain = None, None, None
        held = sessions[0].prev if all(s.prev == sessions[0].prev for s in sessions) else "ar"
        held_time = None
        memo: dict = {}
        for arms in plans:
            plan = []
            for s, b, arm in zip(sessions, budgets, arms):
                tok, rows = s.tok_rows(arm, sustained=True)
                if tok is None or rows is None:
                    break
                plan.append((arm, b / max(tok, 1.0), rows))
            else:
                t = self.batch_time(plan, memo)
                if t is None:
                    continue
                if plain is None:
                    plain = t
                if held != "ar" and arms == [held] * B:
                    held_time = t
                if best_time is None or t < best_time:
                    best, best_time = arms, t
        if best is None or plain is None or best_time >= (1.0 - MARGIN) * plain:
            # plain steps - unless the whole batch is on a drafter that some request has measured once only and that
            # plain steps do not beat by the margin: one block per request is a small sample to leave it on (a first
            # DAS-Wave block, before any copy run, sells it short), so it drafts once more first
            keep = held_time is not None and plain is not None and held_time < (1.0 + MARGIN) * plain \
                and min(s.arms[held].n for s in sessions) < 2
            best = [held] * B if keep else ["ar"] * B
        return [(a, probe) if probe else (arm, False) for (a, probe), arm in zip(picks, best)]

    def together(self, sessions: list[AutoSession], picks: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
        """Each request weighs an arm as if it drafted alone beside the others' last step, but a model-drafting
        arm's rounds run for all of its requests at once, and any arm's drafts can each fall within the margin
        beside the others' drafted rows while all of them together win: the step with every request on one arm -
        and, for a lookup arm (whose drafts that never match only add rows), with those of its requests whose
        drafts commit more than a token on it - is valued against the requests' own choices, and taken when it
        wins by MARGIN.  Probes keep their arm."""
        if len(sessions) < 2:
            return picks
        mine = [a for a, _ in picks]
        own = self.batch_value(sessions, mine)
        if own is None:
            return picks
        B = len(sessions)
        plain = self.batch_value(sessions, ["ar"] * B)
        if plain is not None and plain > (1.0 + MARGIN) * own and any(a != "ar" for a, p in picks if not p):
            # each request chose as if the others stepped as last step; all of them drafting at once loses
            picks = [(a, True) if p else ("ar", False) for a, p in picks]
            mine = [a for a, _ in picks]
            own = self.batch_value(sessions, mine)
            if own is None:
                return picks
        best, best_value = None, (1.0 + MARGIN) * own
        for arm in self.subs:
            plans = [[a if probe else arm for a, probe in picks]]
            if arm in LOOKUP and plain:
                # only the requests whose drafts add tokens faster than a plain step does: their extra tokens
                # against their extra rows at what the candidates' rows together cost a row
                stats = [s.tok_rows(arm) for s in sessions]
                e = sum(r - 1.0 for t, r in stats if t is not None and t > 1.0 and r > 1.0)
                if e > 0:
                    row = (self.verify_time(B + e, B) - self.verify_time(B, B)) / e
                    plans.append([a if probe else arm if t is not None and t - 1.0 > plain * row * (r - 1.0)
                                  else "ar" for (t, r), (a, probe) in zip(stats, picks)])
            for arms in plans:
                if arms == mine or arm not in arms:     # the requests' own choices, or nobody drafting
                    continue
                v = self.batch_value(sessions, arms)
                if v is not None and v > best_value:
                    best, best_value = arms, v
        return picks if best is None else [(a, probe) for a, (_, probe) in zip(best, picks)]

    def propose_batch(self, sessions: list[AutoSession]) -> list[Draft]:
        self._step_time(sessions)
        self.probed = set()
        B = len(sessions)
        picks = [s.choose(B) for s in sessions]
        closed = B > 1 and sessions[0].ctx.closed           # alone, the step's tokens per second is its end
        picks = self.closed_plan(sessions, picks) if closed else self.together(sessions, picks)
        # one token to go: a draft cannot commit more, a probe would measure nothing
        picks = [("ar", False) if s.ctx.room <= 1 else p for s, p in zip(sessions, picks)]
        groups: dict[str, list[int]] = {}
        for i, (s, pick) in enumerate(zip(sessions, picks)):
            s.arm, s.probe = pick
            s.ctx.count_choice(s.arm)
            groups.setdefault(s.arm, []).append(i)
        drafts: list[Draft] = [Draft()] * B
        spent = 0.0
        for arm, idx in groups.items():
            if arm == "ar":
                continue
            subs = [sessions[i].subs[arm] for i in idx]
            for i, sub in zip(idx, subs):
                if sessions[i].prev != arm and hasattr(sub, "copying"):
                    sub.copying = False           # DAS-Wave's copy run follows its own last block only
            self.drafted[arm] = self.elapsed
            t0 = self.clock()
            got = self.subs[arm].propose_batch(subs)
            if self.cuda:
                torch.cuda.synchronize()
            dt = self.clock() - t0
            spent += dt
            self.add_draft_cost(arm, dt, len(idx))
            for i, dr in zip(idx, got):
                drafts[i] = dr
        out = []
        for s, dr in zip(sessions, drafts):
            s.shadow()
            notes = dict(dr.notes or {})
            notes["auto"] = s.arm
            if s.probe:
                notes["probe"] = True
            out.append(replace(dr, notes=notes))
        self._d_prev = spent
        self.groups_last = {arm: len(idx) for arm, idx in groups.items()}
        return out


def _build(knobs: AutoKnobs) -> AutoDrafter:
    return AutoDrafter(knobs)


register(Method("auto", AutoKnobs, _build, stateful=True))
