"""Execution options (``dasspec.Runtime``) run on CPU too and change no token: static-shape attention (every
method) and torch.compile of the primitives; none of them touches the model or process-wide settings."""

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
    static = dasspec.Runtime(static_shapes=True)
    for i, prompt in enumerate(prompts):
        ref = dasspec.generate(model, prompt, "ar", max_new_tokens=12, eos=False, seed=i, init_scale=i % 2)
        for method, knobs in METHODS:
            out = dasspec.generate(model, prompt, method, max_new_tokens=12, eos=False, seed=i,
                                   init_scale=i % 2, runtime=static, **knobs)
            assert out.tokens == ref.tokens, (family, i, method, knobs)


def test_static_shapes_with_a_prefix_cache() -> None:
    """Rows cached under static shapes load into a static-shape cache (zeroed, attended in full) and the rest of
    the prompt runs there: tokens equal eager AR with an eager prefix cache (a cache serves only its own runtime)."""
    model = random_model("raven-llama", seed=4, mean_recurrence=5)
    prefix = [5, 6, 7, 8] * 4
    eager = dasspec.PrefixCache(model, prefix, init_scale=1.0)
    prompts = [prefix + [9, 10, 11], prefix + [3, 5, 6, 7, 8]]
    refs = [dasspec.generate(model, p, "ar", max_new_tokens=10, eos=False, prefix_cache=eager).tokens
            for p in prompts]
    static = dasspec.Runtime(static_shapes=True)
    pc = dasspec.PrefixCache(model, prefix, init_scale=1.0, runtime=static)
    for prompt, ref in zip(prompts, refs):
        for method, knobs in (("ar", {}), ("das-wave", {"gamma": 6, "rounds": 5}), ("pld", {})):
            out = dasspec.generate(model, prompt, method, max_new_tokens=10, eos=False, prefix_cache=pc,
                                   runtime=static, **knobs)
            assert out.tokens == ref and out.stats.cached_tokens == len(prefix), (method, prompt)


def test_static_span_visibility_matches_dynamic() -> None:
    model = random_model("huginn")
    dyn = model.span(5, 7, 3)
    st = model.span(5, 7, 3, static_capacity=16)
    want = torch.zeros(3, 16, dtype=torch.bool)
    want[:, :10] = dyn.mask
    assert torch.equal(st.mask, want)
    prefix, own = st.source_masks()
    assert torch.equal(prefix | own, want) and not (prefix & own).any()
    assert prefix[:, 5:].sum() == 0 and st.rows.tolist() == [7, 8, 9]
    dyn_prefix, dyn_own = dyn.source_masks()                     # the dynamic split: rows [0, n) and [n, end)
    assert torch.equal(dyn_prefix, want[:, :5]) and torch.equal(dyn_own, want[:, 5:10])


def test_compiled_primitives_give_the_same_tokens() -> None:
    """torch.compile through a Runtime: same tokens; the model object and dynamo's process-wide recompile limit are
    left as they were (the limit is raised for the compiled primitives only)."""
    from torch._dynamo import config as dynamo_config

    model = random_model("huginn", seed=2, mean_recurrence=1)
    prompt = list(range(3, 11))
    ref = dasspec.generate(model, prompt, "ar", max_new_tokens=3, eos=False).tokens
    attrs, limit = dict(vars(model)), dynamo_config.recompile_limit
    rt = dasspec.Runtime(compile=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = dasspec.generate(model, prompt, "ar", max_new_tokens=3, eos=False, runtime=rt).tokens
    assert out == ref and rt.static_shapes
    assert rt.primitives(model) is rt.primitives(model) is not model          # compiled once, kept by the runtime
    assert vars(model).keys() == attrs.keys() and dynamo_config.recompile_limit == limit
    assert dasspec.generate(model, prompt, "ar", max_new_tokens=3, eos=False).tokens == ref   # eager again


def test_cuda_graphs_need_cuda() -> None:
    model = random_model("huginn")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(ValueError, match="CUDA"):
        dasspec.generate(model, [3, 4, 5], max_new_tokens=2, runtime=dasspec.Runtime(cuda_graphs=True))


def test_peak_memory_is_measured_only_when_asked(monkeypatch) -> None:
    """A plain generate call leaves process-wide counters alone (no peak-memory window); a benchmark's Runtime
    with track_memory=True opens one and reports the peak."""
    from dasspec.engine.api import engine

    opened = []
    monkeypatch.setattr(engine, "reset_peak_memory", lambda device: opened.append(device))
    model = random_model("huginn", mean_recurrence=2)
    out = dasspec.generate(model, [3, 4, 5], max_new_tokens=2)
    assert opened == [] and out.stats.peak_memory is None
    out = dasspec.generate(model, [3, 4, 5], max_new_tokens=2, runtime=dasspec.Runtime(track_memory=True))
    assert len(opened) == 1 and (out.stats.peak_memory is None or out.stats.peak_memory > 0)


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
