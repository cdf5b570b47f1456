"""The CPU kernels (``dasspec.model.decode_kernel``): the attention kernel computes what SDPA computes, a
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


def _decode(q, k, v, rows, offsets, scale):
    """One query per sequence: sequence s attends ``rows[offsets[s]: offsets[s + 1]]``."""
    return decode_kernel.rows_attention(q, k, v, rows, offsets[:-1], offsets[1:] - offsets[:-1], scale)


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
    got = _decode(q, k, v, torch.cat(rows), offsets, hd ** -0.5)
    assert got.dtype == dtype and got.shape == q.shape
    for s, r in enumerate(rows):
        torch.testing.assert_close(got[s].float(), _sdpa(q[s], k, v, r).float(), rtol=tol, atol=tol)


def test_a_row_has_the_same_bits_alone_in_any_batch_anywhere_at_any_thread_count():
    g = torch.Generator().manual_seed(1)
    H, hd, P = 8, 64, 512
    k, v = torch.randn(H, P, hd, generator=g), torch.randn(H, P, hd, generator=g)
    q = torch.randn(1, H, hd, generator=g)
    mine = torch.randperm(P, generator=g)[:77]
    alone = _decode(q, k, v, mine, torch.tensor([0, 77]), 0.125)
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
            batched = _decode(qs, k2, v2, rows, torch.tensor([0, 300, 377, 382]), 0.125)
            assert torch.equal(batched[1], alone[0])
    finally:
        torch.set_num_threads(threads)


def test_prompt_blocks_attend_causally_as_sdpa_does_and_each_row_as_if_alone():
    """Rows of a multi-row block (query j sees rows [0, start + j]): SDPA's values, and each row the bits it has
    when it is the only query of the call."""
    g = torch.Generator().manual_seed(2)
    H, Hkv, hd, P, start, W = 8, 2, 64, 200, 37, 16
    k, v = torch.randn(Hkv, P, hd, generator=g), torch.randn(Hkv, P, hd, generator=g)
    mine = torch.randperm(P, generator=g)[: start + W]
    q = torch.randn(W, H, hd, generator=g)
    got = decode_kernel.rows_attention(q, k, v, mine, torch.zeros(W, dtype=torch.long),
                                       torch.arange(start + 1, start + W + 1), hd ** -0.5)
    mask = torch.ones(W, start + W, dtype=torch.bool).tril(start)
    want = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[:, mine][None], v[:, mine][None],
                                          attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for j in (0, 7, W - 1):
        alone = decode_kernel.rows_attention(q[j: j + 1], k, v, mine[: start + j + 1], torch.tensor([0]),
                                             torch.tensor([start + j + 1]), hd ** -0.5)
        assert torch.equal(alone[0], got[j])


def test_stores_write_what_index_copy_writes():
    g = torch.Generator().manual_seed(3)
    pool_k, pool_v = torch.randn(4, 64, 32, generator=g), torch.randn(4, 64, 32, generator=g)
    qkv = torch.randn(9, 12, 32, generator=g)                     # strided K / V views, as the layer hands them
    k, v = qkv[:, 4:8].transpose(0, 1), qkv[:, 8:].transpose(0, 1)
    rows = torch.randperm(64, generator=g)[:9]
    want_k, want_v = pool_k.clone().index_copy_(1, rows, k), pool_v.clone().index_copy_(1, rows, v)
    decode_kernel.store_rows(pool_k, pool_v, rows, k, v)
    assert torch.equal(pool_k, want_k) and torch.equal(pool_v, want_v)
    with pytest.raises(RuntimeError, match="outside"):
        decode_kernel.store_rows(pool_k, pool_v, torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 64]), k, v)


def test_rms_norm_is_torchs_and_a_row_keeps_its_bits_in_any_batch():
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(37, 512, generator=g) * 3, torch.randn(512, generator=g)
    got = decode_kernel.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(got, F.rms_norm(x, (512,), w, 1e-6), rtol=1e-6, atol=1e-6)
    for i in (0, 20, 36):
        assert torch.equal(decode_kernel.rms_norm(x[i: i + 1], w, 1e-6)[0], got[i])


@pytest.mark.parametrize("heads, hd", [(3, 10), (4, 64), (55, 96)])
def test_interleaved_rope_keeps_a_rows_bits_in_any_call_at_any_thread_count(heads, hd):
    """Huginn's (and the bundled model's) RoPE is torch's complex product, not a kernel of dasspec's: a row's
    rotation must have the same bits alone as in a call of any size (odd sizes leave vector tails) at any thread
    count, as the SiLU's below must."""
    from dasspec.model.layers import apply_rope
    g = torch.Generator().manual_seed(8)
    ang = torch.randn(40, hd // 2, generator=g) * 3
    rot = torch.polar(torch.ones_like(ang), ang).unsqueeze(1)
    x = torch.randn(8, 40, heads, hd, generator=g) * 3
    threads = torch.get_num_threads()
    try:
        for th in (1, 2, 3, 5):
            torch.set_num_threads(th)
            for B, W in ((8, 40), (3, 7), (1, 1)):
                out = apply_rope(x[:B, :W], rot[:W], True)
                for b, j in ((0, 0), (B - 1, W - 1), (B // 2, W // 2)):
                    one = apply_rope(x[b: b + 1, j: j + 1], rot[j: j + 1], True)
                    assert torch.equal(one[0, 0], out[b, j]), (th, B, W, b, j)
    finally:
        torch.set_num_threads(threads)


def _rope_pairs_in_torch(x, cos, sin):
    a, b, c, s = x[..., 0::2], x[..., 1::2], cos[:, None], sin[:, None]
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)


@pytest.mark.parametrize("heads,hd", [(1, 2), (3, 6), (4, 48), (12, 96)])
def test_rope_pairs_rotate_each_pair_with_two_roundings_per_product(heads, hd):
    """Huginn's RoPE (pairs rotated as complex numbers) takes the kernel on a CPU in float32, inside the one-call
    layers and in ``apply_rope``: re = ac - bd, im = ad + bc, each product rounded, then the difference or sum, for
    every row, head and pair, at any thread count, strided as the q/k view of a projection is.  torch's complex
    product computes that in its vector loop but with other roundings in a row's tail (ATen's scalar path), so it
    is the reference only where a row is whole vectors: Huginn-0125's 96 and the bundled model's 48."""
    from dasspec.model.layers import apply_rope
    g = torch.Generator().manual_seed(hd)
    ang = torch.randn(37, hd // 2, generator=g) * 50
    rot = torch.polar(torch.ones_like(ang), ang).unsqueeze(1)
    qkv = torch.randn(3, 37, heads + 2, hd, generator=g) * 7
    x = qkv[:, :, : heads + 1]                       # the q/k view of a projection: rows strided past v
    r = torch.view_as_real(rot[:, 0])
    want = _rope_pairs_in_torch(x, r[..., 0], r[..., 1])     # torch's real ops: one rounding each
    if hd % 16 == 0:
        assert torch.equal(torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * rot).flatten(-2), want)
    threads = torch.get_num_threads()
    try:
        for th in (1, 2, 3):
            torch.set_num_threads(th)
            assert torch.equal(decode_kernel.rope_pairs(x, r[..., 0], r[..., 1]), want), th
            assert torch.equal(apply_rope(x, rot, True), want), th
            assert torch.equal(apply_rope(x[:1, 5:6], rot[5:6], True), want[:1, 5:6]), th
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("n", [1408, 200, 7])
def test_silu_and_sigmoid_keep_a_values_bits_in_any_call_at_any_thread_count_on_every_path(n):
    """torch's elementwise kernels compute a call's tail on another path than its vectors, and which values fall in
    a tail depends on the call's size and its thread count, so a row's SiLU (and the one-call MLP's) could have other
    bits alone than in a batch.  The kernel's are each value's own, at every thread count and on every ISA path."""
    g = torch.Generator().manual_seed(6)
    y = torch.randn(97, 2 * n, generator=g) * 4
    d = 64
    wfc, wp = torch.randn(2 * n, d, generator=g) / 8, torch.randn(d, n, generator=g) / 8
    x = torch.randn(97, d, generator=g)
    before, threads = decode_kernel.isa(), torch.get_num_threads()
    ref = None
    try:
        for isa in decode_kernel.isas_here():
            decode_kernel.set_isa(isa)
            for th in (1, 2, 3, 5, 7):
                torch.set_num_threads(th)
                silu, sig = decode_kernel.silu_mul(y[:, :n], y[:, n:]), decode_kernel.sigmoid(y)
                mlp = decode_kernel.mlp_rows(x, wfc, wp)
                if ref is None:
                    ref = (silu, sig, mlp)
                    torch.testing.assert_close(silu, F.silu(y[:, :n]) * y[:, n:], rtol=2e-6, atol=1e-6)
                    torch.testing.assert_close(sig, torch.sigmoid(y), rtol=2e-6, atol=1e-7)
                assert torch.equal(silu, ref[0]) and torch.equal(sig, ref[1]) and torch.equal(mlp, ref[2]), (isa, th)
                for i in (0, 31, 50, 96):
                    assert torch.equal(decode_kernel.silu_mul(y[i: i + 1, :n], y[i: i + 1, n:]), silu[i: i + 1])
                    assert torch.equal(decode_kernel.sigmoid(y[i: i + 1]), sig[i: i + 1])
                    assert torch.equal(decode_kernel.mlp_rows(x[i: i + 1], wfc, wp), mlp[i: i + 1]), (isa, th, i)
    finally:
        decode_kernel.set_isa(before)
        torch.set_num_threads(threads)
    yb = y.bfloat16()                                    # bfloat16: torch's two roundings (the SiLU, the product)
    torch.testing.assert_close(decode_kernel.silu_mul(yb[:, :n], yb[:, n:]).float(),
                               (F.silu(yb[:, :n]) * yb[:, n:]).float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 33, 1000, 49152])
def test_argmax_gives_torchs_index_on_every_path(n):
    """Greedy choices take the kernel's argmax: it must pick torch's index whatever the row holds - the first of
    tied maxima (in a vector lane, across lanes and in the tail), the first NaN, +inf, -inf everywhere, -0 beside
    +0 - at any thread count, on every ISA path, for strided and batched rows."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(6, n, generator=g)
    rows = [x, (x * 2).round() / 2, torch.full((3, n), float("-inf")), torch.zeros(2, n), -torch.zeros(2, n)]
    y = x.clone()
    y[:, n // 2] = y[:, n - 1] = float("inf")
    rows.append(y)
    y = x.clone()
    y[0, n // 3] = float("nan")
    y[1, n - 1] = float("nan")
    y[2, n // 2:] = float("nan")
    rows.append(y)
    y = -torch.zeros(3, n)
    y[:, n // 2:] = 0.0
    rows.append(y)
    y = torch.zeros(17, n)
    for r in range(17):                          # one maximum, then its tie, at each position of a 16-lane group
        y[r, min(r, n - 1)] = 1.0
        y[r, min(r + 16, n - 1)] = 1.0
    rows.append(y)
    before, threads = decode_kernel.isa(), torch.get_num_threads()
    try:
        for isa in decode_kernel.isas_here():
            decode_kernel.set_isa(isa)
            for th in (1, 2, 3):
                torch.set_num_threads(th)
                for z in rows:
                    assert torch.equal(decode_kernel.argmax(z), z.argmax(-1)), (isa, th, z)
                    assert torch.equal(decode_kernel.argmax(z[0]), z[0].argmax(-1))
                    assert torch.equal(decode_kernel.argmax(z[:, ::2]), z[:, ::2].argmax(-1))
                    assert torch.equal(decode_kernel.argmax(z[None]), z[None].argmax(-1))
    finally:
        decode_kernel.set_isa(before)
        torch.set_num_threads(threads)


def test_bad_arguments_are_refused_not_read_out_of_bounds():
    k = v = torch.zeros(2, 10, 8)
    q = torch.zeros(1, 2, 8)
    with pytest.raises(RuntimeError, match="row"):
        _decode(q, k, v, torch.tensor([3, 10]), torch.tensor([0, 2]), 1.0)
    with pytest.raises(RuntimeError):
        _decode(q, k, v, torch.tensor([3]), torch.tensor([0, 2]), 1.0)
    with pytest.raises(RuntimeError, match="needs a row"):
        _decode(q, k, v, torch.tensor([], dtype=torch.long), torch.tensor([0, 0]), 1.0)
    # attention_rows' RoPE operands need a row per query row: halves-form tables for half the rows have as many
    # values as pair tables for all of them, and must not be read as those
    x, wqkv, wproj = torch.randn(2, 8), torch.randn(24, 8), torch.randn(8, 8)
    kp, vp = torch.zeros(2, 8, 4), torch.zeros(2, 8, 4)
    lists = (torch.tensor([0, 1]), torch.tensor([0, 0, 1]), torch.tensor([0, 1]), torch.tensor([1, 2]))
    for cos in (torch.randn(1, 4), torch.randn(2, 3)):
        with pytest.raises(RuntimeError, match="a row per row"):
            decode_kernel.attention_rows(x, wqkv, wproj, None, cos, cos, kp, vp, *lists, 0.5, 2, 2)
    for cos in (torch.randn(2, 4), torch.randn(2, 1, 4), torch.randn(2, 2)):      # halves, halves, pairs
        assert decode_kernel.attention_rows(x, wqkv, wproj, None, cos, cos, kp, vp, *lists, 0.5, 2, 2).shape == (2, 8)


def test_core_steps_refuse_a_bad_prefix_pool_before_writing_any():
    """recur_rows checks every step's prefix pools (and the prefix counts' shape and type) before its first layer
    stores into a pool: a later step's bad pool leaves the pools untouched (fails when they are checked only as each
    layer runs); a draft's reads of another length than its steps are refused."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, generator=g)
    wqkv, wproj, wfc, wdown = (torch.randn(*s, generator=g) for s in ((24, 8), (8, 8), (16, 8), (8, 8)))
    lists = (torch.tensor([0, 1]), torch.tensor([0, 0, 1]), torch.tensor([0, 1]), torch.tensor([1, 2]))
    cos = torch.randn(2, 4, generator=g)
    pools = [torch.zeros(2, 8, 4) for _ in range(4)]
    good = [torch.randn(2, 8, 4, generator=g) for _ in range(4)]

    def call(kp, vp, prefix):
        return decode_kernel._load().recur_rows(
            x, 2, "pre", [torch.ones(8)] * 2, [1e-6], [wqkv], [wproj], [None], cos, cos, pools[:2], pools[2:],
            *lists, 0.5, 2, 2, [wfc], [wdown], None, 0.0, None, None, kp, vp, prefix)

    for kp, vp, prefix in ((good[:1] + [torch.zeros(2, 7, 4)], good[2:], torch.tensor([1, 1])),
                           (good[:2], good[2:3] + [None], torch.tensor([1, 1])),
                           (good[:2], good[2:], torch.tensor([1, 1], dtype=torch.int32)),
                           (good[:2], good[2:], torch.tensor([1])), (good[:2], good[2:], None)):
        with pytest.raises(RuntimeError, match="prefix"):
            call(kp, vp, prefix)
        assert not any(p.any() for p in pools)
    with pytest.raises(RuntimeError, match="prefix length outside"):    # a count past a row's list: refused
        call(good[:2], good[2:], torch.tensor([1, 3]))
    call(good[:2], good[2:], torch.tensor([1, 1]))
    assert all(p.any() for p in pools)
    model = random_model("ouro", seed=3, mean_recurrence=4, n_core=1)
    h = torch.zeros(1, 1, model.config.n_embd)
    with pytest.raises(ValueError, match="one \\(kappa, nu\\) per step"):      # not silently fewer steps
        model.recur(h, h, None, None, range(1, 3), reads=[(4, 4)])


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
    real = decode_kernel.rows_attention
    monkeypatch.setattr(decode_kernel, "rows_attention", lambda q, *a: calls.append(q.shape[0]) or real(q, *a))
    from dasspec.model import layers
    monkeypatch.setattr(layers, "kernel_pair", lambda *a: None)       # the sublayers' modules: attention in Python
    batched = dasspec.generate_batch(model, prompts, "ar", max_new_tokens=12, eos=False, max_batch=4)
    assert [r.tokens for r in batched] == alone
    assert 4 in calls                                          # four decoding sequences in one call
    assert max(calls) == sum(map(len, prompts))                # and every prompt row of the prefill in one


def test_rope_in_one_pass_has_the_bits_of_torchs_ops():
    from dasspec.model.layers import rope_operands
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(2, 7, 12, 64, generator=g)
    x = qkv[:, :, :10]                                            # q and k heads: a strided view, as in the layer
    ang = torch.rand(7, 32, generator=g) * 6
    cos2, sin2 = rope_operands(ang.cos(), ang.sin(), False)
    a, b = x.chunk(2, dim=-1)
    want = x * cos2 + torch.cat((-b, a), dim=-1) * sin2
    assert torch.equal(decode_kernel.rope_half(x, cos2, sin2), want)


def test_prompt_blocks_past_the_first_and_past_128_keys_attend_causally():
    """Prompts of several blocks (blocks starting past row 0, ending past 128 keys): greedy AR through the engine
    equals a cache-free full forward, alone and batched, and a batch gives each request its own tokens."""
    model = random_model("ouro", seed=4, mean_recurrence=3, n_core=2)
    prompts = [[(7 * i + 3) % 90 + 5 for i in range(n)] for n in (40, 150)]
    alone = [dasspec.generate(model, p, "ar", max_new_tokens=6, eos=False).tokens for p in prompts]
    with torch.no_grad():
        for p, got in zip(prompts, alone):
            ids = list(p)
            for _ in range(len(got)):
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
            assert ids[len(p):] == got
    batched = dasspec.generate_batch(model, prompts, "ar", max_new_tokens=6, eos=False, max_batch=2)
    assert [r.tokens for r in batched] == alone


@pytest.mark.parametrize("family", ["huginn", "ouro"])
def test_block_by_block_prefill_gives_the_full_forwards_logits_at_every_prompt_row(family):
    """A prompt computed in 16-row blocks over the depth cache gives at every position the bits of one cache-free
    causal forward over the whole prompt (both the row kernel, each row over its own rows)."""
    from dasspec.model.cache import DepthCache
    model = random_model(family, seed=5, mean_recurrence=3, n_core=2)
    T = 150
    ids = torch.tensor([[(7 * i + 3) % 90 + 5 for i in range(T)]])
    with torch.no_grad():
        want = model(ids)[0]
        cache = DepthCache(model.config, model.R, 160, "cpu", torch.float32)
        for s in range(0, T, 16):
            W = min(16, T - s)
            h = model.initial_state(torch.arange(s, s + W), 1.0, 0).unsqueeze(0)
            got = model.full_depth(ids[:, s: s + W], h, model.span(s, s, W), cache)[0]
            assert torch.equal(got, want[s: s + W])


def _pack_everything(monkeypatch):
    """Every float32 CPU product is the kernel's (no threshold left to lower)."""


@pytest.mark.parametrize("family,overrides", [("ouro", {}), ("raven-llama", {}),              # raven-llama: GQA
                                              ("raven-llama", {"qk_bias": True, "n_kv_heads": 4}), ("huginn", {}),
                                              ("raven-olmo", {})])
@pytest.mark.parametrize("method", ["ar", "self-spec"])
def test_sublayers_in_one_call_have_the_bits_of_the_modules_ops(family, overrides, method, monkeypatch):
    """A batched call's attention sublayer (halves-form RoPE, no q/k
    norm) and gated MLP each run as one kernel call, and every sublayer output of every step - prefill, decode
    rows, verification chains - and every token are bit for bit those of the modules' own ops."""
    from dasspec.model import layers
    _pack_everything(monkeypatch)
    model = random_model(family, seed=3, mean_recurrence=4, n_prelude=1, n_core=1, n_coda=1, **overrides)
    prompts = [[5 + i, 9, 11 + 2 * i, 4] * (2 + i) for i in range(3)]

    def run(fused: bool):
        outs, calls = [], {"attention_rows": 0, "mlp_rows": 0}
        hooks = [m.register_forward_hook(lambda m, a, o: outs.append(o.clone())) for m in model.modules()
                 if isinstance(m, (layers.Attention, layers.GatedMLP))]
        with monkeypatch.context() as mp:
            if fused:
                for name in calls:
                    real = getattr(decode_kernel, name)
                    mp.setattr(decode_kernel, name, lambda *a, _n=name, _f=real: calls.__setitem__(_n, calls[_n] + 1)
                               or _f(*a))
            else:
                mp.setattr(layers, "kernel_pair", lambda *a: None)
            res = dasspec.generate_batch(model, prompts, method, max_new_tokens=10, eos=False, max_batch=3)
        for h in hooks:
            h.remove()
        return [r.tokens for r in res], outs, calls

    tokens, outs, calls = run(True)
    tokens_ops, outs_ops, _ = run(False)
    assert tokens == tokens_ops
    assert len(outs) == len(outs_ops) and all(torch.equal(a, b) for a, b in zip(outs, outs_ops))
    assert calls["mlp_rows"] > 0
    # Raven-OLMo norms q and k: its attention keeps the modules' path (Huginn's interleaved RoPE is in the kernel)
    assert (calls["attention_rows"] > 0) == (family != "raven-olmo")


@pytest.mark.parametrize("M", [1, 3, 8, 13, 65, 513])
def test_the_one_call_mlp_has_the_modules_bits_at_every_row_count(M):
    """mlp_rows against the module's ops at row counts on every register-block branch."""
    from dasspec.model.layers import GatedMLP
    from dasspec.testing import tiny_config
    torch.manual_seed(0)
    mlp = GatedMLP(tiny_config("ouro", n_embd=48, head_dim=12, intermediate_size=80)).requires_grad_(False)
    x = torch.randn(M, 48)
    gate, up = decode_kernel.linear(x, mlp.fc.weight).chunk(2, dim=-1)
    want = decode_kernel.linear(decode_kernel.silu_mul(gate, up), mlp.proj.weight)
    assert torch.equal(decode_kernel.mlp_rows(x, mlp.fc.weight, mlp.proj.weight), want)
    assert torch.equal(mlp(x), want)


def test_the_one_call_paths_leave_hooked_or_wrapped_products_and_a_trained_bias_to_the_modules(monkeypatch):
    """A forward hook on a product still runs (its sublayer keeps the modules' path), and a q/k bias that needs its
    gradient is not put through the kernels (they keep no autograd graph)."""
    from dasspec.model import layers
    _pack_everything(monkeypatch)
    model = random_model("raven-llama", seed=3, mean_recurrence=3, n_prelude=1, n_core=1, n_coda=1, qk_bias=True,
                         n_kv_heads=4)
    prompts = [[5, 9, 11, 4] * 3, [7, 3, 9] * 4]
    seen = []
    fc = model.transformer.core_block[0].mlp.fc
    handle = fc.register_forward_hook(lambda m, a, o: seen.append(a[0].shape))
    calls = []
    for name in ("mlp_rows", "pre_layer_rows"):
        monkeypatch.setattr(decode_kernel, name, lambda *a, _f=getattr(decode_kernel, name): calls.append(1) or _f(*a))
    dasspec.generate_batch(model, prompts, "ar", max_new_tokens=4, eos=False, max_batch=2)
    handle.remove()
    assert seen and calls             # the hooked MLP ran its modules (hook called); the others took one call
    captured = []
    monkeypatch.setattr(layers.NormedBlock, "rows", lambda *a: None)       # the sublayers' calls, not the layer's
    real = layers.Attention.forward
    monkeypatch.setattr(layers.Attention, "forward",
                        lambda self, x, span, kv: captured.append((self, x, span, kv)) or real(self, x, span, kv))
    dasspec.generate_batch(model, prompts, "ar", max_new_tokens=6, eos=False, max_batch=2)
    attn, x, span, kv = next(c for c in captured if isinstance(c[2], attention.RaggedSpan) and c[1].shape[1] == 2)
    with torch.no_grad():
        assert attn.rows(x, span, kv) is not None
    attn.qk_bias.requires_grad_(True)
    with torch.enable_grad():
        assert attn.rows(x, span, kv) is None


def _block_outputs(model, prompts, method, block, patch, **knobs) -> tuple[list, list]:
    """The tokens and every ``block`` output of a batched decode (3 prompts, 10 tokens) with ``patch(mp)`` applied
    for its length."""
    outs = []
    hooks = [m.register_forward_hook(lambda m, a, o: outs.append(o.clone())) for m in model.modules()
             if isinstance(m, block)]
    try:
        with pytest.MonkeyPatch.context() as mp:
            patch(mp)
            res = dasspec.generate_batch(model, prompts, method, max_new_tokens=10, eos=False, max_batch=3, **knobs)
    finally:
        for h in hooks:
            h.remove()
    return [r.tokens for r in res], outs


def _same_bits(got: tuple[list, list], want: tuple[list, list], label: str = "") -> None:
    """``_block_outputs`` of two paths: the same tokens and every block output bit for bit."""
    assert got[0] == want[0], label
    assert len(got[1]) == len(want[1]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1])), label


def _counting(mp, names: tuple[str, ...], seen: list, record=lambda *a: 1) -> None:
    """``decode_kernel``'s kernels ``names`` through a wrapper that appends ``record(*args)`` to ``seen``."""
    for name in names:
        real = getattr(decode_kernel, name)
        mp.setattr(decode_kernel, name, lambda *a, _f=real: (seen.append(record(*a)), _f(*a))[1])


@pytest.mark.parametrize("method", ["ar", "self-spec"])
def test_ouros_layer_in_one_call_has_the_bits_of_the_modules_ops(method, monkeypatch):
    """A batched call's whole Ouro layer (four norms, both sublayers, both residual adds)
    runs as one kernel call, and every layer output of every step - prefill, decode rows, verification chains - and
    every token are bit for bit those of the modules' own ops."""
    from dasspec.model.families.ouro import Ouro, PeriNormBlock
    _pack_everything(monkeypatch)
    model = random_model("ouro", seed=3, mean_recurrence=4, n_core=2)
    prompts = [[5 + i, 9, 11 + 2 * i, 4] * (2 + i) for i in range(3)]
    calls = []

    def unfused(mp):
        mp.setattr(PeriNormBlock, "rows", lambda self, x, span, kv: None)
        mp.setattr(Ouro, "recur_rows", lambda *a: None)

    fused = _block_outputs(model, prompts, method, PeriNormBlock, lambda mp: _counting(mp, ("peri_layer_rows",), calls))
    assert len(calls) > 3 * 4 * 2                  # decode steps too, not only the prefill's 4 x 2 layers
    _same_bits(fused, _block_outputs(model, prompts, method, PeriNormBlock, unfused))


@pytest.mark.parametrize("method", ["ar", "self-spec", "das-wave"])
def test_huginns_layer_in_one_call_has_the_bits_of_the_modules_ops(method, monkeypatch):
    """Huginn's sandwich layer (n2(x + attn(n1 x)), then n4(that + mlp(n3 of it)), the RoPE as pairs) runs as one
    kernel call for a batched call, and every layer output of every step and every token are bit for bit those of
    the layer's own calls - and those of the modules' ops, with no sublayer kernel and the RoPE in torch's ops."""
    from dasspec.model import layers
    from dasspec.model.families.huginn import SandwichBlock
    _pack_everything(monkeypatch)
    model = random_model("huginn", seed=3, mean_recurrence=4, n_prelude=1, n_core=2, n_coda=1, qk_bias=True)
    prompts = [[5 + i, 9, 11 + 2 * i, 4] * (2 + i) for i in range(3)]
    calls = []

    def path(mode: str):
        def patch(mp):
            if mode == "layer":
                _counting(mp, ("sandwich_layer_rows",), calls)
            else:
                mp.setattr(SandwichBlock, "rows", lambda self, x, span, kv: None)
            if mode == "torch":                      # the modules' ops, the RoPE as torch's real ops
                mp.setattr(layers, "kernel_pair", lambda *a: None)
                mp.setattr(decode_kernel, "rope_pairs", _rope_pairs_in_torch)
        return _block_outputs(model, prompts, method, SandwichBlock, patch)

    fused = path("layer")
    assert len(calls) > 3 * 2 * 4
    for mode in ("sublayers", "torch"):
        _same_bits(fused, path(mode), mode)


@pytest.mark.parametrize("family,overrides", [("huginn", {"qk_bias": True}), ("ouro", {}),
                                              ("raven-llama", {"n_kv_heads": 4})])
@pytest.mark.parametrize("method,knobs", [("mature-spec", {}), ("self-spec", {"policy": "deep-v"}),
                                          ("mature-spec", {"policy": "k=2,v=3"})])
def test_drafts_reading_the_prefix_at_another_depth_take_one_call(family, overrides, method, knobs, monkeypatch):
    """A draft's layer whose queries read the verified prefix at other depths than they store at (Mature-Spec's
    Deep K/V, self-speculation's Deep V, explicit depths with K and V apart) runs as one kernel call, the prefix
    pools beside the call's own, and every layer output and token are bit for bit those of the layer's sublayer
    calls and of the modules' ops, attention segment by segment (fails when the one call reads the prefix from the
    own pools, or the prefix counts are off)."""
    from dasspec.model import layers
    _pack_everything(monkeypatch)
    model = random_model(family, seed=4, mean_recurrence=4, n_prelude=1, n_core=2, n_coda=1, **overrides)
    prompts = [[5 + i, 9, 11 + 2 * i, 4] * (2 + i) for i in range(3)]
    two = []

    def path(mode: str):
        def patch(mp):
            _counting(mp, ("peri_layer_rows", "pre_layer_rows", "sandwich_layer_rows"), two,
                      lambda x, n, e, a, m: len(a) > 14 and a[14] is not None)
            if mode != "layer":
                mp.setattr(layers.NormedBlock, "rows", lambda self, x, span, kv: None)
            if mode == "torch":         # and attention segment by segment, not through the call's plan
                mp.setattr(layers, "kernel_pair", lambda *a: None)
                mp.setattr(attention, "row_plan", lambda x, kv, span, two_source=False, _f=attention.row_plan:
                           _f(x, kv, span, two_source) if all(p.one_source for p in kv.parts) else None)
        return _block_outputs(model, prompts, method, layers.NormedBlock, patch, **knobs)

    fused = path("layer")
    assert sum(two) > 3 * 2, two                 # the drafts' layers, with the prefix pools
    for mode in ("sublayers", "torch"):
        _same_bits(fused, path(mode), mode)


def test_a_hooked_part_keeps_ouros_layer_on_the_modules(monkeypatch):
    """A forward hook on one of a layer's norms still runs: that layer takes its modules, the others one call."""
    _pack_everything(monkeypatch)
    model = random_model("ouro", seed=3, mean_recurrence=3, n_core=2)
    seen, calls = [], []
    model.transformer.core_block[0].norm_2.register_forward_hook(lambda m, a, o: seen.append(o.shape))
    real = decode_kernel.peri_layer_rows
    monkeypatch.setattr(decode_kernel, "peri_layer_rows", lambda *a: calls.append(1) or real(*a))
    dasspec.generate_batch(model, [[5, 9, 11, 4] * 3, [7, 3, 9] * 4], "ar", max_new_tokens=4, eos=False, max_batch=2)
    assert seen and calls


def test_ouros_one_call_layer_leaves_what_it_cannot_compute_to_the_modules(monkeypatch):
    """q/k norms (not in the kernel) and a layer whose norms differ in eps keep the modules' path (fails when the
    layer's gates skip the attention's own or the eps test)."""
    from dasspec.model.families.ouro import PeriNormBlock
    _pack_everything(monkeypatch)
    fused = []
    real = PeriNormBlock.rows
    monkeypatch.setattr(PeriNormBlock, "rows",
                        lambda self, x, span, kv: (lambda y: fused.append((self, y is not None)) or y)(
                            real(self, x, span, kv)))
    prompts = [[5, 9, 11, 4] * 3, [7, 3, 9] * 4]
    model = random_model("ouro", seed=3, mean_recurrence=3, n_core=2, qk_norm=True)
    dasspec.generate_batch(model, prompts, "ar", max_new_tokens=4, eos=False, max_batch=2)
    assert fused and not any(ok for _, ok in fused)
    fused.clear()
    model = random_model("ouro", seed=3, mean_recurrence=3, n_core=2)
    odd = model.transformer.core_block[0]
    odd.norm_3.eps = odd.norm_1.eps * 10
    dasspec.generate_batch(model, prompts, "ar", max_new_tokens=4, eos=False, max_batch=2)
    assert not any(ok for b, ok in fused if b is odd) and any(ok for b, ok in fused if b is not odd)


@pytest.mark.parametrize("family,method,overrides,knobs", [
    ("ouro", "ar", {}, {}), ("ouro", "self-spec", {}, {}), ("ouro", "das-wave", {}, {}),
    ("ouro", "ar", {"qk_bias": True, "n_kv_heads": 4}, {}), ("nanbeige", "ar", {}, {}),
    ("nanbeige", "self-spec", {}, {}), ("nanbeige", "das-wave", {}, {}), ("huginn", "ar", {"qk_bias": True}, {}),
    ("huginn", "self-spec", {}, {}), ("huginn", "das-wave", {}, {}),
    ("ouro", "mature-spec", {"n_kv_heads": 4}, {"draft_depth": 3}),
    ("nanbeige", "mature-spec", {}, {"policy": "k=2,v=4", "draft_depth": 3}),
    ("huginn", "mature-spec", {"qk_bias": True}, {}), ("huginn", "self-spec", {}, {"policy": "deep-v"})])
def test_core_steps_in_one_call_have_the_bits_of_the_layer_calls(family, method, overrides, knobs, monkeypatch):
    """A batched call's core steps (every layer of every step, each step closed by ln_f) of Ouro's peri-norm layers
    and Nanbeige's pre-norm ones - and Huginn's (each step the adapter over concat[h, e], then its sandwich layers)
    - run as one kernel call, and every recurrence output - prefill, decode rows, verification chains, windows,
    drafts that read the verified prefix at other depths (Mature-Spec's Deep K/V, Deep V, K and V apart) - and
    every token are bit for bit those of the per-layer calls, which are each bit for bit the sublayers' (fails
    when a step's norm, a layer's depth, its q/k bias or its norms' eps is another layer's, or a layer's norms or
    residual adds are another style's, or a draft's step reads the prefix from its own pools or another step's)."""
    from dasspec.model import looped
    from dasspec.model.families import FAMILIES
    from dasspec.model.layers import NormedBlock
    _pack_everything(monkeypatch)
    model = random_model(family, seed=3, mean_recurrence=4, n_core=2, **overrides)
    block = model.transformer.core_block[1]
    for i in range(1, block.norms + 1):           # the second layer's norms with an eps of their own
        setattr(getattr(block, f"norm_{i}"), "eps", 1e-2)
    prompts = [[5 + i, 9, 11 + 2 * i, 4] * (2 + i) for i in range(3)]

    def run(fused: bool):
        outs, calls = [], []
        real_recur = looped.LoopedLM.recur
        with monkeypatch.context() as mp:
            mp.setattr(looped.LoopedLM, "recur", lambda self, *a, **k: (lambda y: outs.append(y.clone()) or y)(
                real_recur(self, *a, **k)))
            if fused == "recurrence":
                real = decode_kernel.recur_rows
                mp.setattr(decode_kernel, "recur_rows", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
            else:
                mp.setattr(type(FAMILIES[family]), "recur_rows", lambda *a: None)
            if fused == "sublayers":
                mp.setattr(NormedBlock, "rows", lambda *a: None)
            if fused == "layers":
                for name in ("peri_layer_rows", "pre_layer_rows", "sandwich_layer_rows"):
                    mp.setattr(decode_kernel, name, lambda *a, _f=getattr(decode_kernel, name): calls.append(0)
                               or _f(*a))
            res = dasspec.generate_batch(model, prompts, method, max_new_tokens=10, eos=False, max_batch=3, **knobs)
        return [r.tokens for r in res], outs, calls

    tokens, outs, calls = run("recurrence")
    assert len(calls) > 3                            # decode steps too, not only the 3 prompts' prefill
    # the drafts' d steps, DAS-Wave's rounds' k updates
    assert any(c < 4 for c in calls) == (method in ("self-spec", "mature-spec", "das-wave"))
    for path in ("layers", "sublayers"):
        tokens_ops, outs_ops, layer_calls = run(path)
        assert (len(layer_calls) > 3 * 2) == (path == "layers"), path      # the decode steps' layers too
        assert tokens == tokens_ops, path
        assert len(outs) == len(outs_ops) and all(torch.equal(a, b) for a, b in zip(outs, outs_ops)), path


@pytest.mark.parametrize("hooked", ["block", "ln_f", "norm"])
def test_a_hooked_block_or_norm_keeps_ouros_core_steps_on_their_calls(hooked, monkeypatch):
    """A forward hook on a core block, on ln_f or on a layer's norm still runs (the steps are not put into one call)."""
    _pack_everything(monkeypatch)
    model = random_model("ouro", seed=3, mean_recurrence=3, n_core=2)
    t = model.transformer
    module = {"block": t.core_block[1], "ln_f": t.ln_f, "norm": t.core_block[0].norm_3}[hooked]
    seen, calls = [], []
    module.register_forward_hook(lambda m, a, o: seen.append(o.shape))
    real = decode_kernel.recur_rows
    monkeypatch.setattr(decode_kernel, "recur_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    dasspec.generate_batch(model, [[5, 9, 11, 4] * 3, [7, 3, 9] * 4], "ar", max_new_tokens=4, eos=False, max_batch=2)
    assert seen and not calls


def test_a_replaced_core_step_or_block_forward_keeps_ouros_core_steps_on_their_calls(monkeypatch):
    """An instance's own core_step or a block's own forward (wrappers, instrumentation) and a class-level replacement
    of the layer's methods are still called: the steps are not put into one call (fails when recur_rows skips them)."""
    from dasspec.model.families.ouro import PeriNormBlock
    _pack_everything(monkeypatch)
    prompts = [[5, 9, 11, 4] * 3, [7, 3, 9] * 4]
    calls = []
    real = decode_kernel.recur_rows
    monkeypatch.setattr(decode_kernel, "recur_rows", lambda *a, **k: calls.append(1) or real(*a, **k))

    def decode(model):
        dasspec.generate_batch(model, prompts, "ar", max_new_tokens=4, eos=False, max_batch=2)

    model = random_model("ouro", seed=3, mean_recurrence=3, n_core=2)
    decode(model)
    assert calls                                  # the plain model takes the one call
    seen = []
    step = model.core_step
    model.core_step = lambda *a, **k: seen.append("core_step") or step(*a, **k)
    block = model.transformer.core_block[1]
    forward = block.forward
    calls.clear()
    decode(model)
    del model.core_step
    block.forward = lambda *a, **k: seen.append("forward") or forward(*a, **k)
    decode(model)
    del block.forward
    with monkeypatch.context() as mp:
        mp.setattr(PeriNormBlock, "rows", lambda self, x, span, kv: seen.append("rows") or None)
        decode(model)
    assert not calls and {"core_step", "forward", "rows"} <= set(seen)


def test_the_recurrences_one_call_takes_once_only_what_every_layer_shares():
    """``layers_agree``: the layers may differ in their weights, q/k bias, pools, norms and eps, but not in what the
    one call takes from the first layer (RoPE tables, the call's rows, scale, heads) - a layer whose scale or RoPE
    table was changed keeps the per-layer calls (fails when it is not asked)."""
    t = [torch.zeros(2) for _ in range(20)]
    attention = (t[0], t[1], None, t[2], t[3], t[4], t[5], t[6], t[7], t[8], t[9], 0.125, 8, 8)
    layer = ([t[10]] * 4, 1e-6, attention, (t[11], t[12]))
    own = ([t[13]] * 4, 1e-5, (t[14], t[15], t[16], t[2], t[3], t[17], t[18]) + attention[7:], (t[19], t[1]))
    assert decode_kernel.layers_agree([layer, own])
    for j, other in ((11, 0.25), (3, torch.zeros(2)), (8, torch.zeros(2)), (12, 16)):
        changed = attention[:j] + (other,) + attention[j + 1:]
        assert not decode_kernel.layers_agree([layer, (layer[0], layer[1], changed, layer[3])]), j


@pytest.mark.parametrize("hd", [64, 40, 8])
def test_queries_grouped_over_one_list_get_the_bits_they_get_alone(hd):
    """Consecutive queries over prefixes of one row list (a prompt block, a chain) are computed in groups that load
    each key and value row once; every query keeps its own arithmetic: the same bits as with lists that start apart
    (no groups), alone, in a group with a prefix read at another depth, on every ISA path."""
    g = torch.Generator().manual_seed(hd)
    H, T = 4, 70
    q, k, v = torch.randn(T, H, hd, generator=g), torch.randn(H, T, hd, generator=g), torch.randn(H, T, hd, generator=g)
    kp, vp = torch.randn(H, T, hd, generator=g), torch.randn(H, T, hd, generator=g)
    lengths = torch.arange(1, T + 1).flip(0)[torch.randperm(T, generator=g)].clamp(min=20)  # unordered lengths
    rows = torch.arange(T)
    grouped = decode_kernel.rows_attention(q, k, v, rows, torch.zeros(T, dtype=torch.long), lengths, 0.2)
    apart = torch.zeros(T, dtype=torch.long)
    apart[1::2] = T
    single = decode_kernel.rows_attention(q, k, v, rows.repeat(2), apart, lengths, 0.2)
    assert torch.equal(grouped, single)
    for s in (0, 5, T - 1):
        alone = decode_kernel.rows_attention(q[s: s + 1], k, v, rows, torch.tensor([0]), lengths[s: s + 1], 0.2)
        assert torch.equal(alone[0], grouped[s])
    prefix = torch.full((T,), 11)
    two = decode_kernel.rows_attention(q, k, v, rows, torch.zeros(T, dtype=torch.long), lengths, 0.2, kp, vp, prefix)
    two_apart = decode_kernel.rows_attention(q, k, v, rows.repeat(2), apart, lengths, 0.2, kp, vp, prefix)
    assert torch.equal(two, two_apart) and not torch.equal(two, grouped)
    isa = decode_kernel.isa()
    try:
        for path in decode_kernel.isas_here():
            decode_kernel.set_isa(path)
            assert torch.equal(decode_kernel.rows_attention(q, k, v, rows, torch.zeros(T, dtype=torch.long), lengths,
                                                            0.2), grouped), path
    finally:
        decode_kernel.set_isa(isa)


REPLACED = ["Attention.forward", "Attention.qkv", "GatedMLP.forward", "RMSNorm.forward", "attn.forward",
            "norm_1.forward"]
REPLACED_CASES = ([(f, t) for f in ("ouro", "nanbeige", "raven-llama", "iquest-loop") for t in REPLACED]
                  + [("iquest-loop", t) for t in ("LoopGate.forward", "gate.forward", "block.mixed")])


@pytest.mark.parametrize("family,target", REPLACED_CASES)
def test_a_replaced_method_the_one_call_paths_would_skip_still_runs(family, target, monkeypatch):
    """Instrumentation that replaces a method a one-call path would skip - a sublayer's forward or ``qkv`` on its
    class, a module's forward on one instance, IQuest-Loop's gate or mixed attention - is called in the batched
    steps as the modules' path calls it: the one-call layers, loops and mixed attention fall back (fails where one
    of them stands in for it)."""
    from dasspec.model import layers
    from dasspec.model.families import iquest
    _pack_everything(monkeypatch)
    kw = dict(n_prelude=1, n_core=1, n_coda=1) if family == "raven-llama" else dict(n_core=2)
    model = random_model(family, seed=3, mean_recurrence=2 if family == "iquest-loop" else 3, **kw)
    block = model.transformer.core_block[0]
    owner, name = target.split(".")
    classes = {"Attention": layers.Attention, "GatedMLP": layers.GatedMLP, "RMSNorm": layers.RMSNorm,
               "LoopGate": iquest.LoopGate}
    where = classes[owner] if owner in classes else {"attn": block.attn, "norm_1": block.norm_1,
                                                      "gate": getattr(block, "gate", None), "block": block}[owner]
    real = getattr(where, name)
    calls = []
    if isinstance(where, type):
        monkeypatch.setattr(where, name, lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    else:
        monkeypatch.setattr(where, name, lambda *a, **k: calls.append(1) or real(*a, **k), raising=False)
    prompts = [[5, 9, 11, 4] * 3, [7, 3, 9] * 4]
    dasspec.generate_batch(model, prompts, "ar", max_new_tokens=4, eos=False, max_batch=2)
    assert len(calls) >= 3, (family, target, len(calls))       # the decode steps' too, not only a prefill's


def _pools_view_by_view(caches, L, steps, reads, two):
    """Every later step's pools read off each sequence's own views: the tensors all of them store into and read
    through the first step's table; None where they differ, or a view has another number of sources than asked."""
    firsts = [c.core_kv(0, reads[0], (steps[0], steps[0])) for c in caches]
    out = []
    for r, read in zip(steps[1:], reads[1:]):
        for i in range(L):
            views = [c.core_kv(i, read, (r, r)) for c in caches]
            v0 = views[0]
            if v0.one_source == two or not attention.prefix_like_own(v0):
                return None
            got = (v0.k_own, v0.v_own, v0.k_prefix, v0.v_prefix)
            if any(v.table is not f.table or any(a is not b for a, b in zip((v.k_own, v.v_own, v.k_prefix,
                                                                             v.v_prefix), got))
                   for v, f in zip(views, firsts)):
                return None
            out.append(got if two else got[:2])
    return out


def test_a_pools_kept_step_pools_are_its_views_pools():
    """``DepthCache.step_pools`` (asked twice: built, then kept) gives what each sequence's own views give for a
    batch of the pool's sequences - the same tensors, None where a view is refused, the same error for a depth
    outside 1..R - for aligned and two-source steps, repeated and unsorted steps, and the same steps asked at other
    reads or sources.  Fails when the kept key leaves out the reads or the sources, or a pool is another layer's or
    step's."""
    import itertools
    from dasspec.model.cache import BlockTable, DepthCache, PagedCache
    from dasspec.testing import tiny_config

    cfg = tiny_config("ouro", n_core=2)
    R, L = 4, cfg.n_core
    pool = DepthCache(cfg, R, 64, "cpu", torch.float32, zeroed=True)
    caches = []
    for blocks in ([1, 2], [5, 3]):
        table = BlockTable(8, 32, "cpu")
        table.append(blocks)
        caches.append(PagedCache(pool, table))

    def outcome(f):
        try:
            got = f()
        except ValueError as e:
            return "error", str(e)
        return "pools", None if got is None else [tuple(map(id, g)) for g in got]

    pairs = [(a, b) for a in range(R + 2) for b in range(R + 2)]            # depths 0 and R + 1 included
    asked = 0
    for steps in [(1, 2, 3, 4), (2, 2, 2), (3, 1, 3), (4, 3), (1,), (2, 5)]:
        for two in (False, True):
            for later in (itertools.product(pairs, repeat=len(steps) - 1) if two else [None]):
                reads = ([(steps[0], R if steps[0] < R else 1)] + list(later) if two
                         else [(r, r) for r in steps])
                want = outcome(lambda: _pools_view_by_view(caches, L, steps, reads, two))
                for _ in range(2):
                    got = outcome(lambda: pool.step_pools(L, tuple(steps[1:]), tuple(reads[1:]), two))
                    assert got == want, (steps, reads, two)
                    asked += 1
    assert asked > 4096 * 2                       # past the kept keys' bound, which only clears them


def test_a_replaced_or_shadowed_part_keeps_the_layer_on_its_modules(monkeypatch):
    """A layer whose norm was replaced by a plain function, or whose MLP an instance attribute shadows (the module
    its forward calls is not the registered one), runs its modules: the function and the shadowing MLP's hook are
    called, and nothing raises (fails when the one-call checks read the registered submodules alone)."""
    import copy

    _pack_everything(monkeypatch)
    prompts = [[5, 9, 11, 4] * 3, [7, 3, 9] * 4]
    model = random_model("ouro", seed=3, mean_recurrence=3, n_core=2)
    want = [r.tokens for r in dasspec.generate_batch(model, prompts, "ar", max_new_tokens=4, eos=False, max_batch=2)]
    block = model.transformer.core_block[1]
    norm = block.norm_2
    seen = []
    del block.norm_2
    block.norm_2 = lambda x: seen.append("norm") or norm(x)
    got = [r.tokens for r in dasspec.generate_batch(model, prompts, "ar", max_new_tokens=4, eos=False, max_batch=2)]
    assert seen and got == want
    block.norm_2 = norm
    shadow = copy.deepcopy(block.mlp)
    shadow.register_forward_hook(lambda m, a, o: seen.append("mlp"))
    object.__setattr__(block, "mlp", shadow)              # an instance attribute beside the registered submodule
    seen.clear()
    got = [r.tokens for r in dasspec.generate_batch(model, prompts, "ar", max_new_tokens=4, eos=False, max_batch=2)]
    assert seen == ["mlp"] * len(seen) and seen and got == want
