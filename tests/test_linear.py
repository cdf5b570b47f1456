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
    assert got.dtype == torch.bfloat16 and got.shape == (*shape[:-1], N)
    torch.testing.assert_close(got.double(), ref, rtol=2 ** -7, atol=2 ** -6)
    torch.testing.assert_close(got.float(), F.linear(x, w, b).float(), rtol=2 ** -7, atol=2 ** -6)


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


def test_every_linear_layer_of_the_model_goes_through_linear():
    import dasspec
    model = dasspec.load_model()
    kinds = {type(m) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert kinds == {lin.Linear}
