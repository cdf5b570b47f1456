"""Every CPU product is the kernels' (one arithmetic, float32 and bfloat16; dasspec/csrc); where they are not built,
wide bfloat16 products on a CPU without bfloat16 units run as tiled float32 GEMMs (dasspec/model/linear.py), whose
values agree with the bfloat16 product to bfloat16 rounding."""

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
    monkeypatch.setattr(lin, "kernel_takes", lambda x, w: False)        # no kernels built
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
    monkeypatch.setattr(lin, "kernel_takes", lambda x, w: False)        # no kernels built
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


def _kernels():
    from dasspec.model import decode_kernel
    if not decode_kernel.available():
        pytest.skip("no kernels: tests/test_kernel_build.py fails where a compiler exists")
    return decode_kernel


# Shapes on every branch of the product: register blocks of 1-4 rows and their remainders, AVX-512's wide block
# (isa_body.h's WIDE_K_MIN / MAX: 5 to 8 rows here, through subsets of 6, 8 and 9 rows, and the last 5 rows of a
# blocked call of 69; a CPU without AVX-512 never takes it), outputs past a chunk, widths below, at and past the 16
# lanes with a tail, more than 16 rows (the blocked path), a weight over 2^18.
SHAPES = [(1, 17, 5), (3, 100, 37), (7, 49, 200), (16, 33, 16), (17, 576, 192), (70, 129, 300), (5, 1024, 300),
          (9, 40, 1408), (6, 37, 1025), (8, 20, 4096), (69, 40, 1408)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_a_products_row_has_the_same_bits_alone_in_any_batch_at_any_thread_count_on_every_isa(M, N, K, dtype):
    """One arithmetic (dasspec/csrc/isa_body.h): a row's output is a function of that row alone - the same bits at
    every row count and position (1 to 70 rows), at 1, 2, 3 and 16 threads, on every instruction-set path of this
    CPU (AVX-512, AVX2, portable) - and within float32 rounding of the float64 product."""
    dk = _kernels()
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x, w, b = (torch.randn(*s, generator=g).to(dtype) for s in ((M, K), (N, K), (N,)))
    threads, isa = torch.get_num_threads(), dk.isa()
    try:
        ref = dk.linear(x, w, b)
        for path in dk.isas_here():
            dk.set_isa(path)
            for t in (1, 2, 3, 16):
                torch.set_num_threads(t)
                assert torch.equal(dk.linear(x, w, b), ref), (path, t)
                for i in {0, M // 2, M - 1}:
                    assert torch.equal(dk.linear(x[i: i + 1], w, b), ref[i: i + 1]), (path, t, i)
                assert torch.equal(dk.linear(x[1:], w, b), ref[1:]), (path, t)
    finally:
        dk.set_isa(isa)
        torch.set_num_threads(threads)
    want = x.double() @ w.double().T + b.double()
    if dtype == torch.float32:
        assert (ref.double() - want).abs().max() <= 1e-6 * K ** 0.5 * (1 + want.abs().max())
    else:                                   # float32 sums, one rounding: torch's bfloat16 product's own values
        assert torch.equal(ref, want.float().bfloat16()) or (ref.double() - want).abs().max() <= 2 ** -7 * (
            1 + want.abs().max())
    assert torch.equal(lin.linear(x, w, b), ref)      # every CPU product takes it, at any size


def test_strided_inputs_and_weights_get_the_same_bits():
    dk = _kernels()
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(9, 40, generator=g), torch.randn(30, 40, generator=g)
    ref = dk.linear(x, w)
    assert torch.equal(lin.linear(x.t().contiguous().t(), w), ref)           # a column-major activation
    assert torch.equal(lin.linear(x, w.t().contiguous().t()), ref)           # an in-major weight
    big = torch.randn(9, 60, 40, generator=g)
    big[:, 7] = x
    assert torch.equal(lin.linear(big[:, 7], w), ref)                        # rows with a stride


def test_autograd_keeps_f_linear():
    """Training: torch's product, which keeps the graph; the kernels keep none."""
    w = torch.randn(64, 32).requires_grad_()
    lin.linear(torch.randn(3, 32), w).sum().backward()
    assert w.grad is not None


def test_the_products_benchmark_times_a_revisions_kernels_beside_todays(capsys):
    """benchmarks/cpu_products.py --against REV (a kernel change's paired A/B) builds REV's kernels beside today's,
    checks their outputs equal and prints one row per cache state with a ratio over the rounds."""
    import importlib.util
    import subprocess
    from pathlib import Path

    _kernels()
    root = Path(__file__).resolve().parents[1]
    try:
        committed = subprocess.run(["git", "rev-parse", "HEAD:dasspec/csrc"], cwd=root, capture_output=True)
    except OSError:
        pytest.skip("no git here")
    if committed.returncode:
        pytest.skip("not a git checkout with the kernels' sources committed")
    spec = importlib.util.spec_from_file_location("bench_cpu_products", root / "benchmarks" / "cpu_products.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    threads = torch.get_num_threads()
    try:
        assert mod.main(["--against", "HEAD", "--shapes", "40x1408", "--rows", "8", "--rounds", "2",
                         "--cold-mb", "0.5", "--threads", str(threads)]) == 0
    finally:
        torch.set_num_threads(threads)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 40 x 1408 | 8 |")]
    assert [r.split(" | ")[2] for r in rows] == ["warm", "cold"]
    assert all(float(r.split(" | ")[5].split()[0]) > 0 for r in rows)
