"""The CPU attention path for wide masked calls (two GEMMs and a softmax) computes what SDPA computes, for full and
grouped-query heads, and wide verification / draft calls take it without changing a token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dasspec
from dasspec.model import attention
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
    got = attention.cpu_gemm_attention(q, k, v, bias, hd ** -0.5)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_float32_cpu_calls_of_every_shape_take_the_row_kernel_and_stay_lossless(monkeypatch):
    """On CPU in float32 no attention call takes SDPA or the GEMM path: causal prefills, one-query steps, masked
    draft windows, chains and prefix reads at another depth all go through ``rows_attention`` (one arithmetic; the
    one-call sublayers and layers run it inside), and every method's tokens equal AR's."""
    from dasspec.model import decode_kernel
    if not decode_kernel.available():
        pytest.skip("no kernels: tests/test_kernel_build.py fails where a compiler exists")
    model = random_model("raven-llama", seed=2, mean_recurrence=4, n_prelude=1, n_core=1, n_coda=1)   # GQA
    torch_paths = []
    real_gemm, real_sdpa = attention.cpu_gemm_attention, attention.F.scaled_dot_product_attention
    monkeypatch.setattr(attention, "cpu_gemm_attention", lambda *a: torch_paths.append("gemm") or real_gemm(*a))
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention",
                        lambda *a, **k: torch_paths.append("sdpa") or real_sdpa(*a, **k))
    # sublayers or whole layers in one call (a batch of one included): the row kernel inside, over one source or,
    # with the prefix pools given, two
    prefix_at = {"attention_rows": lambda a, k: a[15:16], "pre_layer_rows": lambda a, k: a[3][14:15],
                 "peri_layer_rows": lambda a, k: a[3][14:15], "recur_rows": lambda a, k: k.get("prefix_pools") or (),
                 "loop_recur_rows": lambda a, k: ()}
    one_call_two = []
    for name, at in prefix_at.items():
        real = getattr(decode_kernel, name)
        monkeypatch.setattr(decode_kernel, name, lambda *a, real=real, at=at, **k:
                            one_call_two.append(any(x is not None for x in at(a, k))) or real(*a, **k))
    prompt = [3, 4, 5, 6] * 6
    ref = dasspec.generate(model, prompt, "ar", max_new_tokens=24, eos=False)
    for method, knobs in (("das-wave", {"gamma": 24, "rounds": 3, "w_init": 24, "k": 1}), ("pld", {"num_pred": 20}),
                          ("mature-spec", {"policy": "deep-kv"}), ("lookahead", {}), ("token-recycling", {})):
        out = dasspec.generate(model, prompt, method, max_new_tokens=24, eos=False, **knobs)
        assert out.tokens == ref.tokens, method
    # Mature-Spec's drafts read the prefix at depth R in the one-call layer; the rest read one source
    assert torch_paths == [] and any(one_call_two) and not all(one_call_two)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_two_source_attention_is_one_softmax_over_both_sources(heads, kv_heads):
    """Eq. (2)-(3): prefix keys/values from one depth and the call's own from another, under one softmax, equal
    ordinary attention over the concatenated rows (with masks hiding rows of either source)."""
    g = torch.Generator().manual_seed(1)
    W, n, hd = 6, 11, 8
    q = torch.randn(1, heads, W, hd, generator=g)
    kc, vc = torch.randn(kv_heads, n, hd, generator=g), torch.randn(kv_heads, n, hd, generator=g)
    ku, vu = torch.randn(kv_heads, W, hd, generator=g), torch.randn(kv_heads, W, hd, generator=g)
    mc = torch.rand(W, n, generator=g) > 0.3
    mu = torch.ones(W, W, dtype=torch.bool).tril()
    want = F.scaled_dot_product_attention(q, torch.cat((kc, ku), 1)[None], torch.cat((vc, vu), 1)[None],
                                          attn_mask=torch.cat((mc, mu), 1), enable_gqa=heads != kv_heads)
    got = attention.two_source_attention(q, kc, vc, mc, ku, vu, mu, hd ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["huginn", "ouro", "nanbeige", "iquest-loop"])
def test_a_request_alone_gives_the_same_bits_as_a_batch_of_one_or_its_own_span(family, monkeypatch):
    """A lone request is called as a ragged batch of one (``batch._one_call``), which takes the one-call kernels:
    every verification's float32 logits equal, bit for bit, those of the same decode called as its own span
    (fails when the two paths' sums differ), and the batch of one does take a one-call kernel (every family has
    one: Huginn's sandwich layers and core steps since 2026-12-07)."""
    from dasspec.engine.drafting import batch
    from dasspec.model import decode_kernel
    if not decode_kernel.available():
        pytest.skip("no kernels: tests/test_kernel_build.py fails where a compiler exists")
    model = random_model(family, seed=5)
    one_calls = []
    for name in ("pre_layer_rows", "peri_layer_rows", "sandwich_layer_rows", "recur_rows", "loop_recur_rows"):
        real = getattr(decode_kernel, name)
        monkeypatch.setattr(decode_kernel, name, lambda *a, real=real, **k: one_calls.append(1) or real(*a, **k))
    logits: list[torch.Tensor] = []
    real_full = batch.Batch.full_depth
    monkeypatch.setattr(batch.Batch, "full_depth", lambda self, *a, **k: logits.append(real_full(self, *a, **k))
                        or logits[-1])
    runs = {}
    for way, rule in (("span", lambda span, cache: False), ("batch of one", batch._one_call)):
        monkeypatch.setattr(batch, "_one_call", rule)
        logits.clear()
        one_calls.clear()
        for method in ("ar", "das-wave"):
            dasspec.generate(model, [3, 4, 5, 6] * 5, method, max_new_tokens=12, eos=False)
        runs[way] = (list(logits), len(one_calls))
    (a, _), (b, used) = runs["span"], runs["batch of one"]
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    assert used > runs["span"][1]


@pytest.mark.parametrize("family", ["huginn", "ouro", "nanbeige", "iquest-loop"])
def test_float32_cpu_decoding_of_every_family_never_calls_torchs_products_or_attention(family, monkeypatch):
    """One arithmetic, by construction: in float32 on a CPU with the kernels built, decoding - prefill, AR steps,
    chains, trees, windows, a batch, sampled rows - never reaches torch's products or attention (``F.linear``,
    ``torch.matmul`` / ``bmm`` / ``einsum``, SDPA), whose sums may follow the batch; a path routed back through
    one of them fails here on every family that takes it."""
    from dasspec.model import decode_kernel
    if not decode_kernel.available():
        pytest.skip("no kernels: tests/test_kernel_build.py fails where a compiler exists")
    model = random_model(family, seed=4)
    calls: list[str] = []
    for mod, name in ((torch.nn.functional, "linear"), (torch.nn.functional, "scaled_dot_product_attention"),
                      (torch, "matmul"), (torch, "bmm"), (torch, "einsum")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _n=name, _r=real, **k: calls.append(_n) or _r(*a, **k))
    prompts = [[3, 4, 5, 6] * 5, list(range(7, 30)), [9, 8] * 3]
    ref = [dasspec.generate(model, p, "ar", max_new_tokens=10, eos=False).tokens for p in prompts]
    for method in ("das-wave", "token-recycling", "pld", "auto"):
        assert dasspec.generate(model, prompts[0], method, max_new_tokens=10, eos=False).tokens == ref[0], method
    got = dasspec.generate_batch(model, prompts, "das-wave", max_new_tokens=10, eos=False)
    assert [g.tokens for g in got] == ref
    dasspec.generate(model, prompts[1], "token-recycling", max_new_tokens=6, eos=False, do_sample=True, seed=3)
    assert calls == [], sorted(set(calls))


@pytest.mark.parametrize("table", [False, True])
def test_a_causal_spans_lists_and_mask_are_the_masked_spans(table):
    """``CausalSpan`` (a causal call's span, and IQuest-Loop's loop-2 window of one): each query's row list from
    ``row_lists`` - its rows in order, its count of prefix rows - and the mask and bias built on first use equal those
    of the span masked as before (``LoopedLM.span``'s causal mask; ``_window_part``'s general form for a window: the
    causal mask and key position > query's - window), for decode rows, chains and prompt blocks, windows longer and
    shorter than the rows, through a block table or not (fails when a window starts one row early or late, in the
    lists or the mask, or the prefix count ignores the window's start)."""
    from dataclasses import replace

    from dasspec.model.attention import CausalSpan, LayerKV, PagedKV, Span, row_lists
    from dasspec.model.cache import BlockTable

    k = torch.zeros(1, 64, 2)
    tbl = BlockTable(8, 64, "cpu")
    tbl.append([3, 0, 6, 1, 5, 7, 2, 4])
    kv = PagedKV(k, k, k, k, tbl) if table else LayerKV(k, k, k, k)
    two = LayerKV(k, k, k.clone(), k.clone())          # two sources: the prefix counts too
    for n, start, W, window in [(0, 0, 9, 4), (20, 20, 1, 8), (20, 23, 5, 4), (7, 7, 6, 64), (30, 30, 8, 1),
                                (12, 12, 1, 13), (40, 40, 16, 6), (20, 23, 5, 0), (9, 9, 12, 0), (3, 5, 2, 0)]:
        rot = torch.zeros(W, 1, 2)
        span = CausalSpan.of(n, start, W, rot, torch.float32, window)
        cols, qpos = torch.arange(start + W), torch.arange(start, start + W)
        if window:
            mask = (cols[None, :] <= qpos[:, None]) & (cols[None, :] > qpos[:, None] - window)
            old = Span(n=n, start=start, W=W, rot=rot, mask=mask, lo=max(0, n - window + 1))
        else:
            mask = torch.ones(W, start + W, dtype=torch.bool).tril(start)
            old = Span(n=n, start=start, W=W, rot=rot, mask=mask, causal_rows=True)
        old = replace(old, bias=torch.zeros(mask.shape).masked_fill_(~mask, float("-inf")))

        def lists(s, view):
            rows, starts, lengths, prefix = row_lists([view], [s], {})
            return ([rows[a: a + c].tolist() for a, c in zip(starts.tolist(), lengths.tolist())],
                    None if prefix is None else prefix.tolist())

        assert lists(span, kv) == lists(old, kv), (n, start, W, window)
        if not table:
            assert lists(span, two) == lists(old, two), (n, start, W, window)
        assert vars(span)["_mask"] is attention._UNBUILT       # the lists did not need the mask
        assert (torch.equal(span.mask, old.mask) and torch.equal(span.bias, old.bias) and span.lo == old.lo
                and span.causal_rows == old.causal_rows and not span.causal), (n, start, W, window)
