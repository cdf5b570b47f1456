"""The CPU decode-attention kernel (``dasspec.model.decode_kernel``): it computes what SDPA computes, a sequence's
row has the same bits whatever else is in the call, wherever its rows lie and at any thread count, and the engine's
decode steps take it - one call per layer application for every decoding sequence - without changing a token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dasspec
from dasspec.model import attention, decode_kernel
from dasspec.testing import random_model

pytestmark = pytest.mark.skipif(not decode_kernel.available(), reason="the decode kernel could not be built here")


def _sdpa(q, k, v, rows):
    """One sequence's row by SDPA: q [H, hd] over k, v [H_kv, pool, hd] at ``rows``."""
    H, hkv = q.shape[0], k.shape[0]
    return F.scaled_dot_product_attention(q[None, :, None], k[:, rows][None], v[:, rows][None],
                                          enable_gqa=H != hkv)[0, :, 0]


@pytest.mark.parametrize("heads,kv_heads,hd,dtype,tol", [(4, 4, 64, torch.float32, 1e-5),
                                                          (8, 2, 40, torch.float32, 1e-5),
                                                          (8, 2, 64, torch.bfloat16, 2e-2)])
def test_the_kernel_computes_what_sdpa_computes(heads, kv_heads, hd, dtype, tol):
    g = torch.Generator().manual_seed(0)
    P, lengths = 300, [1, 17, 64, 129]
    k = torch.randn(kv_heads, P, hd, generator=g).to(dtype)
    v = torch.randn(kv_heads, P, hd, generator=g).to(dtype)
    q = torch.randn(len(lengths), heads, hd, generator=g).to(dtype)
    rows = [torch.randperm(P, generator=g)[:n] for n in lengths]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    got = decode_kernel.decode_attention(q, k, v, torch.cat(rows), offsets, hd ** -0.5)
    assert got.dtype == dtype and got.shape == q.shape
    for s, r in enumerate(rows):
        torch.testing.assert_close(got[s].float(), _sdpa(q[s], k, v, r).float(), rtol=tol, atol=tol)


def test_a_row_has_the_same_bits_alone_in_any_batch_anywhere_at_any_thread_count():
    g = torch.Generator().manual_seed(1)
    H, hd, P = 8, 64, 512
    k, v = torch.randn(H, P, hd, generator=g), torch.randn(H, P, hd, generator=g)
    q = torch.randn(1, H, hd, generator=g)
    mine = torch.randperm(P, generator=g)[:77]
    alone = decode_kernel.decode_attention(q, k, v, mine, torch.tensor([0, 77]), 0.125)
    # the same rows copied elsewhere in the pool, in order, between sequences of other lengths
    k2, v2 = torch.randn(H, 2 * P, hd, generator=g), torch.randn(H, 2 * P, hd, generator=g)
    k2[:, 600:677], v2[:, 600:677] = k[:, mine], v[:, mine]
    others = [torch.randperm(P, generator=g)[:n] for n in (300, 5)]
    rows = torch.cat([others[0], torch.arange(600, 677), others[1]])
    qs = torch.cat([torch.randn(1, H, hd, generator=g), q, torch.randn(1, H, hd, generator=g)])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            batched = decode_kernel.decode_attention(qs, k2, v2, rows, torch.tensor([0, 300, 377, 382]), 0.125)
            assert torch.equal(batched[1], alone[0])
    finally:
        torch.set_num_threads(threads)


def test_bad_arguments_are_refused_not_read_out_of_bounds():
    k = v = torch.zeros(2, 10, 8)
    q = torch.zeros(1, 2, 8)
    with pytest.raises(RuntimeError, match="row"):
        decode_kernel.decode_attention(q, k, v, torch.tensor([3, 10]), torch.tensor([0, 2]), 1.0)
    with pytest.raises(RuntimeError):
        decode_kernel.decode_attention(q, k, v, torch.tensor([3]), torch.tensor([0, 2]), 1.0)
    with pytest.raises(RuntimeError, match="needs a row"):
        decode_kernel.decode_attention(q, k, v, torch.tensor([], dtype=torch.long), torch.tensor([0, 0]), 1.0)


@pytest.mark.parametrize("family", ["huginn", "ouro", "raven-llama"])
def test_decode_steps_take_the_kernel_once_per_layer_and_stay_lossless(family, monkeypatch):
    """A batch of requests decoding side by side gives each its own AR tokens, and every decode step's one-row
    attention of a layer application is one kernel call over all of them."""
    model = random_model(family, seed=3, mean_recurrence=4, n_prelude=1, n_core=1, n_coda=1)
    prompts = [[5 + i, 9, 11 + 2 * i, 4] * (2 + i) for i in range(4)]
    alone = [dasspec.generate(model, p, "ar", max_new_tokens=12, eos=False).tokens for p in prompts]
    with torch.no_grad():                       # the full forward (no cache, SDPA over every row) agrees
        for p, got in zip(prompts[:2], alone):
            ids = list(p)
            for _ in range(len(got)):
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
            assert ids[len(p):] == got
    calls = []
    real = decode_kernel.decode_attention
    monkeypatch.setattr(decode_kernel, "decode_attention", lambda q, *a: calls.append(q.shape[0]) or real(q, *a))
    batched = dasspec.generate_batch(model, prompts, "ar", max_new_tokens=12, eos=False, max_batch=4)
    assert [r.tokens for r in batched] == alone
    assert max(calls) == 4                                     # four decoding sequences in one call
