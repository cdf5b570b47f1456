"""Loading checkpoints in the Hugging Face layout: single file, shards + index, the local HF cache by repo id,
Huginn's extra tensors, bfloat16; and malformed checkpoints failing before any weight is read, with a message
naming the file / tensor / shapes at fault."""

from __future__ import annotations

import gc
import json
import shutil

import pytest
import torch

import dasspec
import dasspec.model.checkpoint as ckpt
from dasspec import CheckpointError, ConfigError, LoopedLM
from dasspec.testing import random_model
from reference_impl import fake_hf_cache, write_checkpoint, write_tokenizer

IDS = torch.tensor([[5, 17, 3, 99, 42, 8, 61, 7, 23, 11]])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    tok = write_tokenizer("raven-llama")
    return {
        "single": write_checkpoint(root / "single", "raven-llama", vocab_size=320, tokenizer=tok),
        "sharded": write_checkpoint(root / "sharded", "raven-llama", vocab_size=320, n_shards=3, tokenizer=tok),
        "huginn": write_checkpoint(root / "huginn", "huginn", n_shards=2),
    }


def copy_of(folder, tmp_path, name="copy"):
    dst = tmp_path / name
    shutil.copytree(folder, dst)
    return dst


# --- what loads ------------------------------------------------------------------------------------------------

def test_single_file_and_sharded_load_the_same_weights(folders):
    assert not (folders["single"] / "model.safetensors.index.json").exists()
    assert len(list(folders["sharded"].glob("model-0000*-of-00003.safetensors"))) == 3
    a = dasspec.load_model(folders["single"], device="cpu")
    b = dasspec.load_model(folders["sharded"], device="cpu")
    assert a.config.family == b.config.family == "raven-llama"
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb), ka
    assert torch.equal(a(IDS, num_steps=2, init_scale=0), b(IDS, num_steps=2, init_scale=0))
    assert a.tokenizer is not None and a.source == str(folders["single"])
    assert a.dtype == torch.float32 and not any(p.requires_grad for p in a.parameters())


def test_huginn_with_duplicate_head_and_freqs_cis(folders):
    from safetensors import safe_open
    index = json.loads((folders["huginn"] / "model.safetensors.index.json").read_text())["weight_map"]
    assert "freqs_cis" in index and "lm_head.weight" in index
    m = dasspec.load_model(folders["huginn"], device="cpu")
    assert m.config.family == "huginn" and m.config.tie_embeddings
    assert m.lm_head.weight is m.transformer.wte.weight            # tied, the duplicate is not a second tensor
    with safe_open(folders["huginn"] / index["freqs_cis"], "pt") as f:
        table = f.get_tensor("freqs_cis")[0, :, 0]                  # [block_size, hd/2, (cos, sin)]
    torch.testing.assert_close(m.rope_cos, table[..., 0], rtol=0, atol=1e-6)
    torch.testing.assert_close(m.rope_sin, table[..., 1], rtol=0, atol=1e-6)


def test_tied_head_with_a_different_stored_head_is_an_error(folders, tmp_path):
    folder = write_checkpoint(tmp_path / "h", "huginn")
    from safetensors.torch import load_file, save_file
    t = load_file(folder / "model.safetensors")
    t["lm_head.weight"] = t["lm_head.weight"] + 1.0
    save_file(t, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="lm_head.weight differs from transformer.wte.weight"):
        dasspec.load_model(folder, device="cpu")


def test_untied_head_is_the_stored_one(folders):
    m = dasspec.load_model(folders["single"], device="cpu")
    assert m.lm_head.weight is not m.transformer.wte.weight
    assert not torch.equal(m.lm_head.weight, m.transformer.wte.weight)


def test_inv_freq_buffers_are_ignored(tmp_path):
    folder = write_checkpoint(tmp_path / "r", "raven-olmo")
    from safetensors.torch import load_file, save_file
    t = load_file(folder / "model.safetensors")
    t["model.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(t, folder / "model.safetensors")
    assert dasspec.load_model(folder, device="cpu").config.family == "raven-olmo"


def test_hf_repo_id_from_local_cache(folders, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snap = fake_hf_cache(cache, "org/tiny-raven", folders["sharded"])
    assert (snap / "config.json").is_symlink()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    m = dasspec.load_model("org/tiny-raven", device="cpu")
    ref = dasspec.load_model(folders["sharded"], device="cpu")
    assert m.source == str(snap)
    assert torch.equal(m(IDS, num_steps=2, init_scale=0), ref(IDS, num_steps=2, init_scale=0))
    tok = dasspec.load_tokenizer("org/tiny-raven")
    assert tok.encode("The quick brown fox") == ref.tokenizer.encode("The quick brown fox")
    with pytest.raises(CheckpointError, match="'org/missing' is neither a local folder nor in the local Hugging "
                                              "Face cache"):
        dasspec.load_model("org/missing", device="cpu")


def test_bfloat16_smoke(folders):
    m32 = dasspec.load_model(folders["single"], device="cpu", dtype="float32")
    m16 = dasspec.load_model(folders["single"], device="cpu", dtype=torch.bfloat16)
    assert m16.dtype == torch.bfloat16
    a = m32(IDS, num_steps=4, init_scale=0)
    b = m16(IDS, num_steps=4, init_scale=0)
    assert b.dtype == torch.float32                                  # logits are float32 in every dtype
    # bf16 keeps ~3 significant digits; a wrong layout would be off by O(logit scale), not 5% of it
    assert (a - b).abs().max() < 0.05 * a.abs().max() + 0.05
    out = dasspec.generate(m16, IDS[0], max_new_tokens=6, num_steps=2)
    assert len(out.tokens) == 6 and all(0 <= t < m16.config.vocab_size for t in out.tokens)


def test_save_checkpoint_round_trip(tmp_path):
    model = random_model("raven-olmo")
    dasspec.save_checkpoint(model, tmp_path / "m", shard_bytes=20_000)
    assert (tmp_path / "m" / "model.safetensors.index.json").exists()
    back = dasspec.load_model(tmp_path / "m", device="cpu")
    ids = IDS % model.config.vocab_size
    assert torch.equal(model(ids, num_steps=3, init_scale=0), back(ids, num_steps=3, init_scale=0))


def test_cpu_load_stores_linear_weights_in_major_and_still_saves(folders, tmp_path):
    """load_model on CPU re-strides every Linear weight (faster wide passes); values, shapes and saving unchanged."""
    a = dasspec.load_model(folders["huginn"], device="cpu")
    linears = [m for m in a.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.weight.stride() == (1, m.weight.shape[0]) for m in linears)
    assert a.lm_head.weight is a.transformer.wte.weight                 # the tie survives
    dasspec.save_checkpoint(a, tmp_path / "again")
    b = dasspec.load_model(tmp_path / "again", device="cpu")
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb), ka
    fresh = random_model("huginn", seed=1)
    ids = IDS % fresh.config.vocab_size
    ref = fresh(ids, num_steps=3, init_scale=0)
    torch.testing.assert_close(fresh.cpu_weight_layout()(ids, num_steps=3, init_scale=0), ref, rtol=0, atol=1e-5)


def test_bad_dtype_is_named(folders):
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        dasspec.load_model(folders["single"], device="cpu", dtype="int8")


# --- bad checkpoints: clear error, nothing read, nothing half-loaded --------------------------------------------

def looped_models_alive() -> int:
    gc.collect()
    return sum(type(o) is LoopedLM for o in gc.get_objects())


@pytest.fixture
def no_weight_reads(monkeypatch):
    """Counts tensors read from safetensors during a load; a failed load must not read any."""
    reads = []
    real = ckpt.safe_open

    class Spy:
        def __init__(self, *a, **k):
            self._f = real(*a, **k)

        def __enter__(self):
            self._inner = self._f.__enter__()
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

        def keys(self):
            return self._inner.keys()

        def get_slice(self, name):
            return self._inner.get_slice(name)

        def get_tensor(self, name):
            reads.append(name)
            return self._inner.get_tensor(name)

    monkeypatch.setattr(ckpt, "safe_open", Spy)
    return reads


def expect_clean_failure(folder, error, match, reads):
    before = looped_models_alive()
    default_dtype, default_device = torch.get_default_dtype(), torch.get_default_device()
    with pytest.raises(error, match=match) as info:
        dasspec.load_model(folder, device="cpu")
    del info
    assert reads == [], f"tensors were read before the failure: {reads[:3]}"
    assert looped_models_alive() == before, "a partially built model is still reachable"
    assert torch.get_default_dtype() == default_dtype and torch.get_default_device() == default_device


def test_spy_sees_reads_of_a_good_load(folders, no_weight_reads):
    dasspec.load_model(folders["single"], device="cpu")
    assert "lm_head.weight" in no_weight_reads      # the spy works, so an empty list below means something


def test_missing_shard(folders, tmp_path, no_weight_reads):
    folder = copy_of(folders["sharded"], tmp_path)
    (folder / "model-00002-of-00003.safetensors").unlink()
    expect_clean_failure(folder, CheckpointError, "missing shard model-00002-of-00003.safetensors", no_weight_reads)


def test_index_lists_a_tensor_its_shard_lacks(folders, tmp_path, no_weight_reads):
    folder = copy_of(folders["sharded"], tmp_path)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    name = "transformer.ln_f.weight"
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != index["weight_map"][name])
    index["weight_map"][name] = other
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    expect_clean_failure(folder, CheckpointError, f"{other} does not contain {name}", no_weight_reads)


def test_missing_tensor_is_named(tmp_path, no_weight_reads):
    folder = write_checkpoint(tmp_path / "m", "raven-llama", drop=("transformer.core_block.1.mlp.fc.weight",))
    expect_clean_failure(folder, CheckpointError, r"lacks 1 tensor\(s\).*transformer.core_block.1.mlp.fc.weight",
                         no_weight_reads)


def test_untied_checkpoint_without_head_is_named(tmp_path, no_weight_reads):
    folder = write_checkpoint(tmp_path / "m", "raven-olmo", drop=("lm_head.weight",))
    expect_clean_failure(folder, CheckpointError, "lm_head.weight", no_weight_reads)


def test_unexpected_tensor_is_named(tmp_path, no_weight_reads):
    # a Raven config over OLMo weights would silently drop q/k norms; instead the extra tensors are reported
    folder = write_checkpoint(tmp_path / "m", "raven-olmo")
    from safetensors.torch import load_file, save_file
    t = load_file(folder / "model.safetensors")
    t["transformer.adapter.bias"] = torch.zeros(64)
    save_file(t, folder / "model.safetensors")
    expect_clean_failure(folder, CheckpointError, "does not use.*transformer.adapter.bias", no_weight_reads)


def test_shape_mismatch_names_tensor_and_shapes(tmp_path, no_weight_reads):
    # config says 4 kv heads of 16, the weights were made for 2: Wqkv rows differ
    folder = write_checkpoint(tmp_path / "m", "raven-llama", config_edits={"num_key_value_heads": 4})
    expect_clean_failure(folder, CheckpointError,
                         r"shape mismatch for transformer.prelude.0.attn.Wqkv.weight: checkpoint \[192, 128\], "
                         r"config implies \[256, 128\]", no_weight_reads)


def test_vocab_mismatch_names_tensor(tmp_path, no_weight_reads):
    folder = write_checkpoint(tmp_path / "m", "huginn", config_edits={"padded_vocab_size": 256})
    expect_clean_failure(folder, CheckpointError, r"transformer.wte.weight: checkpoint \[128, 48\]", no_weight_reads)


def test_truncated_shard(folders, tmp_path, no_weight_reads):
    folder = copy_of(folders["sharded"], tmp_path)
    shard = folder / "model-00003-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    expect_clean_failure(folder, CheckpointError, "cannot read .*model-00003-of-00003.safetensors", no_weight_reads)


def test_missing_config_and_weights(folders, tmp_path, no_weight_reads):
    folder = copy_of(folders["single"], tmp_path)
    (folder / "config.json").unlink()
    expect_clean_failure(folder, CheckpointError, "missing config.json", no_weight_reads)
    folder = copy_of(folders["single"], tmp_path, "c2")
    (folder / "model.safetensors").unlink()
    expect_clean_failure(folder, CheckpointError, "no model.safetensors or model.safetensors.index.json",
                         no_weight_reads)
    folder = copy_of(folders["single"], tmp_path, "c3")
    (folder / "config.json").write_text("{ not json")
    expect_clean_failure(folder, CheckpointError, "config.json is not valid JSON", no_weight_reads)


def test_bad_config_names_file_and_field(tmp_path, no_weight_reads):
    folder = write_checkpoint(tmp_path / "m", "raven-llama")
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["intermediate_size"]
    (folder / "config.json").write_text(json.dumps(cfg))
    expect_clean_failure(folder, ConfigError, r"config.json: config.json is missing required field intermediate_size",
                         no_weight_reads)


def test_unknown_family(tmp_path, no_weight_reads):
    folder = write_checkpoint(tmp_path / "m", "raven-llama", config_edits={"model_type": "llama"})
    expect_clean_failure(folder, ConfigError, "unsupported model_type 'llama'", no_weight_reads)


def test_bad_sources(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        dasspec.load_model(tmp_path / "nowhere", device="cpu")
    (tmp_path / "file.bin").write_text("x")
    with pytest.raises(CheckpointError, match="is a file; pass the checkpoint folder"):
        dasspec.load_model(tmp_path / "file.bin", device="cpu")
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        dasspec.load_tokenizer(write_checkpoint(tmp_path / "notok", "raven-olmo"))


def test_bad_tokenizer_fails_before_weights(folders, tmp_path, no_weight_reads):
    folder = copy_of(folders["single"], tmp_path)
    (folder / "tokenizer.json").write_text('{"model": 1}')
    expect_clean_failure(folder, CheckpointError, "cannot read .*tokenizer.json", no_weight_reads)


def test_an_unavailable_or_unknown_device_is_refused_up_front(folders):
    with pytest.raises(ValueError, match="unknown device 'gpu0'"):
        dasspec.load_model(folders["single"], device="gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda' is not available"):
            dasspec.load_model(folders["single"], device="cuda")
    else:
        with pytest.raises(ValueError, match="GPU\\(s\\) visible"):
            dasspec.load_model(folders["single"], device=f"cuda:{torch.cuda.device_count()}")
