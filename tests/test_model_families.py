"""Every family on small random checkpoints laid out like the real ones: cached incremental decoding equals the
uncached full forward (fp32, zero and seeded-random initial states), AR generation equals greedy decoding with the
full forward, the RoPE variants and llama3 remap, initial states, and bad model inputs."""

from __future__ import annotations

import math

import pytest
import torch

import dasspec
from dasspec.model.cache import DepthCache
from dasspec.model.layers import apply_rope, rope_inv_freq, rope_operands
from dasspec.testing import tiny_config
from reference_impl import (LAYOUTS, LLAMA3_MINI, huginn_freqs_cis, raven_inv_freq, rotate_half,
                            write_checkpoint)

LAYOUT_NAMES = list(LAYOUTS)
TOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    out = {}
    for i, layout in enumerate(LAYOUT_NAMES):
        folder = write_checkpoint(root / layout, layout, seed=10 + i, n_shards=1 + i % 2)
        out[layout] = dasspec.load_model(folder, device="cpu", dtype=torch.float32)
    return out


def prompt(n: int, vocab: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def cached_logits(model, ids: torch.Tensor, R: int, chunks: list[int], init_scale: float, seed: int):
    """Logits of every position, computed chunk by chunk against the depth cache: the first chunk is a prefill
    (causal from row 0), later chunks are blocks over a materialised prefix (bottom-right causal)."""
    assert sum(chunks) == ids.numel()
    cache = DepthCache(model.config, R, ids.numel(), model.device, model.dtype)
    h0 = model.initial_state(torch.arange(ids.numel()), init_scale, seed).unsqueeze(0)
    rows = []
    for w in chunks:
        n = cache.n
        rows.append(model.full_depth(ids[None, n: n + w], h0[:, n: n + w], model.span(n, n, w), cache, R)[0])
        cache.commit(w)
    return torch.cat(rows)


@pytest.mark.parametrize("init_scale,seed", [(0.0, 0), (1.0, 7)], ids=["zero-state", "seeded-state"])
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_cached_incremental_equals_uncached(models, layout, init_scale, seed):
    model = models[layout]
    ids = prompt(24, seed=1)
    R = 5
    full = model(ids[None], num_steps=R, init_scale=init_scale, seed=seed)[0]
    for chunks in ([24], [10] + [1] * 6 + [3, 5]):
        inc = cached_logits(model, ids, R, chunks, init_scale, seed)
        err = (inc - full).abs().max().item()
        assert err <= TOL, f"{layout} chunks={chunks}: max |dlogit| {err:.2e}"
    if init_scale:   # the random state matters (otherwise this case would not test anything new)
        zero = model(ids[None], num_steps=R, init_scale=0.0)[0]
        assert (zero - full).abs().max() > 10 * TOL


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("init_scale", [0.0, 1.0])
def test_ar_generation_equals_full_forward_greedy(models, layout, init_scale):
    model = models[layout]
    ids = prompt(9, seed=2).tolist()
    R, N = 4, 8
    out = dasspec.generate(model, ids, method="ar", max_new_tokens=N, num_steps=R, init_scale=init_scale,
                           state_seed=3, eos=False)
    seq = list(ids)
    for _ in range(N):
        logits = model(torch.tensor([seq]), num_steps=R, init_scale=init_scale, seed=3)
        seq.append(int(logits[0, -1].argmax()))
    assert out.tokens == seq[len(ids):]
    assert out.stats.new_tokens == N and out.stop_reason == "max_new_tokens"


def test_default_depth_is_mean_recurrence(models):
    model = models["raven-olmo"]
    ids = prompt(6)[None]
    assert model.R == model.config.mean_recurrence == 8
    assert torch.equal(model(ids, init_scale=0), model(ids, num_steps=8, init_scale=0))
    assert not torch.equal(model(ids, init_scale=0), model(ids, num_steps=7, init_scale=0))


def test_batched_forward_equals_rows(models):
    model = models["raven-llama"]
    ids = torch.stack([prompt(12, seed=4), prompt(12, seed=5)])
    both = model(ids, num_steps=3, init_scale=1.0, seed=1)
    for b in range(2):
        one = model(ids[b: b + 1], num_steps=3, init_scale=1.0, seed=1)
        assert (both[b] - one[0]).abs().max() <= 1e-5


def test_heads(models):
    assert models["huginn"].lm_head.weight is models["huginn"].transformer.wte.weight
    for layout in ("raven-llama", "raven-tinyllama", "raven-olmo"):
        m = models[layout]
        assert m.lm_head.weight is not m.transformer.wte.weight


def test_layouts_are_what_the_config_says(models):
    assert models["raven-llama"].config.n_kv_heads == 2 and models["raven-llama"].config.n_heads == 8
    assert models["raven-tinyllama"].config.rope_theta == 10000.0
    olmo_attn = models["raven-olmo"].transformer.core_block[0].attn
    assert olmo_attn.q_norm.weight.shape == (4 * 16,)       # one norm over the whole q projection, not per head
    assert models["huginn"].transformer.prelude[0].attn.qk_bias.shape == (2, 1, 4, 12)


# --- RoPE ------------------------------------------------------------------------------------------------------

def test_interleaved_rope_is_huginns_complex_rotation():
    cfg = tiny_config("huginn")
    x = torch.randn(1, 5, 3, cfg.head_dim)
    pos = torch.tensor([0, 1, 7, 100, 255])
    table = huginn_freqs_cis(cfg.rope_theta, cfg.head_dim, 256)[0, :, 0]         # [n_pos, hd/2, 2]
    cos, sin = table[pos, :, 0], table[pos, :, 1]
    ours = apply_rope(x, rope_operands(cos, sin, interleaved=True), interleaved=True)
    xc = torch.view_as_complex(x.reshape(1, 5, 3, -1, 2).contiguous())
    rot = torch.complex(table[pos, :, 0], table[pos, :, 1])[None, :, None, :]
    want = torch.view_as_real(xc * rot).reshape(x.shape)
    torch.testing.assert_close(ours, want, rtol=0, atol=1e-5)


def test_half_rope_is_hf_rotate_half():
    cfg = tiny_config("raven-olmo")
    x = torch.randn(1, 4, 2, cfg.head_dim)
    pos = torch.tensor([0, 3, 50, 200])
    freqs = pos.float()[:, None] * raven_inv_freq(cfg.rope_theta, cfg.head_dim, None)[None]
    ours = apply_rope(x, rope_operands(freqs.cos(), freqs.sin(), interleaved=False), interleaved=False)
    emb = torch.cat((freqs, freqs), -1)[None, :, None]
    torch.testing.assert_close(ours, x * emb.cos() + rotate_half(x) * emb.sin(), rtol=0, atol=1e-6)


def test_llama3_remap_matches_reference_in_all_three_bands():
    cfg = tiny_config("raven-llama", n_embd=64, n_heads=4, n_kv_heads=2, head_dim=16, rope_scaling=LLAMA3_MINI)
    base = raven_inv_freq(cfg.rope_theta, 16, None)
    want = raven_inv_freq(cfg.rope_theta, 16, LLAMA3_MINI)
    torch.testing.assert_close(rope_inv_freq(cfg), want, rtol=1e-6, atol=0)
    wl = 2 * math.pi / base
    L = LLAMA3_MINI["original_max_position_embeddings"]
    assert (wl < L / 4).any() and (wl > L).any() and ((wl >= L / 4) & (wl <= L)).any()
    assert torch.equal(want[wl < L / 4], base[wl < L / 4])
    torch.testing.assert_close(want[wl > L], base[wl > L] / 32)
    mid = (wl >= L / 4) & (wl <= L)
    assert ((want[mid] < base[mid]) & (want[mid] > base[mid] / 32)).all()


def test_no_scaling_for_rope_type_default():
    cfg = tiny_config("raven-olmo", rope_scaling={"rope_type": "default"})
    torch.testing.assert_close(rope_inv_freq(cfg), raven_inv_freq(cfg.rope_theta, cfg.head_dim, None))


# --- initial states ---------------------------------------------------------------------------------------------

def test_initial_states(models):
    for layout, model in models.items():
        cfg = model.config
        pos = torch.arange(4000)
        assert torch.count_nonzero(model.initial_state(pos[:10], init_scale=0.0)) == 0
        s = model.initial_state(pos, init_scale=1.0, seed=5)
        assert torch.equal(s, model.initial_state(pos, init_scale=1.0, seed=5))             # seeded
        assert not torch.equal(s, model.initial_state(pos, init_scale=1.0, seed=6))
        assert torch.equal(s[[17, 3000]], model.initial_state(torch.tensor([17, 3000]), 1.0, seed=5))  # by position
        sigma = cfg.init_std * cfg.embed_scale            # Huginn scales the state by sqrt(d); Raven does not
        # a normal truncated at +-3 sigma has std 0.9866 sigma
        assert s.std().item() == pytest.approx(0.9866 * sigma, rel=0.02), layout
        assert s.abs().max().item() <= 3 * sigma * (1 + 1e-5)
        torch.testing.assert_close(model.initial_state(pos[:50], 0.5, 5), 0.5 * s[:50])
    assert models["raven-llama"].config.embed_scale == 1.0 and models["huginn"].config.embed_scale > 6


# --- bad inputs -------------------------------------------------------------------------------------------------

def test_model_input_errors(models):
    model = models["huginn"]
    with pytest.raises(ValueError, match="num_steps must be >= 1, got 0"):
        model(prompt(4)[None], num_steps=0)
    with pytest.raises(ValueError, match="num_steps must be a whole number, got 2.5"):
        model(prompt(4)[None], num_steps=2.5)              # not silently truncated to 2
    with pytest.raises(ValueError, match="empty input"):
        model(torch.zeros(1, 0, dtype=torch.long), num_steps=1)
    with pytest.raises(ValueError, match="beyond the model context"):
        model(torch.zeros(1, model.config.block_size + 1, dtype=torch.long), num_steps=1)
