"""Every constant of method auto, in one frozen record, each with the reason for its value.

A value here changes only how fast auto decodes, never a token (every draft is verified by the full-depth target).
The figures these values were measured against are on docs/performance.md ("Method auto") and in the journal's
"Never slower than AR" sections; ``dasspec.methods.auto.TUNING`` is the record in use, and a drafter built with
``AutoDrafter(knobs, tuning=replace(TUNING, ...))`` runs with another (benchmarks, tests).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


def why(value, reason: str):
    """A tuning field with its reason (read back by ``reasons()``)."""
    return field(default=value, metadata={"why": reason})


@dataclass(frozen=True)
class Tuning:
    # --- calibration (``calibrate.py``) ---
    calibration_budget_s: float = why(3.0, "a server builds auto at start-up: at most ~3 s of measuring, then cached "
                                           "per model and machine")
    cal_widths: tuple[int, ...] = why((1, 8, 32, 2, 4, 16), "the most telling widths first, so a slow model that "
                                      "measures only what the budget allows still prices 1, 8 and 32 rows")
    cal_reps: int = why(4, "passes round the widths, each width's minimum kept: a burst of load touches every width "
                           "alike instead of corrupting the one being measured")
    cal_first_share: float = why(0.5, "the first pass over the widths stops once half the budget is spent, so the "
                                      "repetitions that take each width's minimum get the other half")
    wide_round: float = why(1.5, "DAS-Wave's window is the widest whose round costs at most 1.5x a one-row round: "
                                 "past it wider rows stop being nearly free")
    default_k: float = why(4.0, "without a calibration a pass costs a fixed part of ~4 rows plus one per row "
                                "(the bundled model's shape on a CPU)")
    # --- moving averages (``costs.py``, ``earnings.py``) ---
    step_alpha: float = why(0.3, "per-step measurements (pass times, the chosen arm, off-policy lookups): follows a "
                                 "change within ~3 steps, a single noisy step moves it by a third")
    probe_alpha: float = why(0.5, "a model drafter's probes are rare (every ~interval steps): each weighs heavily")
    slow_alpha: float = why(0.1, "the slower average of a lookup's tokens per step, for plans over the rest of a "
                                 "budget: one long match among misses must not commit a whole batch")
    prior_alpha: float = why(0.1, "the drafter's average over its requests changes slowly: it seeds new requests")
    early_steps: int = why(4, "drafted steps measured before the first plain one of their batch size (the first "
                              "probe) kept to price the rows past the plain ones once such a plain step is measured")
    step_clip: float = why(3.0, "a pass measured more than 3x its price where that price was measured (a pause, a "
                                "burst of load) counts as 3x: one bad step must not price a shape out")
    shape_clip: float = why(10.0, "the same where the price comes from other widths only (far less certain)")
    outlier: float = why(3.0, "a width's rate measured on one drafted step is taken at most 3x its nearest measured "
                              "neighbour's: drafting there again measures it")
    # --- choosing (``explorer.py``, ``planners.py``) ---
    margin: float = why(0.05, "a drafter replaces plain steps only when its estimated tokens/s is 5% higher: AR's "
                              "value is certain, the others' estimated")
    prior_trust: float = why(1.5, "a model drafter this request has not measured is used outright when the other "
                                  "requests' average says it wins by 1.5x (a batch then pays one probe, not B); a "
                                  "batch plan that puts such requests on any drafter likewise while fewer than "
                                  "``prior_requests`` requests stand behind that average - where it wins by less, the "
                                  "plan is a budgeted probe")
    prior_requests: int = why(2, "an average that one request's blocks make may be one lucky block (random weights "
                                 "repeat themselves): a batch plan that rests on it is a probe until a second request "
                                 "has measured the drafter")
    min_interval: int = why(2, "a switched-off model drafter is probed at most every 2 steps")
    max_interval: int = why(256, "... and at least every 256 steps, however much a probe costs")
    probe_loss_floor: float = why(0.05, "a probe is charged at least 5% of the best step's time per request: a "
                                        "probe estimated free must still cost budget")
    hint_every: int = why(4, "a model drafter is re-probed at most every 4 steps when a lookup's acceptance "
                             "overtakes its last measured one")
    hint_rise: float = why(0.5, "... by at least half a token per step over its own and over the last hint's level")
    hint_fall: float = why(1.0, "a hint re-arms once the lookups' acceptance falls a token below the last hint's")
    confirm: int = why(3, "the most price probes of a lookup arm in a drafter's life: a noisy drafted step must not "
                          "price it out for good, nor may probing it go on for ever")
    early_resolve: int = why(4, "an off-policy lookup draft whose first 4 tokens matched counts as 5 committed at "
                                "once (a run of matches is noticed at once)")
    hold_below: int = why(2, "a closed batch all on a drafter some request has measured fewer than 2 times stays on "
                             "it unless plain steps win by the margin: one block is a small sample")
    kept_keys: int = why(16, "the outcomes kept between generate calls (memory.py) per model: the last 16 keys, so a "
                             "sweep of knob values does not grow the process")


TUNING = Tuning()


def reasons(t: Tuning = TUNING) -> dict[str, tuple[object, str]]:
    """Every constant with its value and reason (for docs and ``dasspec probe``-style listings)."""
    return {f.name: (getattr(t, f.name), f.metadata["why"]) for f in fields(t)}
