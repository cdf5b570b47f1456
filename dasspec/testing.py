"""Small random checkpoints of every family, for tests and examples (no downloads needed)."""

from __future__ import annotations

import math

import torch

from .model.config import LoopedConfig
from .model.looped import LoopedLM


def tiny_config(family: str = "huginn", **overrides) -> LoopedConfig:
    """A few-layer config of ``family`` with the family's quirks switched on (GQA + llama3 scaling for
    raven-llama, q/k norm for raven-olmo, qk_bias + embed scale + tied head for huginn)."""
    base = dict(family=family, vocab_size=97, n_embd=32, n_heads=4, n_kv_heads=4, head_dim=8,
                intermediate_size=48, n_prelude=1, n_core=2, n_coda=1, mean_recurrence=8, block_size=256,
                eos_token_id=[1], bos_token_id=0)
    if family == "huginn":
        base.update(qk_bias=True, tie_embeddings=True, embed_scale=math.sqrt(32), init_std=math.sqrt(2 / (5 * 32)),
                    rope_theta=50000.0, norm_eps=1e-6)
    elif family == "raven-llama":
        base.update(n_kv_heads=2, n_prelude=2, n_core=3, n_coda=2, rope_theta=500000.0, norm_eps=1e-5,
                    init_std=0.0087,
                    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    elif family == "raven-olmo":
        base.update(qk_norm=True, rope_theta=500000.0, norm_eps=1e-6, init_std=0.0087)
    base.update(overrides)
    return LoopedConfig(**base).validate()


def random_model(family: str = "huginn", seed: int = 0, **overrides) -> LoopedLM:
    """A randomly initialised model; norm weights and biases are perturbed so no parameter is trivially 1/0."""
    torch.manual_seed(seed)
    model = LoopedLM(tiny_config(family, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "qk_bias" in name:
                p.normal_(0, 0.1)
            elif "wte" in name or "lm_head" in name:
                p.normal_(0, 1.0)
            else:
                p.normal_(0, 1.0 / math.sqrt(p.shape[-1]))
    return model.eval().requires_grad_(False)
