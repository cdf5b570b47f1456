"""GPU execution options run on CPU too and change no token: static-shape attention (every method) and
torch.compile of the primitives."""

from __future__ import annotations

import warnings

import pytest
import torch

import dasspec
from dasspec.testing import random_model

METHODS = [("ar", {}), ("self-spec", {"draft_depth": 2, "block": 4}),
           ("mature-spec", {"draft_depth": 2, "block": 4, "policy": "deep-v"}),
           ("das-wave", {"gamma": 6, "rounds": 5}), ("das-wave", {"gamma": 6, "rounds": 5, "policy": "deep-k"}),
           ("pld", {}), ("lookahead", {}), ("token-recycling", {"reset": True}), ("sam", {})]


@pytest.mark.parametrize("family", ["huginn", "raven-llama", "raven-olmo"])
def test_static_shapes_change_no_token(family: str) -> None:
    model = random_model(family, seed=1, mean_recurrence=5)
    prompts = [list(range(3, 15)), [5, 6, 7, 5, 6, 7, 5, 6], list(range(40, 70, 2))]
    for i, prompt in enumerate(prompts):
        model.static_shapes = False
        ref = dasspec.generate(model, prompt, "ar", max_new_tokens=12, eos=False, seed=i, init_scale=i % 2)
        model.static_shapes = True
        try:
            for method, knobs in METHODS:
                out = dasspec.generate(model, prompt, method, max_new_tokens=12, eos=False, seed=i,
                                       init_scale=i % 2, **knobs)
                assert out.tokens == ref.tokens, (family, i, method, knobs)
        finally:
            model.static_shapes = False


def test_static_shapes_with_a_prefix_cache() -> None:
    """The cached rows load into a static-shape cache (zeroed, attended in full) and the rest of the prompt runs
    there: tokens equal eager AR with the same prefix cache."""
    model = random_model("raven-llama", seed=4, mean_recurrence=5)
    prefix = [5, 6, 7, 8] * 4
    pc = dasspec.PrefixCache(model, prefix, init_scale=1.0)
    prompts = [prefix + [9, 10, 11], prefix + [3, 5, 6, 7, 8]]
    refs = [dasspec.generate(model, p, "ar", max_new_tokens=10, eos=False, prefix_cache=pc).tokens for p in prompts]
    model.static_shapes = True
    try:
        for prompt, ref in zip(prompts, refs):
            for method, knobs in (("ar", {}), ("das-wave", {"gamma": 6, "rounds": 5}), ("pld", {})):
                out = dasspec.generate(model, prompt, method, max_new_tokens=10, eos=False, prefix_cache=pc, **knobs)
                assert out.tokens == ref and out.stats.cached_tokens == len(prefix), (method, prompt)
    finally:
        model.static_shapes = False


def test_static_span_visibility_matches_dynamic() -> None:
    model = random_model("huginn")
    dyn = model.span(5, 7, 3)
    st = model.span(5, 7, 3, static_capacity=16)
    want = torch.zeros(3, 16, dtype=torch.bool)
    want[:, :10] = dyn.mask
    assert torch.equal(st.visible, want)
    assert torch.equal(st.vis_prefix | st.vis_own, want) and not (st.vis_prefix & st.vis_own).any()
    assert st.vis_prefix[:, 5:].sum() == 0 and st.rows.tolist() == [7, 8, 9]


def test_compiled_primitives_give_the_same_tokens() -> None:
    model = random_model("huginn", seed=2, mean_recurrence=1)
    prompt = list(range(3, 11))
    ref = dasspec.generate(model, prompt, "ar", max_new_tokens=3, eos=False).tokens
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dasspec.optimize(model, compile=True)
        out = dasspec.generate(model, prompt, "ar", max_new_tokens=3, eos=False).tokens
    assert out == ref and model.compiled and model.static_shapes


def test_cuda_graphs_need_cuda() -> None:
    model = random_model("huginn")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(ValueError, match="CUDA"):
        dasspec.optimize(model, cuda_graphs=True)


def test_gpu_check_script_runs_on_cpu(tmp_path):
    """benchmarks/gpu_check.py is prepared for a lent GPU's few minutes; its CPU path keeps it from rotting."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--shape", "tiny", "--out", str(tmp_path), "--modes", "eager,static", "--new-tokens", "6",
                     "--prompt-len", "12", "--reps", "1"]) == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [(r["mode"], r["method"]) for r in result["runs"]] == [
        ("eager", "ar"), ("eager", "das-wave"), ("static", "ar"), ("static", "das-wave")]
    assert all(r["same_tokens_as_eager_ar"] for r in result["runs"])       # float32 on CPU: lossless
    assert (tmp_path / "gpu_check.md").exists()
