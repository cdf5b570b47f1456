"""IQuest-Coder-V1-Loop: loaded from an HF folder as published (config.json, sharded safetensors under the released
tensor names), its logits against the remote code's, its config options refused where not implemented, and its
depth cache holding the real K/V structure (loop 1 whole, loop 2 read only inside the window).

Parity fixtures (tests/fixtures/iquest_parity.safetensors): logits of the remote code's no-cache forward
(``modeling_iquestloopcoder.py``, transcribed outside the repo) on checkpoints ``iquest_reference`` rebuilds from
their seeds: GQA 4/4, 4/2 and 4/1, loop_num 1, 2 and 3, prompts shorter than and well past the window."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import dasspec
from dasspec.model.config import ConfigError
from iquest_reference import IQuestReference, write_iquest_checkpoint

FIXTURES = Path(__file__).parent / "fixtures" / "iquest_parity.safetensors"
TOL = 1e-4


def _cases():
    with safe_open(str(FIXTURES), "pt") as f:
        meta = json.loads(f.metadata()["cases"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return meta, tensors


CASES, TENSORS = _cases()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("iquest")
    return [write_iquest_checkpoint(root / str(n), seed=c["seed"], loop_num=c["loop_num"], window=c["window"],
                                    shape=dict(num_key_value_heads=c["num_key_value_heads"]), n_shards=1 + n % 2)
            for n, c in enumerate(CASES)]


@pytest.mark.parametrize("n", range(len(CASES)), ids=[
    f"kv{c['num_key_value_heads']}-loops{c['loop_num']}-w{c['window']}-T{c['T']}" for c in CASES])
def test_logits_match_the_remote_code_at_every_loop_count(folders, n):
    case = CASES[n]
    model = dasspec.load_model(folders[n], device="cpu", dtype=torch.float32)
    ref = IQuestReference(folders[n])
    ids = TENSORS[f"ids{n}"]
    assert model.R == case["loop_num"] and model.config.loop_window == case["window"]
    for r in range(1, case["loop_num"] + 1):
        want = TENSORS[f"logits{n}_loop{r}"]
        got = model(ids, num_steps=r)[0]
        assert (got - want).abs().max().item() <= TOL, (case, r)
        assert (ref(ids, r)[0] - want).abs().max().item() <= TOL, ("the test's own reference", case, r)
    if case["loop_num"] >= 2:        # the tolerance has teeth: loop 2 moves the logits far beyond it
        assert (TENSORS[f"logits{n}_loop1"] - TENSORS[f"logits{n}_loop2"]).abs().max() > 100 * TOL


def test_the_window_is_what_loop_2_reads(folders):
    """A prompt past the window: the same weights with a window of 1 (loop 2 sees only itself) or one covering the
    whole prompt give other logits - so the fixtures pin the window's edge, not only its presence."""
    n = next(i for i, c in enumerate(CASES) if c["T"] > 3 * c["window"] and c["loop_num"] == 2)
    ids, want = TENSORS[f"ids{n}"], TENSORS[f"logits{n}_loop2"]
    for w in (CASES[n]["window"] - 1, CASES[n]["window"] + 1):
        model = dasspec.load_model(folders[n], device="cpu", dtype=torch.float32)
        for block in model.transformer.core_block:
            block.window = w
        assert (model(ids)[0] - want).abs().max().item() > 100 * TOL, w


def test_bfloat16_loads_and_follows_float32(folders):
    ids = TENSORS["ids1"]
    f32 = dasspec.load_model(folders[1], device="cpu", dtype=torch.float32)
    b16 = dasspec.load_model(folders[1], device="cpu", dtype=torch.bfloat16)
    assert b16.transformer.core_block[0].gate.weight.dtype == torch.bfloat16
    a, b = f32(ids)[0], b16(ids)[0]
    assert (a - b).abs().max().item() < 0.05 * a.abs().max().item()
    out = dasspec.generate(b16, ids[0].tolist(), "ar", max_new_tokens=4, eos=False)
    assert len(out.tokens) == 4


@pytest.mark.parametrize("edit,field", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"dual_chunk_attention_config": {"chunk_size": 8}}, "dual_chunk_attention_config"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"loop_gate_type": "tanh"}, "loop_gate_type"),
    ({"loop_window_size": 0}, "loop_window_size"),
    ({"loop_num": "2"}, "loop_num"),
])
def test_config_options_not_implemented_are_refused_in_one_line(tmp_path, edit, field):
    folder = write_iquest_checkpoint(tmp_path / "m", config_edits=edit)
    with pytest.raises(ConfigError) as err:
        dasspec.load_model(folder, device="cpu")
    assert field in str(err.value) and "\n" not in str(err.value)


def test_head_dim_absent_is_refused_unless_both_references_agree(tmp_path):
    cfg_path = write_iquest_checkpoint(tmp_path / "m") / "config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["head_dim"]                 # hidden 64 / 4 heads = 16, the remote code's default would be 128
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="head_dim"):
        dasspec.load_model(cfg_path.parent, device="cpu")


def test_missing_gate_projections_are_named(tmp_path):
    folder = write_iquest_checkpoint(tmp_path / "m", drop=("model.gate_projections.1.bias",))
    with pytest.raises(Exception, match=r"gate_projections\.1\.bias"):
        dasspec.load_model(folder, device="cpu")


def test_config_round_trips(folders, tmp_path):
    model = dasspec.load_model(folders[3], device="cpu", dtype=torch.float32)
    from dasspec.model.checkpoint import save_checkpoint
    again = dasspec.load_model(save_checkpoint(model, tmp_path / "again", shard_bytes=1 << 16), device="cpu",
                               dtype=torch.float32)
    assert again.config == model.config
    ids = TENSORS["ids3"]
    assert torch.equal(again(ids), model(ids))


def test_cached_decode_is_the_remote_codes_forward_past_the_window(folders):
    """AR over the depth cache (prefill, then one row at a time, 3 windows past the prompt) equals the uncached
    remote-code forward token by token, alone and batched."""
    model = dasspec.load_model(folders[1], device="cpu", dtype=torch.float32)
    ref = IQuestReference(folders[1])
    prompts = [TENSORS["ids1"][0, :20].tolist(), TENSORS["ids1"][0, 20:23].tolist()]
    want = [ref.greedy(p, 24) for p in prompts]
    assert [dasspec.generate(model, p, "ar", max_new_tokens=24, eos=False).tokens for p in prompts] == want
    assert [o.tokens for o in dasspec.generate_batch(model, prompts, "ar", max_new_tokens=24, eos=False)] == want


def test_loop_2_reads_its_own_cache_only_inside_the_window(folders):
    """The depth cache's structure: after a prefill of 30 rows, a decode row at position 30 reads depth 2's K/V
    only at rows (30 - window, 30] - overwriting older depth-2 rows changes nothing - while depth 1's K/V of every
    row is read (overwriting row 0 at depth 1 changes the logits)."""
    from dasspec.model.cache import DepthCache

    model = dasspec.load_model(folders[1], device="cpu", dtype=torch.float32)
    w, T = model.config.loop_window, 30
    ids = TENSORS["ids1"][:, : T + 1]

    def decode(poison):
        cache = DepthCache(model.config, model.R, T + 1, "cpu", torch.float32)
        h = torch.zeros(1, T, model.config.n_embd)
        model.full_depth(ids[:, :T], h, model.span(0, 0, T), cache)
        cache.commit(T)
        poison(cache)
        return model.full_depth(ids[:, T:], h[:, :1], model.span(T, T, 1), cache)[0, -1]

    clean = decode(lambda c: None)
    assert torch.equal(clean, model(ids)[0, -1]) or (clean - model(ids)[0, -1]).abs().max() <= TOL

    def old_depth2(c):
        c.core_k[:, 1, :, : T + 1 - w] = 1e3
        c.core_v[:, 1, :, : T + 1 - w] = 1e3

    assert torch.equal(decode(old_depth2), clean)

    def edge_depth2(c):                  # the oldest row still inside the window
        c.core_v[:, 1, :, T + 1 - w] = 1e3

    assert (decode(edge_depth2) - clean).abs().max() > 1.0

    def first_depth1(c):
        c.core_v[:, 0, :, 0] = 1e3

    assert (decode(first_depth1) - clean).abs().max() > 1.0


def test_the_loop_gate_is_the_same_bits_in_a_call_of_any_size():
    """A row's gate g = sigmoid(q_h . w_h + b_h) must not depend on the other rows of its call (verification and AR
    must compute the same target): torch's einsum changes its product with the row count and torch's sigmoid computes
    a call's tail on another path - at IQuest's widths a row alone got other bits than in a batch."""
    from dasspec.model.families.iquest import LoopGate
    threads = torch.get_num_threads()
    try:
        for th in (1, 2, 5):
            torch.set_num_threads(th)
            for H, hd in ((8, 64), (40, 128), (3, 20)):
                gate = LoopGate(H, hd).requires_grad_(False)
                g = torch.Generator().manual_seed(1)
                gate.weight.copy_(torch.randn(H, hd, generator=g))
                gate.bias.copy_(torch.randn(H, generator=g))
                q = torch.randn(1, 300, H, hd, generator=g).transpose(1, 2)
                full = gate(q)
                want = torch.sigmoid(torch.einsum("bhsd,hd->bhs", q, gate.weight) + gate.bias[None, :, None])
                torch.testing.assert_close(full, want.unsqueeze(-1), rtol=1e-5, atol=1e-6)
                for W in (1, 2, 5, 17, 64):
                    for s0 in (0, 7):
                        assert torch.equal(gate(q[:, :, s0: s0 + W]), full[:, :, s0: s0 + W]), (th, H, hd, W, s0)
    finally:
        torch.set_num_threads(threads)
