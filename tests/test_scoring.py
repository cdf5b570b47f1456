"""``dasspec.eval.logprobs.score``: the log-probabilities behind lm-eval's log-likelihoods and the server's
``logprobs`` are a plain full-depth forward's (``model(ids)``), to float32 precision, for sequences of different
lengths scored together, at any depth, seed and (Ouro) exit target."""

from __future__ import annotations

import copy

import pytest
import torch

from dasspec.eval.logprobs import score
from dasspec.testing import random_model


def forward_logprobs(model, ids, **options) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids]), **options)[0].double(), -1)


def tolerance(model, seqs, **options) -> float:
    """How far float32 may be from the exact scores here: 4x the plain float32 forward's own distance from the
    float64 one (over every scored position), or 1e-5.  A fixed float32 tolerance would encode one CPU's kernels
    (a recurrence amplifies rounding; on an AVX2-only host the batched and the plain forward differed by 3.4e-5)."""
    exact = copy.deepcopy(model).double()
    own = 0.0
    for ids in seqs:
        if len(ids) > 1:
            own = max(own, (forward_logprobs(model, ids, **options)[:-1]
                            - forward_logprobs(exact, ids, **options)[:-1]).abs().max().item())
    return max(1e-5, 4 * own)


def check(model, seqs, top=0, grouping=None, **options):
    """score() against the plain forward in float64, within ``tolerance``; greedy flags against the plain float32
    forward's argmax."""
    out = score(model, seqs, top=top, **(grouping or {}), **options)
    assert [s.ids for s in out] == seqs                                  # input order
    tol = tolerance(model, seqs, **options)
    exact = copy.deepcopy(model).double()
    for s, ids in zip(out, seqs):
        lp = forward_logprobs(exact, ids, **options)
        want = [lp[t - 1, ids[t]].item() for t in range(1, len(ids))]
        assert s.logprobs == pytest.approx(want, rel=0, abs=tol)
        plain = forward_logprobs(model, ids, **options)
        assert s.greedy == [plain[t - 1].argmax().item() == ids[t] for t in range(1, len(ids))]
        if top:
            for t, alts in enumerate(s.top):
                v, k = plain[t].topk(top)
                assert [a for a, _ in alts] == k.tolist()
                assert [b for _, b in alts] == pytest.approx(lp[t, k].tolist(), rel=0, abs=tol)
    return out


def test_scores_equal_a_plain_forward_batched_or_not():
    model = random_model("huginn", seed=1)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (9, 3, 17, 17, 2, 11)]
    # greedy continuations too, so is_greedy is true somewhere
    with torch.no_grad():
        lp = forward_logprobs(model, seqs[0])
    seqs.append(seqs[0][:1] + lp[:-1].argmax(-1).tolist()[:1])
    a = check(model, seqs, top=3)
    assert any(all(s.greedy) for s in a) and not all(all(s.greedy) for s in a)
    b = check(model, seqs, grouping=dict(max_batch=2, max_tokens=20))                   # other groupings, same numbers
    tol = tolerance(model, seqs)
    assert [x for s in a for x in s.logprobs] == pytest.approx([x for s in b for x in s.logprobs], rel=0, abs=tol)
    check(model, seqs[:3], num_steps=3, seed=7, init_scale=0.5)


@pytest.mark.parametrize("family", ["huginn", "ouro", "nanbeige", "iquest-loop"])
def test_a_sequences_scores_are_the_same_bits_batched_regrouped_or_alone(family):
    """With the kernels built, a sequence's log-probabilities are its own bits whatever it is scored beside: lm-eval
    through ``dasspec eval`` (8 sequences a forward) and the server's echoed logprobs (one) agree exactly.
    IQuest-Loop's cache-free forward included (its loop-2 window past 8 positions; it took SDPA before)."""
    from dasspec.model import decode_kernel
    if not decode_kernel.available():
        pytest.skip("torch's kernels promise no batch invariance")
    model = random_model(family, seed=1)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (9, 3, 17, 40, 2, 11)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = [s.logprobs for s in score(model, seqs, top=2)]
        regrouped = [s.logprobs for s in score(model, seqs, max_batch=2, max_tokens=20)]
        torch.set_num_threads(1)
        alone = [score(model, [s])[0].logprobs for s in seqs]
    finally:
        torch.set_num_threads(threads)
    assert together == regrouped == alone


@pytest.mark.parametrize("window", [1, 8, 64])
def test_iquests_cache_free_window_without_the_kernels_is_the_same_forward(monkeypatch, window):
    """The loop-2 window of a forward without cache on torch's attention (a GPU's; a CPU without the kernels) reads
    what the row kernel reads: each row's last ``loop_window`` keys, its own included (a window of one row, one
    inside the call, one past it; grouped-query heads, 4 over 2)."""
    from dasspec.model import decode_kernel
    model = random_model("iquest-loop", seed=3, loop_window=window)
    assert model.config.n_kv_heads < model.config.n_heads
    ids = torch.randint(0, model.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids)
        monkeypatch.setattr(decode_kernel, "available", lambda: False)
        got = model(ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_scores_follow_the_exit_target():
    model = random_model("ouro", seed=2)
    seqs = [[5, 9, 13, 2, 40], [7, 7, 1]]
    for options in ({}, {"exit_threshold": 0.5}, {"exit_at_step": 1}):
        check(model, seqs, top=2, **options)
    a = score(model, seqs, exit_at_step=0)[0].logprobs
    assert a != pytest.approx(score(model, seqs)[0].logprobs, abs=1e-3)   # the exit changes the target


def test_refusals():
    model = random_model("huginn")
    with pytest.raises(ValueError, match="empty"):
        score(model, [[]])
    with pytest.raises(ValueError, match="vocabulary"):
        score(model, [[1, 97]])
    with pytest.raises(ValueError, match="context"):
        score(model, [[1] * 257])
    with pytest.raises(ValueError, match="top"):
        score(model, [[1, 2]], top=98)
