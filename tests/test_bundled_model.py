"""The model shipped inside the package: loads with no source, generates, and its intermediate depths are
usable readouts (self-speculation depends on it)."""

from __future__ import annotations

import json

import pytest
import torch

import dasspec
from dasspec.model.checkpoint import BUNDLED_DIR
from dasspec.train import depth_agreement

# Held-out text: written for this test, not in the training corpus.
HELD_OUT = '''def moving_average(values, window):
    """Return the averages of every run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    result = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        result.append(total / window)
    return result


class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, key):
        self.counts[key] = self.counts.get(key, 0) + 1
        return self.counts[key]
'''


@pytest.fixture(scope="module")
def model():
    return dasspec.load_model(device="cpu")


def test_bundled_files_and_size():
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "README.md"):
        assert (BUNDLED_DIR / name).exists(), name
    assert (BUNDLED_DIR / "model.safetensors").stat().st_size <= 40 * 2 ** 20
    gen = json.loads((BUNDLED_DIR / "generation_config.json").read_text())
    assert isinstance(gen["eos_token_id"], int) and isinstance(gen.get("dasspec"), dict)


def test_bundled_model_is_huginn_layout(model):
    cfg = model.config
    assert cfg.family == "huginn" and model.R == 32 and cfg.block_size >= 4096
    assert cfg.tie_embeddings and cfg.qk_bias and cfg.n_core >= 1
    assert model.tokenizer is not None and model.tokenizer.bos_id is not None and model.tokenizer.eos_ids
    assert model.source == str(BUNDLED_DIR)


def test_bundled_model_generates_code(model):
    """Trained on Python source, the model continues a signature with an indented body and does not loop; a broken
    model (scrambled weights, a skipped layer, a lost recurrent state) falls into repeating one line."""
    res = dasspec.generate(model, "def fibonacci(n):", max_new_tokens=24)
    assert len(res.tokens) == 24 and res.text.startswith("\n    "), res.text
    lines = [line for line in res.text.split("\n") if line.strip()]
    assert len(lines) == len(set(lines)) >= 2, res.text


def test_intermediate_readouts_track_full_depth(model):
    ids = torch.tensor(model.tokenizer.encode(HELD_OUT))
    m = depth_agreement(model, ids, depths=(1, 4, 16), window=len(ids))
    a = m["agreement"]
    assert a[16] >= 0.9, a                   # depth 16 is nearly mature
    assert a[1] <= a[4] + 0.02 <= a[16] + 0.04, a  # readouts mature with depth
    assert m["loss"][32] < m["loss"][1], m["loss"]
    vocab = model.config.vocab_size
    assert m["loss"][32] < 0.8 * torch.log(torch.tensor(float(vocab))).item()   # far better than uniform
