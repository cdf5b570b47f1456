"""config.json -> LoopedConfig: what is read for each family, the stale fields that must be ignored, family
detection, and bad configs failing with a message that names the field."""

from __future__ import annotations

import copy
import math
import re

import pytest

from dasspec.model.config import ConfigError, LoopedConfig, detect_family
from dasspec.testing import tiny_config
from reference_impl import FAMILY_OF, HUGINN_STD, LAYOUTS, huginn_style_config, random_tensors

LAYOUT_NAMES = list(LAYOUTS)


def weight_names(layout: str) -> list[str]:
    cfg = huginn_style_config(layout, 64)
    return list(random_tensors(cfg, FAMILY_OF[layout]))


def parse(layout: str, edits: dict | None = None, drop: tuple[str, ...] = ()) -> LoopedConfig:
    cfg = huginn_style_config(layout, 64)
    cfg.update(edits or {})
    for key in drop:
        cfg.pop(key, None)
    return LoopedConfig.from_hf(cfg, weight_names(layout))


# --- what each family reads ------------------------------------------------------------------------------------

def test_huginn_fields():
    c = parse("huginn")
    assert c.family == "huginn"
    assert (c.n_embd, c.n_heads, c.n_kv_heads, c.head_dim) == (48, 4, 4, 12)
    assert (c.n_prelude, c.n_core, c.n_coda) == (2, 4, 2)
    assert c.rope_theta == 50000.0 and c.rope_scaling is None       # rope_base is Huginn's RoPE base
    assert c.qk_bias and not c.qk_norm and c.tie_embeddings
    assert c.embed_scale == pytest.approx(math.sqrt(48)) and c.init_std == pytest.approx(math.sqrt(2 / (5 * 48)))
    assert c.norm_eps == 1e-6 and c.block_size == 4096 and c.mean_recurrence == 8
    assert c.block_style == "sandwich" and c.rope_style == "interleaved" and c.norm_after_loop
    # Huginn's own special ids are real for Huginn
    assert c.bos_token_id == 65504 and c.eos_token_id == [65505] and c.pad_token_id == 65509


def test_raven_llama_reads_rope_theta_gqa_llama3_and_json_init_values():
    c = parse("raven-llama")
    assert c.family == "raven-llama"
    assert c.rope_theta == 500000.0
    assert c.rope_scaling["rope_type"] == "llama3" and c.rope_scaling["original_max_position_embeddings"] == 512
    assert (c.n_heads, c.n_kv_heads, c.head_dim) == (8, 2, 16)      # num_key_value_heads read, not derived
    assert c.embed_scale == 1.0 and c.init_std == HUGINN_STD        # init_values read, not derived from n_embd
    assert not c.tie_embeddings        # tie_embeddings wins over the stale tie_word_embeddings: true
    assert c.norm_eps == 1e-5 and not c.qk_bias and not c.qk_norm
    assert c.block_style == "pre" and c.rope_style == "half" and not c.norm_after_loop
    assert c.block_size == 131072      # no RoPE table on disk: max_position_embeddings bounds positions


def test_raven_tinyllama_ignores_stale_rope_base():
    c = parse("raven-tinyllama")
    cfg = huginn_style_config("raven-tinyllama", 64)
    assert cfg["rope_base"] == 500000.0 and cfg["rope_theta"] == 10000.0
    assert c.rope_theta == 10000.0 and c.rope_scaling is None
    assert (c.n_heads, c.n_kv_heads) == (8, 4)


def test_raven_olmo_fields():
    c = parse("raven-olmo")
    assert c.family == "raven-olmo" and c.qk_norm and not c.qk_bias
    assert c.block_style == "post" and c.rope_theta == 500000.0 and c.norm_eps == 1e-6


@pytest.mark.parametrize("layout", ["raven-llama", "raven-tinyllama", "raven-olmo"])
def test_raven_drops_huginn_special_ids(layout):
    """Raven config.json files carry Huginn's bos/eos/pad (65504/65505/65509): in Llama-3's vocabulary those are
    ordinary words, so they must never become stop tokens.  The tokenizer files give the real ids."""
    assert huginn_style_config(layout, 64)["eos_token_id"] == 65505
    c = parse(layout)
    assert c.bos_token_id is None and c.eos_token_id == [] and c.pad_token_id is None
    c = parse(layout, {"eos_token_id": [65505, 65508, 7], "bos_token_id": 3})
    assert c.eos_token_id == [7] and c.bos_token_id == 3


def test_padded_vocab_size_sets_embedding_rows():
    cfg = huginn_style_config("raven-olmo", 64)
    cfg.update(vocab_size=50, padded_vocab_size=64)
    assert LoopedConfig.from_hf(cfg, weight_names("raven-olmo")).vocab_size == 64


def test_hf_attribute_aliases():
    cfg = huginn_style_config("raven-olmo", 64)
    cfg["hidden_size"] = cfg.pop("n_embd")
    cfg["num_attention_heads"] = cfg.pop("n_heads")
    cfg["num_hidden_layers"] = cfg.pop("n_layers")
    c = LoopedConfig.from_hf(cfg, weight_names("raven-olmo"))
    assert (c.n_embd, c.n_heads, c.n_layers) == (64, 4, 6)


def test_rope_scaling_type_alias():
    scaling = dict(huginn_style_config("raven-llama", 64)["rope_scaling"])
    scaling["type"] = scaling.pop("rope_type")
    assert parse("raven-llama", {"rope_scaling": scaling}).rope_scaling["type"] == "llama3"


@pytest.mark.parametrize("family", ["huginn", "raven-llama", "raven-olmo"])
def test_to_hf_round_trip(family):
    cfg = tiny_config(family)
    back = LoopedConfig.from_hf(cfg.to_hf(), weight_names(family))
    for field in ("family", "n_embd", "n_heads", "n_kv_heads", "head_dim", "rope_theta", "rope_scaling",
                  "tie_embeddings", "embed_scale", "init_std", "qk_bias", "qk_norm", "norm_eps", "mean_recurrence"):
        assert getattr(back, field) == getattr(cfg, field), field


# --- family detection -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_family_detected_from_weight_names(layout):
    # every layout's config says model_type huginn_raven and block_class_name SandwichBlock; the weights decide
    assert detect_family(huginn_style_config(layout, 64), weight_names(layout)) == FAMILY_OF[layout]


def test_family_from_config_alone_only_for_huginn():
    assert detect_family(huginn_style_config("huginn", 64)) == "huginn"
    with pytest.raises(ConfigError, match="weight names"):
        detect_family(huginn_style_config("raven-llama", 64))


def test_unknown_family_errors():
    cfg = huginn_style_config("raven-llama", 64)
    with pytest.raises(ConfigError, match="model_type 'llama'"):
        detect_family(dict(cfg, model_type="llama"), weight_names("raven-llama"))
    with pytest.raises(ConfigError, match="unknown dasspec_family 'ouro'"):
        detect_family(dict(cfg, dasspec_family="ouro"))
    names = weight_names("huginn") + ["transformer.core_block.0.attn.q_norm.weight"]
    with pytest.raises(ConfigError, match="unknown layout"):
        detect_family(cfg, names)
    flat = [n.replace("core_block", "h") for n in weight_names("raven-llama")]
    with pytest.raises(ConfigError, match="core_block"):
        detect_family(cfg, flat)
    with pytest.raises(ConfigError, match="unknown family 'gpt2'"):
        LoopedConfig(**dict(tiny_config("huginn").to_dict(), family="gpt2")).validate()


# --- missing and inconsistent fields ----------------------------------------------------------------------------

@pytest.mark.parametrize("layout,field", [
    ("huginn", "n_embd"), ("huginn", "n_heads"), ("huginn", "intermediate_size"),
    ("huginn", "n_layers_in_prelude"), ("huginn", "n_layers_in_recurrent_block"), ("huginn", "n_layers_in_coda"),
    ("huginn", "mean_recurrence"), ("huginn", "rope_base"), ("huginn", "block_size"),
    ("raven-llama", "rope_theta"), ("raven-olmo", "rope_theta"), ("raven-llama", "init_values"),
])
def test_missing_field_is_named(layout, field):
    with pytest.raises(ConfigError, match=f"missing required field {field}"):
        parse(layout, drop=(field,))


def test_missing_vocab_size_is_named():
    with pytest.raises(ConfigError, match="vocab_size"):
        parse("raven-olmo", drop=("vocab_size", "padded_vocab_size"))


@pytest.mark.parametrize("key", ["std", "embed_scale"])
def test_missing_init_value_is_named(key):
    cfg = huginn_style_config("huginn", 64)
    cfg["init_values"] = {k: v for k, v in cfg["init_values"].items() if k != key}
    with pytest.raises(ConfigError, match=f"init_values.{key}"):
        LoopedConfig.from_hf(cfg, weight_names("huginn"))


def test_raven_without_rope_theta_does_not_fall_back_to_rope_base():
    with pytest.raises(ConfigError, match="rope_theta"):
        parse("raven-tinyllama", drop=("rope_theta",))


@pytest.mark.parametrize("edits,message", [
    ({"n_layers": 9}, "n_layers=9"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
    ({"head_dim": 15, "n_heads": 4, "n_embd": 60}, "head_dim=15 must be even"),
    ({"head_dim": 8}, r"n_heads\*head_dim must equal n_embd"),
    ({"test_time_noise": 0.1}, "test_time_noise"),
    ({"n_layers_in_recurrent_block": 0, "n_layers": 4}, "n_layers_in_recurrent_block must be >= 1"),
    ({"mean_recurrence": 0}, "mean_recurrence must be >= 1"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_scaling type 'yarn'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
     "missing original_max_position_embeddings"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                       "original_max_position_embeddings": 512}}, "low_freq_factor < high_freq_factor"),
])
def test_inconsistent_config_is_named(edits, message):
    with pytest.raises(ConfigError, match=message):
        parse("raven-llama", edits)


def test_qk_bias_with_gqa_is_rejected():
    with pytest.raises(ConfigError, match="qk_bias"):
        tiny_config("raven-llama", qk_bias=True)


def test_from_hf_does_not_modify_its_input():
    cfg = huginn_style_config("raven-llama", 64)
    before = copy.deepcopy(cfg)
    parse("raven-llama")
    LoopedConfig.from_hf(cfg, weight_names("raven-llama"))
    assert cfg == before


# --- values of the wrong type or range: named with their value (issue 23) ---------------------------------------

LLAMA3_STRING_FACTOR = {"rope_type": "llama3", "factor": "32", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 512}


@pytest.mark.parametrize("layout,edits,message", [
    ("huginn", {"rope_base": 0}, "rope_base must be > 0, got 0"),
    ("huginn", {"rope_base": -50000}, "rope_base must be > 0, got -50000"),
    ("raven-llama", {"rope_theta": float("inf")}, "rope_theta must be a finite number, got inf"),
    ("huginn", {"norm_eps": -1e-6}, r"norm_eps must be >= 0.0, got -1e-06"),
    ("huginn", {"norm_eps": float("nan")}, "norm_eps must be a finite number, got nan"),
    ("huginn", {"n_embd": 192.7}, "n_embd must be a whole number, got 192.7"),
    ("huginn", {"n_heads": "4"}, "n_heads must be a whole number, got '4'"),
    ("huginn", {"mean_recurrence": True}, "mean_recurrence must be a whole number, got True"),
    ("huginn", {"block_size": "4096"}, "block_size must be a whole number, got '4096'"),
    ("huginn", {"head_dim": 12.5}, "head_dim must be a whole number, got 12.5"),
    ("huginn", {"padded_vocab_size": 64.5}, "padded_vocab_size must be a whole number, got 64.5"),
    ("huginn", {"n_layers": "8"}, "n_layers must be a whole number, got '8'"),
    ("huginn", {"n_layers_in_prelude": -1, "n_layers": None}, "n_layers_in_prelude must be >= 0, got -1"),
    ("huginn", {"tie_embeddings": "false"}, "tie_embeddings must be true or false, got 'false'"),
    ("huginn", {"qk_bias": 1}, "qk_bias must be true or false, got 1"),
    ("huginn", {"init_values": [1.0, 2.0]}, r"init_values must be an object with std and embed_scale, got \[1.0, 2.0\]"),
    ("huginn", {"init_values": {"std": "0.01", "embed_scale": 1.0}}, "init_values.std must be a finite number, "
                                                                     "got '0.01'"),
    ("huginn", {"init_values": {"std": 0.01, "embed_scale": 0}}, "init_values.embed_scale must be > 0, got 0"),
    ("huginn", {"eos_token_id": "65505"}, "eos_token_id must be a whole number, got '65505'"),
    ("huginn", {"eos_token_id": [65505, 1.5]}, "eos_token_id must be a whole number, got 1.5"),
    ("huginn", {"test_time_noise": "0"}, "test_time_noise must be a finite number, got '0'"),
    ("raven-llama", {"rope_scaling": "llama3"}, "rope_scaling must be an object \\(or null\\), got 'llama3'"),
    ("raven-llama", {"rope_scaling": ["llama3"]}, "rope_scaling must be an object"),
    ("raven-llama", {"rope_scaling": LLAMA3_STRING_FACTOR}, "rope_scaling.factor must be a finite number, got '32'"),
    ("raven-llama", {"max_position_embeddings": 1e3 + 0.5}, "max_position_embeddings must be a whole number"),
])
def test_a_bad_value_is_named_with_its_value(layout, edits, message):
    with pytest.raises(ConfigError, match=message):
        parse(layout, edits)


def test_integral_floats_are_whole_numbers():
    assert parse("huginn", {"n_embd": 48.0, "block_size": 4096.0}).n_embd == 48


@pytest.mark.parametrize("value,kind", [([1, 2], "array"), ("x", "string"), (None, "null")])
def test_a_config_that_is_not_an_object_is_named(value, kind):
    with pytest.raises(ConfigError, match=f"config.json must be a JSON object, got a JSON {kind}"):
        LoopedConfig.from_hf(value, weight_names("huginn"))


# --- keys from_hf does not read (issue 29): refused when they change the model, named when unknown ---------------

@pytest.mark.parametrize("edits, message", [
    ({"vocab_size": math.inf}, "vocab_size must be a whole number, got inf"),     # JSON 1e400, beside padded_vocab_size
    ({"vocab_size": 10**9}, "vocab_size=1000000000 exceeds padded_vocab_size=64"),
    ({"nonlin_name": "GELU"}, "nonlin_name is 'GELU', but dasspec implements only 'SiLU'"),
    ({"state_init": "zero"}, "state_init is 'zero'"),
    ({"sliding_window": 128}, "sliding_window is 128"),
    ({"attention_bias": True}, "attention_bias is True"),
    ({"hidden_size": 96}, "n_embd=48 and hidden_size=96 disagree"),
])
def test_unread_keys_that_change_the_model_are_refused(edits, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse("huginn", edits)


def test_unknown_keys_are_named_in_one_warning():
    with pytest.warns(UserWarning, match=r"config.json sets frobnicate, num_experts, which dasspec does not know") \
            as caught:
        parse("raven-llama", {"num_experts": 8, "frobnicate": 1})
    assert len(caught) == 1
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for layout in LAYOUT_NAMES:                 # every key the real files carry is known
            parse(layout)
