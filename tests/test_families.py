"""The model-family interface (dasspec/model/families): every family's checkpoint tensors fill every parameter of
its model exactly once, its config.json round-trips, its knob defaults are the ones the methods get, and
detection picks families by model_type, then by the format's own rule."""

from __future__ import annotations

import pytest
import torch

from dasspec.methods import get_method
from dasspec.model.config import ConfigError, LoopedConfig, detect_family
from dasspec.model.families import FAMILIES
from dasspec.model.looped import LoopedLM
from dasspec.testing import tiny_config


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_checkpoint_tensors_fill_every_parameter_once(family, tied):
    cfg = tiny_config(family, tie_embeddings=tied)
    with torch.device("meta"):
        params = {k: tuple(v.shape) for k, v in LoopedLM(cfg).state_dict().items()}
    rows: dict[str, list[int]] = {}
    for name, slot in cfg.spec.tensor_map(cfg, params).items():
        full = params[slot.param]
        assert slot.shape[1:] == full[1:], name
        start = slot.start or 0
        rows.setdefault(slot.param, []).extend(range(start, start + (slot.shape[0] if slot.shape else 1)))
    head_shared = {"lm_head.weight"} if tied else set()
    assert set(rows) == set(params) - head_shared
    for param, covered in rows.items():
        assert sorted(covered) == list(range(params[param][0] if params[param] else 1)), param


@pytest.mark.parametrize("family", list(FAMILIES))
def test_config_round_trip(family):
    cfg = tiny_config(family)
    names = list(cfg.spec.tensor_map(cfg, _params(cfg)))
    assert LoopedConfig.from_hf(cfg.to_hf(), names) == cfg


def _params(cfg):
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in LoopedLM(cfg).state_dict().items()}


def test_detection_by_model_type():
    with pytest.raises(ConfigError, match=r"unsupported model_type 'qwen2'.*'huginn_raven'"):
        detect_family({"model_type": "qwen2"})


@pytest.mark.parametrize("method,knob,values", [
    ("self-spec", "draft_depth", {"huginn": 8, "raven-llama": 4, "raven-olmo": 4}),
    ("self-spec", "block", {"huginn": 8, "raven-llama": 16, "raven-olmo": 16}),
    ("mature-spec", "block", {"huginn": 8, "raven-llama": 16, "raven-olmo": 16}),
    ("das-wave", "k", {"huginn": 2, "raven-llama": 1, "raven-olmo": 1}),
])
def test_family_knob_defaults_reach_the_methods(method, knob, values, monkeypatch):
    knobs = get_method(method).knobs
    for family, value in values.items():                 # the paper's Table 5
        assert knobs.defaults(family)[knob] == value, family
    assert knob not in knobs.defaults("huginn", given={knob})
    monkeypatch.setattr(FAMILIES["raven-olmo"], "knob_defaults", {})      # a family without a schedule
    with pytest.raises(ValueError, match=f"method '{method}' has no default {knob} for model family 'raven-olmo' "
                                         rf"\(known: huginn, raven-llama[^)]*\); give {knob} explicitly"):
        knobs.defaults("raven-olmo", given=set(knobs.names()) - {knob})
