"""The decode loop's contract with drafters: a method written from nothing in one file (knobs, drafter,
registration) is lossless and gets its CLI flags; drafts are checked against the cache capacity; the per-block
trace; typed knobs with per-family defaults that refuse an unknown family."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

import dasspec
from dasspec.engine.drafting.draft import Draft, Drafter, Session, TreeLayout
from dasspec.engine.base.request import DraftCapacityError
from dasspec.methods import METHODS, Method
from dasspec.methods.knobs import Knobs, knob, positive_int
from dasspec.testing import random_model


@dataclass(frozen=True)
class RepeatKnobs(Knobs):
    method = "repeat"
    copies: int = knob({"huginn": 3, "raven-llama": 2, "raven-olmo": 2}, "repeat: anchor copies proposed")
    as_tree: bool = knob(False, "repeat: propose a chain and a one-node sibling as a tree")

    def validate(self, R: int) -> "RepeatKnobs":
        positive_int(self, "copies")
        return self


class RepeatSession(Session):
    def propose(self) -> Draft:
        req, knobs = self.ctx, self.drafter.knobs
        anchor = req.generated[-1]
        c = min(knobs.copies, req.room - 1)       # the budget rule: inputs at depth <= room - 1
        if c == 0:
            return Draft()
        if knobs.as_tree:               # node 1..c: the chain; node c+1: a sibling of node 1
            return Draft([anchor] * c + [(anchor + 1) % req.config.vocab_size],
                         layout=TreeLayout(list(range(-1, c)) + [0]))
        return Draft([anchor] * c, bonus=True)

    def observe(self, verdict) -> None:
        self.drafter.seen.append(verdict.accepted)


class RepeatDrafter(Drafter):
    """Proposes the anchor repeated: right on runs of one token, wrong elsewhere - both paths get exercised."""

    name = "repeat"
    session = RepeatSession

    def __init__(self, knobs: RepeatKnobs):
        self.knobs = knobs
        self.width = knobs.copies + 2
        self.seen = []


@pytest.fixture
def repeat_method(monkeypatch):
    from dasspec.methods import registry
    registry._load()
    method = Method("repeat", RepeatKnobs, RepeatDrafter)
    monkeypatch.setitem(METHODS, "repeat", method)
    return method


@pytest.mark.parametrize("family", ["huginn", "raven-llama", "raven-olmo"])
def test_a_method_written_in_one_file_is_lossless(repeat_method, family):
    model = random_model(family, seed=2, mean_recurrence=4)
    accepted = 0
    for i, prompt in enumerate(([7] * 9, [3, 4, 5, 6, 7, 8], [9, 9, 2, 9, 9, 2, 9, 9])):
        ref = dasspec.generate(model, prompt, "ar", max_new_tokens=12, eos=False, seed=i, init_scale=1.0)
        for as_tree in (False, True):
            out = dasspec.generate(model, prompt, "repeat", max_new_tokens=12, eos=False, seed=i, init_scale=1.0,
                                   as_tree=as_tree)
            assert out.tokens == ref.tokens, (family, i, as_tree)
            accepted += sum(out.stats.accepted)
    assert dasspec.build_drafter(model, "repeat").knobs.copies == (3 if family == "huginn" else 2)
    assert accepted > 0


def test_a_new_methods_knobs_become_cli_flags(repeat_method):
    from dasspec.cli import build_parser, knobs_from_args

    args = build_parser().parse_args(["generate", "--method", "repeat", "--copies", "5", "--as-tree"])
    assert knobs_from_args(args) == {"copies": 5, "as_tree": True}
    args = build_parser().parse_args(["generate", "--method", "repeat", "--set", "copies=2", "--no-as-tree"])
    assert knobs_from_args(args) == {"copies": 2, "as_tree": False}


def test_derived_flags_parse_by_declared_type():
    from dasspec.cli import build_parser, knobs_from_args

    args = build_parser().parse_args(["generate", "--method", "das-wave", "-J", "3", "--w-init", "4", "--trim",
                                      "--no-carry", "--policy", "k=4,v=32", "--set", "seed_branch=2",
                                      "--set", "alpha=2.5"])
    assert knobs_from_args(args) == {"rounds": 3, "w_init": 4, "trim": True, "carry": False, "policy": "k=4,v=32",
                                     "seed_branch": 2, "alpha": 2.5}
    for bad, message in ((["--gamma", "x"], "gamma: expected an integer"), (["--set", "nope=1"], "no method has"),
                         (["--set", "trim=maybe"], "trim: expected true or false")):
        with pytest.raises(ValueError, match=message):
            knobs_from_args(build_parser().parse_args(["generate", *bad]))


def test_an_unknown_family_gets_no_other_familys_schedule(monkeypatch):
    """Per-family defaults are declared per family: a family without one is an error naming the knob, never
    Raven's (or Huginn's) schedule; explicit values still work."""
    model = random_model("huginn", mean_recurrence=4)
    monkeypatch.setattr(model.config, "family", "new-family", raising=False)
    with pytest.raises(ValueError, match="no default k for model family 'new-family'"):
        dasspec.build_drafter(model, "das-wave")
    assert dasspec.build_drafter(model, "das-wave", {"k": 1}).knobs.k == 1
    assert dasspec.build_drafter(model, "pld").knobs.num_pred == 10         # family-free defaults are fine


def test_default_draft_depth_fits_a_shallow_call():
    """A defaulted draft depth is lowered to R - 1 at a shallower num_steps; an explicit one is checked."""
    model = random_model("huginn", mean_recurrence=8)
    ref = dasspec.generate(model, [3, 4, 5], "ar", max_new_tokens=6, num_steps=4, eos=False).tokens
    out = dasspec.generate(model, [3, 4, 5], "mature-spec", max_new_tokens=6, num_steps=4, eos=False)
    assert out.tokens == ref and out.stats.draft_passes % 3 == 0               # d = min(4, R - 1) = 3
    with pytest.raises(ValueError, match="draft_depth must be < R"):
        dasspec.generate(model, [3, 4, 5], "mature-spec", max_new_tokens=6, num_steps=4, draft_depth=4)


class WideSession(Session):
    def propose(self) -> Draft:
        if self.ctx.room < 2:                       # a depth-1 tree needs room for two more tokens
            return Draft()
        return Draft([self.ctx.generated[-1]] * 19, layout=TreeLayout([-1] + [0] * 19))


class WideTree(Drafter):
    """Proposes a 20-node tree; with ``width`` 1 it breaks the contract (its drafts need 20 verifier rows)."""

    name = "wide"
    session = WideSession

    def __init__(self, width: int):
        self.width = width


def test_a_draft_beyond_the_reserved_capacity_is_refused():
    model = random_model("huginn", mean_recurrence=2)
    with pytest.raises(DraftCapacityError, match="the drafter's width 1"):
        dasspec.generate(model, [3, 4, 5], max_new_tokens=4, drafter=WideTree(1))
    ok = dasspec.generate(model, [3, 4, 5], max_new_tokens=30, eos=False, drafter=WideTree(20))   # declared
    assert ok.tokens == dasspec.generate(model, [3, 4, 5], max_new_tokens=30, eos=False).tokens


def test_trace_records_every_block():
    model = random_model("raven-olmo", seed=1, mean_recurrence=3)
    out = dasspec.generate(model, [5, 6, 5, 6, 5, 6], "pld", max_new_tokens=14, eos=False, trace=True)
    assert len(out.trace) == out.stats.verify_events
    assert sum(v.kept for _, v in out.trace) == len(out.tokens) - 1            # the first token is the prefill's
    assert [v.accepted for _, v in out.trace] == out.stats.accepted
    assert out.trace[0][1].tokens[: out.trace[0][1].kept] == out.tokens[1: 1 + out.trace[0][1].kept]
    assert dasspec.generate(model, [5, 6], max_new_tokens=3).trace is None


def test_a_kept_drafter_is_checked_against_the_calls_depth():
    model = random_model("huginn", mean_recurrence=8)
    drafter = dasspec.build_drafter(model, "mature-spec", {"draft_depth": 6})
    assert dasspec.generate(model, [3, 4], max_new_tokens=4, drafter=drafter).tokens
    with pytest.raises(ValueError, match="draft_depth must be < R"):
        dasspec.generate(model, [3, 4], max_new_tokens=4, num_steps=4, drafter=drafter)
    with pytest.raises(ValueError, match="either a drafter or a method"):
        dasspec.generate(model, [3, 4], "das-wave", max_new_tokens=4, drafter=drafter)


def test_knobs_whose_drafts_cannot_fit_the_context_are_named():
    model = random_model("huginn", mean_recurrence=4, block_size=64)
    with pytest.raises(ValueError, match=r"block=100 is above its ceiling of 63 .*context 64.*the context - 1"):
        dasspec.generate(model, [3, 4], "self-spec", max_new_tokens=4, block=100, draft_depth=2)
    with pytest.raises(ValueError, match=r"gamma=80 is above its ceiling of 63"):
        dasspec.generate(model, [3, 4], "das-wave", max_new_tokens=4, gamma=80, rounds=90)
    with pytest.raises(ValueError, match=r"seed_branch=40 is above its ceiling of 31 .*the window min\(gamma"):
        dasspec.generate(model, [3, 4], "das-wave", max_new_tokens=4, gamma=32, rounds=32, guesses="copy",
                         seed_branch=40)
    with pytest.raises(ValueError, match=r"tree=.* is above its ceiling of 64 .*context nodes"):
        dasspec.build_drafter(model, "token-recycling", {"tree": [[0], [1]] + [[0] * d for d in range(2, 70)]})

    class Wide(dasspec.engine.drafting.draft.Drafter):       # a method without ceilings is still held to the context
        width = 100
    from dasspec.methods import METHODS, Method, register
    from dasspec.methods.ar import ARKnobs
    register(Method("wide-test", ARKnobs, lambda knobs: Wide()))
    try:
        with pytest.raises(ValueError, match=r"wide-test: drafts of up to 100 verifier positions .* exceed the model "
                                             r"context of 64"):
            dasspec.build_drafter(model, "wide-test")
    finally:
        METHODS.pop("wide-test")


def test_sampled_decoding_takes_the_models_sampled_defaults(monkeypatch):
    """A model folder may tune a method separately for sampled decoding ("<method>:sampled" in
    generation_config.json); greedy calls keep the plain section, and explicit knobs beat both."""
    model = random_model("huginn", mean_recurrence=3)
    monkeypatch.setattr(model, "generation_defaults", {"dasspec": {
        "das-wave": {"gamma": 4, "rounds": 3, "w_init": 4},
        "das-wave:sampled": {"gamma": 6, "rounds": 5, "w_init": 6}}})
    widths = {}
    for sample in (False, True):
        out = dasspec.generate(model, [3, 4, 5], "das-wave", max_new_tokens=20, eos=False, do_sample=sample,
                               trace=True)
        widths[sample] = len(out.trace[0][0].tokens)
    assert widths == {False: 4, True: 6}
    assert dasspec.build_drafter(model, "das-wave", {"gamma": 5}, sampled=True).knobs.gamma == 5


class ClosedSession(Session):
    def propose(self) -> Draft:
        self.drafter.seen.append(self.ctx.closed)
        return Draft()


class ClosedRecorder(Drafter):
    """Proposes nothing; records what each drafting session sees of ``closed`` at each step."""

    name = "closed-recorder"
    session = ClosedSession
    width = 1

    def __init__(self):
        self.seen = []


def test_a_closed_batch_says_so_to_drafters():
    """generate_batch is a closed batch: once no request waits for a slot, every drafting session sees ``closed``;
    while requests wait, and in an Engine a server drives, it does not (fails when the scheduler never says so, or
    says so while requests wait); generate_batch's default pool runs all four small requests at once (fails
    without the admission headroom: half of them waited)."""
    model = random_model("huginn", seed=2, mean_recurrence=4)
    rec = ClosedRecorder()
    prompts = [[5, 6, 7], [8, 9, 10, 11], [3, 3, 3], [4, 5]]
    caps = [9, 5, 5, 3]
    dasspec.generate_batch(model, prompts, drafter=rec, max_new_tokens=caps, eos=False, max_batch=4)
    assert len(rec.seen) == 8 + 4 + 4 + 2 and all(rec.seen)     # every step closed: none ever waited
    rec.seen.clear()
    dasspec.generate_batch(model, prompts, drafter=rec, max_new_tokens=caps, eos=False, max_batch=2)
    assert rec.seen[0] is False and rec.seen[-1] is True         # two wait at first; at the end none does
    rec.seen.clear()
    engine = dasspec.Engine(model, max_batch=4, drafter=rec)
    for p, c in zip(prompts, caps):
        engine.add(p, max_new_tokens=c, eos=False)
    while engine.has_work:
        engine.step()
    assert rec.seen and not any(rec.seen)


def test_a_closed_batch_is_not_closed_while_a_prompt_prefills():
    """A long prompt prefilled over several steps beside two decoding requests: until it decodes, the drafters
    are not told the batch is closed (it is the batch's end, and they do not see it; fails when the flag only waits
    for an empty queue)."""
    model = random_model("huginn", seed=2, mean_recurrence=4)
    rec = ClosedRecorder()
    engine = dasspec.Engine(model, max_batch=4, drafter=rec, closed=True, max_step_tokens=16, block_size=8)
    for p, c in (([5, 6, 7], 8), ([8, 9, 10], 8), (list(range(3, 43)), 4)):
        engine.add(p, max_new_tokens=c, eos=False)
    while engine.has_work:
        engine.step()
    assert rec.seen[0] is False and rec.seen[-1] is True
