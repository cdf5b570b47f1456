"""The model as it is trained and what one step minimises.

The model is the Huginn layout (prelude P, shared core F, coda H, adapter injection, sandwich blocks, qk_bias,
tied head, embedding x sqrt(d), initial-state std sqrt(2/(5d))) built by ``dasspec.model.looped.LoopedLM`` and
trained through its own primitives with ``cache=None``, so training runs exactly the computation decoding runs.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor

from ..model.looped import LoopedLM
from .config import TrainConfig
from .prepare import Prepared


def init_weights(model: LoopedLM) -> None:
    """Huginn's 'takase' init: every matrix and the embedding ~ N(0, sqrt(2/(5d))); output projections scaled by
    1/sqrt(2 * effective depth) where effective depth = prelude + coda + core * mean_recurrence; norms 1, biases 0."""
    cfg = model.config
    std = math.sqrt(2 / (5 * cfg.n_embd))
    depth = cfg.n_prelude + cfg.n_coda + cfg.n_core * cfg.mean_recurrence
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif "qk_bias" in name:
                p.zero_()
            elif name.endswith(("attn.proj.weight", "mlp.proj.weight")):
                torch.nn.init.trunc_normal_(p, std=std / math.sqrt(2 * depth), a=-3 * std, b=3 * std)
            else:
                torch.nn.init.trunc_normal_(p, std=std, a=-3 * std, b=3 * std)


def build_model(cfg: TrainConfig, data: Prepared) -> LoopedLM:
    """A freshly initialised model (draws from torch's RNG) for the tokenizer's vocabulary, in training mode."""
    mcfg = replace(cfg.model_config(*data.special_ids()), vocab_size=data.tokenizer.get_vocab_size())
    model = LoopedLM(mcfg).to(torch.device(cfg.device))
    init_weights(model)
    return model.train()


def make_optimizer(cfg: TrainConfig, model: LoopedLM) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms and biases)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=cfg.betas,
                             fused=model.device.type == "cuda")


def initial_states(model: LoopedLM, B: int, T: int, init_scale: float, seed: int) -> Tensor:
    """[B, T, d] like-init states, a different seed per sequence (the model's own per-position draw)."""
    pos = torch.arange(T)
    return torch.stack([model.initial_state(pos, init_scale, seed + b) for b in range(B)])


def looped_loss(model: LoopedLM, x: Tensor, y: Tensor, n: int, k: int, init_scale: float, seed: int) -> Tensor:
    """Cross-entropy of the depth-(n+k) readout; the first n core steps run without gradient (truncated BPTT)."""
    B, T = x.shape
    span = model.span(0, 0, T)
    inj = model.prelude(x, span)
    h = model.start_state(initial_states(model, B, T, init_scale, seed).to(inj.dtype), inj)
    with torch.no_grad():
        h = model.recur(h, inj, span, None, range(1, n + 1))
    h = model.recur(h, inj, span, None, range(n + 1, n + k + 1))
    logits = model.readout(h, span)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())
