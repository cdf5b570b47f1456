"""Proposition 1: every DAS decoder commits exactly full-depth AR's greedy tokens (float32), whatever its
drafter, prefix read policy or carry setting, with zero and with seeded random initial states."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import dasspec
from dasspec.model.checkpoint import BUNDLED_DIR
from dasspec.testing import random_model
from batched import decode_together

POLICIES = ["aligned", "deep-v", "deep-k", "deep-kv"]

# (method, knobs) for random checkpoints (R = 6): every drafter x read policy x carry.
RANDOM_CASES = (
    [("self-spec", {"draft_depth": 2, "block": 4})]
    + [("mature-spec", {"draft_depth": d, "block": 5, "policy": p}) for d, p in zip((1, 3, 2, 4), POLICIES)]
    + [("mature-spec", {"draft_depth": 2, "block": 3, "policy": "k=4,v=5"})]
    + [("das-wave", {"gamma": 8, "rounds": 5, "w_init": 2, "k": k, "policy": p, "carry": c})
       for (p, c), k in zip(itertools.product(POLICIES, (True, False)), (1, 2, 1, 2, 1, 2, 1, 2))]
    + [("das-wave", {"gamma": 5, "rounds": 7, "w_init": 1, "k": 1})]       # window capped at gamma
    + [("das-wave", {"gamma": 8, "rounds": 3, "w_init": 6, "k": 1, "guesses": "lookup", "carry": c})
       for c in (True, False)]                                            # lookup-seeded window
    + [("das-wave", {"gamma": 8, "rounds": 4, "w_init": 3, "k": 1, "trim": True, "guesses": g})
       for g in ("anchor", "lookup", "copy")]                             # trimmed proposals
    + [("das-wave", {"gamma": 8, "rounds": 3, "w_init": 8, "k": 1, "trim": True, "guesses": g, "seed_branch": b,
                     "copy_run": c})                # seed verified as a second branch / seeds verified without rounds
       for g, b, c in (("copy", 4, True), ("lookup", 6, False))]
    + [("das-wave", {"gamma": 4, "rounds": 6, "w_init": 4, "k": 1, "trim": True, "guesses": "copy", "seed_branch": 8,
                     "copy_run": True, "early_stop": True})]  # a window narrower than the seed, rounds stopped early
)


def _prompts(vocab: int, count: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 30, (count,), generator=g).tolist()
    # Low-entropy prompts (repeats) make drafts partly right, so acceptance paths are exercised too.
    out = []
    for i, L in enumerate(lengths):
        base = torch.randint(2, vocab, (max(2, L // 3),), generator=g)
        out.append(base.repeat(4)[:L].tolist() if i % 2 else torch.randint(2, vocab, (L,), generator=g).tolist())
    return out


@pytest.mark.parametrize("init_scale", [0.0, 1.0])
@pytest.mark.parametrize("family", ["huginn", "raven-llama", "raven-olmo"])
def test_random_checkpoints_match_ar(family: str, init_scale: float) -> None:
    # One layer per stage keeps 40 prompts x every case fast; the family's quirks (GQA, llama3 RoPE, q/k norm,
    # sandwich norms) are all in that one layer.  Zero and seeded-random initial states take alternate prompts
    # (20 each), one test each so that the test workers share the six halves evenly.  Each case decodes its 20
    # prompts together (the batched engine: each must equal its own batch-1 AR decode) and two of them alone.
    model = random_model(family, seed=3, mean_recurrence=6, n_prelude=1, n_core=2, n_coda=1)
    prompts = [(i, p) for i, p in enumerate(_prompts(model.config.vocab_size, 40, seed=11)) if i % 2 == int(init_scale)]
    options = [dict(prompt=p, max_new_tokens=10, init_scale=init_scale, seed=i, eos=False) for i, p in prompts]
    refs = [dasspec.generate(model, o["prompt"], "ar", **{k: v for k, v in o.items() if k != "prompt"}).tokens
            for o in options]
    assert all(len(r) == 10 for r in refs)
    accepted = 0
    for method, knobs in RANDOM_CASES:
        outs = decode_together(model, options, method, knobs)
        for (i, _), out, ref in zip(prompts, outs, refs):
            assert out.tokens == ref, (family, init_scale, i, method, knobs)
            accepted += sum(out.stats.accepted)
        for o, ref in list(zip(options, refs))[:2]:                    # the plain batch-1 path too
            out = dasspec.generate(model, o["prompt"], method, **{k: v for k, v in o.items() if k != "prompt"},
                                   **knobs)
            assert out.tokens == ref, (family, init_scale, method, knobs)
    assert accepted > 0, "no draft was ever accepted: the acceptance path went untested"


def test_seeded_initial_state_changes_output_but_stays_lossless() -> None:
    """Random initial states matter (different seeds may change AR's tokens) and every method follows AR."""
    model = random_model("huginn", seed=5)
    prompt = list(range(2, 14))
    outs = {s: dasspec.generate(model, prompt, "ar", max_new_tokens=24, seed=s, eos=False).tokens for s in range(4)}
    logits = {s: model(torch.tensor([prompt]), init_scale=1.0, seed=s)[0, -1] for s in range(2)}
    assert not torch.equal(logits[0], logits[1])
    for s, ref in outs.items():
        out = dasspec.generate(model, prompt, "das-wave", max_new_tokens=24, seed=s, eos=False, gamma=8, rounds=5)
        assert out.tokens == ref


def _bundled_prompts(count: int) -> list[str]:
    """Half GSM8K test questions (zero-shot, from $DASSPEC_DATA; the test skips without them), half code."""
    from dasspec.eval.data import data_dir
    from dasspec.eval.tasks import gsm8k

    root = data_dir()
    if root is None or not (root / "gsm8k" / "test.jsonl").exists():
        pytest.skip("GSM8K test questions not found: set DASSPEC_DATA to the data folder")
    prompts = [gsm8k.prompt(row["question"], shots=0) for row in gsm8k.load(root)[: count // 2]]
    code = ["def fibonacci(n):", "import os\n\ndef list_files(path):", "class Stack:\n    def __init__(self):",
            "def is_prime(n):\n    \"\"\"Return True if n is prime.\"\"\"", "for i in range(10):",
            "def read_json(path):", "import re\n\nPATTERN = ", "def merge_sort(items):",
            "def parse_args():\n    parser = argparse.ArgumentParser(", "Janet has 3 apples and buys 5 more.",
            "def gcd(a, b):", "with open('data.txt') as f:"]
    prompts += code
    return prompts[:count]


# Every drafter x read policy x carry on the bundled model, at a shallower target (R = 8) to keep the suite fast:
# Proposition 1 holds for any target depth, and the verifier is whatever full depth the call asks for.
BUNDLED_CASES = (
    [("self-spec", {"draft_depth": 4, "block": 6})]
    + [("mature-spec", {"draft_depth": 3, "block": 6, "policy": p}) for p in POLICIES]
    + [("das-wave", {"gamma": 12, "rounds": 8, "k": 1, "policy": p, "carry": c})
       for p, c in itertools.product(POLICIES, (True, False))]
    + [("das-wave", {"gamma": 12, "rounds": 2, "w_init": 12, "k": 1, "guesses": "lookup"})]
    + [("das-wave", {"gamma": 12, "rounds": 3, "w_init": 12, "k": 1, "guesses": g, "trim": True})
       for g in ("lookup", "copy")]
    + [("das-wave", {"gamma": 12, "rounds": 3, "w_init": 12, "k": 1, "guesses": "copy", "trim": True,
                     "seed_branch": b, "copy_run": c}) for b, c in ((12, False), (0, True), (6, True))]
    + [("das-wave", {"gamma": 4, "rounds": 6, "w_init": 4, "k": 1, "guesses": "copy", "trim": True,
                     "seed_branch": 12, "copy_run": True, "early_stop": True})]
)


def _bundled():
    if not (BUNDLED_DIR / "config.json").exists():
        pytest.skip("bundled model not built yet")
    return dasspec.load_model(device="cpu", dtype="float32")


def test_bundled_model_every_policy_matches_ar() -> None:
    """Each case decodes the 20 prompts together (the batched engine), every one equal to its batch-1 AR decode;
    zero and seeded-random initial states alternate (each request has its own)."""
    model = _bundled()
    prompts = [model.tokenizer.encode(t) for t in _bundled_prompts(20)]
    assert len(prompts) == 20
    options = [dict(prompt=ids, max_new_tokens=10, init_scale=float(i % 2), seed=i) for i, ids in enumerate(prompts)]
    refs = [dasspec.generate(model, o["prompt"], "ar", num_steps=8, **{k: v for k, v in o.items() if k != "prompt"})
            for o in options]
    for method, knobs in BUNDLED_CASES:
        outs = decode_together(model, options, method, knobs, num_steps=8)
        for i, (out, ref) in enumerate(zip(outs, refs)):
            assert out.tokens == ref.tokens, (i, method, knobs)


def test_bundled_model_default_decoders_match_full_depth_ar() -> None:
    """The shipped configuration: R = 32 and each decoder's defaults for this model."""
    model = _bundled()
    prompts = [model.tokenizer.encode(t) for t in _bundled_prompts(20)]
    options = [dict(prompt=ids, max_new_tokens=12, init_scale=float(i % 2), seed=i) for i, ids in enumerate(prompts)]
    refs = [dasspec.generate(model, o["prompt"], "ar", **{k: v for k, v in o.items() if k != "prompt"}).tokens
            for o in options]
    accepted = 0
    for method in ("self-spec", "mature-spec", "das-wave"):
        for i, (out, ref) in enumerate(zip(decode_together(model, options, method), refs)):
            assert out.tokens == ref, (i, method)
            accepted += sum(out.stats.accepted)
        out = dasspec.generate(model, prompts[0], method, max_new_tokens=12, init_scale=0.0, seed=0)   # alone
        assert out.tokens == refs[0], method
    assert accepted > 0


def _wave_request(model, ids, **knobs):
    """A prefilled request and the validated DAS-Wave knobs for calling ``wave.refine`` directly."""
    from dasspec.methods.wave import WaveKnobs
    from dasspec.testing import Stepper

    kn = WaveKnobs(**knobs).validate(model.R)
    dec = Stepper(model, ids, 40, width=kn.w + 1)
    dec.prefill()
    dec.back(kn.w + 1)
    return dec.ctx, kn


@torch.inference_mode()
def _refine(req, kn, incremental=True, guesses=None):
    from dasspec.methods.wave import WaveDrafter, refine

    session = WaveDrafter(kn).start(req)
    if not incremental:
        session.inj = None
    return refine([session], kn, [guesses], [{}])[0].clone()


def test_wave_incremental_prelude_proposes_what_full_recompute_proposes() -> None:
    """The CPU shortcut (prelude recomputed from the first changed guess) is an optimisation only: proposals
    equal those of recomputing the whole window's prelude every round, with and without trim and early stop."""
    model = _bundled()
    changed_late = 0
    for i, text in enumerate(_bundled_prompts(8)):
        ids = model.tokenizer.encode(text)
        cut = i % 2 == 1                               # odd prompts: trim and early stop on
        props = []
        for incremental in (True, False):
            req, kn = _wave_request(model, ids, gamma=19, rounds=12, w_init=8, k=1, trim=cut, early_stop=cut)
            props.append(_refine(req, kn, incremental))
        assert torch.equal(props[0], props[1]), i
        changed_late += int((props[0] != props[0][0]).any())
    assert changed_late > 0, "every proposal repeated the anchor: the prelude shortcut went untested"


@pytest.mark.parametrize("knobs", [{"k": 2}, {"policy": "aligned", "k": 3}, {"policy": "deep-v", "k": 2}])
def test_wave_rounds_in_one_call_propose_what_their_core_steps_do(knobs, monkeypatch) -> None:
    """A round's k updates that each store where they read, at one depth (aligned reads, Deep K/V), run as the
    target's steps at those depths (``Batch.recur``, one call): the proposals and carried states equal those of one
    ``core_step`` per update at the policy's reads, and an update reading K and V at different depths (Deep V) keeps
    its core steps (fails when the one call takes another depth than the policy's, or takes Deep V's updates)."""
    from dasspec.methods import wave
    from dasspec.model import decode_kernel

    model = _bundled()
    props, one_calls = [], []
    for path in ("one call", "core steps"):
        with monkeypatch.context() as mp:
            if path == "core steps":          # the rounds as before: one core_step per update
                mp.setattr(wave, "aligned_depths", lambda step_reads: None)
            mp.setattr(decode_kernel, "recur_rows", lambda *a, _f=decode_kernel.recur_rows, **k:
                       one_calls.append((path, a[1])) or _f(*a, **k))
            got = []
            for text in ("def add(a, b):\n    return", "Natalia sold clips to 48 of her friends in April,"):
                req, kn = _wave_request(model, model.tokenizer.encode(text), gamma=8, rounds=4, w_init=4, **knobs)
                session = wave.WaveDrafter(kn).start(req)
                with torch.inference_mode():
                    got += [wave.refine([session], kn, [None], [{}])[0].clone(), session.H.clone()]  # proposals, states
            props.append(got)
    assert all(torch.equal(a, b) for a, b in zip(*props))
    rounds = [c for c in one_calls if c[0] == "one call" and c[1] == knobs["k"]]     # (prefills run R steps)
    assert bool(rounds) == (knobs.get("policy") != "deep-v"), one_calls


def test_wave_lookup_guesses_seed_the_first_round() -> None:
    """guesses="lookup" / "copy": round 0 refines the text that followed an earlier occurrence of the suffix
    (earliest / latest, ``find_draft`` / ``find_copy``), not copies of the anchor."""
    from dasspec.methods.pld import find_copy, find_draft

    model = random_model("huginn", seed=3, mean_recurrence=6, n_prelude=1, n_core=2, n_coda=1)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    # Every token occurs twice, whatever the anchor is: the earliest and the latest occurrence differ.
    prompt = torch.randperm(V - 2, generator=g).add(2).tolist() + torch.randperm(V - 2, generator=g).add(2).tolist()
    seen = []
    real = model.prelude

    def spy(ids, span, cache=None):
        seen.append(ids[0].tolist())
        return real(ids, span, cache)

    model.prelude = spy
    firsts = {}
    for guesses in ("anchor", "lookup", "copy"):
        seen.clear()
        dasspec.generate(model, prompt, "das-wave", max_new_tokens=20, eos=False, gamma=8, rounds=2, w_init=8, k=1,
                         guesses=guesses)
        first = next(x for x in seen if len(x) == 8)              # round 0 of the first block: the whole window
        anchor = first[0]
        firsts[guesses] = first
        if guesses == "anchor":
            assert first == [anchor] * 8
        else:
            find = find_copy if guesses == "copy" else find_draft
            expected = find(np.array(prompt + [anchor]), 3, 7).tolist()
            assert len(expected) == 7 and first == [anchor] + expected, (guesses, first, expected)
    assert firsts["lookup"] != firsts["copy"]


def test_wave_trim_stops_after_the_first_proposal_the_last_round_changed() -> None:
    """trim=True: the proposals are the untrimmed ones up to and including the first position whose guess the
    last round changed (found here by running one round fewer on a fixed-width window)."""
    model = _bundled()
    trimmed = 0
    for text in _bundled_prompts(10):
        ids = model.tokenizer.encode(text)
        props = {}
        for J, trim in ((3, False), (4, False), (4, True)):
            req, kn = _wave_request(model, ids, gamma=16, rounds=J, w_init=16, k=1, trim=trim)
            props[J, trim] = _refine(req, kn).tolist()
        before, after, got = props[3, False], props[4, False], props[4, True]
        first = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), None)
        assert got == (after if first is None else after[: first + 1]), text
        trimmed += len(got) < len(after)
    assert trimmed > 0, "no window was trimmed: the trim path went untested"


def test_wave_seed_branch_tree_layout() -> None:
    """seed_branch: the verifier gets [anchor, wave chain, seed past the common prefix] as a two-branch tree; a
    seed that adds nothing beyond the chain leaves the plain chain."""
    from dasspec.methods.wave import seed_branch_layout
    from dasspec.testing import Stepper

    model = random_model("huginn", seed=1, mean_recurrence=4, n_prelude=1, n_core=1, n_coda=1)
    stepper = Stepper(model, [2, 3, 4], 30, width=16)
    stepper.prefill()
    n = stepper.n
    dec = stepper.req

    @torch.inference_mode()
    def layout(props, seed, max_len):
        dec.tokens[n + 1: n + 1 + len(props)] = torch.tensor(props)
        return seed_branch_layout(stepper.ctx, torch.tensor(props), np.array(seed), max_len)

    lay = layout([5, 6, 7, 8], [5, 6, 9, 9, 9], 4)              # common prefix 2, seed capped at 4
    assert lay.parents == (-1, 0, 1, 2, 3, 2, 5)
    assert dec.tokens[n + 1: n + 7].tolist() == [5, 6, 7, 8, 9, 9]
    lay = layout([5, 6], [5, 6, 7], 8)                          # the chain is a prefix of the seed: one chain
    assert lay.parents == (-1, 0, 1, 2) and lay.is_chain
    assert dec.tokens[n + 1: n + 4].tolist() == [5, 6, 7]
    assert layout([5, 6, 7], [5, 6], 8) is None                 # the seed is a prefix of the chain
    lay = layout([5, 6, 7], [9] * 10, 8)                        # chain and seed part at once: a short probe
    assert lay.parents == (-1, 0, 1, 2, 0, 4, 5, 6)             # SEED_PROBE = 4 seed tokens, not 8
    lay = layout([5, 6, 7], [5, 6] + [9] * 10, 8)               # two shared tokens: the whole branch
    assert len(lay.parents) == 1 + 3 + 6
    assert layout([5, 6, 7], [9, 9], 0) is None                 # capped to nothing


def test_wave_seed_branch_and_copy_run_on_the_bundled_model() -> None:
    """seed_branch: on repetitive output some blocks accept a path through the seed branch (not the wave's
    chain).  copy_run: a block runs no rounds exactly when the previous block committed the whole seed it tested
    (the seed branch's L tokens after rounds, the whole seed after none); without it every block runs rounds.
    Tokens stay AR's.  Read off the per-block trace."""
    from dasspec.methods.wave import COPY_RUN_GROWTH

    model = _bundled()
    L = 8
    skipped = seed_paths = 0
    for text in _bundled_prompts(6):
        ids = model.tokenizer.encode(text)
        ref = dasspec.generate(model, ids, "ar", max_new_tokens=48)
        for copy_run in (False, True):
            out = dasspec.generate(model, ids, "das-wave", max_new_tokens=48, gamma=16, w_init=16, rounds=3,
                                   guesses="copy", trim=True, seed_branch=L, copy_run=copy_run, trace=True)
            assert out.tokens == ref.tokens, (copy_run, text)
            blocks = [(d.notes, v) for d, v in out.trace]
            if not copy_run:
                assert all(notes["kind"] != "copy-run" and notes["rounds"] >= 1 for notes, _ in blocks)
                seed_paths += sum(notes["kind"] == "seed-branch" and v.path != list(range(len(v.path)))
                                  for notes, v in blocks)
                continue
            assert blocks[0][0]["kind"] != "copy-run"
            for (prev, verdict), (notes, _) in zip(blocks, blocks[1:]):
                seed = prev["seed"].tolist()
                tested = seed if prev["kind"] == "copy-run" else seed[:L]
                committed = verdict.tokens[: verdict.kept]
                whole = bool(tested) and committed[: len(tested)] == tested
                assert (notes["kind"] == "copy-run") == (whole and len(notes["seed"]) > 0), (text, prev, notes)
                skipped += notes["kind"] == "copy-run"
                assert notes["asked"] == (COPY_RUN_GROWTH * 16 if whole else 16)   # a copy run asks for more
    assert seed_paths > 0, "no block accepted a path through the seed branch: the tree path went untested"
    assert skipped > 0, "no block skipped its rounds: the copy-run path went untested"


def test_wave_early_stop_ends_the_rounds_at_the_first_unchanged_round(monkeypatch) -> None:
    """early_stop: a block's rounds end right after the first round whose readout changed no guess (that round's
    whole window is proposed); without it every block runs J rounds.  A window narrower than seed_branch still
    draws a seed of seed_branch tokens.  Tokens stay AR's."""
    from dasspec.methods import resolve_knobs
    from dasspec.methods.wave import WaveDrafter

    model = _bundled()
    J, gamma, L = 6, 4, 12
    rounds: list[list[bool]] = []           # per block: did each round change a guess?
    live = {}                                # the request whose rounds are running
    real_readout = model.readout

    def readout(h, span, cache=None, rows=None):
        out = real_readout(h, span, cache, rows)
        if "req" in live:                    # the guesses in the token scratch are the previous round's
            W, guesses = h.shape[1], live["req"].tokens
            start = span.parts[0].start if hasattr(span, "parts") else span.start     # a batch of one, or a span
            rounds[-1].append(bool((out[0].argmax(-1) != guesses[start + 1: start + W + 1]).any()))
        return out

    class Spy(WaveDrafter):                  # marks the draft phase, where readouts are rounds
        def propose_batch(self, sessions):
            rounds.append([])
            live["req"] = sessions[0].ctx._req           # (a test may look behind the context)
            try:
                return super().propose_batch(sessions)
            finally:
                live.clear()

    monkeypatch.setattr(model, "readout", readout)
    stopped = 0
    for text in _bundled_prompts(4):
        ids = model.tokenizer.encode(text)
        ref = dasspec.generate(model, ids, "ar", max_new_tokens=32)
        for early in (False, True):
            rounds.clear()
            knobs = dict(gamma=gamma, w_init=gamma, rounds=J, guesses="copy", trim=True, seed_branch=L,
                         copy_run=False, early_stop=early)
            drafter = Spy(resolve_knobs(model, "das-wave", knobs))
            out = dasspec.generate(model, ids, drafter=drafter, max_new_tokens=32, trace=True)
            assert out.tokens == ref.tokens, (early, text)
            assert {d.notes["asked"] for d, _ in out.trace} == {L}   # the seed is seed_branch long, not gamma
            assert out.stats.draft_passes == sum(len(r) for r in rounds)
            for r in rounds:
                first = r.index(False) + 1 if early and False in r else J
                assert len(r) == first, (early, r)           # stop at the first unchanged round, never before
                stopped += len(r) < J
    assert stopped > 0, "no block stopped its rounds early: the early_stop path went untested"
