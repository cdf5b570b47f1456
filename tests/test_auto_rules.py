"""Method auto's parts alone: each rule of the explorer (dasspec/methods/auto/explorer.py) on a hand-made
``Situation`` - what makes it fire and what keeps it quiet -, the tuning record (every constant has its reason and
lives there), the cost model fed only by the executor's measurements (no wall-clock reading, no device
synchronisation in its code), and a trace that names, per step, the rule that decided and the estimates compared."""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

import pytest

import dasspec
from dasspec.methods.auto import TUNING, explorer, reasons
from dasspec.methods.auto.explorer import Budget, Choice, Situation
from dasspec.testing import random_model

AUTO = Path(dasspec.__file__).parent / "methods" / "auto"
T = TUNING


def sit(values, **kw) -> Situation:
    kw.setdefault("B", 1)
    kw.setdefault("room", 50)
    kw.setdefault("closed", False)
    kw.setdefault("measured", frozenset())
    return Situation(values=values, **kw)


def budget(explore=0.05, elapsed=100.0) -> Budget:
    b = Budget(explore)
    b.elapsed = elapsed
    return b


AR = (10.0, 0.1, 1.0)                       # AR: 10 tokens/s, a step of 0.1 s committing 1 token


def test_one_to_go_and_unpriced_decide_before_anything_is_compared() -> None:
    assert explorer.one_to_go(sit({"ar": AR}, room=1), budget(), T) == Choice("ar", False, "one-to-go")
    assert explorer.one_to_go(sit({"ar": AR}, room=2), budget(), T) is None
    assert explorer.unpriced(sit({"ar": None}), budget(), T) == Choice("ar", False, "unpriced")
    assert explorer.unpriced(sit({"ar": AR}), budget(), T) is None


def test_first_measure_probes_an_unmeasured_model_arm_once_a_step() -> None:
    b = budget()
    s = sit({"ar": AR, "das-wave": None, "pld": None})
    assert explorer.first_measure(s, b, T) == Choice("das-wave", True, "first-measure")
    assert explorer.first_measure(s, b, T) is None            # one request a step
    assert explorer.first_measure(sit({"ar": AR, "pld": None}), budget(), T) is None    # lookups: off-policy


def test_exploit_takes_the_best_measured_arm_only_past_the_margin() -> None:
    wave = frozenset({"das-wave"})
    assert explorer.exploit(sit({"ar": AR, "das-wave": (12.0, 0.2, 2.4)}, measured=wave), T).arm == "das-wave"
    won_by_less = (10.0 * (1 + T.margin) - 0.01, 0.2, 2.0)
    assert explorer.exploit(sit({"ar": AR, "das-wave": won_by_less}, measured=wave), T) == \
        Choice("ar", False, "margin")
    # a model arm this request has not measured is not exploited (the others' average is not its own)
    assert explorer.exploit(sit({"ar": AR, "das-wave": (50.0, 0.2, 10.0)}), T).arm == "ar"


def test_trusted_prior_uses_an_arm_the_average_says_wins_by_far() -> None:
    best = Choice("ar", False, "best")
    far = sit({"ar": AR, "das-wave": (10.0 * T.prior_trust + 0.1, 0.2, 3.0)})
    assert explorer.trusted_prior(far, best, budget(), T) == Choice("das-wave", False, "trusted-prior")
    near = sit({"ar": AR, "das-wave": (10.0 * T.prior_trust - 0.1, 0.2, 3.0)})
    assert explorer.trusted_prior(near, best, budget(), T) is None
    mine = sit({"ar": AR, "das-wave": (30.0, 0.2, 6.0)}, measured=frozenset({"das-wave"}))
    assert explorer.trusted_prior(mine, best, budget(), T) is None


def test_prior_probe_is_charged_to_the_budget() -> None:
    best = Choice("ar", False, "best")
    s = sit({"ar": AR, "das-wave": (12.0, 0.2, 2.4)})
    b = budget(explore=0.05, elapsed=100.0)
    assert explorer.prior_probe(s, best, b, T) == Choice("das-wave", True, "prior-probe")
    assert b.explored == pytest.approx(0.2 - 1.0 / 10.0)        # its step less AR's time for its one token
    assert explorer.prior_probe(s, best, budget(elapsed=0.0), T) is None     # no budget yet
    assert explorer.prior_probe(sit({"ar": AR, "das-wave": (10.2, 0.2, 2.04)}), best, budget(), T) is None


def test_price_probe_tries_a_lookup_priced_out_now_and_then() -> None:
    best = Choice("ar", False, "best")
    # pld would commit 3 tokens in a 0.4 s step (7.5 tokens/s: loses) but 0.25 s at its hoped price (12: wins)
    s = sit({"ar": AR, "pld": (7.5, 0.4, 3.0)}, rows_priced=True, hope=lambda arm: (12.0, 0.25, 3.0))
    b = budget(elapsed=100.0)
    assert explorer.price_probe(s, best, b, T) == Choice("pld", True, "price-probe")
    assert explorer.price_probe(s, best, b, T) is None                      # one probe of an arm a step
    b2 = budget(elapsed=100.0)
    b2.drafted["pld"] = 100.0                                               # it drafted just now
    assert explorer.price_probe(s, best, b2, T) is None
    b3 = budget(elapsed=100.0)
    b3.price_probes["pld"] = T.confirm                                       # confirmed often enough
    assert explorer.price_probe(s, best, b3, T) is None
    closed = sit({"ar": AR, "pld": (7.5, 0.4, 3.0)}, B=4, closed=True, rows_priced=True,
                 hope=lambda arm: (12.0, 0.25, 3.0))
    assert explorer.price_probe(closed, best, budget(), T) is None           # a closed batch's horizon is short
    hopeless = sit({"ar": AR, "pld": (7.5, 0.4, 3.0)}, rows_priced=True, hope=lambda arm: (10.2, 0.29, 3.0))
    assert explorer.price_probe(hopeless, best, budget(), T) is None


def test_hint_probe_follows_a_rise_of_the_lookups() -> None:
    best = Choice("ar", False, "best")
    wave = frozenset({"das-wave"})
    values = {"ar": AR, "das-wave": (8.0, 0.25, 2.0)}                 # measured at 2 tokens a block, losing
    rising = sit(values, measured=wave, seeded=wave, since={"das-wave": T.hint_every}, own={"das-wave": 2.0},
                 look=3.0)
    assert explorer.hint_probe(rising, best, budget(), T) == Choice("das-wave", True, "hint-probe")
    for quiet in (dict(since={"das-wave": T.hint_every - 1}), dict(look=2.0 + T.hint_rise), dict(hint_level=2.9),
                  dict(seeded=frozenset())):
        s = sit(values, **{**dict(measured=wave, seeded=wave, since={"das-wave": T.hint_every},
                                  own={"das-wave": 2.0}, look=3.0), **quiet})
        assert explorer.hint_probe(s, best, budget(), T) is None, quiet


def test_interval_probe_spaces_probes_by_their_cost() -> None:
    best = Choice("ar", False, "best")
    wave = frozenset({"das-wave"})
    values = {"ar": AR, "das-wave": (8.0, 0.25, 2.0)}
    loss = 0.25 - 2.0 / 10.0
    interval = loss * 1 / (0.05 * 0.1)                                 # B loss / (explore x step time) = 10 steps
    due = sit(values, measured=wave, since={"das-wave": round(interval)})
    assert explorer.interval_probe(due, best, budget(), T) == Choice("das-wave", True, "interval-probe")
    early = sit(values, measured=wave, since={"das-wave": round(interval) - 1})
    assert explorer.interval_probe(early, best, budget(), T) is None


def test_choose_tries_the_rules_in_order_and_explores_only_with_a_budget() -> None:
    s = sit({"ar": AR, "das-wave": (12.0, 0.2, 2.4)})
    assert explorer.choose(s, budget(explore=0.0), T).rule == "best"      # explore 0: exploit only
    assert explorer.choose(s, budget(), T).rule == "prior-probe"
    assert set(explorer.RULES) == {"one-to-go", "unpriced", "first-measure", "margin", "best", "trusted-prior",
                                   "prior-probe", "price-probe", "hint-probe", "interval-probe"}


def test_every_constant_lives_in_the_tuning_record_with_its_reason() -> None:
    got = reasons()
    assert len(got) == len(fields(TUNING)) >= 20
    assert all(len(why) > 20 for _, why in got.values())
    # no module of auto but tuning.py binds a numeric constant at module level (CAL_VERSION: a cache format)
    for path in AUTO.glob("*.py"):
        if path.name == "tuning.py":
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                    and isinstance(node.value.value, (int, float)) and not isinstance(node.value.value, bool):
                assert [t.id for t in node.targets] == ["CAL_VERSION"], (path.name, ast.unparse(node))


def test_the_cost_model_reads_no_clock_and_syncs_no_device() -> None:
    """Prices come from the executor's ``PassTiming``; drafting is timed by ``Lap`` (read after the step's one
    synchronisation).  Outside the calibration (which measures the model before any request) and the lookups'
    host-only off-policy drafts, nothing in auto reads a clock or synchronises a device."""
    for path in AUTO.glob("*.py"):
        src = path.read_text()
        assert "synchronize" not in src or path.name == "calibrate.py", path.name
        if path.name not in ("calibrate.py", "earnings.py", "drafter.py"):
            assert "perf_counter" not in src and "import time" not in src, path.name


def test_a_trace_names_the_rule_and_the_estimates_of_every_step() -> None:
    model = random_model("huginn", seed=6)
    out = dasspec.generate(model, list(range(3, 20)) * 2, "auto", max_new_tokens=24, eos=False, trace=True,
                           explore=1.0, calibrate=False)
    rules = set(explorer.RULES)
    for draft, _ in out.trace:
        n = draft.notes
        assert n["auto"] in ("ar", "das-wave", "sam", "pld") and n["rule"] in rules, n
        if n["rule"] not in ("one-to-go", "unpriced"):
            assert "ar" in n["estimates"], n
    assert any(d.notes["rule"] == "first-measure" for d, _ in out.trace)


def test_the_executor_hands_auto_its_measured_passes() -> None:
    """In a real engine run the drafter's prices come from ``measured`` calls (fails when the executor does not
    call it: nothing is fitted past the calibration's start)."""
    model = random_model("ouro", seed=5)
    d = dasspec.methods.build_drafter(model, "auto", {"calibrate": False})
    seen = []
    real = d.measured
    d.measured = lambda timing: (seen.append(timing), real(timing))
    dasspec.generate_batch(model, [list(range(5, 30)), list(range(40, 52))], drafter=d, max_new_tokens=12, eos=False)
    assert seen and all(t.seconds > 0 and t.rows >= t.requests >= 1 for t in seen)
    assert d.costs.plain or d.costs.ema_v is not None
    assert d.budget.elapsed == pytest.approx(sum(t.seconds + t.draft_seconds for t in seen))
    assert all(t.host_seconds > 0 for t in seen) and d.costs.host is not None and d.costs.overhead > 0


def test_every_step_pays_its_host_time_whatever_it_drafts() -> None:
    """A drafted arm commits 3 tokens a step over a pass 1.5x a plain one's; with nothing else in a step AR's
    tokens per second win.  Every step also costs the executor's host work (batching, acceptance, commits), which
    an arm taking fewer steps a token saves: with host seconds equal to a plain pass the drafted arm wins (fails
    when the estimates leave them out: once a model's passes are cheap, they are a large part of a step)."""
    from dasspec.methods.auto.costs import CostModel
    from dasspec.methods.auto.earnings import Earnings, Priors
    from dasspec.methods.auto.planners import batch_time, batch_value
    costs, priors = CostModel(None), Priors()
    for _ in range(4):
        costs.add_pass(0.010, 4, 4)                   # plain passes of 4 requests
        costs.add_pass(0.040, 16, 4)                  # 12 drafted rows past them
    costs.add_draft("das-wave", 0.020, 4)
    earnings = [Earnings(["ar", "das-wave"], priors) for _ in range(4)]
    for e in earnings:
        e.verdict("das-wave", 3, 4, 1)
    plain, wave = batch_value(costs, earnings, ["ar"] * 4), batch_value(costs, earnings, ["das-wave"] * 4)
    assert plain > wave
    t_plain = batch_time(costs, [("ar", 30.0, 1.0)] * 4)
    costs.add_host(0.050)
    assert costs.overhead == pytest.approx(0.050)
    assert batch_value(costs, earnings, ["das-wave"] * 4) > batch_value(costs, earnings, ["ar"] * 4)
    assert batch_time(costs, [("ar", 30.0, 1.0)] * 4) == pytest.approx(t_plain + 30 * 0.050)
