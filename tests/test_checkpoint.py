"""Loading checkpoints in the Hugging Face layout: single file, shards + index, the local HF cache by repo id,
Huginn's extra tensors, bfloat16, the CPU weight layout per dtype, bounded memory; and malformed, hostile or
garbage checkpoints failing before any weight is read (or, for values only reading finds, before a model exists),
with a message naming the file / field / tensor at fault."""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import re
import textwrap
import weakref
from pathlib import Path

import pytest
import torch

import dasspec
import dasspec.model.checkpoint as ckpt
from dasspec import CheckpointError, ConfigError, LoopedLM
from dasspec.testing import random_model
from reference_impl import fake_hf_cache, write_checkpoint, write_ouro_checkpoint, write_tokenizer

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


def test_cpu_loads_keep_linear_weights_contiguous_and_still_save(folders, tmp_path):
    """load_model on CPU, float32 or bfloat16, keeps every Linear weight [out, in] contiguous (the rows the
    kernels' product reads in place); saving is unchanged; a model whose weights were re-strided gets them back
    from cpu_weight_layout with the same values and the same logits bit for bit."""
    a = dasspec.load_model(folders["huginn"], device="cpu")
    linears = [m for m in a.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.weight.is_contiguous() for m in linears)
    assert a.lm_head.weight is a.transformer.wte.weight                 # the tie survives
    dasspec.save_checkpoint(a, tmp_path / "again")
    b = dasspec.load_model(tmp_path / "again", device="cpu")
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb), ka
    m = dasspec.load_model(folders["huginn"], device="cpu", dtype=torch.bfloat16)
    assert all(lin.weight.is_contiguous() for lin in m.modules() if isinstance(lin, torch.nn.Linear))
    fresh = random_model("huginn", seed=1)
    ids = IDS % fresh.config.vocab_size
    ref = fresh(ids, num_steps=3, init_scale=0)
    for lin in fresh.modules():
        if isinstance(lin, torch.nn.Linear):
            lin.weight.data = lin.weight.data.t().contiguous().t()          # in-major strides, same values
    assert not fresh.lm_head.weight.is_contiguous()
    fresh.cpu_weight_layout()
    assert all(lin.weight.is_contiguous() for lin in fresh.modules() if isinstance(lin, torch.nn.Linear))
    assert torch.equal(fresh(ids, num_steps=3, init_scale=0), ref)
    moved = b.to(torch.bfloat16).cpu_weight_layout()
    assert moved.lm_head.weight is moved.transformer.wte.weight
    for (ka, va), (kb, vb) in zip(m.state_dict().items(), moved.state_dict().items()):
        assert ka == kb and torch.equal(va, vb), ka


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_chunked_reads_convert_exactly(folders, monkeypatch, dtype):
    """Tensors are read in chunks far smaller than a tensor (so every chunk boundary is crossed) straight into the
    load's dtype and layout: the values are the stored ones, converted once."""
    from safetensors.torch import load_file
    import dasspec.model.safetensors_io as sio
    monkeypatch.setattr(sio, "CHUNK_BYTES", 100)
    m = dasspec.load_model(folders["sharded"], device="cpu", dtype=dtype)
    stored = {}
    for shard in sorted(folders["sharded"].glob("model-*.safetensors")):
        stored.update(load_file(shard))
    state = m.state_dict()
    assert set(state) == set(stored)
    for k, v in stored.items():
        assert torch.equal(state[k], v.to(dtype)), k


def test_peak_memory_stays_near_the_loaded_size(tmp_path):
    """A bfloat16 load of float32 shards adds the loaded model plus one read chunk to the process's resident
    memory: not the shards' mapped pages, nor a float32 copy of the model or of its largest tensor (the head,
    read last).  Measured in a fresh process: VmHWM after a warm-up load."""
    model = random_model("raven-llama", n_embd=512, n_heads=8, n_kv_heads=2, head_dim=64, intermediate_size=2048,
                         vocab_size=16384, n_prelude=1, n_core=1, n_coda=1)
    dasspec.save_checkpoint(model, tmp_path / "m", shard_bytes=40 << 20)
    del model
    script = textwrap.dedent(f"""
        import json, torch, dasspec
        import dasspec.model.safetensors_io as sio
        from dasspec.model.memory import _proc_bytes, peak_memory, reset_peak_memory
        torch.set_num_threads(1)
        sio.CHUNK_BYTES = 1 << 20
        dasspec.load_model(device="cpu", dtype=torch.bfloat16)       # warm-up (the bundled model): imports, kernels
        base = _proc_bytes("/proc/self/status", "VmRSS")
        reset_peak_memory(torch.device("cpu"))
        m = dasspec.load_model({str(tmp_path / "m")!r}, device="cpu", dtype=torch.bfloat16)
        size = sum(p.numel() * p.element_size() for p in m.parameters())
        print(json.dumps({{"added": peak_memory(torch.device("cpu")) - base, "size": size}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["size"] > 40 << 20                   # the model dominates the process's other allocations
    assert got["added"] <= 1.25 * got["size"] + (1 << 20), got


def test_bad_dtype_is_named(folders):
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        dasspec.load_model(folders["single"], device="cpu", dtype="int8")


# --- bad checkpoints: clear error, nothing read, nothing half-loaded --------------------------------------------

@contextlib.contextmanager
def models_built():
    """Weak references to every LoopedLM constructed inside the block (a meta-device model included)."""
    refs = []
    real_init = LoopedLM.__init__

    def init(self, *args, **kwargs):
        refs.append(weakref.ref(self))
        real_init(self, *args, **kwargs)
    LoopedLM.__init__ = init
    try:
        yield refs
    finally:
        LoopedLM.__init__ = real_init


def still_alive(refs) -> int:
    if any(r() is not None for r in refs):
        gc.collect()                            # only when refcounting alone left one: gc is slow with torch loaded
    return sum(r() is not None for r in refs)


@pytest.fixture
def no_weight_reads(monkeypatch):
    """Counts tensors read during a load (headers and the tied head's spot check are not reads); a failed load
    must not read any."""
    reads = []
    real = ckpt.read_into

    def spy(path, entry, out, *args, **kwargs):
        reads.append(entry.name)
        return real(path, entry, out, *args, **kwargs)

    monkeypatch.setattr(ckpt, "read_into", spy)
    return reads


def expect_clean_failure(folder, error, match, reads, built_none=False, dtype=None):
    """The load fails with ``error`` matching ``match``, having read no tensor (``reads`` from no_weight_reads, or
    None when reading is allowed), left no model reachable and changed no torch default; ``built_none``: not even
    a meta-device model was constructed (the failure came before the module build)."""
    default_dtype, default_device = torch.get_default_dtype(), torch.get_default_device()
    with models_built() as built, pytest.raises(error, match=match) as info:
        dasspec.load_model(folder, device="cpu", dtype=dtype)
    del info
    if reads is not None:
        assert reads == [], f"tensors were read before the failure: {reads[:3]}"
    assert still_alive(built) == 0, "a partially built model is still reachable"
    assert not (built_none and built), "a model was built before the check"
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


# --- garbage refused by name (issue 23) --------------------------------------------------------------------------

def rewrite_tensors(folder, edit) -> None:
    from safetensors.torch import load_file, save_file
    t = load_file(folder / "model.safetensors")
    edit(t)
    save_file(t, folder / "model.safetensors")


@pytest.mark.parametrize("dtype,code", [(torch.int32, "I32"), (torch.bool, "BOOL")])
def test_a_non_float_weight_is_refused_by_name(tmp_path, no_weight_reads, dtype, code):
    folder = write_checkpoint(tmp_path / "m", "raven-olmo")
    rewrite_tensors(folder, lambda t: t.update({"transformer.ln_f.weight": t["transformer.ln_f.weight"].to(dtype)}))
    expect_clean_failure(folder, CheckpointError, f"tensor transformer.ln_f.weight in .*model.safetensors has dtype "
                                                  f"{code}", no_weight_reads)


@pytest.mark.parametrize("value,dtype,shown", [(math.nan, torch.float32, "nan"), (math.inf, torch.bfloat16, "inf"),
                                               (-math.inf, torch.float32, "-inf"),
                                               (1e6, torch.float16, "inf")])   # finite in the file, not in fp16
def test_a_non_finite_weight_is_refused_by_name(tmp_path, value, dtype, shown):
    folder = write_checkpoint(tmp_path / "m", "raven-olmo")
    name = "transformer.core_block.1.mlp.proj.weight"

    def poison(t):
        t[name][3, 5] = value
    rewrite_tensors(folder, poison)
    expect_clean_failure(folder, CheckpointError, rf"tensor {name} in .*model.safetensors holds a non-finite value "
                                                  rf"\({shown} at index \[3, 5\]\)", None, dtype=dtype)


@pytest.mark.parametrize("content,message", [
    ([1, 2], "config.json must hold a JSON object, got a JSON array"),
    ("n_embd", "config.json must hold a JSON object, got a JSON string"),
])
def test_config_of_the_wrong_json_type(tmp_path, no_weight_reads, content, message):
    folder = write_checkpoint(tmp_path / "m", "raven-olmo")
    (folder / "config.json").write_text(json.dumps(content))
    expect_clean_failure(folder, CheckpointError, message, no_weight_reads)


def test_a_bad_config_value_names_file_field_and_value(tmp_path, no_weight_reads):
    folder = write_checkpoint(tmp_path / "m", "huginn", config_edits={"n_embd": 48.7})
    expect_clean_failure(folder, ConfigError, r"config.json: config field n_embd must be a whole number, got 48.7",
                         no_weight_reads)


def test_a_tokenizer_larger_than_the_embedding_is_refused(tmp_path, no_weight_reads):
    folder = write_checkpoint(tmp_path / "m", "raven-llama", vocab_size=128, tokenizer=write_tokenizer("raven-llama"))
    expect_clean_failure(folder, CheckpointError, r"tokenizer.json has token ids up to \d+, but the model's embedding "
                                                  r"\(transformer.wte.weight\) has 128 rows", no_weight_reads)


# --- sizes pinned to the weights and to memory before anything is built (issue 23) --------------------------------

@contextlib.contextmanager
def deadline(seconds: int):
    """Fail (instead of hanging the suite) if the block runs longer than ``seconds``."""
    def expired(*_):
        raise TimeoutError(f"still running after {seconds} s")
    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("layout,edits,message", [
    # Huginn's stored RoPE table pins its context
    ("huginn", {"block_size": 10**10}, r"block_size=10000000000, but the checkpoint's RoPE table freqs_cis "
                                       r"\[1, 4096, 1, 6, 2\] holds 4096 positions"),
    # Raven has no table on disk: memory decides
    ("raven-llama", {"max_position_embeddings": 10**10}, r"loading needs .* GiB for the RoPE table of 10000000000 "
                                                         r"positions"),
    ("raven-olmo", {"n_layers_in_recurrent_block": 10**6, "n_layers": None},
     r"n_layers_in_recurrent_block=1000000, but the checkpoint's transformer.core_block.\* layers number 2"),
    ("raven-olmo", {"n_embd": 10**9, "head_dim": 25 * 10**7},
     r"transformer.wte.weight: checkpoint \[128, 64\], config implies \[128, 1000000000\]"),
    ("raven-olmo", {"intermediate_size": 10**9}, r"intermediate_size=1000000000, but the checkpoint's MLP weights"),
])
def test_config_sizes_are_pinned_to_the_weights_before_building(tmp_path, no_weight_reads, layout, edits, message):
    folder = write_checkpoint(tmp_path / "m", layout, config_edits=edits)
    with deadline(20):                    # unguarded, these build 10^6 layers or allocate terabytes
        expect_clean_failure(folder, CheckpointError, message, no_weight_reads, built_none=True)


def test_weights_larger_than_free_memory_are_refused_before_reading(folders, monkeypatch, no_weight_reads):
    import dasspec.model.memory as memory
    monkeypatch.setattr(memory, "available_memory", lambda device: 10_000_000)  # the RoPE table fits, not the rest
    expect_clean_failure(folders["sharded"], CheckpointError, r"loading needs 1\d.\d MiB for the weights in float32 "
                                                              r"and the RoPE table, but only 9.5 MiB is available",
                         no_weight_reads)


# --- only regular files inside the checkpoint are opened (issue 23) ------------------------------------------------

def edit_index(folder, shard_of: dict) -> None:
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    index["weight_map"].update(shard_of)
    path.write_text(json.dumps(index))


@pytest.mark.parametrize("shard", ["/etc/hostname", "../outside.safetensors", "sub/../../outside.safetensors"])
def test_an_index_cannot_name_files_outside_the_folder(folders, tmp_path, no_weight_reads, monkeypatch, shard):
    folder = copy_of(folders["sharded"], tmp_path)
    shutil.copyfile(folder / "model-00001-of-00003.safetensors", tmp_path / "outside.safetensors")
    opened = []
    real = ckpt.read_header
    monkeypatch.setattr(ckpt, "read_header", lambda p: opened.append(p) or real(p))
    edit_index(folder, {"transformer.ln_f.weight": shard})
    expect_clean_failure(folder, CheckpointError, f"lists shard '{re.escape(shard)}' for transformer.ln_f.weight: "
                                                  "only files inside", no_weight_reads)
    assert opened == []


def test_a_fifo_or_directory_is_never_opened_as_a_weight_file(folders, tmp_path, no_weight_reads):
    folder = copy_of(folders["sharded"], tmp_path)
    shard = folder / "model-00002-of-00003.safetensors"
    shard.unlink()
    os.mkfifo(shard)
    with deadline(10):                    # opening a FIFO for reading waits for a writer that never comes
        expect_clean_failure(folder, CheckpointError, "weight file .*model-00002-of-00003.safetensors is a FIFO",
                             no_weight_reads)
    shard.unlink()
    shard.mkdir()
    expect_clean_failure(folder, CheckpointError, "model-00002-of-00003.safetensors is a directory", no_weight_reads)
    (folder / "config.json").unlink()
    os.mkfifo(folder / "config.json")
    with deadline(10):
        expect_clean_failure(folder, CheckpointError, "config.json .*config.json is a FIFO", no_weight_reads)


def test_tokenizer_side_files_are_checked_like_the_rest(folders, tmp_path, no_weight_reads):
    """tokenizer_config.json / special_tokens_map.json / chat_template.jinja of the wrong type or shape are named
    (a FIFO is never waited on; a JSON array is not an AttributeError; malformed JSON is not skipped)."""
    folder = copy_of(folders["single"], tmp_path)
    config = folder / "tokenizer_config.json"
    config.write_text("[1, 2]")
    expect_clean_failure(folder, CheckpointError, "tokenizer_config.json must hold a JSON object, got a JSON array",
                         no_weight_reads)
    with pytest.raises(CheckpointError, match="tokenizer_config.json must hold a JSON object"):
        dasspec.load_tokenizer(folder)
    config.write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer_config.json is not valid JSON"):
        dasspec.load_tokenizer(folder)
    config.unlink()
    (folder / "special_tokens_map.json").unlink(missing_ok=True)
    os.mkfifo(folder / "special_tokens_map.json")
    with deadline(10):
        expect_clean_failure(folder, CheckpointError, "special_tokens_map.json .* is a FIFO", no_weight_reads)
        with pytest.raises(CheckpointError, match="special_tokens_map.json .* is a FIFO"):
            dasspec.load_tokenizer(folder)
    (folder / "special_tokens_map.json").unlink()
    os.mkfifo(folder / "chat_template.jinja")
    with deadline(10):
        with pytest.raises(CheckpointError, match="chat_template.jinja .* is a FIFO"):
            dasspec.load_tokenizer(folder)


def test_symlink_loops_are_named(folders, tmp_path, no_weight_reads):
    folder = copy_of(folders["single"], tmp_path)
    (folder / "config.json").unlink()
    os.symlink("config.json", folder / "config.json")
    expect_clean_failure(folder, CheckpointError, "cannot open config.json .*config.json: Too many levels of "
                                                  "symbolic links", no_weight_reads)
    folder = copy_of(folders["single"], tmp_path, "c2")
    (folder / "model.safetensors").unlink()
    os.symlink("model.safetensors", folder / "model.safetensors")
    expect_clean_failure(folder, CheckpointError, "cannot open weight file .*model.safetensors", no_weight_reads)
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    with pytest.raises(CheckpointError, match="dangling symlink or a symlink loop"):
        dasspec.load_model(tmp_path / "loop", device="cpu")


def test_hf_cache_ref_cannot_point_outside_the_snapshots(folders, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snap = fake_hf_cache(cache, "org/tiny-raven", folders["sharded"])
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    ref = cache / "models--org--tiny-raven" / "refs" / "main"
    ref.write_text("../../../../elsewhere")
    with pytest.raises(CheckpointError, match=r"refs/main does not hold a commit hash \(21 bytes") as err:
        dasspec.load_model("org/tiny-raven", device="cpu")
    assert "elsewhere" not in str(err.value)            # what a file that is not a ref holds is never quoted
    outside = copy_of(folders["sharded"], tmp_path, "outside")
    evil = "e" * 40
    os.symlink(outside, snap.parent / evil)             # a snapshot that is a link out of the cache
    ref.write_text(evil)
    with pytest.raises(CheckpointError, match="resolves outside"):
        dasspec.load_model("org/tiny-raven", device="cpu")


def test_hf_cache_ref_that_does_not_resolve_is_an_error(folders, tmp_path, monkeypatch):
    """A refs/main linked to a private file is refused unread (the file's first bytes used to appear in the
    message); a ref naming a missing snapshot is an error, never another snapshot loaded in its place."""
    cache = tmp_path / "hub"
    snap = fake_hf_cache(cache, "org/tiny-raven", folders["sharded"])
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    ref = cache / "models--org--tiny-raven" / "refs" / "main"
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2-private-token")
    ref.unlink()
    ref.symlink_to(secret)
    with pytest.raises(CheckpointError, match="symlink that leads outside") as err:
        dasspec.load_model("org/tiny-raven", device="cpu")
    assert "hunter2" not in str(err.value)
    ref.unlink()
    ref.write_text("f" * 40)
    with pytest.raises(CheckpointError, match=f"refs/main names commit {'f' * 40}, but .* does not exist"):
        dasspec.load_model("org/tiny-raven", device="cpu")
    ref.write_text(snap.name)
    assert dasspec.load_model("org/tiny-raven", device="cpu").source == str(snap)     # the cache's own links load


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                                  "generation_config.json", "chat_template.jinja"])
def test_a_symlink_out_of_the_checkpoint_is_refused(folders, tmp_path, no_weight_reads, name):
    """Every file a load opens must lie inside the folder after symlinks: a chat template linked to a private file
    used to make that file's text part of every chat prompt.  Links inside the folder still load."""
    folder = copy_of(folders["single"], tmp_path)
    private = tmp_path / "private" / name
    private.parent.mkdir()
    if (folder / name).exists():
        (folder / name).rename(private)
    else:
        private.write_text("{}" if name.endswith(".json") else "{{ 'SECRET' }}")
    (folder / name).symlink_to(private)
    with pytest.raises(CheckpointError, match=f"{re.escape(name)} .*is a symlink that leads outside") as err:
        dasspec.load_model(folder, device="cpu")
    assert "SECRET" not in str(err.value)
    (folder / name).unlink()
    (folder / "inner").mkdir()
    private.rename(folder / "inner" / name)
    (folder / name).symlink_to(Path("inner") / name)
    dasspec.load_model(folder, device="cpu")


# --- damaged files: a CheckpointError naming the file, never a traceback (issue 23) -------------------------------

@pytest.mark.parametrize("damage,message", [
    (lambda b: b[:5], "shorter than a safetensors header"),
    (lambda b: (10**12).to_bytes(8, "little") + b[8:], "header length 1000000000000 does not fit the file"),
    (lambda b: b[:8] + b"[" + b[9:], "the header is not valid JSON"),
    (lambda b: b[:-100], "data_offsets .* outside the file's"),
])
def test_a_damaged_single_file_is_named(folders, tmp_path, no_weight_reads, damage, message):
    folder = copy_of(folders["single"], tmp_path)
    path = folder / "model.safetensors"
    path.write_bytes(damage(path.read_bytes()))
    expect_clean_failure(folder, CheckpointError, f"cannot read .*model.safetensors: .*{message}", no_weight_reads)


@pytest.mark.parametrize("name,content,message", [
    ("model.safetensors.index.json", [1], "model.safetensors.index.json must hold a JSON object, got a JSON array"),
    ("model.safetensors.index.json", {"weight_map": ["a"]}, "has no weight_map object"),
    ("model.safetensors.index.json", {"weight_map": {"transformer.ln_f.weight": 3}},
     "weight_map entries must map tensor names to file names, got 'transformer.ln_f.weight': 3"),
    ("tokenizer_config.json", ["eos"], "tokenizer_config.json must hold a JSON object, got a JSON array"),
    ("special_tokens_map.json", "x", "special_tokens_map.json must hold a JSON object, got a JSON string"),
    ("generation_config.json", [], "generation_config.json must hold a JSON object, got a JSON array"),
])
def test_json_files_of_the_wrong_type_are_named(folders, tmp_path, no_weight_reads, name, content, message):
    folder = copy_of(folders["sharded"], tmp_path)
    (folder / name).write_text(json.dumps(content))
    expect_clean_failure(folder, CheckpointError, message, no_weight_reads)


# --- Ouro: upstream's tensor names, fused into dasspec's q/k/v and gate/up weights ---------------------------------

@pytest.fixture(scope="module")
def ouro_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("ouro")
    return {"single": write_ouro_checkpoint(root / "single", seed=1),
            "sharded": write_ouro_checkpoint(root / "sharded", seed=1, n_shards=3)}


def test_ouro_single_file_and_sharded_load_the_same_weights(ouro_folders):
    a = dasspec.load_model(ouro_folders["single"], device="cpu")
    b = dasspec.load_model(ouro_folders["sharded"], device="cpu")
    assert a.config.family == b.config.family == "ouro" and (a.config.n_prelude, a.config.n_coda) == (0, 0)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb), ka
    from safetensors import safe_open
    with safe_open(ouro_folders["single"] / "model.safetensors", "pt") as f:       # k sits after q in Wqkv
        k = f.get_tensor("model.layers.2.self_attn.k_proj.weight")
        up = f.get_tensor("model.layers.2.mlp.up_proj.weight")
    assert torch.equal(a.transformer.core_block[2].attn.Wqkv.weight[64:96], k)
    assert torch.equal(a.transformer.core_block[2].mlp.fc.weight[96:], up)


def test_ouro_bfloat16_load(ouro_folders):
    m32 = dasspec.load_model(ouro_folders["sharded"], device="cpu", dtype="float32")
    m16 = dasspec.load_model(ouro_folders["sharded"], device="cpu", dtype="bfloat16")
    assert {p.dtype for p in m16.parameters()} == {torch.bfloat16}        # norms and the gate too, as upstream's
    for exit in ({}, {"exit_threshold": 0.5}, {"exit_at_step": 1}):
        a, b = m32(IDS, **exit), m16(IDS, **exit)
        assert b.dtype == torch.float32 and (a - b).abs().max() < 0.1 * a.abs().max(), exit


def test_ouro_save_round_trip_uses_upstream_names(ouro_folders, tmp_path):
    m = dasspec.load_model(ouro_folders["single"], device="cpu")
    dasspec.save_checkpoint(m, tmp_path / "again")
    from safetensors import safe_open
    with safe_open(tmp_path / "again" / "model.safetensors", "pt") as f, \
            safe_open(ouro_folders["single"] / "model.safetensors", "pt") as g:
        assert set(f.keys()) == set(g.keys())
        assert all(torch.equal(f.get_tensor(k), g.get_tensor(k)) for k in g.keys())
    back = dasspec.load_model(tmp_path / "again", device="cpu")
    assert back.config == m.config


@pytest.mark.parametrize("change,message", [
    ({"drop": ("model.layers.1.self_attn.v_proj.weight",)},
     r"lacks 1 tensor\(s\) of the ouro layout, e.g. model.layers.1.self_attn.v_proj.weight"),
    ({"edit": {"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}},
     "1 tensor.s. the ouro layout does not use, e.g. model.layers.0.self_attn.q_proj.bias"),
    ({"edit": {"model.layers.2.self_attn.k_proj.weight": torch.zeros(64, 64)}},
     r"shape mismatch for model.layers.2.self_attn.k_proj.weight: checkpoint \[64, 64\], config implies \[32, 64\]"),
    ({"edit": {"model.early_exit_gate.bias": torch.zeros(2)}},
     r"shape mismatch for model.early_exit_gate.bias: checkpoint \[2\], config implies \[1\]"),
    ({"config_edits": {"num_hidden_layers": 10**6}},
     r"num_hidden_layers=1000000, but the checkpoint's model.layers.\* layers number 3"),
    ({"config_edits": {"vocab_size": 200}},
     r"model.embed_tokens.weight: checkpoint \[128, 64\], config implies \[200, 64\]"),
    ({"config_edits": {"intermediate_size": 10**9}}, "intermediate_size=1000000000, but the checkpoint's MLP"),
    ({"config_edits": {"layer_types": ["full_attention", "sliding_attention", "full_attention"]}},
     "sliding-window attention layers"),
    ({"config_edits": {"use_sliding_window": True, "layer_types": None, "max_window_layers": 1}},
     "sliding-window attention layers"),
    ({"config_edits": {"hidden_act": "gelu"}}, "hidden_act must be 'silu'"),
    ({"config_edits": {"total_ut_steps": 0}}, "total_ut_steps must be >= 1, got 0"),
    ({"config_edits": {"hidden_size": None}}, "missing required field hidden_size"),
    ({"config_edits": {"tie_word_embeddings": True}}, "lm_head.weight differs from model.embed_tokens.weight"),
])
def test_ouro_checks_name_the_problem_before_reading(tmp_path, no_weight_reads, change, message):
    folder = write_ouro_checkpoint(tmp_path / "m", **change)
    with deadline(20):                    # unguarded, a claim of 10^6 layers builds them
        expect_clean_failure(folder, (ConfigError, CheckpointError), message, no_weight_reads)


def test_ouro_tied_head(tmp_path):
    folder = write_ouro_checkpoint(tmp_path / "m", drop=("lm_head.weight",), config_edits={"tie_word_embeddings": True})
    m = dasspec.load_model(folder, device="cpu")
    assert m.lm_head.weight is m.transformer.wte.weight
