"""Every method runs in bfloat16 (the CUDA default) on every family, loaded the way users load checkpoints, with
eager and static-shape execution.  CPU stands in for the GPU here: the dtype paths (masks, carried states, tree
compaction, the depth cache) are the same.  Tokens may differ from bf16 AR after the first (near-tie flips across
pass widths, paper sec. B.3); the first comes from the same full-depth prefill for every method, so it must match."""

from __future__ import annotations

import pytest
import torch

import dasspec
from dasspec.methods import method_names
from dasspec.testing import random_model

torch.set_num_threads(1)

PROMPT = [5, 9, 13, 7, 22, 31] * 4          # repeats, so retrieval drafts and copy seeds get accepted
NEW = 16


@pytest.fixture(scope="module", params=["huginn", "raven-llama", "raven-olmo"])
def bf16_model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param) / "ckpt"
    dasspec.save_checkpoint(random_model(request.param, mean_recurrence=16), folder)   # R > self-spec d = 8
    model = dasspec.load_model(folder, device="cpu", dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    return model


@pytest.mark.parametrize("static_shapes", [False, True], ids=["eager", "static"])
def test_every_method_runs_in_bfloat16(bf16_model, static_shapes):
    model = dasspec.optimize(bf16_model, static_shapes=static_shapes)
    try:
        ref = dasspec.generate(model, PROMPT, "ar", max_new_tokens=NEW, eos=False)
        assert len(ref.tokens) == NEW
        for method in method_names():
            out = dasspec.generate(model, PROMPT, method, max_new_tokens=NEW, eos=False)
            assert len(out.tokens) == NEW, method
            assert all(0 <= t < model.config.vocab_size for t in out.tokens), method
            assert out.tokens[0] == ref.tokens[0], method
            assert out.stats.sequential_passes > 0, method
        wave = dasspec.generate(model, PROMPT, "das-wave", max_new_tokens=NEW, eos=False, guesses="copy",
                                trim=True, seed_branch=8, copy_run=True, early_stop=True, gamma=8, rounds=4,
                                w_init=8, k=1)
        assert len(wave.tokens) == NEW and wave.tokens[0] == ref.tokens[0]
    finally:
        dasspec.optimize(model, static_shapes=False)
