"""What a step costs: the price of a verification pass over its rows and of each arm's drafting, fitted on what the
executor measured (``PassTiming``: the pass's own seconds, read after the step's one device synchronisation) and on
the laps auto times around its sub-drafters - never on wall-clock gaps between calls.

* **a pass**: ``V = scale * full(rows)`` over the pass's rows, where ``full(W)`` is the calibrated model time of a
  full-depth pass over W rows (``Sizing``; without a calibration ``default_k + W``) and ``scale`` is a ratio of
  moving averages (load and the engine's own overhead fold into it).  Once plain steps (a row per request) are
  measured, a pass over n requests' rows is priced in two parts: the n plain rows at the scale of plain steps of
  about n requests (powers of two of n; between measured counts interpolated, outside them the nearest one's), the
  e rows past them at seconds per row measured on drafted steps, by width (powers of two of e; a width not measured
  takes its measured neighbours', so rows are priced linearly from the nearest; a width measured on one step only
  at most ``outlier`` x its nearest neighbour's).  The calibration's rows are one sequence's own, while a drafted
  step's extra rows each read a request's cached prefix beside the others' and can cost far more than the
  calibration's shape says (docs/performance-journal.md, "Pricing the rows a draft adds").  Drafted steps measured
  before the first plain one of their batch size (the first probe) count once it is.  A pass that carried prompt
  rows is not fitted: its time is not the drafts'.
* **drafting**: per arm and size of group m drafting together (powers of two of m), a fitted scale over
  ``draft_units`` (DAS-Wave's rounds over m windows from the calibration; a lookup's host work, a unit per request).
"""

from __future__ import annotations

from .calibrate import Sizing
from .tuning import TUNING, Tuning

LOOKUP = ("sam", "pld")           # drafters that need no model pass


def ema(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else old + alpha * (new - old)


def ema2(old: tuple[float, float] | None, v: float, f: float, alpha: float) -> tuple[float, float]:
    """Moving averages of a measured time and its modelled cost (their ratio: a fitted scale)."""
    return (v, f) if old is None else (ema(old[0], v, alpha), ema(old[1], f, alpha))


def bucket(e: float) -> int:
    """The width bucket of e rows (or requests): 1, 2-3, 4-7, 8-15, ... (powers of two)."""
    return max(int(e), 1).bit_length() - 1


def _rate(got: tuple) -> float:
    return max(got[0] / got[1], 0.0)


def by_width(table: dict[int, tuple], b: int, outlier: float | None = None) -> float:
    """A table by width bucket of (a time, what it is per, ...) at bucket b: b's own ratio, between measured
    buckets interpolated, outside them the nearest one's.  ``outlier``: entries carry their steps third, and a width
    measured on one step only is taken at most ``outlier`` x the nearest other width's ratio."""
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


def even_then_ema(old: tuple[float, float, int] | None, y: float, e: float, alpha: float
                  ) -> tuple[float, float, int]:
    """Moving averages of a drafted step's time past the plain part and its extra rows, and the steps so far: the
    first few averaged evenly (a noisy first step weighs a third after three), then at ``alpha``."""
    if old is None:
        return y, e, 1
    a = max(alpha, 1.0 / (old[2] + 1))
    return old[0] + a * (y - old[0]), old[1] + a * (e - old[1]), old[2] + 1


class CostModel:
    """Prices of passes and drafting, fitted online.  ``wave``: per model-drafting arm its knobs (gamma, w_init, k,
    rounds), for the shape of its rounds."""

    def __init__(self, sizing: Sizing | None, tuning: Tuning = TUNING):
        self.sizing, self.t = sizing, tuning
        self.wave: dict[str, object] = {}
        # verification seconds per pass and the model's pass cost of its rows: ``scale`` prices passes until plain
        # steps are measured (then ``plain`` and ``extra``)
        self.ema_v: float | None = None if sizing is None else sizing.full1
        self.ema_f: float | None = None if sizing is None else sizing.full1
        # the same over plain passes (a row per request) only, by ``bucket`` of their requests: a batch's plain rows
        # each read their own prefix, which the calibration's one-sequence shape does not price, so one scale for
        # every batch size would mistake a batch's shape for load
        self.plain: dict[int, tuple[float, float]] = {}
        # drafted passes by ``bucket`` of their rows past the plain ones: that time in seconds, those rows (moving
        # averages: their ratio is what one such row costs), and how many were measured.  Seconds, not the plain
        # scale's units: the plain scale moves with the batch size, a drafted row's price need not
        self.extra: dict[int, tuple[float, float, int]] = {}
        self.early: list[tuple[float, int, int]] = []   # drafted passes before their batch size's first plain one
        # per arm and ``bucket`` of the group drafting together: drafting seconds and ``draft_units``
        self.dcost: dict[str, dict[int, tuple[float, float]]] = {}
        self.host: float | None = None     # the executor's seconds a step outside its pass and drafting

    # -- fitting --
    def add_pass(self, v: float, rows: int, n: int) -> None:
        """Fold a measured pass (``v`` seconds over ``rows`` verifier rows of n requests) into the prices: clipped
        to ``step_clip`` x its price where that was measured (``shape_clip`` x where it comes from other widths or
        batch sizes; not while only the calibration's shape prices the rows a draft adds, often far too low).  A
        drafted pass of a batch size whose plain passes are not measured yet waits in ``early`` for the first of
        them: its plain part priced from another batch size would land on its extra rows."""
        t = self.t
        f = self.pass_cost(rows)
        expected = self.verify_time(rows, n)
        plain_seen = bucket(n) in self.plain
        if expected is not None and (rows <= n or self.extra):
            seen = plain_seen and (rows <= n or bucket(rows - n) in self.extra)
            v = min(v, (t.step_clip if seen else t.shape_clip) * expected)
        self.ema_v = ema(self.ema_v, v, t.step_alpha)
        self.ema_f = ema(self.ema_f, f, t.step_alpha)
        if rows <= n:
            self.plain[bucket(n)] = ema2(self.plain.get(bucket(n)), v, f, t.step_alpha)
            waiting = [e for e in self.early if bucket(e[2]) not in self.plain]
            for early in self.early:
                if bucket(early[2]) in self.plain:
                    self._add_extra(*early)
            self.early = waiting
        elif plain_seen:
            self._add_extra(v, rows, n)
        elif len(self.early) < t.early_steps:
            self.early.append((v, rows, n))

    def _add_extra(self, v: float, rows: int, n: int) -> None:
        """A drafted pass's seconds past its plain part (signed, so noise averages out rather than ratchets up), at
        the bucket of its rows past the plain ones."""
        if rows > n:
            b = bucket(rows - n)
            self.extra[b] = even_then_ema(self.extra.get(b), v - self.sp(n) * self.pass_cost(n), float(rows - n),
                                          self.t.step_alpha)

    def add_draft(self, arm: str, seconds: float, m: int = 1) -> None:
        """Fold ``arm``'s drafting for a group of m requests into its measured cost at that group size."""
        table = self.dcost.setdefault(arm, {})
        b = bucket(m)
        table[b] = ema2(table.get(b), seconds, self.draft_units(arm, m), self.t.step_alpha)

    def add_host(self, seconds: float) -> None:
        """Fold a step's host seconds (``PassTiming.host_seconds``) into what every step costs beside its pass."""
        self.host = ema(self.host, seconds, self.t.step_alpha)

    # -- prices --
    @property
    def overhead(self) -> float:
        """Seconds every step costs outside its pass and drafting, whatever it drafted (0 until measured): an arm
        that takes fewer steps a token saves them, so the arms are compared with them."""
        return self.host or 0.0

    def pass_cost(self, rows: float) -> float:
        """The model's cost of one pass over ``rows`` rows, in the calibration's seconds (without one: a fixed part
        of ``default_k`` rows plus one per row)."""
        return self.sizing.full(rows) if self.sizing is not None else self.t.default_k + rows

    @property
    def scale(self) -> float | None:
        """Measured verification seconds per unit of ``pass_cost``."""
        return None if self.ema_v is None else self.ema_v / self.ema_f

    def sp(self, n: int) -> float:
        """The measured seconds per unit of ``pass_cost`` of plain passes over n requests (needs ``plain``)."""
        return by_width(self.plain, bucket(n))

    def extra_rate(self, e: float) -> float | None:
        """Seconds of one of e rows past the plain ones (None: no drafted pass yet)."""
        return by_width(self.extra, bucket(e), self.t.outlier) if self.extra else None

    def verify_time(self, rows: float, n: int, hoped_rows: float = 0.0) -> float | None:
        """Expected seconds of a pass over ``rows`` rows of n >= 1 requests: ``sp(n) * full(n) + e * extra_rate(e)``
        for the e = rows - n rows past the plain ones once plain passes are measured (until a drafted one is, the
        calibration's shape ``full(rows) - full(n)`` at the plain scale); before plain passes, every row at the one
        fitted ``scale``.  ``hoped_rows``: that many of the extra rows (one request's draft) at the lower of the
        measured rate and the calibration's shape - what a lookup's price probe hopes for."""
        if not self.plain:
            scale = self.scale
            return None if scale is None else scale * self.pass_cost(rows)
        sp = self.sp(n)
        base = sp * self.pass_cost(n)
        e = rows - n
        if e <= 0:
            return base
        rate = self.extra_rate(e)
        if rate is None:
            return base + sp * max(self.pass_cost(rows) - self.pass_cost(n), 0.0)
        extra = e * rate
        if hoped_rows > 0:
            h = min(hoped_rows, e)
            extra -= max(h * rate - sp * max(self.pass_cost(rows) - self.pass_cost(rows - h), 0.0), 0.0)
        return base + extra

    def draft_units(self, arm: str, m: int) -> float:
        """The model's cost of ``arm`` drafting for m requests at once, in the calibration's seconds: a model
        drafter's rounds over m windows (without a calibration: a fixed part of one request plus one per request);
        a lookup's host work, a unit per request."""
        if arm in LOOKUP:
            return float(m)
        kn = self.wave.get(arm)
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
        return by_width(table, bucket(m)) * self.draft_units(arm, m) / m
