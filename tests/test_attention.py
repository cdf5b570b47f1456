"""The CPU attention path for wide masked calls (two GEMMs and a softmax) computes what SDPA computes, for full and
grouped-query heads, and wide verification / draft calls take it without changing a token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dasspec
from dasspec import layers
from dasspec.testing import random_model


@pytest.mark.parametrize("heads,kv_heads,dtype,tol", [(4, 4, torch.float32, 1e-5), (8, 2, torch.float32, 1e-5),
                                                       (8, 2, torch.bfloat16, 2e-2)])
def test_gemm_attention_matches_sdpa(heads, kv_heads, dtype, tol):
    g = torch.Generator().manual_seed(0)
    W, n, hd = 20, 37, 16
    q = torch.randn(1, heads, W, hd, generator=g).to(dtype)
    k = torch.randn(kv_heads, n + W, hd, generator=g).to(dtype)
    v = torch.randn(kv_heads, n + W, hd, generator=g).to(dtype)
    mask = torch.ones(W, n + W, dtype=torch.bool).tril(n)
    mask[5, n + 2] = False                          # a tree row that does not see one earlier node
    mask[7, 3] = False                              # nor one prefix row
    bias = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
    want = F.scaled_dot_product_attention(q, k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                          enable_gqa=heads != kv_heads)
    got = layers.gemm_attention(q, k, v, bias, hd ** -0.5)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_wide_calls_take_the_gemm_path_and_stay_lossless(monkeypatch):
    model = random_model("raven-llama", seed=2, mean_recurrence=4, n_prelude=1, n_core=1, n_coda=1)   # GQA
    calls = []
    real = layers.gemm_attention
    monkeypatch.setattr(layers, "gemm_attention", lambda q, *a: calls.append(q.shape[2]) or real(q, *a))
    prompt = [3, 4, 5, 6] * 6
    ref = dasspec.generate(model, prompt, "ar", max_new_tokens=24, eos=False)
    assert calls == []                      # AR: a causal prefill and one-query steps, both SDPA
    for method, knobs in (("das-wave", {"gamma": 24, "rounds": 3, "w_init": 24, "k": 1}), ("pld", {"num_pred": 20})):
        out = dasspec.generate(model, prompt, method, max_new_tokens=24, eos=False, **knobs)
        assert out.tokens == ref.tokens, method
    assert calls and min(calls) >= layers.GEMM_ATTENTION_MIN_W
