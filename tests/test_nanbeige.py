"""Nanbeige4.2 loaded from HF folders as upstream saves them, against upstream's own numbers: the fixtures in
tests/fixtures/nanbeige were computed by upstream's modeling_nanbeige.py (README there), so max |d logit| <= 1e-4 in
float32 over seeds, prompt lengths (1 to 40), GQA ratios (4:1, 2:1, 3:1, MHA), square and non-square q / o, and the
loop counts the config allows (num_loops 1, 2, 3, and loop_loss_weights overriding it); greedy continuations through
dasspec's depth cache equal upstream's through its own cache.  Then what the loader refuses (each option upstream
defines and dasspec does not implement, unknown keys) and the pitfalls the tolerance catches."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import dasspec
from dasspec.model.config import ConfigError
from dasspec.model.families.nanbeige import OFF
from reference_impl import nanbeige_config, nanbeige_tensors, write_nanbeige_checkpoint

TOL = 1e-4
FIXTURES = Path(__file__).parent / "fixtures" / "nanbeige"
META = json.loads((FIXTURES / "fixtures.json").read_text())
LOOPS = {"gqa4_loops2_s0": 2, "gqa2_loops2_s1": 2, "mha_loops2_s2": 2, "gqa2_loops1_s3": 1,
         "gqa2_lossweights_s4": 2, "gqa3_loops3_s5": 3}


def case(name: str, dtype=torch.float32):
    model = dasspec.load_model(FIXTURES / name, device="cpu", dtype=dtype)
    fx = load_file(FIXTURES / name / "fixture.safetensors")
    return model, [(fx[f"ids_{j}"], fx[f"logits_{j}"]) for j in range(len(META[name]["lengths"]))]


def worst(model, pairs, **kw) -> float:
    return max((model(ids, **kw) - want).abs().max().item() for ids, want in pairs)


@pytest.mark.parametrize("name", list(META))
def test_logits_match_upstream(name):
    model, pairs = case(name)
    assert model.config.family == "nanbeige" and model.R == LOOPS[name]
    assert worst(model, pairs) <= TOL


@pytest.mark.parametrize("name", list(META))
def test_greedy_through_the_depth_cache_equals_upstreams_cached_greedy(name):
    model, pairs = case(name)
    for (ids, _), want in zip(pairs, META[name]["greedy"]):
        got = dasspec.generate(model, ids[0].tolist(), "ar", max_new_tokens=len(want), eos=False).tokens
        assert got == want


def test_the_loop_count_is_the_depth_and_num_steps_overrides_it():
    """dasspec's depth r is upstream's loop: the 1-loop fixture read at two steps is no longer upstream's 1-loop
    model, and the 2-loop fixture read at one step is not its 2-loop model; num_steps=R is the default."""
    one, pairs = case("gqa2_loops1_s3")
    assert one.R == 1
    assert (one(pairs[1][0], num_steps=2) - pairs[1][1]).abs().max().item() > 100 * TOL
    two, pairs = case("gqa4_loops2_s0")
    assert torch.equal(two(pairs[2][0]), two(pairs[2][0], num_steps=2))
    assert (two(pairs[2][0], num_steps=1) - pairs[2][1]).abs().max().item() > 100 * TOL


def test_bfloat16_load_tracks_float32():
    model, pairs = case("gqa4_loops2_s0", torch.bfloat16)
    assert model.dtype == torch.bfloat16
    ids, want = pairs[2]
    got = model(ids)
    assert got.dtype == torch.float32 and (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8
    assert (got - want).abs().max().item() < 0.5


def test_a_stored_zero_inv_freq_is_ignored(tmp_path):
    """Upstream's inv_freq is a buffer that a meta-device load leaves at zero (and some re-saved checkpoints carry
    it): dasspec computes its own frequencies and ignores any stored ``*.inv_freq``."""
    folder = tmp_path / "m"
    shutil.copytree(FIXTURES / "gqa4_loops2_s0", folder)
    from safetensors.torch import save_file
    sd = load_file(folder / "model.safetensors")
    for i in range(2):
        sd[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)
    save_file(sd, folder / "model.safetensors")
    model = dasspec.load_model(folder, device="cpu", dtype=torch.float32)
    fx = load_file(folder / "fixture.safetensors")
    assert (model(fx["ids_2"]) - fx["logits_2"]).abs().max().item() <= TOL


def test_pitfall_zero_inv_freq_breaks_parity(monkeypatch):
    """RoPE with zero frequencies (the word-salad bug) is caught by the tolerance."""
    model, pairs = case("gqa4_loops2_s0")
    model.rope_cos.fill_(1.0)
    model.rope_sin.fill_(0.0)
    assert worst(model, pairs[1:]) > 100 * TOL


def test_pitfall_norm_only_after_the_last_loop_breaks_parity(monkeypatch):
    """skip_loop_final_norm=true semantics (ln_f only before the head) differ from the released model's."""
    model, pairs = case("gqa2_loops2_s1")
    monkeypatch.setattr(type(model.family), "norm_every_step", False)
    assert worst(model, pairs) > 100 * TOL


def test_pitfall_hidden_over_heads_as_head_dim_is_refused(tmp_path):
    """A loader deriving head_dim = hidden / heads (32 / 4 = 8, the Llama default) instead of reading head_dim
    (16) would build the wrong q / k / v split: the checkpoint's shapes are refused by name."""
    folder = tmp_path / "m"
    shutil.copytree(FIXTURES / "gqa4_loops2_s0", folder)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["head_dim"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match="shape mismatch for model.layers.0.self_attn"):
        dasspec.load_model(folder, device="cpu")


ENABLED = {"qk_layernorm": True, "emb_neighbor_num": 4, "emb_split_num": 2, "ngram_vocab_size_ratio": 2.0,
           "insert_ngram_layer_idx": [0], "ngram_insert_all_layers": True, "ngram_compressed_tokenizer": True,
           "enable_double_loop_split": True, "loop_share_kv": True, "mhc_diff_for_loop": True,
           "mhc_double_stream_position_for_loop": "mid", "enable_hyper_connection": True, "enable_mhc": True,
           "enable_h_res_identity": True, "mhc_identity_nohresparam": True, "enable_depth_attention": True,
           "attention_bias": True, "mlp_bias": True}


@pytest.mark.parametrize("field", list(OFF))
def test_each_unimplemented_option_is_refused_naming_it(field):
    cfg = nanbeige_config()
    names = list(nanbeige_tensors(cfg))
    assert dasspec.LoopedConfig.from_hf(dict(cfg, **{field: OFF[field]}), names).family == "nanbeige"
    with pytest.raises(ConfigError, match=rf"^config field {field}=.* enables a Nanbeige option dasspec does not "
                                          "implement") as err:
        dasspec.LoopedConfig.from_hf(dict(cfg, **{field: ENABLED[field]}), names)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("edit,message", [
    ({"skip_loop_final_norm": True}, "skip_loop_final_norm=true"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling="),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling="),
    ({"hidden_act": "gelu"}, "hidden_act must be 'silu'"),
    ({"use_flux_capacitor": True}, "'use_flux_capacitor'.*does not know"),
    ({"loop_loss_weights": "none"}, "loop_loss_weights must be an array"),
])
def test_other_refusals(edit, message):
    cfg = nanbeige_config()
    with pytest.raises(ConfigError, match=message):
        dasspec.LoopedConfig.from_hf(dict(cfg, **edit), list(nanbeige_tensors(cfg)))


def test_published_fields_and_defaults():
    cfg = nanbeige_config()
    c = dasspec.LoopedConfig.from_hf(cfg, list(nanbeige_tensors(cfg)))
    assert (c.n_prelude, c.n_core, c.n_coda, c.mean_recurrence) == (0, 3, 0, 2)
    assert (c.n_embd, c.n_heads, c.n_kv_heads, c.head_dim) == (32, 4, 2, 16)      # q / o: 64 x 32, not square
    assert (c.rope_theta, c.norm_eps, c.block_size, c.tie_embeddings) == (7e7, 1e-5, 512, False)
    assert c.rope_style == "half" and c.block_style == "pre" and c.init_std == 0.0
    for key in ("num_loops", "loop_loss_weights", "head_dim", "kv_channels", "num_key_value_heads", "rope_theta",
                "rms_norm_eps", "max_position_embeddings"):
        cfg.pop(key)
    cfg["num_attention_heads"] = 2                         # NanbeigeConfig's defaults: 1 loop, head_dim = d / heads
    c = dasspec.LoopedConfig.from_hf(cfg)
    assert (c.mean_recurrence, c.head_dim, c.n_kv_heads, c.rope_theta, c.norm_eps, c.block_size) == \
        (1, 16, 2, 10000.0, 1e-6, 2048)
    assert dasspec.LoopedConfig.from_hf(dict(cfg, loop_loss_weights=[0.2, 0.3])).mean_recurrence == 3


def test_sharded_folder_with_tokenizer_loads(tmp_path):
    from reference_impl import write_tokenizer
    folder = write_nanbeige_checkpoint(tmp_path / "m", vocab_size=320, seed=1, n_shards=3,
                                       tokenizer=write_tokenizer("nanbeige"))
    model = dasspec.load_model(folder, device="cpu")
    assert model.config.family == "nanbeige" and model.tokenizer.token_to_id("<|im_end|>") in model.tokenizer.eos_ids


def test_the_published_layout_at_small_width(tmp_path):
    """The real layout without its weights (benchmarks/nanbeige_files.py: the published config.json, a two-shard
    index, the real vocabulary and special ids) built at width 64 by ``build_real_checkpoint``: it loads in both
    dtypes with all 22 layers x 2 loops and the 166,144-row vocabulary, the tokenizer's BOS / EOS are the published
    ids, and a speculative method equals AR on it."""
    import importlib.util

    from dasspec.testing import build_real_checkpoint

    spec = importlib.util.spec_from_file_location("nanbeige_files",
                                                  Path(__file__).parents[1] / "benchmarks" / "nanbeige_files.py")
    files = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(files)
    src = files.write_files(tmp_path / "files")
    folder = build_real_checkpoint(src, tmp_path / "ckpt", scale="small")
    assert sorted(p.name for p in folder.glob("*.safetensors")) == ["model-00001-of-00002.safetensors",
                                                                   "model-00002-of-00002.safetensors"]
    for dtype in (torch.bfloat16, torch.float32):
        model = dasspec.load_model(folder, device="cpu", dtype=dtype)
        c = model.config
        assert (c.vocab_size, c.n_core, c.mean_recurrence, c.block_size, c.rope_theta) == (166144, 22, 2, 262144, 7e7)
        assert model.dtype == dtype
    tok = model.tokenizer
    assert (tok.bos_id, tok.eos_ids, tok.pad_id) == (166100, [166101], 0)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "2+2?"}], enable_thinking=False),
                     add_special_tokens=False)
    assert ids[0] == 166100 and ids[-6:] == [166103, 13, 13, 166104, 13, 13]        # <think>\n\n</think>\n\n
    ref = dasspec.generate(model, ids, "ar", max_new_tokens=6, eos=False).tokens
    assert dasspec.generate(model, ids, "pld", max_new_tokens=6, eos=False).tokens == ref
