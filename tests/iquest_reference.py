"""IQuest-Coder-V1-Loop for the tests: random checkpoints under the published tensor names, and the forward of the
HF remote code (``modeling_iquestloopcoder.py``, ``IQuestLoopCoderModel._forward_loop``: the no-cache path)
written out plainly from reading it - not from dasspec.

What the reference computes (loop 1, then loops 2..loop_num, then ``model.norm`` and ``lm_head``):
  loop 1, every layer:  x += o(softmax(q k^T / sqrt(hd) + causal) v);  x += mlp(post_ln(x)),  q,k,v of in_ln(x)
                        and K1, V1 = that layer's k, v kept
  loop t >= 2:          q2, k2, v2 of in_ln(x);  g = sigmoid(einsum(q2, gate.weight) + gate.bias) per head;
                        A over (K1, V1) causally; B over (k2, v2) causally within rows (i - window, i];
                        x += o(g A + (1 - g) B);  x += mlp(post_ln(x))
Stored fixtures (tests/fixtures/iquest_parity.pt) were made by a line-for-line transcription of the remote code's
no-cache path, run outside the repo (docs/families.md, "IQuest-Coder-V1-Loop"); this file is checked against them.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from reference_impl import load_state_dict, repeat_kv, rms_norm, rotate_half, write_folder

IQUEST_MINI = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                   num_hidden_layers=3)


def iquest_config(vocab_size: int = 128, *, loop_num: int = 2, window: int = 8, **shape) -> dict:
    """config.json of a miniature IQuest-Loop with the fields IQuestLoopCoderConfig defines (shape overrides)."""
    dims = {**IQUEST_MINI, **shape}
    return {
        "architectures": ["IQuestLoopCoderForCausalLM"], "model_type": "iquestloopcoder", **dims,
        "auto_map": {"AutoConfig": "configuration_iquestloopcoder.IQuestLoopCoderConfig",
                     "AutoModelForCausalLM": "modeling_iquestloopcoder.IQuestLoopCoderForCausalLM"},
        "vocab_size": vocab_size, "hidden_act": "silu", "max_position_embeddings": 512,
        "initializer_range": 0.02, "rms_norm_eps": 1e-05, "use_cache": True, "tie_word_embeddings": False,
        "rope_theta": 500000.0, "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0,
        "mlp_bias": False, "loop_num": loop_num, "loop_window_size": window,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None, "torch_dtype": "bfloat16",
    }


def iquest_tensors(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the published names (``model.gate_projections.{i}`` [H, hd] + [H]: gates of order 1)."""
    g = torch.Generator().manual_seed(seed)
    d, nh, nkv, hd, inter = (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
                             cfg["head_dim"], cfg["intermediate_size"])

    def lin(o, i):
        return torch.randn(o, i, generator=g) / math.sqrt(i)

    def norm():
        return 0.5 + torch.rand(d, generator=g)

    t = {"model.embed_tokens.weight": torch.randn(cfg["vocab_size"], d, generator=g)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = lin(nh * hd, d)
        t[p + "self_attn.k_proj.weight"] = lin(nkv * hd, d)
        t[p + "self_attn.v_proj.weight"] = lin(nkv * hd, d)
        t[p + "self_attn.o_proj.weight"] = lin(d, nh * hd)
        t[p + "mlp.gate_proj.weight"] = lin(inter, d)
        t[p + "mlp.up_proj.weight"] = lin(inter, d)
        t[p + "mlp.down_proj.weight"] = lin(d, inter)
        t[p + "input_layernorm.weight"] = norm()
        t[p + "post_attention_layernorm.weight"] = norm()
        t[f"model.gate_projections.{i}.weight"] = torch.randn(nh, hd, generator=g) / math.sqrt(hd)
        t[f"model.gate_projections.{i}.bias"] = 0.5 * torch.randn(nh, generator=g)
    t["model.norm.weight"] = norm()
    t["lm_head.weight"] = lin(cfg["vocab_size"], d)
    return t


def write_iquest_checkpoint(folder: str | os.PathLike, *, vocab_size: int = 128, seed: int = 0, n_shards: int = 1,
                            loop_num: int = 2, window: int = 8, shape: dict | None = None,
                            config_edits: dict | None = None, drop: tuple[str, ...] = (),
                            tokenizer: dict | None = None) -> Path:
    cfg = iquest_config(vocab_size, loop_num=loop_num, window=window, **(shape or {}))
    tensors = iquest_tensors(cfg, seed)
    for k in drop:
        tensors.pop(k)
    cfg.update(config_edits or {})
    return write_folder(Path(folder), cfg, tensors, n_shards, tokenizer)


class IQuestReference:
    """The remote code's no-cache forward, float32, batch 1."""

    def __init__(self, folder: str | os.PathLike):
        import json
        self.cfg = json.loads((Path(folder) / "config.json").read_text())
        self.sd = load_state_dict(folder)
        c = self.cfg
        self.H, self.Hkv, self.hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.eps, self.window, self.loops = c["rms_norm_eps"], c["loop_window_size"], c["loop_num"]
        self.inv_freq = 1.0 / (c["rope_theta"] ** (torch.arange(0, self.hd, 2, dtype=torch.int64).float() / self.hd))

    def W(self, name: str) -> torch.Tensor:
        return self.sd[name]

    def qkv(self, x: torch.Tensor, i: int, cos: torch.Tensor, sin: torch.Tensor):
        p = f"model.layers.{i}.self_attn."
        T = x.shape[0]
        q = (x @ self.W(p + "q_proj.weight").T).view(T, self.H, self.hd).transpose(0, 1)
        k = (x @ self.W(p + "k_proj.weight").T).view(T, self.Hkv, self.hd).transpose(0, 1)
        v = (x @ self.W(p + "v_proj.weight").T).view(T, self.Hkv, self.hd).transpose(0, 1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k, v

    def attention(self, q, k, v, window: int | None) -> torch.Tensor:
        T = q.shape[1]
        k, v = repeat_kv(k[None], self.H // self.Hkv)[0], repeat_kv(v[None], self.H // self.Hkv)[0]
        s = q @ k.transpose(1, 2) / math.sqrt(self.hd)
        i = torch.arange(T)
        hidden = i[None, :] > i[:, None]
        if window is not None:
            hidden = hidden | (i[None, :] <= i[:, None] - window)
        s = s.masked_fill(hidden, float("-inf"))
        return torch.softmax(s, dim=-1) @ v                                   # [H, T, hd]

    def layer(self, x: torch.Tensor, i: int, cos, sin, k1v1: list, loop: int) -> torch.Tensor:
        p = f"model.layers.{i}."
        h = rms_norm(x, self.W(p + "input_layernorm.weight"), self.eps)
        q, k, v = self.qkv(h, i, cos, sin)
        if loop == 1:
            k1v1[i] = (k, v)
            y = self.attention(q, k, v, None)
        else:
            k1, v1 = k1v1[i]
            gw, gb = self.W(f"model.gate_projections.{i}.weight"), self.W(f"model.gate_projections.{i}.bias")
            g = torch.sigmoid(torch.einsum("htd,hd->ht", q, gw) + gb[:, None])[..., None]
            y = g * self.attention(q, k1, v1, None) + (1 - g) * self.attention(q, k, v, self.window)
        x = x + y.transpose(0, 1).reshape(x.shape[0], -1) @ self.W(p + "self_attn.o_proj.weight").T
        h = rms_norm(x, self.W(p + "post_attention_layernorm.weight"), self.eps)
        m = torch.nn.functional.silu(h @ self.W(p + "mlp.gate_proj.weight").T) * (h @ self.W(p + "mlp.up_proj.weight").T)
        return x + m @ self.W(p + "mlp.down_proj.weight").T

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, loops: int | None = None) -> torch.Tensor:
        """Logits [1, T, V] of ids [1, T] after ``loops`` (default loop_num) loops."""
        ids = ids.reshape(-1)
        T = ids.numel()
        freqs = torch.outer(torch.arange(T).float(), self.inv_freq)
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos(), emb.sin()
        x = self.W("model.embed_tokens.weight")[ids]
        n = self.cfg["num_hidden_layers"]
        k1v1: list = [None] * n
        for loop in range(1, (loops or self.loops) + 1):
            for i in range(n):
                x = self.layer(x, i, cos, sin, k1v1, loop)
        x = rms_norm(x, self.W("model.norm.weight"), self.eps)
        return (x @ self.W("lm_head.weight").T)[None]

    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        seq = list(prompt)
        for _ in range(max_new_tokens):
            seq.append(int(self(torch.tensor([seq]))[0, -1].argmax()))
        return seq[len(prompt):]
