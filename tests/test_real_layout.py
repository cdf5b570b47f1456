"""Huginn-0125's real layout, scaled down: a checkpoint built from the real repository's config.json, shard index
and tokenizer (``dasspec.testing.build_real_checkpoint``, random takase weights, narrow widths) loads through the
real index format, carries the real tokenizer's special ids, the tied head with its duplicate ``lm_head.weight``
and the ``freqs_cis`` buffer, and every method is lossless on it.

The repository files (everything but the weights) come from ``$DASSPEC_HUGINN_FILES``, by default
``../shared/checkpoints/huginn-0125`` beside the repository; without them these tests are skipped.

Ouro-1.4B likewise (``$DASSPEC_OURO_FILES``, default ``../shared/checkpoints/ouro-1.4b``: config.json, the SmolLM2
tokenizer, the ChatML template; no index, so the builder writes one model.safetensors in the config's bfloat16).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import dasspec
from dasspec.testing import SMALL_WIDTHS, build_real_checkpoint, real_config, real_tensor_specs

HUGINN_FILES = Path(os.environ.get("DASSPEC_HUGINN_FILES")
                    or Path(__file__).resolve().parents[2] / "shared" / "checkpoints" / "huginn-0125")
OURO_FILES = Path(os.environ.get("DASSPEC_OURO_FILES")
                  or Path(__file__).resolve().parents[2] / "shared" / "checkpoints" / "ouro-1.4b")
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def src() -> Path:
    missing = [f for f in ("config.json", INDEX, "tokenizer.json") if not (HUGINN_FILES / f).is_file()]
    if missing:
        pytest.skip(f"Huginn-0125 repository files: {HUGINN_FILES} lacks {', '.join(missing)} "
                    "(set DASSPEC_HUGINN_FILES)")
    return HUGINN_FILES


@pytest.fixture(scope="module")
def small(src, tmp_path_factory) -> Path:
    return build_real_checkpoint(src, tmp_path_factory.mktemp("huginn") / "small", scale="small")


@pytest.fixture(scope="module")
def model(small):
    return dasspec.load_model(small, device="cpu")


def test_full_size_plan_is_the_real_index(src):
    """At full size the builder's shapes add up to the real index's total_size to the byte: 77 tensors, fp32."""
    index = json.loads((src / INDEX).read_text())
    specs = real_tensor_specs(real_config(src, "full"), index["weight_map"])
    assert len(specs) == len(index["weight_map"]) == 77
    assert sum(math.prod(s) for s in specs.values()) * 4 == index["metadata"]["total_size"]
    assert specs["transformer.core_block.0.mlp.fc.weight"] == (2 * 17920, 5280)
    assert specs["lm_head.weight"] == specs["transformer.wte.weight"] == (65536, 5280)


def test_small_checkpoint_follows_the_real_index_and_config(src, small):
    index, built = (json.loads((f / INDEX).read_text()) for f in (src, small))
    assert built["weight_map"] == index["weight_map"]                 # same keys, same shard of each
    shards = sorted(set(index["weight_map"].values()))
    assert sorted(p.name for p in small.glob("model-*.safetensors")) == shards
    total = 0
    for shard in shards:
        with safe_open(small / shard, "pt") as f:
            names = set(f.keys())
            assert names == {n for n, s in index["weight_map"].items() if s == shard}, shard
            for n in names:
                t = f.get_slice(n)
                assert t.get_dtype() == "F32", n
                total += math.prod(t.get_shape()) * 4
    assert built["metadata"]["total_size"] == total
    real, cfg = (json.loads((f / "config.json").read_text()) for f in (src, small))
    assert set(cfg) == set(real)
    changed = {k for k in real if cfg[k] != real[k]}
    assert changed == set(SMALL_WIDTHS) | {"init_values"}
    assert cfg["init_values"]["embed_scale"] == pytest.approx(math.sqrt(SMALL_WIDTHS["n_embd"]))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        assert (small / name).read_bytes() == (src / name).read_bytes(), name


def test_loads_through_the_real_index_with_tied_head_and_freqs_cis(small, model):
    cfg = model.config
    assert cfg.family == "huginn" and cfg.tie_embeddings and cfg.qk_bias and cfg.mean_recurrence == 32
    assert (cfg.vocab_size, cfg.n_embd, cfg.n_prelude, cfg.n_core, cfg.n_coda) == (65536, 64, 2, 4, 2)
    assert model.lm_head.weight is model.transformer.wte.weight        # the duplicate is not a second tensor
    weight_map = json.loads((small / INDEX).read_text())["weight_map"]
    with safe_open(small / weight_map["lm_head.weight"], "pt") as f:
        head = f.get_tensor("lm_head.weight")
    with safe_open(small / weight_map["freqs_cis"], "pt") as f:
        table = f.get_tensor("freqs_cis")
    assert weight_map["lm_head.weight"] != weight_map["transformer.wte.weight"]   # another shard, as in the real one
    assert torch.equal(head, model.transformer.wte.weight)
    assert table.shape == (1, 4096, 1, 8, 2)
    torch.testing.assert_close(model.rope_cos, table[0, :, 0, :, 0], rtol=0, atol=1e-6)
    torch.testing.assert_close(model.rope_sin, table[0, :, 0, :, 1], rtol=0, atol=1e-6)


def test_tokenizer_special_ids(model):
    tok = model.tokenizer
    assert tok.bos_id == 65504 and tok.eos_ids[0] == 65505 and tok.pad_id == 65509
    assert tok.token_to_id("<|begin_text|>") == 65504 and tok.token_to_id("<|end_text|>") == 65505
    assert tok.encode("Hello")[0] == 65504                            # the template adds BOS
    assert tok.backend.get_vocab_size(with_added_tokens=True) == model.config.vocab_size == 65536


def test_every_method_is_lossless(model):
    ids = model.tokenizer.encode("The quick brown fox jumps over the lazy dog. The quick brown")
    ar = dasspec.generate(model, ids, "ar", max_new_tokens=8, num_steps=4).tokens
    assert len(ar) == 8
    for method in dasspec.method_names():
        if method == "ar":
            continue
        out = dasspec.generate(model, ids, method, max_new_tokens=8, num_steps=4)
        assert out.tokens == ar, method


# --- Ouro-1.4B ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ouro_src() -> Path:
    missing = [f for f in ("config.json", "tokenizer.json", "tokenizer_config.json") if not (OURO_FILES / f).is_file()]
    if missing:
        pytest.skip(f"Ouro-1.4B repository files: {OURO_FILES} lacks {', '.join(missing)} (set DASSPEC_OURO_FILES)")
    return OURO_FILES


@pytest.fixture(scope="module")
def ouro(ouro_src, tmp_path_factory):
    return dasspec.load_model(build_real_checkpoint(ouro_src, tmp_path_factory.mktemp("ouro") / "small"), device="cpu")


def test_ouro_full_size_plan_is_the_published_model(ouro_src):
    """At full size: 24 layers of 11 tensors + embedding, final norm, gate weight and bias, head = 269 tensors
    holding the published 1,434,652,673 parameters."""
    specs = real_tensor_specs(real_config(ouro_src, "full"))
    assert len(specs) == 269 and sum(math.prod(s) for s in specs.values()) == 1_434_652_673
    assert specs["model.layers.23.mlp.gate_proj.weight"] == (5632, 2048)
    assert specs["model.early_exit_gate.weight"] == (1, 2048) and specs["model.early_exit_gate.bias"] == (1,)


def test_ouro_small_loads_with_the_real_tokenizer_and_chat_template(ouro):
    cfg = ouro.config
    assert (cfg.family, cfg.n_core, cfg.mean_recurrence, cfg.vocab_size, cfg.n_embd) == ("ouro", 24, 4, 49152, 64)
    with safe_open(Path(ouro.source) / "model.safetensors", "pt") as f:
        assert f.get_slice("model.norm.weight").get_dtype() == "BF16"         # the published files' dtype
    tok = ouro.tokenizer
    assert (tok.bos_id, tok.eos_ids, tok.pad_id) == (1, [2], 0)           # <|im_start|>, <|im_end|>, <|endoftext|>
    assert tok.encode("Hello")[0] != tok.bos_id                           # no BOS added: the template starts turns
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text, add_special_tokens=False)
    out = dasspec.generate(ouro, ids, "ar", max_new_tokens=4, eos=False).tokens
    seq = list(ids)
    for _ in range(4):
        seq.append(int(ouro(torch.tensor([seq]))[0, -1].argmax()))
    assert out == seq[len(ids):]
