"""Sampling stays lossless: for a given seed every method emits exactly the tokens AR sampling emits (Gumbel-max
with noise keyed by absolute position, ``dasspec.engine.base.sampling``); the sampled tokens follow
softmax(warp(logits)); Hugging Face's conventions; bad options are refused before anything runs."""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch

import dasspec
from dasspec.engine.base.sampling import Sampling
from dasspec.model.checkpoint import BUNDLED_DIR
from dasspec.testing import random_model
from batched import decode_together

POLICIES = ["aligned", "deep-v", "deep-k", "deep-kv"]
SETTINGS = [dict(temperature=0.7), dict(temperature=1.0), dict(temperature=1.5), dict(temperature=0.7, top_p=0.9),
            dict(temperature=1.0, top_k=5), dict(temperature=1.5, min_p=0.05),
            dict(temperature=1.0, top_k=20, top_p=0.95, min_p=0.02)]
# Every drafter, every read policy, carry on and off, the DAS-Wave extensions (R = 6 random checkpoints).
CASES = (
    [("self-spec", {"draft_depth": 2, "block": 4})]
    + [("mature-spec", {"draft_depth": 3, "block": 4, "policy": p}) for p in POLICIES]
    + [("das-wave", {"gamma": 8, "rounds": 4, "w_init": 2, "k": 1 + (i % 2), "policy": p, "carry": c})
       for i, (p, c) in enumerate(itertools.product(POLICIES, (True, False)))]
    + [("das-wave", {"gamma": 6, "rounds": 4, "w_init": 6, "k": 1, "guesses": "copy", "trim": True,
                     "seed_branch": 6, "copy_run": True, "early_stop": True})]
    + [(m, {}) for m in ("pld", "lookahead", "token-recycling", "sam")]
)


def _prompts(vocab: int, count: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        L = int(torch.randint(3, 20, (1,), generator=g))
        base = torch.randint(2, vocab, (max(2, L // 3),), generator=g)
        out.append(base.repeat(4)[:L].tolist() if i % 2 else torch.randint(2, vocab, (L,), generator=g).tolist())
    return out


@pytest.mark.parametrize("family", ["huginn", "raven-llama", "raven-olmo"])
def test_every_method_samples_what_ar_samples(family):
    model = random_model(family, seed=3, mean_recurrence=6, n_prelude=1, n_core=2, n_coda=1)
    prompts = _prompts(model.config.vocab_size, len(SETTINGS), seed=5)
    options = [dict(prompt=p, max_new_tokens=10, eos=False, do_sample=True, seed=100 + i, init_scale=float(i % 2),
                    **setting) for i, (p, setting) in enumerate(zip(prompts, SETTINGS))]
    refs = [dasspec.generate(model, o["prompt"], "ar", **{k: v for k, v in o.items() if k != "prompt"}).tokens
            for o in options]
    assert all(len(r) == 10 for r in refs)
    accepted = 0
    for method, knobs in CASES:            # every setting's request decoded together (each its own sampler)
        for i, (out, ref) in enumerate(zip(decode_together(model, options, method, knobs), refs)):
            assert out.tokens == ref, (family, i, SETTINGS[i], method, knobs)
            accepted += sum(out.stats.accepted)
        for o, ref in list(zip(options, refs))[:2]:                    # and alone
            out = dasspec.generate(model, o["prompt"], method, **{k: v for k, v in o.items() if k != "prompt"},
                                   **knobs)
            assert out.tokens == ref, (family, method, knobs)
    assert accepted > 0


def _bundled():
    if not (BUNDLED_DIR / "config.json").exists():
        pytest.skip("bundled model not built yet")
    return dasspec.load_model(device="cpu", dtype="float32")


BUNDLED_TEXTS = ["def fibonacci(n):", "Question: Tom has 3 apples and buys 4 more. How many apples does he have?\n"
                 "Answer:", "import os\n\ndef list_files(path):", "for i in range(10):"]


def test_bundled_model_samples_what_ar_samples():
    """The shipped knobs of every method at R = 32, and the wave's read policies at a shallower target."""
    model = _bundled()
    for i, text in enumerate(BUNDLED_TEXTS):
        ids = model.tokenizer.encode(text)
        setting = SETTINGS[i % 3] | ({"top_p": 0.95} if i % 2 else {})
        kw = dict(max_new_tokens=12, do_sample=True, seed=i, init_scale=float(i % 2), **setting)
        ref = dasspec.generate(model, ids, "ar", **kw).tokens
        for method in dasspec.method_names():
            assert dasspec.generate(model, ids, method, **kw).tokens == ref, (i, method)
        ref8 = dasspec.generate(model, ids, "ar", num_steps=8, **kw).tokens
        for policy in POLICIES:
            out = dasspec.generate(model, ids, "das-wave", num_steps=8, policy=policy, carry=bool(i % 2), **kw)
            assert out.tokens == ref8, (i, policy)


def test_coupled_drafting_keeps_acceptance():
    """Drafters that read the model perturb their shallow logits with the noise of the position they propose for,
    so at T = 1 they agree with the target about as often as greedy drafts do (independent noise would make two
    draws of a broad distribution disagree)."""
    model = _bundled()
    A = {}
    for sample in (False, True):
        runs = [dasspec.generate(model, model.tokenizer.encode(t), "mature-spec", max_new_tokens=32, seed=i,
                                 do_sample=sample, temperature=1.0 if sample else None)
                for i, t in enumerate(BUNDLED_TEXTS)]
        A[sample] = sum(sum(r.stats.accepted) for r in runs) / sum(r.stats.verify_events for r in runs)
    assert A[True] >= 0.6 * A[False], A


# --- the distribution -------------------------------------------------------------------------------------------

def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of ``counts`` against ``probs`` (cells expecting < 5 pooled)."""
    expected = probs * counts.sum()
    small = expected < 5
    if small.any():
        counts = torch.cat((counts[~small], counts[small].sum().view(1)))
        expected = torch.cat((expected[~small], expected[small].sum().view(1)))
    stat = ((counts - expected) ** 2 / expected).sum()
    df = torch.tensor((len(counts) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, stat.double() / 2))


@pytest.mark.parametrize("setting", [dict(temperature=0.7), dict(temperature=1.5, top_k=6),
                                     dict(temperature=1.0, top_p=0.8), dict(temperature=1.2, min_p=0.1),
                                     dict(temperature=0.9, top_k=8, top_p=0.9, min_p=0.05)])
def test_sampled_tokens_follow_the_warped_softmax(setting):
    """Over many positions (independent noise), the sampled token's frequencies match softmax(warp(logits)) with
    the warpers written out here independently (Hugging Face's definitions); no filtered token ever appears."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 16, generator=g) * 2
    s = Sampling(seed=7, **setting)
    n = 40_000
    tokens = s(logits.expand(n, -1), 0)
    z = logits[0] / setting["temperature"]
    keep = torch.ones(16, dtype=torch.bool)
    if "top_k" in setting:
        keep &= z >= z.sort(descending=True).values[setting["top_k"] - 1]
    if "top_p" in setting:
        p = torch.where(keep, z, -torch.inf).softmax(-1)
        order = p.argsort(descending=True)
        cum = p[order].cumsum(0)
        k = int((cum < setting["top_p"]).sum()) + 1                  # the smallest top set reaching top_p
        top = torch.zeros(16, dtype=torch.bool)
        top[order[:k]] = True
        keep &= top
    if "min_p" in setting:
        p = torch.where(keep, z, -torch.inf).softmax(-1)
        keep &= p >= setting["min_p"] * p.max()
    probs = torch.where(keep, z, -torch.inf).softmax(-1).double()
    counts = torch.bincount(tokens, minlength=16).double()
    assert counts[~keep].sum() == 0, "a filtered token was sampled"
    assert _chi_square_p(counts[keep], probs[keep]) > 1e-4


def test_the_first_sampled_token_follows_the_models_distribution():
    """Through generate: AR's first token over many seeds is distributed as softmax(logits / T) of the prompt's
    last position (the seed moves the initial states too, so those are zero here)."""
    model = random_model("huginn", seed=1, mean_recurrence=2, vocab_size=11)
    prompt = [3, 4, 5]
    probs = (model(torch.tensor([prompt]), init_scale=0.0)[0, -1] / 1.3).softmax(-1).double()
    n = 1500
    firsts = [dasspec.generate(model, prompt, max_new_tokens=1, do_sample=True, temperature=1.3, seed=s,
                               init_scale=0.0).tokens[0] for s in range(n)]
    counts = torch.bincount(torch.tensor(firsts), minlength=11).double()
    assert _chi_square_p(counts, probs) > 1e-4


def test_noise_does_not_depend_on_the_width_of_a_call():
    """A position's noise is the same alone and inside a wide block, at any offset."""
    s = Sampling(temperature=1.0, seed=3)
    logits = torch.zeros(40, 50)
    wide = s(logits, 100)
    alone = torch.cat([s(logits[i: i + 1], 100 + i) for i in range(40)])
    scattered = s(logits[[5, 17]], torch.tensor([105, 117]))
    assert torch.equal(wide, alone) and torch.equal(scattered, wide[[5, 17]])
    assert len(set(wide.tolist())) > 20                              # zero logits: the noise alone decides


def test_top_p_drops_tied_tokens_by_id():
    """Tokens tied at the top-p boundary are dropped lowest id first (a stable sort), the same in every call -
    alone or in a batch of rows, at any vocabulary size - so AR and every speculative method keep the same set."""
    g = torch.Generator().manual_seed(0)
    s = Sampling(temperature=1.0, top_p=0.6)
    for V in (97, 4096):
        logits = torch.randint(0, 4, (6, V), generator=g).float()          # four values: ties everywhere
        kept = s.warp(logits) > float("-inf")
        for row, keep in zip(logits, kept):
            z = row - row.max()
            order = torch.tensor(sorted(range(V), key=lambda i: (z[i].item(), i)))   # ascending, ties by id
            drop = z[order].softmax(-1).cumsum(-1) <= 1 - 0.6
            drop[-1] = False
            want = torch.ones(V, dtype=torch.bool)
            want[order[drop]] = False
            assert torch.equal(keep, want), V
            assert torch.equal(s.warp(row[None])[0] > float("-inf"), want), V


def test_a_seed_uses_every_bit():
    """Seeds that differ only above bit 31 (or in sign) draw other noise; a seed below 2^32 keeps the noise it
    always had (the stored values: outputs sampled before this change still reproduce)."""
    from dasspec.model.noise import gumbel_noise, position_noise

    pos = torch.arange(64)
    for a, b in ((7, 7 + 2**32), (2**40, 2**41), (5, -5), (2**32 - 5, -5), (1, 2**62 + 1)):
        assert not torch.equal(gumbel_noise(pos, 97, a), gumbel_noise(pos, 97, b)), (a, b)
        assert not torch.equal(position_noise(pos, 8, a), position_noise(pos, 8, b)), (a, b)
    assert [round(x, 6) for x in gumbel_noise(torch.tensor([0, 9]), 3, 0).flatten().tolist()] == GUMBEL_SEED0
    assert [round(x, 6) for x in position_noise(torch.tensor([3]), 4, 12345).flatten().tolist()] == STATE_12345


@pytest.mark.parametrize("vocab", [97, 166144])
def test_gumbel_noise_is_the_formulas_bits_for_any_rows_drawn_once_per_position(vocab):
    """The noise is drawn in blocks of rows, in place, once per distinct position (a tree's siblings share it): the
    same bits as the formula written out op for op, for repeated, unordered and distinct positions, any seed - and
    a tree's rows cost one draw per position, not one per row."""
    from dasspec.model import noise
    from dasspec.model.noise import _GUMBEL_STREAM, _MASK32, _hash32, gumbel_noise, seed_key

    def formula(positions, seed):
        s = torch.tensor(seed_key(seed, _GUMBEL_STREAM), dtype=torch.int64)
        row = _hash32((positions.to(torch.int64) ^ s) & _MASK32)
        bits = _hash32(_hash32(row[:, None] ^ torch.arange(vocab)) + 0x9E3779B9 & _MASK32)
        u = (bits.to(torch.float64) + 0.5) / float(1 << 32)
        return (-torch.log(-torch.log(u))).to(torch.float32)

    tree = torch.tensor([7, 8, 8, 8, 9, 9, 10, 3])
    for pos in (torch.tensor([5]), torch.arange(100, 103), tree):
        for seed in (0, 123, -5, 2**40 + 3):
            assert torch.equal(gumbel_noise(pos, vocab, seed), formula(pos, seed)), (pos, seed)
    drawn = []
    hash_ = noise._hash32_

    def count(x):
        drawn.append(x.shape[0])
        return hash_(x)
    try:
        noise._hash32_ = count
        gumbel_noise(tree, vocab, 0)
    finally:
        noise._hash32_ = hash_
    assert sum(drawn) == 2 * len(set(tree.tolist()))          # two mixes per row of each distinct position


GUMBEL_SEED0 = [-0.58012, 1.191041, 1.489094, -0.325356, 3.175548, -0.153169]    # noise of seeds < 2^32 as
STATE_12345 = [0.753463, -0.767677, 1.117164, -0.917536]                       # drawn before the full width


# --- interface ------------------------------------------------------------------------------------------------

def test_hugging_face_conventions():
    model = random_model("huginn", mean_recurrence=3)
    prompt = [3, 4, 5, 6]
    greedy = dasspec.generate(model, prompt, max_new_tokens=8, eos=False).tokens
    default_t = dasspec.generate(model, prompt, max_new_tokens=8, eos=False, do_sample=True, seed=4).tokens
    assert default_t == dasspec.generate(model, prompt, max_new_tokens=8, eos=False, do_sample=True, seed=4,
                                         temperature=1.0).tokens                           # T defaults to 1.0
    assert default_t == dasspec.generate(model, prompt, max_new_tokens=8, eos=False, do_sample=True,
                                         seed=4).tokens                                    # same seed, same sample
    samples = {tuple(dasspec.generate(model, prompt, max_new_tokens=8, eos=False, do_sample=True,
                                      seed=s).tokens) for s in range(4)}
    assert len(samples) > 1
    with pytest.warns(UserWarning, match="do_sample is off"):
        out = dasspec.generate(model, prompt, max_new_tokens=8, eos=False, temperature=0.7, top_p=0.9)
    assert out.tokens == greedy
    with warnings.catch_warnings():
        warnings.simplefilter("error")                               # defaults passed out of habit: no warning
        assert dasspec.generate(model, prompt, max_new_tokens=8, eos=False, do_sample=False,
                                temperature=1.0, top_p=1.0).tokens == greedy
    with pytest.raises(ValueError, match="temperature=0 with do_sample=True"):
        dasspec.generate(model, prompt, max_new_tokens=8, do_sample=True, temperature=0)


@pytest.mark.parametrize("options,message", [
    (dict(temperature=-1.0), "temperature must be"), (dict(temperature=math.nan), "temperature must be"),
    (dict(temperature=math.inf), "temperature must be"), (dict(top_p=0.0), "top_p must be"),
    (dict(top_p=1.5), "top_p must be"), (dict(top_k=0), "top_k must be"), (dict(top_k=2.5), "top_k must be"),
    (dict(min_p=1.0), "min_p must be"), (dict(min_p=-0.1), "min_p must be"), (dict(seed=1.5), "seed must be"),
    (dict(do_sample="yes"), "do_sample must be"),
])
def test_bad_sampling_options_are_named(options, message):
    model = random_model("huginn", mean_recurrence=2)
    calls = []
    real = model.prelude
    model.prelude = lambda *a, **k: calls.append(1) or real(*a, **k)
    kw = {"do_sample": True, **options}
    with pytest.raises(ValueError, match=message):
        dasspec.generate(model, [3, 4, 5], max_new_tokens=4, **kw)
    assert calls == []                                               # nothing was computed


def test_cli_samples_like_the_api():
    import contextlib
    import io

    from dasspec.cli import main

    model = dasspec.load_model() if (BUNDLED_DIR / "config.json").exists() else pytest.skip("no bundled model")
    ids = model.tokenizer.encode("def f(x):")
    want = dasspec.generate(model, ids, "das-wave", max_new_tokens=10, do_sample=True, temperature=0.8, top_p=0.9,
                            seed=5).text
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        assert main(["generate", "--prompt", "def f(x):", "--method", "das-wave", "--max-new-tokens", "10",
                     "--temperature", "0.8", "--top-p", "0.9", "--seed", "5", "--quiet"]) == 0
    assert buf.getvalue().rstrip("\n") == want
