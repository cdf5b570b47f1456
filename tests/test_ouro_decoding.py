"""Ouro decoded by every method: each emits Ouro's own AR decode token for token - greedy and sampled (same seed),
for the default target (the last step) and both early-exit targets, at batch 1 and through ``generate_batch`` - and
AR is Ouro's own decode (the uncached forward, token by token).  Also pinned: drafts start where the target starts
(the family's ``start_state``), requests with different exit rules share a pass, and ChatML turns stop at
``<|im_end|>`` whatever the tokenizer files name as EOS."""

from __future__ import annotations

import pytest
import torch

import dasspec
from dasspec.engine.api.engine import Engine
from reference_impl import write_ouro_checkpoint, write_tokenizer

TARGETS = [{}, {"exit_threshold": 0.6}, {"exit_at_step": 1}]
TARGET_IDS = ["last-step", "threshold", "at-step"]
SAMPLED = {"do_sample": True, "temperature": 0.8, "seed": 5}
CAP = 8
# Every method: the family's defaults (DAS-Wave's: every extension on), Mature-Spec under each read policy, DAS-Wave
# also with deep reads, lookup seeds and no carried states, and the model-agnostic baselines.
METHODS = [("self-spec", {}), ("mature-spec", {})] + [
    ("mature-spec", {"policy": p}) for p in ("aligned", "deep-v", "deep-k")] + [
    ("das-wave", {}),
    ("das-wave", {"carry": False, "policy": "deep-kv", "guesses": "lookup", "trim": False, "seed_branch": 4}),
    ("pld", {}), ("lookahead", {"window": 3, "ngram": 3, "guess_set": 3}), ("token-recycling", {}), ("sam", {})]


@pytest.fixture(scope="module")
def ouro(tmp_path_factory):
    folder = write_ouro_checkpoint(tmp_path_factory.mktemp("ouro") / "m", vocab_size=320, seed=3,
                                   tokenizer=write_tokenizer("ouro"))
    return dasspec.load_model(folder, device="cpu", dtype=torch.float32)


def prompts(vocab: int) -> list[list[int]]:
    """A repetitive prompt (the lookup drafters find copies in it), a random one and a short one."""
    g = torch.Generator().manual_seed(11)
    base = torch.randint(3, vocab, (5,), generator=g).tolist()
    return [base * 4, torch.randint(3, vocab, (23,), generator=g).tolist(), base[:3]]


def own_decode(model, prompt: list[int], target: dict, n: int) -> list[int]:
    """Ouro's own greedy decode: the uncached forward at the target, one token at a time."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq]), **target)[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("target", TARGETS, ids=TARGET_IDS)
def test_ar_is_ouros_own_decode(ouro, target):
    """AR (prefill, then one cached step per token) emits the uncached forward's argmax at every position - the
    first token included - for each target; the targets differ, so the check can tell them apart."""
    ps = prompts(ouro.config.vocab_size)
    for p in ps[:2]:
        got = dasspec.generate(ouro, p, "ar", max_new_tokens=6, eos=False, **target).tokens
        assert got == own_decode(ouro, p, target, 6), (target, p)
    firsts = {str(t): dasspec.generate(ouro, ps[1], "ar", max_new_tokens=1, eos=False, **t).tokens[0]
              for t in TARGETS}
    assert len(set(firsts.values())) > 1, f"the targets agree on this prompt, so nothing tells them apart: {firsts}"


@pytest.mark.parametrize("target", TARGETS, ids=TARGET_IDS)
def test_every_method_equals_ar_greedy_and_sampled_alone_and_batched(ouro, target):
    ps = prompts(ouro.config.vocab_size)
    accepted = {}
    for sampling in ({}, SAMPLED):
        opts = dict(max_new_tokens=CAP, eos=False, **target, **sampling)
        ref = [dasspec.generate(ouro, p, "ar", **opts).tokens for p in ps]
        for method, knobs in METHODS:
            name = f"{method} {knobs} {sampling or 'greedy'}"
            alone = dasspec.generate(ouro, ps[0], method, **opts, **knobs)
            assert alone.tokens == ref[0], name
            # (a kept drafter: generate_batch's own ``policy`` argument is the engine's SpeculationPolicy)
            drafter = dasspec.build_drafter(ouro, method, knobs, sampled=bool(sampling))
            batched = dasspec.generate_batch(ouro, ps, max_batch=3, drafter=drafter, **opts)
            assert [b.tokens for b in batched] == ref, name
            accepted[name] = sum(alone.stats.accepted) + sum(sum(b.stats.accepted) for b in batched)
    greedy = [n for n in accepted if n.endswith("greedy")]
    assert sum(accepted[n] > 0 for n in greedy) >= len(greedy) // 2, f"too little is accepted to test: {accepted}"


def test_requests_with_different_exit_rules_share_a_pass(ouro):
    """One engine, one verification pass per step over requests of every target: each gets its own AR decode."""
    ps = prompts(ouro.config.vocab_size)
    for method, knobs in [("ar", {}), ("self-spec", {}), ("das-wave", {})]:
        engine = Engine(ouro, method, knobs, max_batch=3)
        rids = [engine.add(p, max_new_tokens=CAP, eos=False, **t) for p, t in zip(ps, TARGETS)]
        while engine.has_work:
            engine.step()
        for rid, p, t in zip(rids, ps, TARGETS):
            assert engine.result(rid).tokens == dasspec.generate(ouro, p, "ar", max_new_tokens=CAP, eos=False,
                                                                 **t).tokens, (method, t)


@pytest.mark.parametrize("d", [1, 2, 3])
def test_drafts_start_from_the_families_initial_state(ouro, d):
    """A depth-d draft with aligned reads is the d-step model's greedy continuation, i.e. the forward's argmax at
    exit_at_step = d - 1 - exactly so only if the draft starts where the target does (Ouro: the token embedding,
    ``Family.start_state``), not from a zero or random state: self-spec's block, and a one-round, one-position
    DAS-Wave window of k = d updates."""
    p = prompts(ouro.config.vocab_size)[1]
    wave = dict(gamma=1, w_init=1, rounds=1, k=d, carry=False, guesses="anchor", trim=False, early_stop=False)
    for method, knobs in (("self-spec", dict(draft_depth=d, block=3)), ("das-wave", wave)):
        out = dasspec.generate(ouro, p, method, max_new_tokens=CAP, eos=False, trace=True, **knobs)
        seq = list(p) + [out.tokens[0]]
        for draft, verdict in out.trace:
            proposed = list(draft.tokens)
            assert proposed == own_decode(ouro, seq, {"exit_at_step": d - 1}, len(proposed)), (method, d)
            seq += verdict.tokens[: verdict.kept]


def test_chatml_turns_stop_at_im_end(tmp_path):
    """Ouro's base files name <|endoftext|> as EOS; a reply (ChatML) ends with <|im_end|>, so the family adds it as
    a stop: a model whose first reply token is <|im_end|> stops there.  Other families' stops are unchanged."""
    folder = write_ouro_checkpoint(tmp_path / "m", vocab_size=320, seed=3, tokenizer=write_tokenizer("ouro"))
    model = dasspec.load_model(folder, device="cpu")
    tok = model.tokenizer
    end, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    assert (end, im_end) == (0, 2) and tok.eos_ids == [end, im_end]
    assert dasspec.load_tokenizer(folder).eos_ids == [end, im_end]
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]), add_special_tokens=False)
    first = dasspec.generate(model, ids, max_new_tokens=1, eos=False).tokens[0]
    assert first not in (end, im_end)
    head = model.lm_head.weight.contiguous().clone()
    head[[first, im_end]] = head[[im_end, first]]          # now the reply's first token is <|im_end|>
    replying = dasspec.load_model(write_ouro_checkpoint(tmp_path / "r", vocab_size=320, seed=3,
                                                        tokenizer=write_tokenizer("ouro"),
                                                        edit={"lm_head.weight": head}), device="cpu")
    assert dasspec.generate(replying, ids, max_new_tokens=4, eos=False).tokens[0] == im_end
    out = dasspec.generate(replying, ids, max_new_tokens=4)
    assert (out.tokens, out.stop_reason) == ([im_end], "eos")

    other = tmp_path / "olmo"                 # a huginn_raven tokenizer that also has ChatML tokens
    other.mkdir()
    for name, text in write_tokenizer("raven-olmo", extra=("<|im_start|>", "<|im_end|>")).items():
        (other / name).write_text(text)
    (other / "config.json").write_text('{"model_type": "huginn_raven"}')
    olmo = dasspec.load_tokenizer(other)
    assert olmo.eos_ids == [olmo.token_to_id("<|endoftext|>")]
