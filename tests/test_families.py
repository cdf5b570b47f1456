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
from reference_impl import ouro_config, ouro_tensors


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


def test_ouro_config_reads_upstream_fields_and_defaults():
    cfg = ouro_config()
    c = LoopedConfig.from_hf(cfg, ouro_tensors(cfg))
    assert (c.family, c.n_prelude, c.n_core, c.n_coda, c.mean_recurrence) == ("ouro", 0, 3, 0, 4)
    assert (c.n_embd, c.n_heads, c.n_kv_heads, c.head_dim, c.intermediate_size) == (64, 4, 2, 16, 96)
    assert c.rope_theta == 1e6 and c.block_size == 512 and c.norm_eps == 1e-6 and not c.tie_embeddings
    assert c.embed_scale == 1.0 and c.init_std == 0.0 and c.block_style == "peri" and c.rope_style == "half"
    for key in ("total_ut_steps", "num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps",
                "max_position_embeddings", "tie_word_embeddings", "hidden_act", "layer_types"):
        cfg.pop(key)
    c = LoopedConfig.from_hf(cfg, ouro_tensors(ouro_config()))       # upstream OuroConfig's defaults
    assert (c.mean_recurrence, c.n_kv_heads, c.head_dim, c.rope_theta, c.norm_eps, c.block_size) == \
        (4, 4, 16, 10000.0, 1e-6, 32768)


def test_detection_by_model_type():
    cfg = ouro_config()
    assert detect_family(cfg, ouro_tensors(cfg)) == "ouro" and detect_family(cfg) == "ouro"
    assert detect_family(dict(cfg, dasspec_family="ouro")) == "ouro"
    with pytest.raises(ConfigError, match="no model.layers.. weights: not an Ouro layout"):
        detect_family(cfg, ["transformer.core_block.0.attn.Wqkv.weight"])
    with pytest.raises(ConfigError, match="unknown dasspec_family 'huginn' for model_type 'ouro'"):
        detect_family(dict(cfg, dasspec_family="huginn"))
    with pytest.raises(ConfigError, match=r"unsupported model_type 'qwen2'.*'huginn_raven', .*'ouro'") as err:
        detect_family(dict(cfg, model_type="qwen2"))
    for name in ("Huginn-0125", "Raven-Llama", "Ouro", "IQuest-Coder-V1-Loop", "Nanbeige4.2"):     # every family
        assert name in str(err.value), name


@pytest.mark.parametrize("method,knob,values", [
    ("self-spec", "draft_depth", {"huginn": 8, "raven-llama": 4, "raven-olmo": 4, "ouro": 1, "iquest-loop": 1, "nanbeige": 1}),
    ("self-spec", "block", {"huginn": 8, "raven-llama": 16, "raven-olmo": 16, "ouro": 2, "iquest-loop": 3,
                            "nanbeige": 2}),
    ("mature-spec", "block", {"huginn": 8, "raven-llama": 16, "raven-olmo": 16, "ouro": 2, "iquest-loop": 3,
                              "nanbeige": 2}),
    ("das-wave", "k", {"huginn": 2, "raven-llama": 1, "raven-olmo": 1, "ouro": 1, "iquest-loop": 1, "nanbeige": 1}),
])
def test_family_knob_defaults_reach_the_methods(method, knob, values, monkeypatch):
    knobs = get_method(method).knobs
    for family, value in values.items():                 # the paper's Table 5; Ouro's from its dev prompts
        assert knobs.defaults(family)[knob] == value, family
    assert knob not in knobs.defaults("huginn", given={knob})
    monkeypatch.setattr(FAMILIES["raven-olmo"], "knob_defaults", {})      # a family without a schedule
    with pytest.raises(ValueError, match=f"method '{method}' has no default {knob} for model family 'raven-olmo' "
                                         rf"\(known: huginn, raven-llama[^)]*\); give {knob} explicitly"):
        knobs.defaults("raven-olmo", given=set(knobs.names()) - {knob})


def test_family_schedules_name_real_knobs_and_replace_the_methods_defaults():
    """Every family's knob_defaults names registered methods and knobs they take (a typo would be silently unused);
    a family's value replaces even a knob the method declares with one default for all (Ouro's few, aligned DAS-Wave
    rounds), and the other families keep the method's own."""
    for family in FAMILIES.values():
        for method, values in family.knob_defaults.items():
            names = get_method(method).knobs.names()
            assert set(values) <= set(names), (family.name, method, sorted(set(values) - set(names)))
    wave = get_method("das-wave").knobs
    assert (wave.defaults("ouro")["rounds"], wave.defaults("ouro")["policy"]) == (3, "aligned")
    assert (wave.defaults("huginn")["rounds"], wave.defaults("raven-llama")["policy"]) == (24, "deep-kv")
    assert "rounds" not in wave.defaults("ouro", given={"rounds"})
