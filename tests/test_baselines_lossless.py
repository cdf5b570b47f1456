"""The four model-agnostic baselines (PLD, Lookahead, Token Recycling, SAM-Decoding) commit exactly full-depth
AR's greedy tokens in float32 - with zero and with seeded random initial states, with stop tokens inside accepted
chunks, on random checkpoints of every family and on the bundled model - and their drafts do get accepted (so the
tree / chain acceptance and compaction paths are exercised, not just AR fallbacks)."""

from __future__ import annotations

import gzip
import itertools
import json
import os
from pathlib import Path

import pytest
import torch

import dasspec
from dasspec.model.checkpoint import BUNDLED_DIR
from dasspec.testing import random_model
from batched import decode_together

METHODS = ["pld", "lookahead", "token-recycling", "sam"]

# Non-default knobs (small trees / windows, pool seeding, custom tree): fewer prompts each.
VARIANTS = [
    ("pld", {"max_ngram": 1, "num_pred": 3}),
    ("lookahead", {"window": 3, "ngram": 4, "guess_set": 2, "pool_from_prompt": True}),
    ("lookahead", {"window": 1, "ngram": 2, "guess_set": 1}),
    ("token-recycling", {"topk": 2, "tree": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]}),
    ("sam", {"alpha": 1.5, "n_predicts": 6, "len_threshold": 2}),
]


def _prompts(vocab: int, count: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        L = int(torch.randint(4, 30, (1,), generator=g))
        if i % 2:   # low-entropy prompts (repeats) make retrieval drafts partly right
            base = torch.randint(2, vocab, (max(2, L // 3),), generator=g)
            out.append(base.repeat(4)[:L].tolist())
        else:
            out.append(torch.randint(2, vocab, (L,), generator=g).tolist())
    return out


def _check(model, prompts, cases, max_new: int) -> dict[str, int]:
    """Every case on every prompt equals AR (init_scale alternating 0 / 1 by prompt, per-prompt seeds, a stop
    token inside the generation on every 4th prompt); returns accepted draft tokens per method.  Each case keeps
    one drafter across the prompts (Token Recycling's table stays hot, as in the benchmark): the prompts of a case
    are decoded one at a time, then again all together (the batched engine; the table shared by all)."""
    accepted = {m: 0 for m, _ in cases}
    drafters = [dasspec.build_drafter(model, method, knobs) for method, knobs in cases]
    options, refs = [], []
    for i, prompt in enumerate(prompts):
        init = float(i % 2)
        ref = dasspec.generate(model, prompt, "ar", max_new_tokens=max_new, init_scale=init, seed=i, eos=False)
        assert len(ref.tokens) == max_new
        stop = None
        if i % 4 == 3:   # a stop token that first appears mid-generation (inside some accepted chunk)
            j = next((j for j in range(max_new // 2, max_new) if ref.tokens[j] not in ref.tokens[:j]), None)
            if j is not None:
                stop = [ref.tokens[j]]
                ref = dasspec.generate(model, prompt, "ar", max_new_tokens=max_new, init_scale=init, seed=i,
                                       eos=False, stop=stop)
                assert len(ref.tokens) == j + 1 and ref.stop_reason == "eos"
        options.append(dict(prompt=prompt, max_new_tokens=max_new, init_scale=init, seed=i, eos=False, stop=stop))
        refs.append(ref)
    for (method, knobs), drafter in zip(cases, drafters):
        for i, (o, ref) in enumerate(zip(options, refs)):
            if i < 4:                                  # the plain batch-1 path, the table warming up
                out = dasspec.generate(model, o["prompt"], drafter=drafter,
                                       **{k: v for k, v in o.items() if k != "prompt"})
                assert out.tokens == ref.tokens, (model.config.family, i, method, knobs)
                assert out.stop_reason == ref.stop_reason
                accepted[method] += sum(out.stats.accepted)
        for i, (out, ref) in enumerate(zip(decode_together(model, options, drafter=drafter), refs)):
            assert out.tokens == ref.tokens, (model.config.family, i, method, knobs)
            assert out.stop_reason == ref.stop_reason
            accepted[method] += sum(out.stats.accepted)
    return accepted


@pytest.mark.parametrize("family", ["huginn", "raven-llama", "raven-olmo", "ouro", "iquest-loop", "nanbeige"])
def test_random_checkpoints_match_ar(family: str) -> None:
    """20 prompts per method and family with the default knobs (Token Recycling's table stays hot across them)."""
    model = random_model(family, seed=4)
    accepted = _check(model, _prompts(model.config.vocab_size, 20, seed=7), [(m, {}) for m in METHODS], 12)
    assert all(accepted.values()), f"a drafter never had a draft accepted: {accepted}"


@pytest.mark.parametrize("family", ["huginn", "raven-llama", "raven-olmo"])
def test_knob_variants_match_ar(family: str) -> None:
    model = random_model(family, seed=5)
    _check(model, _prompts(model.config.vocab_size, 4, seed=8), VARIANTS, 12)


def test_sam_static_corpus_trees_are_lossless(tmp_path: Path) -> None:
    """Static-corpus trees (verify_tree with branching) on a corpus of the model's own continuations."""
    model = random_model("raven-llama", seed=4)
    prompts = _prompts(model.config.vocab_size, 12, seed=3)
    corpus = [p + dasspec.generate(model, p, "ar", max_new_tokens=24, eos=False).tokens for p in prompts[6:]]
    path = tmp_path / "corpus.json"
    path.write_text(json.dumps(corpus))
    proposed = accepted = 0
    for i, prompt in enumerate(prompts):
        ref = dasspec.generate(model, prompt, "ar", max_new_tokens=20, init_scale=float(i % 2), eos=False)
        out = dasspec.generate(model, prompt, "sam", max_new_tokens=20, init_scale=float(i % 2), eos=False,
                               static_corpus=str(path), len_bias=0, n_predicts=12)
        assert out.tokens == ref.tokens, i
        proposed += sum(out.stats.proposed)
        accepted += sum(out.stats.accepted)
    assert proposed and accepted


def test_context_end_is_handled() -> None:
    """Near the model's context end trees are truncated / Lookahead falls back to AR - still lossless."""
    # the context (96) holds the default drafts (Lookahead 56 positions, Token Recycling's tree 81): a context
    # smaller than a method's drafts is refused by build_drafter; the request ends at the context's last position
    model = random_model("raven-olmo", seed=4, block_size=96)
    prompt = ([3, 4, 5, 6, 3, 4, 5, 6, 3, 4] * 8)[:78]
    ref = dasspec.generate(model, prompt, "ar", max_new_tokens=18, eos=False)
    for method, knobs in [("lookahead", {}), ("token-recycling", {}), ("pld", {}), ("sam", {})]:
        out = dasspec.generate(model, prompt, method, max_new_tokens=18, eos=False, **knobs)
        assert out.tokens == ref.tokens, method


# --- the bundled model ---------------------------------------------------------------------------------------

def _data_dir() -> Path:
    return Path(os.environ.get("DASSPEC_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


def _bundled_prompts(count: int) -> list[str]:
    """Realistic prompts: GSM8K test questions and HumanEval prompts (alternating)."""
    data = _data_dir()
    gsm, code = [], []
    path = data / "gsm8k" / "test.jsonl"
    if path.exists():
        with path.open() as f:
            gsm = ["Question: " + json.loads(line)["question"] + "\nAnswer:" for line in itertools.islice(f, count)]
    path = data / "humaneval" / "HumanEval.jsonl.gz"
    if path.exists():
        with gzip.open(path, "rt") as f:
            code = [json.loads(line)["prompt"] for line in itertools.islice(f, count)]
    mixed = [p for pair in itertools.zip_longest(gsm, code) for p in pair if p]
    return mixed[:count]


BUNDLED_CASES = [("pld", {}), ("lookahead", {}), ("token-recycling", {}), ("sam", {})]


@pytest.mark.skipif(not (BUNDLED_DIR / "config.json").exists(), reason="bundled model not built yet")
def test_bundled_model_matches_ar() -> None:
    model = dasspec.load_model(device="cpu", dtype="float32")
    prompts = _bundled_prompts(20)
    if len(prompts) < 20:
        pytest.skip(f"evaluation data not found under {_data_dir()} (set DASSPEC_DATA)")
    accepted = {m: 0 for m, _ in BUNDLED_CASES}
    # the prompt's end (where generation starts) keeps CPU time low; zero and seeded-random initial states alternate
    options = [dict(prompt=model.tokenizer.encode(text)[-64:], max_new_tokens=10, init_scale=float(i % 2), seed=i)
               for i, text in enumerate(prompts)]
    refs = [dasspec.generate(model, o["prompt"], "ar", **{k: v for k, v in o.items() if k != "prompt"}).tokens
            for o in options]
    for method, knobs in BUNDLED_CASES:                # all 20 together, one drafter (Token Recycling's table)
        for i, (out, ref) in enumerate(zip(decode_together(model, options, method, knobs), refs)):
            assert out.tokens == ref, (i, method, knobs)
            accepted[method] += sum(out.stats.accepted)
    assert all(accepted.values()), f"a drafter never had a draft accepted: {accepted}"
