"""Nanbeige4.2 (T = 2 loops over a non-square GQA Llama stack) decoded by every method and ``auto``: each emits the
model's own AR decode token for token - greedy and sampled (same seed), alone, batched through ``generate_batch``,
with prompts sharing a prefix in a pool small enough to preempt - and AR is the model's own decode (the uncached
forward, token by token).  Also: a loop-1 draft is the 1-loop model's greedy continuation (drafts start from the
embedding, as the target does), ChatML replies stop at <|im_end|>, and the chat template's thinking switch."""

from __future__ import annotations

import pytest
import torch

import dasspec
from dasspec.engine.api.engine import Engine
from reference_impl import write_nanbeige_checkpoint, write_tokenizer

SAMPLED = {"do_sample": True, "temperature": 0.8, "seed": 5}
CAP = 8
METHODS = [("self-spec", {}), ("mature-spec", {})] + [
    ("mature-spec", {"policy": p}) for p in ("aligned", "deep-v", "deep-k")] + [
    ("das-wave", {}),
    ("das-wave", {"carry": False, "policy": "deep-kv", "guesses": "lookup", "trim": False, "seed_branch": 4}),
    ("pld", {}), ("lookahead", {"window": 3, "ngram": 3, "guess_set": 3}), ("token-recycling", {}), ("sam", {}),
    ("auto", {"explore": 1.0})]


@pytest.fixture(scope="module")
def nanbeige(tmp_path_factory):
    folder = write_nanbeige_checkpoint(tmp_path_factory.mktemp("nanbeige") / "m", vocab_size=320, seed=3,
                                       n_shards=2, tokenizer=write_tokenizer("nanbeige"))
    return dasspec.load_model(folder, device="cpu", dtype=torch.float32)


def prompts(vocab: int) -> list[list[int]]:
    """A repetitive prompt (the lookup drafters find copies in it), a random one and a short one."""
    g = torch.Generator().manual_seed(11)
    base = torch.randint(3, vocab, (5,), generator=g).tolist()
    return [base * 4, torch.randint(3, vocab, (23,), generator=g).tolist(), base[:3]]


def own_decode(model, prompt: list[int], n: int, steps: int | None = None) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq]), num_steps=steps)[0, -1].argmax()))
    return seq[len(prompt):]


def test_the_checkpoint_is_the_published_layout(nanbeige):
    c = nanbeige.config
    assert (c.family, c.mean_recurrence, c.n_prelude, c.n_coda) == ("nanbeige", 2, 0, 0)
    assert c.n_heads * c.head_dim != c.n_embd and c.n_kv_heads < c.n_heads     # non-square q / o, GQA


def test_ar_is_the_models_own_decode(nanbeige):
    for p in prompts(nanbeige.config.vocab_size)[:2]:
        assert dasspec.generate(nanbeige, p, "ar", max_new_tokens=6, eos=False).tokens == own_decode(nanbeige, p, 6)


def test_every_method_equals_ar_greedy_and_sampled_alone_and_batched(nanbeige):
    ps = prompts(nanbeige.config.vocab_size)
    accepted = {}
    for sampling in ({}, SAMPLED):
        opts = dict(max_new_tokens=CAP, eos=False, **sampling)
        ref = [dasspec.generate(nanbeige, p, "ar", **opts).tokens for p in ps]
        for method, knobs in METHODS:
            name = f"{method} {knobs} {sampling or 'greedy'}"
            alone = dasspec.generate(nanbeige, ps[0], method, **opts, **knobs)
            assert alone.tokens == ref[0], name
            drafter = dasspec.build_drafter(nanbeige, method, knobs, sampled=bool(sampling))
            batched = dasspec.generate_batch(nanbeige, ps, max_batch=3, drafter=drafter, **opts)
            assert [b.tokens for b in batched] == ref, name
            accepted[name] = sum(alone.stats.accepted) + sum(sum(b.stats.accepted) for b in batched)
    greedy = [n for n in accepted if n.endswith("greedy")]
    assert sum(accepted[n] > 0 for n in greedy) >= len(greedy) // 2, f"too little is accepted to test: {accepted}"


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_shared_prefixes_and_preemption_keep_every_answer(nanbeige, sampled):
    """Prompts sharing a 20-token prefix in a pool far too small for all of them at once: blocks are shared and
    requests swapped out and back in, and each answer is still its own batch-1 AR decode."""
    g = torch.Generator().manual_seed(4)
    vocab = nanbeige.config.vocab_size
    shared = torch.randint(3, vocab, (20,), generator=g).tolist()
    ps = [shared + torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in (3, 9, 5, 12, 7, 4)]
    kw = dict(max_new_tokens=24, eos=False, **({"do_sample": True, "temperature": 0.8} if sampled else {}))
    refs = [dasspec.generate(nanbeige, p, "ar", seed=i, **kw).tokens for i, p in enumerate(ps)]
    preempted = shared_rows = 0
    for method, knobs in (("ar", {}), ("self-spec", {}), ("das-wave", {}), ("pld", {}), ("auto", {})):
        engine = Engine(nanbeige, method, knobs, max_batch=6, block_size=4, kv_budget=96, max_step_tokens=16)
        ids = [engine.add(p, seed=i, **kw) for i, p in enumerate(ps)]
        while engine.has_work:
            engine.step()
        assert [engine.result(i).tokens for i in ids] == refs, method
        preempted += engine.scheduler.preemptions
        shared_rows += engine.scheduler.shared_rows
    assert preempted > 0 and shared_rows > 0, "the case is trivial: nothing was preempted or shared"


def test_prefix_cache_is_lossless(nanbeige):
    ps = prompts(nanbeige.config.vocab_size)
    prefix = ps[1][:20]                    # one full block of 16 rows to share
    pc = dasspec.PrefixCache(nanbeige, prefix)
    for method in ("ar", "das-wave", "mature-spec"):
        for tail in (ps[0], ps[2]):
            p = prefix + tail
            ref = dasspec.generate(nanbeige, p, "ar", max_new_tokens=CAP, eos=False).tokens
            assert dasspec.generate(nanbeige, p, method, max_new_tokens=CAP, eos=False, prefix_cache=pc).tokens == ref


def test_a_loop_one_draft_is_the_one_loop_models_continuation(nanbeige):
    """Self-spec's loop-1 drafts are the greedy continuation of the model read after one loop - exactly so only if
    drafts start from the token embedding as the target does (``Family.start_state``)."""
    p = prompts(nanbeige.config.vocab_size)[1]
    out = dasspec.generate(nanbeige, p, "self-spec", max_new_tokens=CAP, eos=False, trace=True, draft_depth=1,
                           block=3)
    seq = list(p) + [out.tokens[0]]
    for draft, verdict in out.trace:
        assert list(draft.tokens) == own_decode(nanbeige, seq, len(draft.tokens), steps=1)
        seq += verdict.tokens[: verdict.kept]


def test_chatml_replies_stop_at_im_end_and_the_thinking_switch(nanbeige, tmp_path):
    tok = nanbeige.tokenizer
    im_end = tok.token_to_id("<|im_end|>")
    assert im_end in tok.eos_ids
    chat = [{"role": "user", "content": "Hi"}]
    thinking = tok.apply_chat_template(chat)
    plain = tok.apply_chat_template(chat, enable_thinking=False)
    assert thinking.endswith("<|im_start|>assistant\n<think>\n")
    assert plain.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = tok.encode(plain, add_special_tokens=False)
    first = dasspec.generate(nanbeige, ids, max_new_tokens=1, eos=False).tokens[0]
    head = nanbeige.lm_head.weight.contiguous().clone()
    head[[first, im_end]] = head[[im_end, first]]          # now the reply's first token is <|im_end|>
    replying = dasspec.load_model(write_nanbeige_checkpoint(tmp_path / "r", vocab_size=320, seed=3,
                                                            tokenizer=write_tokenizer("nanbeige"),
                                                            edit={"lm_head.weight": head}), device="cpu")
    out = dasspec.generate(replying, ids, max_new_tokens=4)
    assert (out.tokens, out.stop_reason) == ([im_end], "eos")
