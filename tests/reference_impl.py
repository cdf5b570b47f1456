"""A deliberately plain, independent re-implementation of the three looped families' forward pass, used only by
tests, plus writers for small random checkpoints and tokenizers laid out like the real ones.

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

def load_state_dict(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder, by key name, in float32 (single file or index + shards)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
             else ["model.safetensors"])
    out = {}
    for name in files:
        with safe_open(folder / name, "pt") as f:
            for key in f.keys():
                out[key] = f.get_tensor(key).float()
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
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

    def __init__(self, folder: str | os.PathLike, family: str):
        folder = Path(folder)
        c = json.loads((folder / "config.json").read_text())
        self.family = family
        self.sd = load_state_dict(folder)
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
                table = huginn_freqs_cis(c["rope_base"], self.hd, c["block_size"])
            self.freqs = torch.view_as_complex(table[0, :, 0].contiguous())        # [n_pos, hd/2] complex
            self.head = self.sd["transformer.wte.weight"]                           # tied
        else:
            self.inv_freq = raven_inv_freq(c["rope_theta"], self.hd, c.get("rope_scaling"))
            self.head = self.sd["lm_head.weight"]

    # --- pieces -----------------------------------------------------------------------------------------
    def W(self, name: str) -> torch.Tensor:
        return self.sd[name]

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [B, S, H, hd] at positions pos [S]."""
        if self.family == "huginn":
            xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], self.hd // 2, 2).contiguous())
            out = torch.view_as_real(xc * self.freqs[pos][None, :, None, :])
            return out.reshape(x.shape).to(x.dtype)
        freqs = pos.float()[:, None] * self.inv_freq[None, :]                      # [S, hd/2]
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
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
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
        """float32 logits [B, S, V] at recurrence depth num_steps; state0 [B, S, d] (default: zeros)."""
        if ids.dim() == 1:
            ids = ids[None]
        B, S = ids.shape
        pos = torch.arange(S)
        e = self.W("transformer.wte.weight")[ids]
        if self.embed_scale != 1.0:
            e = e * self.embed_scale
        for i in range(self.n_pre):
            e = self.block(e, f"transformer.prelude.{i}.", pos)
        s = torch.zeros_like(e) if state0 is None else state0.expand_as(e).clone()
        for _ in range(num_steps):
            x = torch.cat([s, e], dim=-1) @ self.W("transformer.adapter.weight").T
            for j in range(self.n_core):
                x = self.block(x, f"transformer.core_block.{j}.", pos)
            s = x
        ln_f = self.W("transformer.ln_f.weight")
        x = rms_norm(s, ln_f, self.eps) if self.norm_after_loop else s
        for k in range(self.n_coda):
            x = self.block(x, f"transformer.coda.{k}.", pos)
        return (rms_norm(x, ln_f, self.eps) @ self.head.T).float()

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
    save_tensors(folder, tensors, n_shards)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    for name, text in (tokenizer or {}).items():
        (folder / name).write_text(text)
    return folder


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
}


def write_tokenizer(kind: str = "raven-llama", vocab_size: int = 300) -> dict[str, str]:
    """A byte-level BPE trained on a few sentences; the special tokens and BOS template of ``kind``'s tokenizer.
    Returns {file name: text} for tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    bos, eos, pad, extra = SPECIALS[kind]
    specials = [t for t in (bos, eos, pad) if t] + extra
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
