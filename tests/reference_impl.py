"""A deliberately plain, independent re-implementation of the looped families' forward pass (Huginn, Raven-Llama,
Raven-OLMo, and Ouro at the end of the file), used only by tests, plus writers for small random checkpoints and
tokenizers laid out like the real ones.

Written from the parity spec (docs/families.md, notes on the upstream Huginn / Raven modeling files), not from
dasspec: it never imports dasspec.  Everything is spelled out the slow, obvious way - separate q/k/v split,
``repeat_kv`` for GQA, explicit causal mask and softmax, the adapter applied to ``cat([state, e])``, Huginn RoPE as
a complex multiply by the stored ``freqs_cis`` table, Raven RoPE as HF ``rotate_half`` with ``cat(freqs, freqs)``
and the llama3 remap done per frequency in a Python loop - and no cache: every call recomputes everything.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

HUGINN_SPECIAL_IDS = {"bos_token_id": 65504, "eos_token_id": 65505, "pad_token_id": 65509}


# =================================================================================================================
# Reference forward pass
# =================================================================================================================

def load_state_dict(folder: str | os.PathLike, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder, by key name, in ``dtype`` (single file or index + shards)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
             else ["model.safetensors"])
    out = {}
    for name in files:
        with safe_open(folder / name, "pt") as f:
            for key in f.keys():
                out[key] = f.get_tensor(key).to(dtype)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.to(torch.promote_types(x.dtype, torch.float32))      # float32, or float64 for a float64 reference
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return y.to(x.dtype) * weight


def raven_inv_freq(theta: float, head_dim: int, rope_scaling: dict | None) -> torch.Tensor:
    """HF LlamaRotaryEmbedding / Olmo2RotaryEmbedding inverse frequencies, llama3 remap done entry by entry."""
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv = 1.0 / (theta ** exps)
    if not rope_scaling or (rope_scaling.get("rope_type") or rope_scaling.get("type")) in (None, "default"):
        return inv
    assert (rope_scaling.get("rope_type") or rope_scaling.get("type")) == "llama3"
    f = rope_scaling["factor"]
    lo = rope_scaling["low_freq_factor"]
    hi = rope_scaling["high_freq_factor"]
    L = rope_scaling["original_max_position_embeddings"]
    low_wl, high_wl = L / lo, L / hi
    new = inv.clone()
    for j in range(inv.numel()):
        wl = 2 * math.pi / inv[j]
        if wl < high_wl:
            new[j] = inv[j]
        elif wl > low_wl:
            new[j] = inv[j] / f
        else:
            s = (L / wl - lo) / (hi - lo)
            new[j] = (1 - s) * inv[j] / f + s * inv[j]
    return new


def huginn_freqs_cis(theta: float, head_dim: int, n_pos: int) -> torch.Tensor:
    """Huginn's persistent RoPE buffer: [1, n_pos, 1, head_dim/2, 2], cos in channel 0 and sin in channel 1."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angle = torch.outer(torch.arange(n_pos, dtype=torch.float32), inv)
    return torch.stack((angle.cos(), angle.sin()), dim=-1)[None, :, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, H_kv, S, hd] -> [B, H_kv * n_rep, S, hd], each kv head repeated n_rep times in place (HF repeat_kv)."""
    if n_rep == 1:
        return x
    B, H, S, D = x.shape
    return x[:, :, None].expand(B, H, n_rep, S, D).reshape(B, H * n_rep, S, D)


class ReferenceModel:
    """Uncached full forward of one checkpoint folder, for ``family`` in huginn / raven-llama / raven-olmo
    (given by the test, not detected)."""

    def __init__(self, folder: str | os.PathLike, family: str, dtype: torch.dtype = torch.float32):
        """``dtype`` float64: the same math with float32's rounding out of the way (tests that must not depend on
        one CPU's float32 kernels compare there)."""
        folder = Path(folder)
        c = json.loads((folder / "config.json").read_text())
        self.folder, self.family, self.dtype = folder, family, dtype
        self.sd = load_state_dict(folder, dtype)
        self.d = c["n_embd"]
        self.nh = c["n_heads"]
        self.nkv = c["num_key_value_heads"]
        self.hd = c["head_dim"]
        self.inter = c["intermediate_size"]
        self.eps = c["norm_eps"]
        self.n_pre, self.n_core, self.n_coda = (c["n_layers_in_prelude"], c["n_layers_in_recurrent_block"],
                                                c["n_layers_in_coda"])
        self.mean_recurrence = c["mean_recurrence"]
        self.embed_scale = c["init_values"]["embed_scale"]
        self.norm_after_loop = family == "huginn"        # Huginn: latent = ln_f(s_R) before the coda
        if family == "huginn":
            table = self.sd.get("freqs_cis")
            if table is None:
                table = huginn_freqs_cis(c["rope_base"], self.hd, c["block_size"]).to(dtype)
            self.freqs = torch.view_as_complex(table[0, :, 0].contiguous())        # [n_pos, hd/2] complex
            self.head = self.sd["transformer.wte.weight"]                           # tied
        else:
            self.inv_freq = raven_inv_freq(c["rope_theta"], self.hd, c.get("rope_scaling")).to(dtype)
            self.head = self.sd["lm_head.weight"]

    # --- pieces -----------------------------------------------------------------------------------------
    def W(self, name: str) -> torch.Tensor:
        return self.sd[name]

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [B, S, H, hd] at positions pos [S]."""
        if self.family == "huginn":
            xc = torch.view_as_complex(x.to(self.dtype).reshape(*x.shape[:-1], self.hd // 2, 2).contiguous())
            out = torch.view_as_real(xc * self.freqs[pos][None, :, None, :])
            return out.reshape(x.shape).to(x.dtype)
        freqs = pos.to(self.dtype)[:, None] * self.inv_freq[None, :]               # [S, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, :, None, :], emb.sin()[None, :, None, :]
        return x * cos + rotate_half(x) * sin

    def attention(self, x: torch.Tensor, p: str, pos: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        qkv = x @ self.W(p + "attn.Wqkv.weight").T
        q = qkv[..., : self.nh * self.hd]
        k = qkv[..., self.nh * self.hd: (self.nh + self.nkv) * self.hd]
        v = qkv[..., (self.nh + self.nkv) * self.hd:]
        if self.family == "raven-olmo":                       # RMSNorm over the whole q and k, before heads
            q = rms_norm(q, self.W(p + "attn.q_norm.weight"), self.eps)
            k = rms_norm(k, self.W(p + "attn.k_norm.weight"), self.eps)
        q = q.reshape(B, S, self.nh, self.hd)
        k = k.reshape(B, S, self.nkv, self.hd)
        v = v.reshape(B, S, self.nkv, self.hd)
        if self.family == "huginn":                           # additive bias before RoPE
            bias = self.W(p + "attn.qk_bias")                 # [2, 1, nh, hd]
            q = q + bias[0]
            k = k + bias[1]
        q, k = self.rope(q, pos), self.rope(k, pos)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        k = repeat_kv(k, self.nh // self.nkv)
        v = repeat_kv(v, self.nh // self.nkv)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.hd)
        future = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)
        scores = scores.masked_fill(future, float("-inf"))
        probs = torch.softmax(scores.to(self.dtype), dim=-1).to(q.dtype)
        y = (probs @ v).transpose(1, 2).reshape(B, S, self.nh * self.hd)
        return y @ self.W(p + "attn.proj.weight").T

    def mlp(self, x: torch.Tensor, p: str) -> torch.Tensor:
        h = x @ self.W(p + "mlp.fc.weight").T
        gate, up = h[..., : self.inter], h[..., self.inter:]
        return (torch.nn.functional.silu(gate) * up) @ self.W(p + "mlp.proj.weight").T

    def block(self, x: torch.Tensor, p: str, pos: torch.Tensor) -> torch.Tensor:
        def n(i, t):
            return rms_norm(t, self.W(f"{p}norm_{i}.weight"), self.eps)
        if self.family == "huginn":
            x = n(2, x + self.attention(n(1, x), p, pos))
            return n(4, x + self.mlp(n(3, x), p))
        if self.family == "raven-llama":
            x = x + self.attention(n(1, x), p, pos)
            return x + self.mlp(n(2, x), p)
        x = x + n(1, self.attention(x, p, pos))
        return x + n(2, self.mlp(x, p))

    # --- whole model ------------------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, num_steps: int, state0: torch.Tensor | None = None) -> torch.Tensor:
        """float32 (float64 for a float64 reference) logits [B, S, V] at recurrence depth num_steps; state0 [B, S,
        d] (default: zeros)."""
        if ids.dim() == 1:
            ids = ids[None]
        B, S = ids.shape
        pos = torch.arange(S)
        e = self.W("transformer.wte.weight")[ids]
        if self.embed_scale != 1.0:
            e = e * self.embed_scale
        for i in range(self.n_pre):
            e = self.block(e, f"transformer.prelude.{i}.", pos)
        s = torch.zeros_like(e) if state0 is None else state0.to(e.dtype).expand_as(e).clone()
        for _ in range(num_steps):
            x = torch.cat([s, e], dim=-1) @ self.W("transformer.adapter.weight").T
            for j in range(self.n_core):
                x = self.block(x, f"transformer.core_block.{j}.", pos)
            s = x
        ln_f = self.W("transformer.ln_f.weight")
        x = rms_norm(s, ln_f, self.eps) if self.norm_after_loop else s
        for k in range(self.n_coda):
            x = self.block(x, f"transformer.coda.{k}.", pos)
        return (rms_norm(x, ln_f, self.eps) @ self.head.T).to(torch.promote_types(self.dtype, torch.float32))

    __call__ = forward

    def greedy(self, prompt: list[int], max_new_tokens: int, num_steps: int,
               state_fn=None, stop_ids: tuple[int, ...] = ()) -> list[int]:
        """Greedy continuation by re-running the full forward for every new token.  ``state_fn(n)`` gives the
        initial states of the first n positions (default zeros)."""
        seq = list(prompt)
        out: list[int] = []
        for _ in range(max_new_tokens):
            ids = torch.tensor([seq])
            s0 = None if state_fn is None else state_fn(len(seq))[None]
            nxt = int(self.forward(ids, num_steps, s0)[0, -1].argmax())
            out.append(nxt)
            seq.append(nxt)
            if nxt in stop_ids:
                break
        return out


# =================================================================================================================
# Random checkpoints shaped like the real ones, in miniature
# =================================================================================================================

# Miniature shapes.  raven-llama: GQA 8/2 and llama3 scaling with original_max_position_embeddings 512, so with
# head_dim 16 and theta 5e5 the frequencies fall in all three bands (unchanged / smoothed / divided by factor).
LAYOUTS = {
    "huginn": dict(n_embd=48, n_heads=4, num_key_value_heads=4, head_dim=12, intermediate_size=80,
                   n_layers_in_prelude=2, n_layers_in_recurrent_block=4, n_layers_in_coda=2),
    "raven-llama": dict(n_embd=128, n_heads=8, num_key_value_heads=2, head_dim=16, intermediate_size=160,
                        n_layers_in_prelude=2, n_layers_in_recurrent_block=3, n_layers_in_coda=2),
    "raven-tinyllama": dict(n_embd=64, n_heads=8, num_key_value_heads=4, head_dim=8, intermediate_size=96,
                            n_layers_in_prelude=2, n_layers_in_recurrent_block=2, n_layers_in_coda=2),
    "raven-olmo": dict(n_embd=64, n_heads=4, num_key_value_heads=4, head_dim=16, intermediate_size=96,
                       n_layers_in_prelude=2, n_layers_in_recurrent_block=2, n_layers_in_coda=2),
}
FAMILY_OF = {"huginn": "huginn", "raven-llama": "raven-llama", "raven-tinyllama": "raven-llama",
             "raven-olmo": "raven-olmo"}
LLAMA3_MINI = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 512, "rope_type": "llama3"}
HUGINN_STD = 0.008703882797784892


def huginn_style_config(layout: str, vocab_size: int, mean_recurrence: int = 8) -> dict:
    """config.json of a miniature checkpoint, carrying every field (stale ones included) the real file does.

    Huginn: the huginn-0125 file.  Raven: that file after the converter's ``setattr`` updates - so Huginn's
    bos/eos/pad ids, a stale ``rope_base``, ``block_class_name: SandwichBlock``, Huginn's ``init_values`` with
    ``embed_scale`` 1.0, and a stale ``tie_word_embeddings: true`` next to ``tie_embeddings: false``."""
    shape = dict(LAYOUTS[layout])
    n_layers = (shape["n_layers_in_prelude"] + shape["n_layers_in_recurrent_block"]
                + shape["n_layers_in_coda"])
    d = shape["n_embd"]
    cfg = {
        "activation_checkpoint_impl": "per-iteration",
        "architecture_class_name": "RecurrentGPT",
        "architectures": ["RavenForCausalLM"],
        "auto_map": {"AutoConfig": "raven_config_minimal.RavenConfig",
                     "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM"},
        "bias": False,
        "block_class_name": "SandwichBlock",
        "block_size": 4096,
        **HUGINN_SPECIAL_IDS,
        "effective_expected_depth": 132,
        "init_orthogonal": False,
        "init_strategy": "takase",
        "init_values": {"embed_scale": math.sqrt(d), "embedding": math.sqrt(2 / (5 * d)),
                        "out_proj": math.sqrt(2 / (5 * d)) / math.sqrt(2 * 132), "std": math.sqrt(2 / (5 * d))},
        "injection_type": "linear",
        "mean_backprop_depth": 8,
        "mean_recurrence": mean_recurrence,
        "mlp_class_name": "GatedMLP",
        "model_type": "huginn_raven",
        "n_layers": n_layers,
        "nonlin_name": "SiLU",
        "norm_class_name": "RMSNorm_llama",
        "norm_eps": 1e-06,
        "padded_vocab_size": vocab_size,
        "padding_multiple": 4096,
        "qk_bias": True,
        "rope_base": 50000,
        "sampling_scheme": "poisson-lognormal-filling",
        "state_init": "like-init",
        "test_time_noise": 0,
        "test_time_noise_type": "fixed",
        "tie_embeddings": True,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "transformers_version": "4.44.2",
        "vocab_size": vocab_size,
        **shape,
    }
    if layout == "huginn":
        return cfg
    # --- the Raven converter's updates (Huginn's init_values are kept, only embed_scale is reset) ---------
    cfg["init_values"] = dict(cfg["init_values"], embed_scale=1.0, std=HUGINN_STD)
    cfg.update(qk_bias=False, tie_embeddings=False, block_size=1024, transformers_version="4.53.1",
               rope_base=500000.0)                      # stale: never the RoPE base of a Raven model
    if layout == "raven-llama":
        cfg.update(norm_eps=1e-05, rope_theta=500000.0, rope_scaling=dict(LLAMA3_MINI),
                   max_position_embeddings=131072)
    elif layout == "raven-tinyllama":
        cfg.update(norm_eps=1e-05, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=2048)
    elif layout == "raven-olmo":
        cfg.update(norm_eps=1e-06, rope_theta=500000.0, max_position_embeddings=4096)
    return cfg


def random_tensors(cfg: dict, family: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights for every tensor name the family's checkpoints hold (norms around 1, no trivial 0/1)."""
    g = torch.Generator().manual_seed(seed)
    d, nh, nkv, hd, inter = (cfg["n_embd"], cfg["n_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
                             cfg["intermediate_size"])
    V = cfg["padded_vocab_size"]

    def lin(o, i):
        return torch.randn(o, i, generator=g) / math.sqrt(i)

    def norm(n):
        return 0.5 + torch.rand(n, generator=g)

    t: dict[str, torch.Tensor] = {}
    emb_std = cfg["init_values"]["std"] * 2 if family == "huginn" else 1.0
    t["transformer.wte.weight"] = torch.randn(V, d, generator=g) * emb_std
    groups = (("prelude", cfg["n_layers_in_prelude"]), ("core_block", cfg["n_layers_in_recurrent_block"]),
              ("coda", cfg["n_layers_in_coda"]))
    for group, n in groups:
        for i in range(n):
            p = f"transformer.{group}.{i}."
            t[p + "attn.Wqkv.weight"] = lin((nh + 2 * nkv) * hd, d)
            t[p + "attn.proj.weight"] = lin(d, nh * hd)
            t[p + "mlp.fc.weight"] = lin(2 * inter, d)
            t[p + "mlp.proj.weight"] = lin(d, inter)
            for k in range(1, (4 if family == "huginn" else 2) + 1):
                t[p + f"norm_{k}.weight"] = norm(d)
            if family == "huginn":
                t[p + "attn.qk_bias"] = 0.1 * torch.randn(2, 1, nh, hd, generator=g)
            if family == "raven-olmo":
                t[p + "attn.q_norm.weight"] = norm(nh * hd)
                t[p + "attn.k_norm.weight"] = norm(nkv * hd)
    t["transformer.adapter.weight"] = lin(d, 2 * d)
    t["transformer.ln_f.weight"] = norm(d)
    if family == "huginn":     # tied, but the file also holds an identical lm_head copy and the RoPE table
        t["lm_head.weight"] = t["transformer.wte.weight"].clone()
        t["freqs_cis"] = huginn_freqs_cis(cfg["rope_base"], hd, cfg["block_size"])
    else:
        t["lm_head.weight"] = lin(V, d)
    return t


def write_folder(folder: Path, cfg: dict, tensors: dict, n_shards: int, tokenizer: dict[str, str] | None) -> Path:
    """A checkpoint folder: the tensors (``n_shards`` safetensors files), config.json and the tokenizer files."""
    save_tensors(folder, tensors, n_shards)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    for name, text in (tokenizer or {}).items():
        (folder / name).write_text(text)
    return folder


def save_tensors(folder: Path, tensors: dict[str, torch.Tensor], n_shards: int = 1) -> None:
    """One model.safetensors, or ``n_shards`` files + model.safetensors.index.json (HF naming)."""
    folder.mkdir(parents=True, exist_ok=True)
    if n_shards == 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    weight_map = {}
    for s in range(n_shards):
        fname = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {k: tensors[k].contiguous() for k in names[s::n_shards]}
        save_file(part, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def write_checkpoint(folder: str | os.PathLike, layout: str, *, vocab_size: int = 128, seed: int = 0,
                     n_shards: int = 1, mean_recurrence: int = 8, config_edits: dict | None = None,
                     drop: tuple[str, ...] = (), tokenizer: dict | None = None) -> Path:
    """Write a random checkpoint folder of ``layout`` (huginn / raven-llama / raven-tinyllama / raven-olmo).
    ``tokenizer``: files from ``write_tokenizer`` to copy in (name -> text)."""
    folder = Path(folder)
    family = FAMILY_OF[layout]
    cfg = huginn_style_config(layout, vocab_size, mean_recurrence)
    tensors = random_tensors(cfg, family, seed)
    for k in drop:
        tensors.pop(k)
    cfg.update(config_edits or {})
    return write_folder(folder, cfg, tensors, n_shards, tokenizer)


# =================================================================================================================
# Tiny tokenizers (HF tokenizers library), in the families' conventions
# =================================================================================================================

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A looped transformer applies the same core block many times.",
    "Shallow queries read mature values from the verified prefix.",
    "Two plus two is four, and three times three is nine.",
    "def add(a, b):\n    return a + b\n",
    "Speculative decoding drafts tokens and verifies them with the target.",
]

SPECIALS = {
    "huginn": ("<|begin_text|>", "<|end_text|>", "<|pad|>", ["<|begin_header|>", "<|end_header|>", "<|end_turn|>"]),
    "raven-llama": ("<|begin_of_text|>", "<|end_of_text|>", None, []),
    "raven-olmo": (None, "<|endoftext|>", "<|pad|>", []),
    # Ouro's published base files: EOS <|endoftext|> (id 0), then the ChatML tokens <|im_start|> 1, <|im_end|> 2
    "ouro": (None, "<|endoftext|>", None, ["<|im_start|>", "<|im_end|>"]),
    # Nanbeige4.2's files: BOS <|im_start|> (added by the tokenizer's template, as there), EOS <|im_end|>, pad
    # <unk>, ChatML turns with a <think> block (166100 / 166101 / 0 / 166103-4 there)
    "nanbeige": ("<|im_start|>", "<|im_end|>", "<unk>", ["<think>", "</think>"]),
}


def write_tokenizer(kind: str = "raven-llama", vocab_size: int = 300, extra: tuple[str, ...] = ()) -> dict[str, str]:
    """A byte-level BPE trained on a few sentences; the special tokens and BOS template of ``kind``'s tokenizer
    (and ``extra`` special tokens after them).  Returns {file name: text} for tokenizer.json,
    tokenizer_config.json and special_tokens_map.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    bos, eos, pad, more = SPECIALS[kind]
    specials = [t for t in (bos, eos, pad) if t] + more + list(extra)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    config = {"bos_token": bos, "eos_token": eos, "pad_token": pad, "tokenizer_class": "PreTrainedTokenizerFast"}
    special_map = {k: v for k, v in config.items() if k != "tokenizer_class" and v is not None}
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(config),
            "special_tokens_map.json": json.dumps(special_map)}


# =================================================================================================================
# A fake Hugging Face hub cache
# =================================================================================================================

def fake_hf_cache(cache_root: str | os.PathLike, repo_id: str, src_folder: str | os.PathLike,
                  commit: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """Lay ``src_folder`` out as ``HF_HUB_CACHE/models--org--name/{refs/main, snapshots/<commit>/, blobs/}``, the
    snapshot files being relative symlinks to content-addressed blobs, as huggingface_hub writes them."""
    repo = Path(cache_root) / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    for f in sorted(Path(src_folder).iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    return snap


# =================================================================================================================
# Ouro: upstream OuroForCausalLM.forward (ouro_rl/modeling/modeling_ouro.py @ 531187b), written out plainly
# =================================================================================================================
#
# Written from reading the upstream file, not from dasspec: the checkpoint's own tensor names, separate q/k/v and
# gate/up projections, HF ``rotate_half`` RoPE with cos/sin of cat(freqs, freqs), eager attention (additive causal
# mask, float32 softmax, ``repeat_kv``), the four layer norms named as upstream names them, ``model.norm`` after
# every one of the T steps (the normed state feeds the next step), one gate logit per step, and upstream's exit
# rules: ``exit_at_step`` (0-based; an out-of-range one is silently ignored, as upstream does), else
# ``exit_threshold`` (first step whose cumulative exit probability reaches it; the last when none does), with both
# defaulting to config.json's ``early_exit_step`` / ``early_exit_threshold`` exactly as upstream reads them.

class OuroReference:
    """Uncached full forward of an HF Ouro folder."""

    def __init__(self, folder: str | os.PathLike):
        folder = Path(folder)
        c = json.loads((folder / "config.json").read_text())
        self.sd = load_state_dict(folder)
        self.d = c["hidden_size"]
        self.nh = c["num_attention_heads"]
        self.nkv = c.get("num_key_value_heads") or self.nh
        self.hd = c.get("head_dim") or self.d // self.nh
        self.n_layers = c["num_hidden_layers"]
        self.eps = c.get("rms_norm_eps", 1e-6)
        self.theta = c.get("rope_theta", 10000.0)
        self.total_ut_steps = c.get("total_ut_steps", 4)
        self.config_exit_step = c.get("early_exit_step")
        self.config_exit_threshold = c.get("early_exit_threshold", 1.0)
        tied = c.get("tie_word_embeddings", False)
        self.head = self.sd["model.embed_tokens.weight" if tied else "lm_head.weight"]
        self.norm_every_step = True          # the tests turn this off to show the pitfall it guards

    def W(self, name: str) -> torch.Tensor:
        return self.sd[name]

    def cos_sin(self, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.hd, 2, dtype=torch.int64).float() / self.hd))
        freqs = torch.arange(S).float()[:, None] @ inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()                                    # [S, hd]

    def decoder_layer(self, x: torch.Tensor, i: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{i}."
        B, S, _ = x.shape
        residual = x
        h = rms_norm(x, self.W(p + "input_layernorm.weight"), self.eps)
        q = (h @ self.W(p + "self_attn.q_proj.weight").T).view(B, S, self.nh, self.hd).transpose(1, 2)
        k = (h @ self.W(p + "self_attn.k_proj.weight").T).view(B, S, self.nkv, self.hd).transpose(1, 2)
        v = (h @ self.W(p + "self_attn.v_proj.weight").T).view(B, S, self.nkv, self.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k, v = repeat_kv(k, self.nh // self.nkv), repeat_kv(v, self.nh // self.nkv)
        mask = torch.full((S, S), float("-inf")).triu(1)
        weights = torch.softmax((q @ k.transpose(2, 3)) * self.hd ** -0.5 + mask, dim=-1, dtype=torch.float32)
        attn = (weights.to(q.dtype) @ v).transpose(1, 2).reshape(B, S, self.nh * self.hd)
        attn = attn @ self.W(p + "self_attn.o_proj.weight").T
        x = residual + rms_norm(attn, self.W(p + "input_layernorm_2.weight"), self.eps)
        residual = x
        h = rms_norm(x, self.W(p + "post_attention_layernorm.weight"), self.eps)
        gate = h @ self.W(p + "mlp.gate_proj.weight").T
        up = h @ self.W(p + "mlp.up_proj.weight").T
        h = (torch.nn.functional.silu(gate) * up) @ self.W(p + "mlp.down_proj.weight").T
        return residual + rms_norm(h, self.W(p + "post_attention_layernorm_2.weight"), self.eps)

    def steps(self, ids: torch.Tensor, num_steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every step's (normed) state [B, S, d] and gate logit [B, S]."""
        if ids.dim() == 1:
            ids = ids[None]
        cos, sin = self.cos_sin(ids.shape[1])
        x = self.W("model.embed_tokens.weight")[ids]
        norm = self.W("model.norm.weight")
        states, gates = [], []
        for ut in range(num_steps):
            for i in range(self.n_layers):
                x = self.decoder_layer(x, i, cos, sin)
            if self.norm_every_step or ut == num_steps - 1:
                x = rms_norm(x, norm, self.eps)
            states.append(x)
            gates.append((x @ self.W("model.early_exit_gate.weight").T + self.W("model.early_exit_gate.bias"))[..., 0])
        return states, gates

    @staticmethod
    def threshold_steps(gates: list[torch.Tensor], tau: float) -> torch.Tensor:
        """Per position, the first step whose cumulative exit probability reaches tau (else the last)."""
        T = len(gates)
        remaining = torch.ones_like(gates[0])
        cumulative = torch.zeros_like(gates[0])
        chosen = torch.full(gates[0].shape, T - 1, dtype=torch.long)
        decided = torch.zeros(gates[0].shape, dtype=torch.bool)
        for t in range(T):
            lam = torch.sigmoid(gates[t])
            p = remaining if t == T - 1 else lam * remaining
            remaining = remaining * (1.0 - lam)
            cumulative = cumulative + p
            newly = (cumulative >= tau) & ~decided
            chosen[newly] = t
            decided |= newly
        return chosen

    def forward(self, ids: torch.Tensor, num_steps: int | None = None, exit_at_step: int | None = None,
                exit_threshold: float | None = None, use_early_exit_gate: bool = True,
                return_exit_steps: bool = False):
        """float32 logits [B, S, V], as upstream with total_ut_steps = num_steps (default: the config's)."""
        T = num_steps or self.total_ut_steps
        states, gates = self.steps(ids, T)
        exit_at_step = exit_at_step if exit_at_step is not None else self.config_exit_step
        exit_threshold = exit_threshold if exit_threshold is not None else self.config_exit_threshold
        exit_steps = torch.full(gates[0].shape, T - 1, dtype=torch.long)
        if use_early_exit_gate and exit_at_step is not None and 0 <= exit_at_step < T:
            exit_steps[:] = exit_at_step
        elif use_early_exit_gate and exit_threshold is not None:
            exit_steps = self.threshold_steps(gates, exit_threshold)
        chosen = torch.zeros_like(states[0])
        for b in range(chosen.shape[0]):
            for s in range(chosen.shape[1]):
                chosen[b, s] = states[int(exit_steps[b, s])][b, s]
        logits = (chosen @ self.head.T).float()
        return (logits, exit_steps) if return_exit_steps else logits

    __call__ = forward

    def greedy(self, prompt: list[int], max_new_tokens: int, num_steps: int, **exit) -> list[int]:
        seq = list(prompt)
        for _ in range(max_new_tokens):
            seq.append(int(self.forward(torch.tensor([seq]), num_steps, **exit)[0, -1].argmax()))
        return seq[len(prompt):]


OURO_MINI = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                 num_hidden_layers=3)


def ouro_config(vocab_size: int = 128, total_ut_steps: int = 4) -> dict:
    """config.json of a miniature Ouro, with every field the published Ouro-1.4B file carries (bos/eos/pad all 0
    as published; GQA 4/2 here, where the real models are MHA, so the q/k/v split is exercised)."""
    n = OURO_MINI["num_hidden_layers"]
    return {
        "architectures": ["OuroForCausalLM"], "model_type": "ouro", **OURO_MINI,
        "hidden_act": "silu", "vocab_size": vocab_size, "max_position_embeddings": 512,
        "rope_theta": 1000000.0, "rope_scaling": None, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
        "total_ut_steps": total_ut_steps, "early_exit_threshold": 1.0, "use_sliding_window": False,
        "sliding_window": None, "max_window_layers": n, "layer_types": ["full_attention"] * n,
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "torch_dtype": "bfloat16",
        "auto_map": {"AutoConfig": "configuration_ouro.OuroConfig",
                     "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM"},
    }


def ouro_tensors(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under upstream's tensor names (norms around 1, gate logits of order 1)."""
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
        for name in ("input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2"):
            t[f"{p}{name}.weight"] = norm()
    t["model.norm.weight"] = norm()
    t["model.early_exit_gate.weight"] = lin(1, d)
    t["model.early_exit_gate.bias"] = 0.5 * torch.randn(1, generator=g)
    t["lm_head.weight"] = lin(cfg["vocab_size"], d)
    return t


def write_ouro_checkpoint(folder: str | os.PathLike, *, vocab_size: int = 128, seed: int = 0, n_shards: int = 1,
                          config_edits: dict | None = None, drop: tuple[str, ...] = (),
                          edit: dict[str, torch.Tensor] | None = None, tokenizer: dict | None = None) -> Path:
    """Write a random HF Ouro folder; ``edit`` replaces or adds tensors; ``tokenizer``: files from
    ``write_tokenizer`` (name -> text)."""
    folder = Path(folder)
    cfg = ouro_config(vocab_size)
    tensors = ouro_tensors(cfg, seed)
    for k in drop:
        tensors.pop(k)
    tensors.update(edit or {})
    cfg.update(config_edits or {})
    return write_folder(folder, cfg, tensors, n_shards, tokenizer)


# =================================================================================================================
# Nanbeige4.2: random HF folders in upstream's layout (its forward is checked against upstream's own logits:
# tests/fixtures/nanbeige)
# =================================================================================================================

NANBEIGE_MINI = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=80,
                     num_hidden_layers=3)

# ChatML with Nanbeige's thinking switch, written from its behaviour (not upstream's file): the generation prompt
# opens a <think> block, or with enable_thinking=false closes an empty one.
NANBEIGE_CHAT_TEMPLATE = (
    "{%- if messages and messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + "
    "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{%- if m.role != 'system' %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}")


def nanbeige_config(vocab_size: int = 128, num_loops: int = 2) -> dict:
    """config.json of a miniature Nanbeige4.2 with every field the published 3B file carries (non-square q / o:
    4 heads of 16 over a 32-wide stream, GQA 4/2, rope_theta 7e7, kv_channels = head_dim); the special ids are
    those of ``write_tokenizer("nanbeige")`` (<|im_start|> 0, <|im_end|> 1, <unk> 2)."""
    return {
        "architectures": ["NanbeigeForCausalLM"], "model_type": "nanbeige", **NANBEIGE_MINI,
        "auto_map": {"AutoConfig": "configuration_nanbeige.NanbeigeConfig",
                     "AutoModel": "modeling_nanbeige.NanbeigeModel",
                     "AutoModelForCausalLM": "modeling_nanbeige.NanbeigeForCausalLM"},
        "vocab_size": vocab_size, "kv_channels": NANBEIGE_MINI["head_dim"], "hidden_act": "silu",
        "max_position_embeddings": 512, "rope_theta": 70000000, "rope_scaling": None, "attention_bias": False,
        "attention_dropout": 0.0, "rms_norm_eps": 1e-05, "num_loops": num_loops, "loop_loss_weights": [],
        "skip_loop_final_norm": False, "pretraining_tp": 1, "tie_word_embeddings": False,
        "pad_token_id": 2, "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
    }


def nanbeige_tensors(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under upstream's tensor names (a Llama layer: two norms)."""
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
    t["model.norm.weight"] = norm()
    t["lm_head.weight"] = lin(cfg["vocab_size"], d)
    return t


def write_nanbeige_checkpoint(folder: str | os.PathLike, *, vocab_size: int = 128, seed: int = 0, n_shards: int = 1,
                              num_loops: int = 2, config_edits: dict | None = None,
                              edit: dict[str, torch.Tensor] | None = None, tokenizer: dict | None = None) -> Path:
    """Write a random HF Nanbeige folder; ``edit`` replaces or adds tensors; ``tokenizer``: files from
    ``write_tokenizer("nanbeige")``, to which the ChatML + thinking-switch template is added as chat_template.jinja."""
    folder = Path(folder)
    cfg = nanbeige_config(vocab_size, num_loops)
    tensors = nanbeige_tensors(cfg, seed)
    tensors.update(edit or {})
    cfg.update(config_edits or {})
    if tokenizer is not None:
        tokenizer = dict(tokenizer, **{"chat_template.jinja": NANBEIGE_CHAT_TEMPLATE})
    return write_folder(folder, cfg, tensors, n_shards, tokenizer)
