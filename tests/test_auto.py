"""Method ``auto`` (dasspec/methods/auto/): whatever it chooses, every output is full-depth AR's (greedy, sampled
per seed, batched; random checkpoints and the bundled model, float32); it records what it chose; its chooser
switches back to a drafter that starts paying (re-measured by probes, or scored off-policy for the lookup
drafters); its calibration is cached, skippable, and only lowers DAS-Wave's window where the model's own knobs are
defaults.  No timing assertions: the choice tests run on a simulated clock."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

import dasspec
from dasspec.engine.api.stats import GenerationStats
from dasspec.engine.drafting import Draft, Drafter, PassTiming, Session, Verdict
from dasspec.methods import build_drafter
from dasspec.methods.auto import TUNING, AutoDrafter, AutoKnobs, Sizing
from dasspec.methods.auto import calibrate as cal_mod
from dasspec.methods.auto import drafter as drafter_mod
from dasspec.methods.auto import explorer, planners
from dasspec.methods.auto.earnings import ArmStats
from dasspec.methods.pld import PLDDrafter, PLDKnobs
from dasspec.testing import random_model


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """The calibration cache of these tests lives in their own folder, never in the user's home."""
    monkeypatch.setenv("DASSPEC_CACHE", str(tmp_path / "cache"))


def _prompts(vocab: int, count: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        L = int(torch.randint(6, 24, (1,), generator=g))
        if i % 2:                      # repeats, so the lookup drafters have something to accept
            out.append(torch.randint(2, vocab, (max(2, L // 3),), generator=g).repeat(4)[:L].tolist())
        else:
            out.append(torch.randint(2, vocab, (L,), generator=g).tolist())
    return out


def _all_choices(results) -> dict[str, int]:
    total: dict[str, int] = {}
    for r in results:
        for k, v in r.stats.choices.items():
            total[k] = total.get(k, 0) + v
    return total


@pytest.mark.parametrize("family", ["huginn", "ouro", "iquest-loop", "nanbeige"])
def test_random_checkpoints_match_ar(family: str) -> None:
    """Six prompts, greedy and sampled (a seed per prompt), one at a time with a kept drafter and all together
    (generate_batch, max_batch 3): every output equals that prompt's AR decode.  ``explore=1`` makes the chooser
    switch among the drafters often, so every arm's drafts are verified; with calibration (the cached path)."""
    model = random_model(family, seed=6)
    prompts = _prompts(model.config.vocab_size, 6, seed=11)
    for sampled in (False, True):
        opts = dict(do_sample=True, temperature=0.8, top_p=0.95) if sampled else {}
        refs = [dasspec.generate(model, p, "ar", max_new_tokens=20, eos=False, seed=i, **opts).tokens
                for i, p in enumerate(prompts)]
        kept = build_drafter(model, "auto", {"explore": 1.0}, sampled=sampled)
        for i, p in enumerate(prompts[:3]):
            out = dasspec.generate(model, p, drafter=kept, max_new_tokens=20, eos=False, seed=i, **opts)
            assert out.tokens == refs[i], (family, sampled, i)
        outs = dasspec.generate_batch(model, prompts, "auto", max_new_tokens=20, eos=False, max_batch=3,
                                      seed=list(range(len(prompts))), explore=1.0, **opts)
        assert [o.tokens for o in outs] == refs, (family, sampled)
        # the same on a clock that ticks per reading and passes priced by their rows, so the choices are
        # deterministic: several drafters' drafts are verified, not only AR steps
        ticking = build_drafter(model, "auto", {"explore": 1.0, "calibrate": False}, sampled=sampled)
        ticking.clock = TickClock()
        # the executor's measured pass, replaced by the uncalibrated shape of its rows (4 + rows, 5 ms a unit)
        measured = ticking.measured
        ticking.measured = lambda t: measured(replace(t, seconds=5e-3 * (4 + t.rows), draft_seconds=0.0))
        outs = dasspec.generate_batch(model, prompts, drafter=ticking, max_new_tokens=20, eos=False, max_batch=3,
                                      seed=list(range(len(prompts))), **opts)
        assert [o.tokens for o in outs] == refs, (family, sampled)
        used = _all_choices(outs)
        assert len(used) >= (2 if sampled else 3), (family, sampled, used)


def test_bundled_model_matches_ar(eval_data) -> None:
    """The bundled model on GSM8K questions, greedy and sampled, batched: AR's tokens; and auto does speculate
    there (its drafts are accepted)."""
    root = eval_data("gsm8k/test.jsonl")
    model = dasspec.load_model()
    tok = dasspec.load_tokenizer()
    with open(root / "gsm8k" / "test.jsonl") as f:
        qs = [json.loads(next(f))["question"] for _ in range(3)]
    prompts = [tok.encode(f"Question: {q}\nAnswer:") for q in qs]
    for sampled in (False, True):
        opts = dict(do_sample=True, temperature=0.7, top_p=0.95) if sampled else {}
        seeds = [3, 4, 5]
        refs = dasspec.generate_batch(model, prompts, "ar", max_new_tokens=40, seed=seeds, **opts)
        outs = dasspec.generate_batch(model, prompts, "auto", max_new_tokens=40, seed=seeds, max_batch=3, **opts)
        assert [o.tokens for o in outs] == [r.tokens for r in refs], sampled
        if not sampled:
            assert sum(sum(o.stats.accepted) for o in outs) > 0


def test_choices_are_recorded() -> None:
    """Each draft's notes name the drafter auto chose (``probe`` on explorations) and ``stats.choices`` counts the
    steps per drafter."""
    model = random_model("huginn", seed=6)
    prompt = _prompts(model.config.vocab_size, 2, seed=3)[1]
    out = dasspec.generate(model, prompt, "auto", max_new_tokens=24, eos=False, trace=True, explore=1.0,
                           calibrate=False)
    arms = [d.notes["auto"] for d, _ in out.trace]
    assert set(arms) <= {"ar", "das-wave", "sam", "pld"}
    counts = {a: arms.count(a) for a in set(arms)}
    assert out.stats.choices == counts
    assert out.stats.to_dict()["choices"] == counts
    assert any(d.notes.get("probe") for d, _ in out.trace)


def test_a_later_call_starts_from_what_earlier_calls_measured() -> None:
    """``generate`` / ``generate_batch`` build a drafter per call; what auto measured (prices, what each drafter
    earned) is kept for the next such call on the model, so its drafter neither waits for a plain pass to price
    (``unpriced``) nor probes DAS-Wave at its first step - unless anything in the key differs (threads, depth,
    knobs, greedy or the sampling options), the ``recall`` knob is off, the model is another object (a copy), or
    the drafter was built by its user.  Fails without ``remember`` after either call, with any of those left out of
    the key, or with the knob ignored."""
    model = random_model("huginn", seed=6)
    prompt = _prompts(model.config.vocab_size, 1, seed=11)[0]
    ar = dasspec.generate(model, prompt, "ar", max_new_tokens=12, eos=False)

    def rules(m=model, batch: bool = False, **kw) -> list[str]:
        opts = dict(max_new_tokens=12, eos=False, trace=True, calibrate=False, **kw)
        out = (dasspec.generate_batch(m, [prompt, prompt[:5]], "auto", **opts)[0] if batch
               else dasspec.generate(m, prompt, "auto", **opts))
        assert {"do_sample", "num_steps"} & set(kw) or out.tokens == ar.tokens      # (AR at the same options)
        return [d.notes["rule"] for d, _ in out.trace]

    first = rules()
    assert first[:2] == ["unpriced", "first-measure"], first
    again = rules()
    assert "unpriced" not in again and "first-measure" not in again, again
    # off: neither kept nor read (either way the second call would start priced)
    assert rules(recall=False)[0] == rules(recall=False)[0] == "unpriced"
    R = model.depth(None)
    for kw in ({"explore": 0.5}, {"num_steps": R // 2}, {"do_sample": True}, {"do_sample": True, "temperature": 0.5},
               {"runtime": dasspec.Runtime(static_shapes=True)},
               {"batch": True, "policy": dasspec.SpeculationPolicy(max_tokens=2)}):
        assert rules(**kw)[0] == "unpriced", kw
        assert rules(**kw)[0] != "unpriced", kw                                # ... and kept under its own key
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert rules()[0] == "unpriced"                                        # prices are per thread count
    finally:
        torch.set_num_threads(threads)
    assert rules(copy.deepcopy(model))[0] == "unpriced"                       # another object: its own shelf
    # generate_batch keeps and reads under the same key as generate
    other = random_model("huginn", seed=6)
    assert rules(other, batch=True)[0] == "unpriced" and rules(other)[0] != "unpriced"
    # a drafter built by its user carries its own state: nothing of it is kept for the calls that build theirs
    mine = random_model("huginn", seed=6)
    d = build_drafter(mine, "auto", {"calibrate": False})
    dasspec.generate(mine, prompt, drafter=d, max_new_tokens=12, eos=False)
    assert d.priors.table and rules(mine)[0] == "unpriced"
    # the target's exit rule is part of the key (Ouro's early exit moves every price)
    ouro = random_model("ouro", seed=3)
    opts = dict(max_new_tokens=12, eos=False, trace=True, calibrate=False)
    dasspec.generate(ouro, prompt, "auto", **opts)
    assert dasspec.generate(ouro, prompt, "auto", exit_threshold=0.5, **opts).trace[0][0].notes["rule"] == "unpriced"


def test_the_kept_outcomes_hold_the_last_keys_used() -> None:
    """At most ``kept_keys`` keys per model, the least recently used dropped (a sweep of knob values must not grow
    the process); a recall counts as a use; another model's keys are its own."""
    from dasspec.methods.auto import memory
    a, b = random_model("huginn", seed=1), random_model("huginn", seed=2)
    state = ({"p": 1}, {"x": 1})
    for key in ("k1", "k2"):
        memory.keep(a, key, state, 2)
    assert memory.recall(a, "k1") is not None                # k1 used last: k2 goes first
    memory.keep(a, "k3", state, 2)
    memory.keep(b, "k2", state, 2)
    assert memory.recall(a, "k2") is None and memory.recall(a, "k1") and memory.recall(a, "k3")
    assert memory.recall(b, "k2") == state and memory.recall(b, "k1") is None
    # copies both ways: what a drafter learns on, and what its caller still holds, are not the kept state
    state[1]["x"] = 2
    got = memory.recall(b, "k2")
    got[1]["x"] = 3
    assert memory.recall(b, "k2")[1] == {"x": 1}
    # a kept state from another calibration, or another tuning's key, is not taken
    d = build_drafter(a, "auto", {"calibrate": False})
    d.recall(a, 8, ())
    kept = copy.deepcopy((d.costs, d.priors))
    kept[0].sizing, kept[1].table["das-wave"] = "another calibration", (3.0, 4.0)
    memory.keep(*d.kept, kept, 2)
    e = build_drafter(a, "auto", {"calibrate": False})
    e.recall(a, 8, ())
    assert e.kept == d.kept and e.priors.table == {}
    key = memory.memory_key(a, 8, d.knobs, TUNING, ())
    assert memory.memory_key(a, 8, d.knobs, replace(TUNING, margin=0.5), ()) != key


# --- the chooser, on a simulated clock ------------------------------------------------------------------------

class TickClock:
    """A clock that advances 1 ms per reading."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1e-3
        return self.t


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeWaveSession(Session):
    pass


class FakeWave(Drafter):
    """A drafter that needs model passes: its drafts cost ``cost`` seconds on the fake clock."""

    name = "das-wave"
    session = FakeWaveSession
    width = 9

    def __init__(self, clock: FakeClock, cost: float):
        self.clock, self.cost = clock, cost

    def propose_batch(self, sessions):
        self.clock.t += self.cost
        return [Draft([0] * 8) for _ in sessions]


def _fake_req(text: list[int], P: int, budget: int):
    stats = GenerationStats(method="auto")

    def count_choice(name):
        stats.choices[name] = stats.choices.get(name, 0) + 1
    return SimpleNamespace(P=P, prompt=text[:P], generated=[text[P]], budget=budget, room=budget, done=False,
                           stats=stats, device=torch.device("cpu"), count_choice=count_choice, cap=None,
                           closed=False)


def _simulate(drafter: AutoDrafter, req, text: list[int], steps: int, wave_tokens, seen: list | None = None
              ) -> list[str]:
    """Drive one session for ``steps`` steps: drafts are judged against ``text`` (the target's tokens), the fake
    wave's by ``wave_tokens(step)``; a verification costs 0.1 x (4 + rows) seconds.  Returns the arm per step
    (``seen``: (seconds, tokens, probe) of each step appended)."""
    clock = drafter.clock
    s = req.session = drafter.start(req)
    arms = []
    for step in range(steps):
        t0 = clock.t
        [d] = drafter.propose_batch([s])
        drafting = clock.t - t0
        at = len(req.generated) + req.P           # the position of the next token
        toks = d.tokens.tolist() if hasattr(d.tokens, "tolist") else list(d.tokens)
        if s.arm == "das-wave":
            m = wave_tokens(step) - 1
        else:
            m = 0
            while m < len(toks) and toks[m] == text[at + m]:
                m += 1
        committed = text[at: at + m + 1]
        rows = len(toks) + 1
        req.generated.extend(committed)
        req.room = req.budget = req.budget - len(committed)
        s.observe(Verdict(kept=len(committed), accepted=m, path=list(range(m + 1)), tokens=committed,
                          pred=torch.zeros(rows, dtype=torch.long), logits=torch.zeros(rows, 1)))
        drafter.measured(PassTiming(0.1 * (4 + rows), rows, 1, 0, drafting))     # the executor's measurement
        arms.append(s.arm)
        if seen is not None:
            seen.append((0.1 * (4 + rows) + drafting, len(committed), s.probe))
    return arms


def _auto(arms: str, explore: float, subs: dict) -> AutoDrafter:
    d = AutoDrafter(AutoKnobs(arms=arms, explore=explore, calibrate=False).validate(8), clock=FakeClock())
    d.adopt(subs(d.clock))
    return d


def _verdict(committed: list[int], rows: int) -> Verdict:
    m = len(committed) - 1
    return Verdict(kept=len(committed), accepted=m, path=list(range(m + 1)), tokens=committed,
                   pred=torch.zeros(rows, dtype=torch.long), logits=torch.zeros(rows, 1))


def test_prices_and_the_explore_budget_come_from_measured_passes_only() -> None:
    """The cost model learns from the executor's ``PassTiming`` only: an idle server's wall-clock time is never
    decoding time (fails when the budget or the prices come from gaps between calls), and a pass that carried a
    prompt's rows counts as decoded time but is not taken as the drafts' price (fails when it is fitted)."""
    d = _auto("pld", 0.05, lambda clock: {"pld": PLDDrafter(PLDKnobs())})
    text = list(range(10, 200))
    req = _fake_req(text, 5, 100)
    s = d.start(req)
    d.clock.t += 1000.0                                # idle: time passes, nothing is measured

    def step(timing: PassTiming) -> None:
        d.propose_batch([s])
        s.observe(_verdict([text[len(req.generated) + req.P]], 1))
        req.generated.append(text[len(req.generated) + req.P])
        d.measured(timing)
    step(PassTiming(0.02, 1, 1, 0, 0.001))
    assert d.budget.elapsed == pytest.approx(0.021)
    assert d.costs.plain[0][0] == pytest.approx(0.02)     # a plain pass, priced as measured
    d.clock.t += 1000.0
    step(PassTiming(5.0, 1, 1, 64, 0.0))               # a prompt's 64 rows rode along
    assert d.budget.elapsed == pytest.approx(5.021)
    assert d.costs.plain[0][0] == pytest.approx(0.02)


def test_switches_back_to_a_model_drafter_that_starts_paying() -> None:
    """A drafter whose drafts cost 1 s and commit 1 token per step for 120 steps (AR: 1 token for 0.5 s, the
    drafter's steps 2.3 s) is switched off; from step 120 its drafts commit 9 tokens, and auto is back on it within
    25 steps (with ``explore=0.2`` a probe costing 1.8 s is made every 18 steps) and stays there - because
    switched-off drafters are re-measured (fails when the chooser never explores)."""
    d = _auto("das-wave", 0.2, lambda clock: {"das-wave": FakeWave(clock, 1.0)})
    text = list(range(10, 2000))
    arms = _simulate(d, _fake_req(text, 5, 1500), text, 200, lambda step: 1 if step < 120 else 9)
    before = arms[20:120]
    assert before.count("das-wave") <= 0.2 * len(before), before
    after = arms[120:]
    back = next((i for i, a in enumerate(after) if a == "das-wave"), None)
    assert back is not None and back <= 25, after
    assert after[back:].count("das-wave") >= 0.9 * len(after[back:]), after


def test_the_explore_budget_bounds_every_probe_the_first_included() -> None:
    """A drafter that never pays (3 s of drafting, 1 token a step; a plain step 0.5 s): its first probe is taken
    unpriced, and what it lost is charged once measured, so over 250 steps each later probe is taken only while the
    probes' measured losses, its own included, stay within ``explore`` of the decoded time - a short request pays
    one probe, not two (fails when the first probe is left out of the budget: a second comes at step ~153)."""
    d = _auto("das-wave", 0.05, lambda clock: {"das-wave": FakeWave(clock, 3.0)})
    text = list(range(10, 1000))
    seen: list = []
    _simulate(d, _fake_req(text, 5, 800), text, 250, lambda step: 1, seen)
    probes = [i for i, (_, _, probe) in enumerate(seen) if probe]
    assert probes[0] <= 1, probes                     # (step 0 measures a plain pass: no calibration here)
    lost = elapsed = 0.0
    for i, (seconds, tokens, probe) in enumerate(seen):
        elapsed += seconds
        if probe:
            lost += seconds - tokens * 0.5
            if i > probes[0]:
                assert lost <= 0.05 * elapsed, (i, lost, elapsed, probes)
    assert len(probes) == 1, probes


def test_probes_are_charged_what_they_lost_not_what_they_were_expected_to() -> None:
    """A drafter whose first block commits 3 tokens and every later one 1 (1 s of drafting; a plain step 0.5 s):
    its re-probes are each expected to lose less than they do, and the budget takes what each measured, so over
    400 steps the probes' measured losses end within ``explore`` of the decoded time (fails when a probe stays
    charged its estimate: a seventh probe, 11.6 s lost against 10.6)."""
    d = _auto("das-wave", 0.05, lambda clock: {"das-wave": FakeWave(clock, 1.0)})
    text = list(range(10, 3000))
    seen: list = []
    _simulate(d, _fake_req(text, 5, 2500), text, 400, lambda step: 3 if step <= 1 else 1, seen)
    lost = sum(seconds - tokens * 0.5 for seconds, tokens, probe in seen if probe)
    assert lost <= 0.05 * sum(seconds for seconds, _, _ in seen), (lost, [i for i, x in enumerate(seen) if x[2]])


def test_a_first_probe_beside_drafting_requests_is_charged_its_own_loss(monkeypatch) -> None:
    """Four requests: one probes DAS-Wave (0.5 s of drafting, 9 rows, 1 token) while three draft with prompt lookup
    (6 rows, 5 tokens each).  What the probe cost is its drafting and its rows' share of the pass: 0.5 s + 0.4 s
    at the priced rows (the pass taken as priced, 1.55 s, against 1.15 s with the prober plain); the others'
    tokens do not pay for it (fails when the step's tokens are all valued at a plain step's rate: 0.45 s)."""
    d = _auto("das-wave,pld", 0.05, lambda clock: {"das-wave": FakeWave(clock, 0.5), "pld": PLDDrafter(PLDKnobs())})
    text = list(range(10, 400))
    reqs = [_fake_req(text, 5, 100) for _ in range(4)]
    sessions = [d.start(r) for r in reqs]
    monkeypatch.setattr(drafter_mod, "together", lambda costs, earnings, picks, *a: (list(picks), None))

    def step(picks: list, committed: list[int], rows: list[int], seconds: float) -> None:
        monkeypatch.setattr(drafter_mod, "choose", lambda sit, budget, t, it=iter(picks): next(it))
        t0 = d.clock.t
        d.propose_batch(sessions)
        for s, r, k, n in zip(sessions, reqs, committed, rows):
            at = len(r.generated) + r.P
            s.observe(_verdict(text[at: at + k], n))
            r.generated.extend(text[at: at + k])
        d.measured(PassTiming(seconds, sum(rows), 4, 0, d.clock.t - t0))

    plain = explorer.Choice("ar", False, "best")
    step([plain] * 4, [1] * 4, [1] * 4, 0.4)                   # prices a plain step: 0.05 s a unit of pass_cost
    assert d.costs.verify_time(4, 4) == pytest.approx(0.4)
    before = d.budget.explored
    step([explorer.Choice("das-wave", True, "first-measure")] + [explorer.Choice("pld", False, "best")] * 3,
         [1, 5, 5, 5], [9, 6, 6, 6], 1.55)
    assert d.budget.explored - before == pytest.approx(0.9), d.budget.explored - before


def test_lookup_drafter_is_noticed_within_a_few_steps() -> None:
    """Text that turns repetitive at token 80: prompt lookup (never used while nothing repeats) is chosen within
    a few steps of the first repeated stretch, because its drafts are scored off-policy every step (fails when
    the lookup drafts are not scored while another arm runs)."""
    d = _auto("pld", 0.05, lambda clock: {"pld": PLDDrafter(PLDKnobs())})
    period = list(range(3000, 3011))
    text = list(range(100, 180)) + period * 60
    arms = _simulate(d, _fake_req(text, 4, 600), text, 140, lambda step: 1)
    first = arms.index("pld") if "pld" in arms else None
    assert "pld" not in arms[:60], arms
    # the repeat starts at token 80; the first copy of the period (11 tokens) must pass before anything matches
    steps_to_repeat = 80 - 5
    assert first is not None and first <= steps_to_repeat + 11 + 6, arms
    assert arms[first:].count("pld") >= 0.8 * len(arms[first:]), arms


class GroupWave(FakeWave):
    """A model-drafting arm whose rounds run for all its requests at once: a call costs ``cost`` x (1 + m)."""

    def propose_batch(self, sessions):
        self.clock.t += self.cost * (1 + len(sessions))
        return [Draft([0] * 8) for _ in sessions]


def _simulate_batch(drafter: AutoDrafter, B: int, steps: int, wave_tokens: int, texts: list | None = None,
                    budgets: list[int] | None = None, closed: bool = False, verify=None,
                    probes: list | None = None) -> list[list[str]]:
    """B requests decoding together on ``texts`` (default random text: the lookups never match): the fake wave's
    drafts commit ``wave_tokens``, a lookup's what matches the text, at most what the budget leaves (a request
    whose budget is spent leaves the batch: "done"); a verification pass costs 100 x the calibrated pass over the
    step's rows (``verify(rows, requests)``: seconds, instead).  ``closed``: a closed batch with nobody waiting
    (``DraftContext.closed``); budgets default 1000.  Returns the arms per step (``probes``: (step, arm) of each
    probe appended)."""
    clock = drafter.clock
    g = torch.Generator().manual_seed(5)
    texts = texts or [torch.randint(10, 5000, (1200,), generator=g).tolist() for _ in range(B)]
    reqs = [_fake_req(t, 5, b) for t, b in zip(texts, budgets or [1000] * B)]
    for r in reqs:
        r.closed = closed
    sessions = [drafter.start(r) for r in reqs]
    out = []
    for step in range(steps):
        live = [i for i, r in enumerate(reqs) if r.budget > 0]
        if not live:
            break
        t0 = clock.t
        drafts = drafter.propose_batch([sessions[i] for i in live])
        drafting = clock.t - t0
        if probes is not None:
            probes.extend((step, sessions[i].arm) for i in live if sessions[i].probe)
        rows_all = 0
        verdicts = []
        for i, d in zip(live, drafts):
            s, req, text = sessions[i], reqs[i], texts[i]
            toks = d.tokens.tolist() if hasattr(d.tokens, "tolist") else list(d.tokens)
            toks = toks[: req.room - 1]                  # the engine cuts a chain to the budget rule
            at = len(req.generated) + req.P
            if s.arm == "das-wave":
                m = min(wave_tokens - 1, len(toks))
            else:
                m = 0
                while m < len(toks) and toks[m] == text[at + m]:
                    m += 1
            rows = len(toks) + 1
            rows_all += rows
            verdicts.append((s, req, text[at: at + m + 1], m, rows))
        seconds = 100 * drafter.pass_cost(rows_all) if verify is None else verify(rows_all, len(verdicts))
        for s, req, committed, m, rows in verdicts:
            req.generated.extend(committed)
            req.room = req.budget = req.budget - len(committed)
            s.observe(Verdict(kept=len(committed), accepted=m, path=list(range(m + 1)), tokens=committed,
                              pred=torch.zeros(rows, dtype=torch.long), logits=torch.zeros(rows, 1)))
        drafter.measured(PassTiming(seconds, rows_all, len(verdicts), 0, drafting))
        out.append([s.arm if r.budget > 0 or i in live else "done" for i, (s, r) in enumerate(zip(sessions, reqs))])
    return out


def _batched_auto(cost: float) -> AutoDrafter:
    d = _auto("das-wave", 0.05, lambda clock: {"das-wave": GroupWave(clock, cost)})
    d.sizing = Sizing.of(_table(0.01), 4)          # wide rows nearly free, as on the bundled model
    return d


def test_a_batch_drafts_together_where_drafting_alone_does_not_pay() -> None:
    """Four requests; the model drafter's call costs 0.14 s x (1 + m) and commits 3 tokens per request.  Alone it
    loses to a plain step (one request drafting: about 7.3 tokens/s against AR's 7.8), all four together win
    (about 9.0): auto puts the whole batch on it (fails when each request weighs the arm alone) - once the
    exploration budget admits the step that probes the three requests that have not drafted (about 0.6 s lost were
    each of them to commit one token, against 5% of the decoded time less the first probe's measured loss: by step
    28)."""
    arms = _simulate_batch(_batched_auto(0.14), 4, 60, 3)
    first = next(i for i, step in enumerate(arms) if all(a == "das-wave" for a in step))
    late = arms[first:]
    together = sum(all(a == "das-wave" for a in step) for step in late)
    assert first <= 29 and together >= 0.9 * len(late), arms


def test_a_batch_does_not_draft_together_where_that_loses() -> None:
    """The same with the drafter's call at 0.3 s x (1 + m): together it loses too (about 6.2 tokens/s against
    7.8), and auto keeps plain steps apart from its probes."""
    arms = _simulate_batch(_batched_auto(0.3), 4, 60, 3)
    late = arms[10:]
    drafting = sum(a == "das-wave" for step in late for a in step)
    assert drafting <= 0.1 * 4 * len(late), arms


class SteepWave(FakeWave):
    """A model-drafting arm whose group costs far more than the calibration's shape of m windows says: a call costs
    ``cost`` x (1 + 4 (m - 1))."""

    def propose_batch(self, sessions):
        self.clock.t += self.cost * (1 + 4 * (len(sessions) - 1))
        return [Draft([0] * 8) for _ in sessions]


def test_one_requests_lucky_block_does_not_put_a_batch_on_a_drafter() -> None:
    """Six requests; one has drafted once with the model drafter, 8 tokens of 8 rows, and the others have not
    tried it.  A step with all six drafting costs 6 plain ones: at that one block's 8 tokens a request it would win
    by 1.33x (48 tokens against 36) - by less than ``prior_trust``, so the plan is a probe of the five, charged at
    its loss were each of them to commit one token, and the batch steps plain until the budget has room for it -
    in a server's batch and in a closed one (fails when the drafter's average prices every request outright -
    docs/performance-journal.md, "One lucky block and the batch plans" - and when the probe ignores the budget).
    Once a second request has measured it, the average prices the others outright."""
    d = _auto("das-wave", 0.05, lambda clock: {"das-wave": GroupWave(clock, 0.1)})
    d.sizing = Sizing.of(_table(0.1), 4)
    d.costs.add_pass(0.1, 6, 6)                             # plain steps measured
    V6, V48 = d.costs.verify_time(6, 6), d.costs.verify_time(48, 6)
    d.costs.add_draft("das-wave", 6 * V6 - V48, 6)          # six drafting together: 6 plain steps in all
    sessions = [d.start(_fake_req(list(range(100, 400)), 5, 100)) for _ in range(6)]
    sessions[0].earnings.verdict("das-wave", 8, 8, 0)
    earnings = [s.earnings for s in sessions]
    plain = [explorer.Choice("ar", False, "best")] * 6

    def together(budget=None) -> tuple[list[str], str | None]:
        got, rule = planners.together(d.costs, earnings, plain, ["das-wave"], d.tuning, budget)
        return [c.arm for c in got], rule

    def closed(budget=None) -> tuple[list[str], str | None]:
        got, rule = planners.closed_plan(d.costs, earnings, plain, ["das-wave"], [100] * 6, ["ar"] * 6, d.tuning,
                                         budget)
        return [c.arm for c in got], rule
    value = planners.batch_value(d.costs, earnings, ["das-wave"] * 6) / planners.batch_value(d.costs, earnings,
                                                                                             ["ar"] * 6)
    assert 1 + d.tuning.margin < value < d.tuning.prior_trust
    assert together() == (["ar"] * 6, None) and closed() == (["ar"] * 6, "closed-plain")
    for plan, rule in ((together, "together-das-wave-probe"), (closed, "closed-all-das-wave-probe")):
        budget = explorer.Budget(0.05)
        budget.elapsed = 10 * V6                             # too little decoded for a probe losing ~4 steps
        assert plan(budget)[0] == ["ar"] * 6 and budget.explored == 0.0
        budget.elapsed = 1000 * V6
        assert plan(budget) == (["das-wave"] * 6, rule)
        assert budget.explored > 3 * V6                      # its loss were the five to commit one token each
    sessions[1].earnings.verdict("das-wave", 8, 8, 1)
    assert together() == (["das-wave"] * 6, "together-das-wave")
    assert closed() == (["das-wave"] * 6, "closed-all-das-wave")


def test_a_group_drafting_cost_is_priced_as_measured_at_its_size() -> None:
    """Four requests; a model drafter that pays alone by the calibration's shape but costs 13x its one-request
    cost for the four.  After one step of all four drafting together (priced by the shape; a budgeted probe of the
    requests that have not drafted), that group's cost is measured at its size and the batch steps plain, probes
    apart (fails when one scale over every group size
    prices it - the one-request probes pull the price back down and the batch drafts together again - or when the
    requests' own choices, each made as if drafting alone, are taken though all of them at once lose)."""
    d = _auto("das-wave", 0.05, lambda clock: {"das-wave": SteepWave(clock, 0.1)})
    d.sizing = Sizing.of(_table(0.01), 4)
    arms = _simulate_batch(d, 4, 120, 3)
    assert sum(step.count("das-wave") == 4 for step in arms) == 1, arms
    measured = next(i for i, step in enumerate(arms) if step.count("das-wave") == 4)
    assert measured < 20 and all(step.count("das-wave") <= 1 for step in arms[measured + 1:]), arms


def _lookup_batch(repeating: list[bool], budgets: list[int], closed: bool, verify=None) -> list[list[str]]:
    """Four requests under auto with prompt lookup only, wide rows nearly free in the calibration (as on the
    bundled model): request i's text repeats a 7-token period when ``repeating[i]`` (its lookup drafts match), else
    is random.  ``verify``: the simulated verification cost (``_simulate_batch``)."""
    d = _auto("pld", 0.05, lambda clock: {"pld": PLDDrafter(PLDKnobs())})
    d.sizing = Sizing.of(_table(0.01), 4)
    g = torch.Generator().manual_seed(8)
    texts = [list(range(3000 + 10 * i, 3007 + 10 * i)) * 200 if rep else
             torch.randint(10, 2000, (1400,), generator=g).tolist() for i, rep in enumerate(repeating)]
    return _simulate_batch(d, len(texts), 40, 1, texts=texts, budgets=budgets, closed=closed, verify=verify)


def test_a_closed_batch_drafts_only_where_that_brings_its_end_nearer() -> None:
    """One of four equal requests has text its lookup drafts match.  In a server auto drafts for it: its extra
    tokens raise the step's tokens per second.  In a closed batch it does not: the batch ends with the three that
    cannot draft, so its drafts would only end that request sooner, for more rows than its plain steps (fails when a
    closed batch is valued as a server's steps).  Given the longest budget of the batch, or alone (the last request
    of a closed batch), it drafts: now its steps are the batch's end (fails when drafting never counts there)."""
    lone = [True, False, False, False]
    open_arms = _lookup_batch(lone, [1000] * 4, closed=False)      # 200 would end its budget by step 24
    assert sum(step[0] == "pld" for step in open_arms[10:]) >= 20, open_arms
    closed_arms = _lookup_batch(lone, [200] * 4, closed=True)
    assert sum(step[0] == "pld" for step in closed_arms[10:]) <= 3, closed_arms
    longest = _lookup_batch(lone, [1000, 200, 200, 200], closed=True)
    assert sum(step[0] == "pld" for step in longest[10:]) >= 20, longest
    last = _lookup_batch([True], [1000], closed=True)
    assert sum(step[0] == "pld" for step in last[10:]) >= 20, last


def test_a_closed_batch_drafts_together_where_every_request_gains() -> None:
    """Every request's text repeats: in a closed batch all four draft with prompt lookup - together they bring the
    batch's end nearer (fails when a closed batch weighs only plain steps)."""
    arms = _lookup_batch([True] * 4, [1000] * 4, closed=True)
    together = sum(all(a == "pld" for a in step) for step in arms[10:])
    assert together >= 20, arms


def test_a_closed_batch_of_unequal_requests_drafts_where_it_pays() -> None:
    """A model drafter that pays for every request (3 tokens a block, drafting together cheap) in a closed batch
    whose requests have 400, 390, 380 and 370 tokens to go: all four draft, every step - each request left on plain
    steps would become the batch's end (fails when only the requests at the longest budget may draft, as a
    step-by-step valuation of the batch's end had it: the bundled model's batch then ran mostly plain steps)."""
    arms = _simulate_batch(_batched_auto(0.05), 4, 40, 3, budgets=[400, 390, 380, 370], closed=True)
    assert all(step == ["das-wave"] * 4 for step in arms[10:]), arms


def test_rows_past_the_plain_ones_are_priced_as_measured() -> None:
    """Every request's text repeats, so prompt lookup's drafts commit about 8 tokens; the calibration says wide
    rows are nearly free, but here each row past a request's first costs 0.3 of a plain 4-row pass (so the drafted
    steps, about 44 rows, lose to plain ones).  After its first drafted steps auto prices those rows as measured
    and decodes plain (fails when one scale fitted over all steps prices them: it keeps drafting)."""
    def verify(rows: int, n: int) -> float:
        return 1.0 + 0.3 * (rows - n)
    for closed in (False, True):
        arms = _lookup_batch([True] * 4, [1000] * 4, closed=closed, verify=verify)
        drafted = sum(a == "pld" for step in arms for a in step)
        assert drafted <= 4 * 4, (closed, arms)
        assert all(a == "ar" for step in arms[-20:] for a in step), (closed, arms)


def test_the_first_probe_prices_the_rows_past_the_plain_ones() -> None:
    """With a calibration the first step already probes DAS-Wave (one request's 9 rows beside three plain ones),
    before any plain step is measured; that step prices the rows past the plain ones once one is, so when the text
    turns repetitive, prompt lookup - paying by the calibration's shape, not at the measured price (as
    ``test_rows_past_the_plain_ones_are_priced_as_measured``) - never drafts (fails when drafted steps before the
    first plain one are dropped: the batch drafts once to learn the price)."""
    def verify(rows: int, n: int) -> float:
        return 1.0 + 0.3 * (rows - n)
    g = torch.Generator().manual_seed(9)
    for closed in (False, True):
        d = _auto("das-wave,pld", 0.0, lambda clock: {"das-wave": FakeWave(clock, 0.1),      # no probe but the first
                                                      "pld": PLDDrafter(PLDKnobs())})
        d.sizing = Sizing.of(_table(0.01), 4)
        d.costs.ema_f = d.sizing.full1
        d.costs.ema_v = 1.0 / d.sizing.full(4) * d.costs.ema_f       # bind's start: the calibrated pass, at this clock's scale
        texts = [torch.randint(10, 2000, (30,), generator=g).tolist() + list(range(3000 + 10 * i, 3007 + 10 * i)) * 200
                 for i in range(4)]
        arms = _simulate_batch(d, 4, 70, 1, texts=texts, budgets=[1000] * 4, closed=closed, verify=verify)
        assert [step[0] for step in arms].count("das-wave") == 1, arms
        assert not any(a == "pld" for step in arms for a in step), (closed, arms)


def test_a_batch_drafts_with_a_lookup_together_where_each_alone_wavers() -> None:
    """Four requests whose prompt-lookup drafts all match; a row past a request's first costs 0.1 of a plain
    pass.  All four drafting commit about 44 tokens for 5 plain passes' time (AR: 4 for 1), but each request,
    weighing its own draft beside the others' drafted rows of the last step, gains less than the margin and
    steps plain, which makes drafting pay again for the next: weighed as one step the batch drafts throughout
    (fails when only model drafters are weighed together: it alternates)."""
    def verify(rows: int, n: int) -> float:
        return 1.0 + 0.1 * (rows - n)
    arms = _lookup_batch([True] * 4, [1000] * 4, closed=False, verify=verify)
    assert all(step.count("pld") == 4 for step in arms[10:]), arms


def test_a_batch_drafts_with_a_lookup_together_only_where_it_matches() -> None:
    """Two of four requests' prompt-lookup drafts match; the others' text, on 20 token ids, gives their drafts
    matches to start from that do not continue (about 10 rows for little more than a token); a row past a
    request's first costs 0.2 of a plain pass.  Drafting together pays for the two, and the others step plain
    beside them (fails when only every request on the arm is weighed, or requests whose drafts commit a little
    more than a token are taken along: the batch alternates between drafting and not)."""
    def verify(rows: int, n: int) -> float:
        return 1.0 + 0.2 * (rows - n)
    d = _auto("pld", 0.05, lambda clock: {"pld": PLDDrafter(PLDKnobs())})
    d.sizing = Sizing.of(_table(0.01), 4)
    g = torch.Generator().manual_seed(8)
    texts = [list(range(3000 + 10 * i, 3007 + 10 * i)) * 200 for i in range(2)] + \
        [torch.randint(10, 30, (1400,), generator=g).tolist() for _ in range(2)]
    arms = _simulate_batch(d, 4, 40, 1, texts=texts, budgets=[1000] * 4, verify=verify)
    assert all(step == ["pld", "pld", "ar", "ar"] for step in arms[-20:]), arms


def test_a_probe_keeps_its_arm_when_the_batch_drafts_together() -> None:
    """Four requests whose prompt-lookup drafts pay together; DAS-Wave's probes come every few dozen steps.  The
    step with the others on prompt lookup keeps the probing request on DAS-Wave (fails when drafting together
    overrides probes: DAS-Wave is never measured again, and each overridden probe is charged all the same)."""
    def verify(rows: int, n: int) -> float:
        return 1.0 + 0.1 * (rows - n)
    d = _auto("das-wave,pld", 0.05, lambda clock: {"das-wave": FakeWave(clock, 0.1), "pld": PLDDrafter(PLDKnobs())})
    d.sizing = Sizing.of(_table(0.01), 4)
    probes: list = []
    arms = _simulate_batch(d, 4, 100, 1, texts=_repeating_texts(9), budgets=[4000] * 4, verify=verify,
                           probes=probes)
    late = [i for i, arm in probes if arm == "das-wave" and i > 10]
    assert late and all(sorted(arms[i]) == ["das-wave", "pld", "pld", "pld"] for i in late), (probes, arms)


def _repeating_texts(seed: int) -> list[list[int]]:
    """Four requests' texts: 30 random tokens, then a 7-token period (prompt lookup's drafts match)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 2000, (30,), generator=g).tolist() + list(range(3000 + 10 * i, 3007 + 10 * i)) * 200
            for i in range(4)]


def test_rows_a_draft_adds_are_priced_by_their_count() -> None:
    """The calibration says rows are free up to 16 and dear past them; here each row past a request's first
    costs 0.05 of a plain pass, whatever the width.  The first step's DAS-Wave probe (8 extra rows) measures that
    rate; when the texts turn repetitive, all four requests drafting with prompt lookup (about 40 extra rows, at
    least 5 x the plain tokens for 3 x the time) pays, and auto drafts (fails when the probe's multiple of the
    calibration's shape prices the wider step: that multiple is huge where the shape calls the rows free)."""
    def verify(rows: int, n: int) -> float:
        return 1.0 + 0.05 * (rows - n)
    ws = (1, 2, 4, 8, 16, 32)
    table = {"prelude": {w: 0.0 for w in ws}, "head": {w: 1e-3 for w in ws},
             "core": {w: 1e-3 * (1.0 if w <= 16 else 4.0) for w in ws}}
    for closed in (False, True):
        d = _auto("das-wave,pld", 0.0, lambda clock: {"das-wave": FakeWave(clock, 0.1),      # no probe but the first
                                                      "pld": PLDDrafter(PLDKnobs())})
        d.sizing = Sizing.of(table, 4)
        d.costs.ema_f = d.sizing.full1
        d.costs.ema_v = 1.0 / d.sizing.full(4) * d.costs.ema_f       # bind's start: the calibrated pass, at this clock's scale
        arms = _simulate_batch(d, 4, 150, 1, texts=_repeating_texts(9), budgets=[4000] * 4, closed=closed,
                               verify=verify)
        assert [step[0] for step in arms].count("das-wave") == 1, arms
        assert sum(all(a == "pld" for a in step) for step in arms[-20:]) >= 18, (closed, arms)


def test_a_lookup_priced_out_by_one_noisy_step_is_tried_again() -> None:
    """Four requests of a server whose texts turn repetitive; each row past a request's first costs 0.05 of a
    plain pass, but the batch's first drafted step (all four on prompt lookup) also takes an 8 s pause, which
    prices the rows out.  A lookup's price is re-measured by budgeted probes (the pause itself earns the first):
    one request's draft, a narrower width, measured at its true price; the paused width, measured once, then
    weighs at most ``OUTLIER`` x that rate, the requests draft again and it is measured anew (fails without the
    probes, or without that cap: plain to the end)."""
    calls = []

    def verify(rows: int, n: int) -> float:
        calls.append(rows > n)
        return 1.0 + 0.05 * (rows - n) + (8.0 if rows > n and calls.count(True) == 1 else 0.0)
    d = _auto("pld", 0.05, lambda clock: {"pld": PLDDrafter(PLDKnobs())})
    d.sizing = Sizing.of(_table(0.01), 4)
    probes: list = []
    arms = _simulate_batch(d, 4, 150, 1, texts=_repeating_texts(10), budgets=[4000] * 4, verify=verify,
                           probes=probes)
    first = next(i for i, step in enumerate(arms) if "pld" in step)
    assert arms[first + 1].count("pld") == 1 and probes[0] == (first + 1, "pld"), (probes, arms)   # priced out
    assert sum(all(a == "pld" for a in step) for step in arms[-20:]) >= 18, arms


def test_price_probes_stop_where_the_price_stands_and_skip_closed_batches() -> None:
    """Prompt lookup's drafts match, but each row past a request's first costs 0.3 of a plain pass, so drafting
    loses (it would win at the calibration's nearly-free rows).  A server's drafter re-measures that price by
    ``CONFIRM`` probes, then stops (fails when probes go on every loss / explore seconds); a closed batch, whose
    horizon is its budgets, never price-probes (fails when it does)."""
    def verify(rows: int, n: int) -> float:
        return 1.0 + 0.3 * (rows - n)
    for closed in (False, True):
        d = _auto("pld", 0.05, lambda clock: {"pld": PLDDrafter(PLDKnobs())})
        d.sizing = Sizing.of(_table(0.01), 4)
        probes: list = []
        arms = _simulate_batch(d, 4, 400, 1, texts=_repeating_texts(11), budgets=[4000] * 4, closed=closed,
                               verify=verify, probes=probes)
        first = next(i for i, step in enumerate(arms) if "pld" in step)
        assert arms[first].count("pld") == 4, arms       # the first drafted step: priced by the calibration
        drafted = [i for i, step in enumerate(arms) if i > first and "pld" in step]
        assert len(probes) == (0 if closed else TUNING.confirm), (closed, probes)
        assert drafted == [i for i, _ in probes], (drafted, probes)      # only the probes drafted


def test_a_widths_first_drafted_steps_weigh_evenly() -> None:
    """A width's first drafted steps are averaged evenly (then at the moving average's weight), so a pause in the
    first weighs a third after three, and the price probes' ``CONFIRM`` measurements count alike (fails when the
    first step is taken whole and the next at 0.3: the pause keeps half its weight)."""
    d = _auto("pld", 0.05, lambda clock: {"pld": PLDDrafter(PLDKnobs())})
    d.costs.plain = {2: (1.0, d.pass_cost(4))}                   # sp: a plain pass over four rows takes 1 s
    for v in (1.0 + 10 * 0.1 + 9.0, 1.0 + 10 * 0.1, 1.0 + 10 * 0.1):    # 0.1 s a row past the plain ones; a pause
        d.costs._add_extra(v, 14, 4)
    assert d.costs.verify_time(14, 4) == pytest.approx(1.0 + 1.0 + 9.0 / 3)
    d.costs._add_extra(2.0, 14, 4)
    assert d.costs.verify_time(14, 4) == pytest.approx(1.0 + 0.7 * 4.0 + 0.3 * 1.0)


def test_a_price_probe_hopes_only_for_its_own_rows() -> None:
    """What a lookup's price probe hopes for: its own draft's rows at what the calibration's shape says they add,
    the other requests' drafted rows at the measured rate (fails when every extra row is priced by the shape: the
    others' rows would make a draft that cannot pay look as if it might); rates between measured widths are
    interpolated."""
    d = _auto("pld", 0.05, lambda clock: {"pld": PLDDrafter(PLDKnobs())})
    d.sizing = Sizing.of(_table(0.01), 4)
    d.costs.plain = {2: (1.0, d.pass_cost(4))}                   # sp: a plain pass over four rows takes 1 s
    d.costs._add_extra(1.0 + 0.1 * 16, 20, 4)                 # 0.1 s a row past the plain ones, at 16 of them
    shape = d.costs.sp(4) * (d.pass_cost(20) - d.pass_cost(15))  # what the shape says the last 5 rows add
    assert d.costs.verify_time(20, 4) == pytest.approx(2.6)
    assert d.costs.verify_time(20, 4, hoped_rows=5) == pytest.approx(2.6 - 0.5 + shape)
    d.costs._add_extra(1.0 + 0.3 * 4, 8, 4)                   # 0.3 s a row at 4 of them
    assert d.costs.verify_time(12, 4) == pytest.approx(1.0 + 8 * (0.3 + 0.1) / 2)    # 8 rows: between the two


def test_a_batchs_plain_rows_do_not_reprice_the_rows_a_draft_adds() -> None:
    """Plain passes are priced by batch size, and a drafted row's price is in seconds: a batch of 8 whose plain
    passes cost 4x what the calibration's shape says a batch of 1's do reprices neither a plain pass of one request
    nor the rows a draft adds (fails with one plain scale for every batch size: the batch's shape is read as load
    and scales every drafted row by it)."""
    d = _auto("pld", 0.05, lambda clock: {"pld": PLDDrafter(PLDKnobs())})
    d.sizing = Sizing.of(_table(0.01), 4)
    c = d.costs
    one, eight = c.pass_cost(1), c.pass_cost(8)
    for _ in range(3):
        c.add_pass(1.0 * one, 1, 1)                           # sp(1) = 1 s per unit
    c.add_pass(1.0 * one + 0.1 * 16, 17, 1)                   # 0.1 s a row past the plain one, at 16 of them
    for _ in range(3):
        c.add_pass(4.0 * eight, 8, 8)                         # a batch's plain rows: 4 s per unit
    assert c.verify_time(1, 1) == pytest.approx(one)
    assert c.verify_time(8, 8) == pytest.approx(4.0 * eight)
    assert c.verify_time(8 + 16, 8) == pytest.approx(4.0 * eight + 1.6)
    assert c.verify_time(1 + 16, 1) == pytest.approx(one + 1.6)
    c.add_pass(4.0 * eight + 0.05 * 16, 24, 8)                # the batch's own drafted rows: 0.05 s each
    assert c.verify_time(1 + 16, 1) == pytest.approx(one + 0.5 * (0.1 + 0.05) * 16)


def test_a_batch_size_drafting_before_its_first_plain_pass_waits_for_it() -> None:
    """A batch of 8 that drafts before any plain pass of 8 (its plain rows 4x a lone request's per unit) does not put
    its plain part on the rows a draft adds: those passes wait for the batch size's first plain pass and are then
    priced with it (fails when they are fitted at once with a lone request's plain scale: the extra rows read 30x
    their price, and stay so after the batch's plain passes)."""
    d = _auto("pld", 0.05, lambda clock: {"pld": PLDDrafter(PLDKnobs())})
    c = d.costs
    one, eight = c.pass_cost(1), c.pass_cost(8)
    for _ in range(3):
        c.add_pass(1.0 * one, 1, 1)
    c.add_pass(1.0 * one + 0.05 * 16, 17, 1)                  # a lone request: 0.05 s a drafted row
    for _ in range(3):
        c.add_pass(4.0 * eight + 0.05 * 16, 24, 8)            # the batch drafts first
    assert c.extra_rate(16) == pytest.approx(0.05)
    c.add_pass(4.0 * eight, 8, 8)                             # its first plain pass
    assert c.extra_rate(16) == pytest.approx(0.05) and not c.early
    assert c.verify_time(8 + 16, 8) == pytest.approx(4.0 * eight + 0.8)


def test_a_requests_first_block_moves_the_drafters_average() -> None:
    """A request's first block with a model drafter is one sample (DAS-Wave's first after plain steps has no copy
    run to follow): its estimate starts from the other requests' average and moves by the probe weight (fails when
    the first block replaces the average: one short block put a batch of 8 on plain steps for good)."""
    from dasspec.methods.auto.earnings import Earnings, Priors
    priors = Priors()
    for _ in range(20):
        Earnings(["das-wave"], priors).verdict("das-wave", 14, 18, 3)
    e = Earnings(["das-wave"], priors)
    avg = priors.get("das-wave")
    e.verdict("das-wave", 6, 6, 3)
    a = TUNING.probe_alpha
    assert e.tok_rows("das-wave") == pytest.approx(((1 - a) * avg[0] + a * 6, (1 - a) * avg[1] + a * 6))
    assert e.arms["das-wave"].n == 1


def test_one_lucky_match_does_not_put_a_closed_batch_on_a_drafter() -> None:
    """A closed batch plans for the rest of its budgets, so one lucky step must not commit it: four requests whose
    lookup drafts committed one token for 20 steps and then five once (the step's average jumps to 2.2, a drafted
    step costs 1.75 plain ones: drafting would pay at 2.2) stay plain; where the drafts keep committing three, they
    draft (fails when the plan takes the step's average: the lucky step puts the batch on prompt lookup)."""
    d = _auto("pld", 0.05, lambda clock: {"pld": PLDDrafter(PLDKnobs())})
    d.sizing = Sizing.of(_table(0.0248), 4)     # full(44 rows) = 1.75 full(4 rows)
    d.costs.ema_v = d.costs.ema_f = 1.0
    d.costs.dcost["pld"] = {0: (1e-9, 1.0)}
    text = list(range(100, 400))
    reqs = [_fake_req(text, 5, 100) for _ in range(4)]
    for r in reqs:
        r.closed = True
    sessions = [d.start(r) for r in reqs]
    for s in sessions:
        for step in range(20):           # as a lookup arm's measurements are taken (AutoSession.resolve)
            s.arms["pld"].add(1, 11, step, TUNING.step_alpha, TUNING.slow_alpha)
        s.arms["pld"].add(5, 11, 20, TUNING.step_alpha, TUNING.slow_alpha)
    assert sessions[0].tok_rows("pld")[0] > 2.0
    plain = [("ar", False)] * 4
    assert _closed(d, sessions, plain) == plain
    for s in sessions:
        for step in range(21, 40):
            s.arms["pld"].add(3, 11, step, TUNING.step_alpha, TUNING.slow_alpha)
    assert _closed(d, sessions, plain) == [("pld", False)] * 4


def test_a_closed_batch_on_a_drafter_measured_once_leaves_it_only_when_plain_steps_win_by_the_margin() -> None:
    """Four requests whose drafts commit 1.7 tokens a step, a drafted step costing 1.75 plain ones: drafting is
    2.9% slower than plain steps.  A batch that stepped plain stays plain (a drafter must win by the margin); one
    whose every request drafted last step, each after one measurement, drafts once more (some of the bundled
    model's closed batches went plain on DAS-Wave's first blocks, before its copy runs:
    docs/performance-journal.md; fails without the rule); after two measurements, or at 1.6 tokens (9.4% slower), it steps plain."""
    d = _auto("pld", 0.05, lambda clock: {"pld": PLDDrafter(PLDKnobs())})
    d.sizing = Sizing.of(_table(0.0248), 4)     # full(44 rows) = 1.75 full(4 rows)
    d.costs.ema_v = d.costs.ema_f = 1.0
    d.costs.dcost["pld"] = {0: (1e-9, 1.0)}
    reqs = [_fake_req(list(range(100, 400)), 5, 100) for _ in range(4)]
    for r in reqs:
        r.closed = True
    sessions = [d.start(r) for r in reqs]

    def plan(tok: float, prev: str, n: int = 1) -> list:
        for s in sessions:
            s.arms["pld"] = ArmStats()
            for step in range(n):
                s.arms["pld"].add(tok, 11, step, 1.0)
            s.prev = prev
        return _closed(d, sessions, [("ar", False)] * 4)
    assert plan(1.7, "ar") == [("ar", False)] * 4
    assert plan(1.7, "pld") == [("pld", False)] * 4
    assert plan(1.7, "pld", n=2) == [("ar", False)] * 4
    assert plan(1.6, "pld") == [("ar", False)] * 4


def _closed(d: AutoDrafter, sessions, picks: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
    """The closed-batch planner's arms for ``sessions`` given their own (arm, probe) picks."""
    got, _ = planners.closed_plan(d.costs, [s.earnings for s in sessions], [explorer.Choice(a, p, "own")
                                  for a, p in picks], list(d.subs), [s.ctx.budget for s in sessions],
                                  [s.prev for s in sessions], d.tuning)
    return [(c.arm, c.probe) for c in got]


def _lookup_stats(d: AutoDrafter, budgets: list[int], tok: float) -> list:
    """Closed-batch sessions of ``d`` whose prompt lookup has committed ``tok`` tokens of 11 rows every step."""
    reqs = [_fake_req(list(range(100, 400)), 5, b) for b in budgets]
    sessions = []
    for r in reqs:
        r.closed = True
        s = d.start(r)
        for step in range(40):
            s.arms["pld"].add(tok, 11, step, TUNING.step_alpha, TUNING.slow_alpha)
        sessions.append(s)
    return sessions


def test_a_request_with_one_token_to_go_is_left_out_of_a_batch_plan(monkeypatch) -> None:
    """A batch plan (closed or drafting together) puts every request on prompt lookup; its request with one token
    to go takes a plain step all the same (fails when the plan overrides the rule)."""
    d = _auto("pld", 0.05, lambda clock: {"pld": PLDDrafter(PLDKnobs())})
    d.sizing = Sizing.of(_table(0.0248), 4)
    d.costs.ema_v = d.costs.ema_f = 1.0
    d.costs.dcost["pld"] = {0: (1e-9, 1.0)}
    def everyone(costs, earnings, picks, *a):
        return [explorer.Choice("pld", False, "test") for _ in earnings], "test"
    monkeypatch.setattr(drafter_mod, "closed_plan", everyone)
    monkeypatch.setattr(drafter_mod, "together", everyone)
    for closed in (True, False):
        sessions = _lookup_stats(d, [100, 100, 100, 1], 3.0)
        for s in sessions:
            s.ctx.closed = closed
        d.propose_batch(sessions)
        assert [s.arm for s in sessions] == ["pld", "pld", "pld", "ar"], closed


def test_a_request_with_one_token_to_go_takes_a_plain_step() -> None:
    """With one token left a draft cannot commit more and a probe measures nothing: the request takes a plain step
    although DAS-Wave was never measured (fails without the rule: the step probes it), and the lookup arm is not
    scored on an empty draft (fails when it is: a miss recorded at every request's end)."""
    make = lambda: _auto("das-wave,pld", 0.2, lambda clock: {"das-wave": FakeWave(clock, 1.0),  # noqa: E731
                                                              "pld": PLDDrafter(PLDKnobs())})
    text = list(range(10, 100))
    req = _fake_req(text, 5, 2)
    d = make()
    arms = _simulate(d, req, text, 2, lambda step: 1)
    assert arms == ["ar", "ar"], arms
    assert not d.budget.probed                               # no probe booked that would not run (fails without the rule)
    assert req.session.arms["pld"].n == 1, req.session.arms["pld"].n      # scored at step 0 only
    arms = _simulate(make(), _fake_req(text, 5, 3), text, 2, lambda step: 1)
    assert arms == ["ar", "das-wave"], arms           # with two to go it probes


# --- calibration ------------------------------------------------------------------------------------------------

def test_calibration_is_cached_and_optional(monkeypatch) -> None:
    model = random_model("ouro", seed=2)
    costs = cal_mod.calibration(model)
    assert set(costs) == {"prelude", "core", "head"} and 1 in costs["core"]
    assert cal_mod._cache_file().is_file()

    def refuse(*a, **k):
        raise AssertionError("measured again")
    monkeypatch.setattr(cal_mod, "measure_costs", refuse)
    assert cal_mod.calibration(model) == costs                      # from the model's copy
    del model._auto_calibrations
    assert cal_mod.calibration(model) == costs                      # from the file
    d = build_drafter(model, "auto", {"calibrate": False})           # skipped: nothing measured
    assert d.sizing is None
    d = build_drafter(model, "auto")
    assert d.sizing is not None and d.width >= max(s.width for s in d.subs.values())


def test_calibration_is_measured_once_per_model_where_the_cache_cannot_be_written(monkeypatch, tmp_path) -> None:
    # a server builds an auto drafter per set of request knobs; a read-only home (a container, a Ray worker) must not
    # cost a measurement each
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("DASSPEC_CACHE", str(tmp_path / "file" / "cache"))     # below a file: mkdir fails
    model = random_model("ouro", seed=3)
    build_drafter(model, "auto")
    monkeypatch.setattr(cal_mod, "measure_costs", lambda *a, **k: pytest.fail("measured again"))
    d = build_drafter(model, "auto", {"explore": 0.1})
    assert d.sizing is not None and not (tmp_path / "file" / "cache").exists()


class _BurstModel:
    """What measure_costs calls, on a fake clock: a core step over W rows takes (1 + W / 32) ms, calls
    ``burst`` 20 x that (another process took the machine)."""

    def __init__(self, clock: FakeClock, burst: range):
        self.clock, self.burst, self.calls = clock, burst, 0
        self.device = torch.device("cpu")

    def span(self, start, past, W):
        return W

    def initial_state(self, positions):
        return torch.zeros(len(positions), 1)

    def start_state(self, h0, e):
        return h0

    def prelude(self, ids, span):
        return None

    def core_step(self, h, e, W):
        self.calls += 1
        self.clock.t += 1e-3 * (1 + W / 32) * (20 if self.calls in self.burst else 1)
        return h

    def readout(self, h, span):
        return None


def test_calibration_survives_a_burst_of_load(monkeypatch) -> None:
    """A burst of load over five consecutive core steps: measured width by width, it would cover every
    repetition of one width (that width then costs 20 x its neighbours and the window and pass costs follow the
    noise); measured round the widths, each width keeps a quiet repetition (fails when the repetitions of a width
    run back to back)."""
    clock = FakeClock()
    monkeypatch.setattr(cal_mod, "time", SimpleNamespace(perf_counter=clock))
    for start in range(2, 16):
        model = _BurstModel(clock, range(start, start + 5))
        core = cal_mod.measure_costs(model, budget_s=10.0)["core"]
        assert set(core) == set(TUNING.cal_widths)
        for W, t in core.items():
            assert t == pytest.approx(1e-3 * (1 + W / 32)), (start, W, core)


def test_a_narrow_width_measured_dearer_is_not_believed() -> None:
    """A pass over more rows never costs less: a width measured dearer than a wider one takes the wider one's
    time (fails without the envelope: full(2) would exceed full(32))."""
    costs = _table(0.01)
    costs["core"][2] = 10 * costs["core"][32]
    s = Sizing.of(costs, 4)
    widths = sorted(costs["core"])
    assert all(s.full(a) <= s.full(b) for a, b in zip(widths, widths[1:]))


def _table(core_wide: float) -> dict:
    """Costs where a round over W rows costs 1 + core_wide x (W - 1) one-row rounds' worth."""
    ws = (1, 2, 4, 8, 16, 32)
    return {"prelude": {w: 0.0 for w in ws}, "core": {w: 1e-3 * (1 + core_wide * (w - 1)) for w in ws},
            "head": {w: 1e-3 for w in ws}}


def test_window_follows_pass_costs_but_keeps_the_models_own_knobs(monkeypatch) -> None:
    """Where wide rounds cost more, DAS-Wave's window (gamma, W_init) under auto narrows, and its rounds fit one AR
    step; knobs a model's generation_config.json sets (the bundled model's tuned schedule) are kept."""
    assert Sizing.of(_table(0.01), 4).window == 32
    assert Sizing.of(_table(2.0), 4).window == 1
    monkeypatch.setattr(drafter_mod, "calibration", lambda model, **k: _table(2.0))
    ouro = random_model("ouro", seed=2)
    own = build_drafter(ouro, "das-wave").knobs
    wave = build_drafter(ouro, "auto").subs["das-wave"].knobs
    assert wave.gamma == wave.w_init == 1 < own.gamma
    assert wave.rounds <= own.rounds
    bundled = dasspec.load_model()
    assert build_drafter(bundled, "auto").subs["das-wave"].knobs == build_drafter(bundled, "das-wave").knobs


def test_a_sub_drafters_longer_chains_are_backed_under_auto() -> None:
    """DAS-Wave's copy runs reach past its width (``reach``); under auto the engine must back them as far, or auto
    cuts them short and runs below DAS-Wave where it pays (the bundled model's schedule has copy runs)."""
    bundled = dasspec.load_model()
    own = build_drafter(bundled, "das-wave")
    assert own.reach > own.width
    auto = build_drafter(bundled, "auto")
    assert auto.reach >= own.reach
    prompt = dasspec.load_tokenizer().encode("a b c d a b c d a b c d a b c d a b c d a b c d")
    out = dasspec.generate(bundled, prompt, drafter=auto, max_new_tokens=120, eos=False, trace=True)
    assert out.tokens == dasspec.generate(bundled, prompt, "ar", max_new_tokens=120, eos=False).tokens


def test_a_knob_of_another_method_names_that_method() -> None:
    # auto is the server's and lm-eval's default: DAS-Wave's knobs sent to it (a config, a request, DasspecLM's
    # keywords) say where they belong
    model = random_model("ouro", seed=4)
    with pytest.raises(ValueError, match=r"does not take gamma; its knobs: arms, explore, calibrate, recall; "
                                         r"gamma is a knob "
                                         r"of das-wave \(name that method\)"):
        build_drafter(model, "auto", {"gamma": 4})
    with pytest.raises(ValueError, match=r"does not take nope; its knobs: [a-z, _]+$"):
        build_drafter(model, "auto", {"nope": 4})
