"""The one hardware shortcut in the math: wide bfloat16 products on a CPU without bfloat16 units run as tiled
float32 GEMMs (dasspec/model/linear.py).  Values must agree with the bfloat16 product to bfloat16 rounding."""

import pytest
import torch
import torch.nn.functional as F

from dasspec.model import linear as lin


@pytest.mark.parametrize("shape,tile_bytes", [((3, 5, 64), 1 << 21), ((2, 7, 48), 4 * 48 * 8), ((9, 40), 4 * 40 * 9)])
def test_tiled_product_equals_the_bfloat16_product(monkeypatch, shape, tile_bytes):
    """Every output row and column, with tiles that do not divide the weight's rows, and a bias."""
    monkeypatch.setattr(lin, "TILE_BYTES", tile_bytes)
    g = torch.Generator().manual_seed(0)
    K, N = shape[-1], 77
    x = torch.randn(*shape, generator=g).bfloat16()
    w = torch.randn(N, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g).bfloat16()
    got = lin.tiled_float32_linear(x, w, b)
    ref = (x.double() @ w.double().t() + b.double())
    assert got.dtype == torch.bfloat16 and got.shape == (*shape[:-1], N) and got.is_contiguous()
    torch.testing.assert_close(got.double(), ref, rtol=2 ** -7, atol=2 ** -6)
    torch.testing.assert_close(got.float(), F.linear(x, w, b).float(), rtol=2 ** -7, atol=2 ** -6)


def test_tiled_product_ignores_the_default_dtype():
    x, w = torch.randn(4, 24).bfloat16(), torch.randn(40, 24).bfloat16()
    ref = lin.tiled_float32_linear(x, w)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert torch.equal(lin.tiled_float32_linear(x, w), ref)
    finally:
        torch.set_default_dtype(old)


def test_linear_takes_the_tiled_path_only_where_it_pays(monkeypatch):
    calls = []
    real = lin.tiled_float32_linear
    monkeypatch.setattr(lin, "tiled_float32_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    monkeypatch.setattr(lin, "cpu_has_bf16_units", lambda: False)
    monkeypatch.setattr(lin, "MIN_WEIGHT_ELEMENTS", 0)
    w = torch.randn(32, 16).bfloat16()
    wide, narrow = torch.randn(1, lin.WIDE_ROWS, 16).bfloat16(), torch.randn(1, lin.WIDE_ROWS - 1, 16).bfloat16()
    with torch.no_grad():
        lin.linear(wide, w)
        lin.linear(narrow, w)                       # too few rows
        lin.linear(wide.float(), w.float())         # float32: torch's own
    assert calls == [wide.shape]
    wg = w.clone().requires_grad_()
    lin.linear(wide, wg).float().sum().backward()   # training keeps autograd's F.linear
    assert calls == [wide.shape] and wg.grad is not None
    monkeypatch.setattr(lin, "cpu_has_bf16_units", lambda: True)
    with torch.no_grad():
        lin.linear(wide, w)                         # bfloat16 units: torch's own kernels
    assert calls == [wide.shape]


@pytest.mark.parametrize("family", ["huginn", "ouro"])
def test_a_bfloat16_model_decodes_through_the_tiled_products(monkeypatch, tmp_path, family):
    """Every Linear layer goes through ``linear``; a bf16 model whose every product of four or more rows takes the
    tiled path computes what the float32 model does and decodes a batch with the first tokens of bf16 AR alone."""
    import dasspec
    from dasspec.testing import random_model

    model = random_model(family, mean_recurrence=4)
    assert {type(m) for m in model.modules() if isinstance(m, torch.nn.Linear)} == {lin.Linear}
    dasspec.save_checkpoint(model, tmp_path / "ckpt")
    bf16 = dasspec.load_model(tmp_path / "ckpt", device="cpu", dtype=torch.bfloat16)
    fp32 = dasspec.load_model(tmp_path / "ckpt", device="cpu")
    calls = []
    real = lin.tiled_float32_linear
    monkeypatch.setattr(lin, "tiled_float32_linear", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(lin, "cpu_has_bf16_units", lambda: False)
    monkeypatch.setattr(lin, "MIN_WEIGHT_ELEMENTS", 0)
    ids = torch.tensor([[5, 9, 13, 7, 22, 31] * 3])
    cos = F.cosine_similarity(bf16(ids, num_steps=4)[0], fp32(ids, num_steps=4)[0], dim=-1)
    assert calls and cos.min() > 0.98
    prompts = [[5, 9, 13, 7, 22, 31] * 3, [7, 3, 9] * 5, [4, 8, 15, 16, 23]]
    alone = [dasspec.generate(bf16, p, "ar", max_new_tokens=4, eos=False).tokens for p in prompts]
    outs = dasspec.generate_batch(bf16, prompts, "ar", max_new_tokens=4, eos=False, max_batch=3)
    assert [o.tokens[0] for o in outs] == [a[0] for a in alone]


def test_packed_float32_rows_do_not_depend_on_the_row_count(monkeypatch):
    """The float32 CPU path (oneDNN, packed weight; two rows or more): each row has the same bits at any row count,
    and agrees with F.linear to float32 rounding; a written weight is repacked."""
    if not lin.onednn_packing():
        pytest.skip("no oneDNN linear in this torch build")
    monkeypatch.setattr(lin, "PACK_MIN_ELEMENTS", 0)
    g = torch.Generator().manual_seed(0)
    for N, K in ((96, 64), (64, 176), (300, 64)):
        w = torch.randn(N, K, generator=g) * 0.05
        x = torch.randn(1, 37, K, generator=g)
        with torch.inference_mode():
            alone = lin.linear(x, w)
            for M in (2, 3, 4, 5, 8, 9, 16, 33):
                assert torch.equal(lin.linear(x[:, :M], w), alone[:, :M]), (N, K, M)
                assert torch.equal(lin.linear(x[:, 37 - M:], w), alone[:, 37 - M:]), (N, K, M)
            torch.testing.assert_close(alone, F.linear(x, w), rtol=1e-5, atol=1e-5)
            w.mul_(2)
            torch.testing.assert_close(lin.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def _avx512() -> bool:
    try:
        return " avx512f" in open("/proc/cpuinfo").read()
    except OSError:
        return False


@pytest.mark.parametrize("N,K", [(96, 64), (300, 176), (64, 1408), (40, 2100)])
def test_a_few_rows_read_panels_with_onednns_bits(N, K):
    """Products of 1-16 rows read the weight's 16-column panels (``decode_kernel.register_panels``: oneDNN's
    arithmetic, k in oneDNN's blocks) and give every row the bits oneDNN's packed product gives it among 37 rows -
    a single row too.  Fails when the panels are refused (their test product disagreed with oneDNN's: a wrong
    k-block or summation order) or when a registered product's bits differ.  (The k-blocks asserted found are those
    of the pinned torch's oneDNN on an AVX-512 host.)"""
    from dasspec.model import decode_kernel
    if not lin.onednn_packing() or not decode_kernel.available():
        pytest.skip("no oneDNN linear or no CPU kernels here")
    g = torch.Generator().manual_seed(2)
    w = torch.randn(N, K, generator=g) * 0.05
    x = torch.randn(37, K, generator=g)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)
    among = torch.ops.mkldnn._linear_pointwise(torch.cat((x, x.new_zeros(3, K))), packed, None, "none", [], "")[:37]
    kb = decode_kernel.register_panels(packed, w)
    try:
        if not _avx512():
            assert kb == 0                          # no panels: oneDNN's product serves every call
            return
        assert kb > 0
        for M in range(1, 17):
            assert torch.equal(decode_kernel.packed_linear(x[:M], packed, lin.padded_rows(M)), among[:M]), M
            assert torch.equal(decode_kernel.packed_linear(x[37 - M:], packed, lin.padded_rows(M)), among[37 - M:]), M
    finally:
        decode_kernel.unregister_panels(packed)


def test_panels_serve_only_the_thread_count_they_were_checked_at(monkeypatch):
    """oneDNN splits k over threads for a narrow weight with a long k, so its arithmetic follows the thread count:
    panels registered at one thread must not serve a call at two (fails when the thread count is not compared)."""
    from dasspec.model import decode_kernel
    if not lin.onednn_packing() or not decode_kernel.available():
        pytest.skip("no oneDNN linear or no CPU kernels here")
    monkeypatch.setattr(lin, "PACK_MIN_ELEMENTS", 0)
    monkeypatch.setattr(lin, "_PACKS", lin._Packs())
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(32, 32768, generator=g) * 0.05, torch.randn(40, 32768, generator=g)
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            torch.set_num_threads(1)
            lin.linear(x[:2], w)                        # packed (and its panels checked) at one thread
            for t in (2, 1):
                torch.set_num_threads(t)
                assert torch.equal(lin.linear(x[:8], w), lin.linear(x, w)[:8]), t
    finally:
        torch.set_num_threads(threads)


def test_a_single_row_takes_the_packed_product_only_with_more_than_one_thread(monkeypatch):
    """One row (a batch-1 decode step): oneDNN's product at two threads or more, MKL's at one; both compute the
    product; wide calls of every rounding step keep their rows' bits."""
    if not lin.onednn_packing():
        pytest.skip("no oneDNN linear in this torch build")
    monkeypatch.setattr(lin, "PACK_MIN_ELEMENTS", 0)
    calls = []
    real = lin.packed_float32_linear
    monkeypatch.setattr(lin, "packed_float32_linear", lambda x, *a: calls.append(x.shape[-2]) or real(x, *a))
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(96, 64, generator=g) * 0.05, torch.randn(1, 465, 64, generator=g)
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            for t, packed in ((1, False), (2, True)):
                torch.set_num_threads(t)
                calls.clear()
                torch.testing.assert_close(lin.linear(x[:, :1], w), F.linear(x[:, :1], w), rtol=1e-5, atol=1e-5)
                assert bool(calls) == packed, t
            alone = lin.linear(x, w)
            for M in (65, 100, 300, 465):
                assert torch.equal(lin.linear(x[:, :M], w), alone[:, :M]), M
    finally:
        torch.set_num_threads(threads)


def test_packed_path_leaves_autograd_and_a_full_budget_to_f_linear(monkeypatch):
    calls = []
    real = lin.packed_float32_linear
    monkeypatch.setattr(lin, "packed_float32_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    w = torch.randn(64, 32).requires_grad_()
    lin.linear(torch.randn(3, 32), w).sum().backward()      # training: autograd's F.linear
    assert not calls and w.grad is not None
    monkeypatch.setattr(lin, "_PACKS", lin._Packs())
    monkeypatch.setattr(lin, "PACK_MIN_ELEMENTS", 0)
    monkeypatch.setattr(lin, "PACK_BUDGET_BYTES", 64 * 32 * 4)             # one copy (its panels do not fit)
    a, b = torch.randn(64, 32), torch.randn(64, 32)
    with torch.no_grad():
        lin.linear(torch.randn(3, 32), a)                   # fits the budget: packed
        lin.linear(torch.randn(3, 32), b)                   # past it: F.linear, for good
        lin.linear(torch.randn(3, 32), b)
    assert len(calls) == (1 if lin.onednn_packing() else 0)


def test_the_budget_counts_panels_only_where_they_are_made(monkeypatch):
    """Weights whose panels are not made (refused, no AVX-512, no kernels) cost the budget their oneDNN copy only:
    three of them fit a budget of three copies (fails when the panels are charged before they exist)."""
    from dasspec.model import decode_kernel
    if not lin.onednn_packing():
        pytest.skip("no oneDNN linear in this torch build")
    monkeypatch.setattr(lin, "PACK_MIN_ELEMENTS", 0)
    monkeypatch.setattr(lin, "_PACKS", lin._Packs())
    monkeypatch.setattr(lin, "PACK_BUDGET_BYTES", 3 * 64 * 32 * 4)
    monkeypatch.setattr(decode_kernel, "register_panels", lambda packed, w: 0)
    weights = [torch.randn(64, 32) for _ in range(3)]
    with torch.no_grad():
        packed = [lin.packed_weight(torch.randn(3, 32), w) is not None for w in weights]
    assert packed == [True, True, True] and lin._PACKS.bytes == 3 * 64 * 32 * 4
