"""``dasspec train``: the recipe of the bundled looped model (nanoGPT spirit: one config, one loop).

    dasspec train --out DIR                      # the shipped model: CPU, 2 threads, <= 90 minutes
    dasspec train --out DIR --preset cuda-small --device cuda

The model is the Huginn layout (prelude P, shared core F, coda H, adapter injection, sandwich blocks, qk_bias,
tied head, embedding x sqrt(d), initial-state std sqrt(2/(5d))) built by ``dasspec.model.looped.LoopedLM`` and trained
through its own primitives (prelude / core_step / readout with cache=None), then written with
``save_checkpoint`` so ``dasspec.load_model(DIR)`` loads it exactly like a real checkpoint.

Depth is what the bundled model must learn to use: every step samples a recurrence depth r from Huginn's
log-normal-Poisson scheme (``sample_depth``), starts from a random initial state (like-init, a fresh seed per
step), runs ``r - k`` core steps without gradients and back-propagates through the last ``k``.  The loss is
on the depth-r readout only.  ``depth_agreement`` measures what this buys: how often the depth-d readout's argmax
equals the depth-R one.  The sampler's mean ramps up from a few steps over the first part of the run (the Raven
retrofit code's ``mean_recurrence_schedule``): shallow steps are cheap while the model is still learning token
statistics, and a rerun of the flat-depth recipe sat on the unigram plateau for hundreds of steps (model card).

Schedules (learning rate, depth ramp) run on steps, so ``dasspec train`` gives the same run on any machine; only
its duration changes.  ``time_budget_s`` is a safety stop.  On a CPU shared with other jobs, ``share_cpu`` drops
to one thread while the others are busy (a spinning OpenMP thread waiting for a taken core stalls every op).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ..model.config import LoopedConfig
from ..model.looped import LoopedLM

BOS, EOS, PAD = "<|begin_text|>", "<|end_text|>", "<|pad|>"


# ---------------------------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class TrainConfig:
    preset: str = "tiny"
    # model (Huginn layout)
    vocab_size: int = 4096
    n_embd: int = 192
    n_heads: int = 4
    intermediate_size: int = 512
    n_prelude: int = 1
    n_core: int = 2
    n_coda: int = 1
    block_size: int = 4096              # context (RoPE table rows); 8-shot GSM8K + 512 new tokens fit
    rope_theta: float = 50000.0
    # depth schedule (Huginn: mean 32, sigma 0.5, backprop depth 8)
    mean_recurrence: int = 32           # R: mean training depth and the inference depth
    depth_sigma: float = 0.5
    backprop_depth: int = 8             # k: gradient flows through the last k core steps
    min_depth: int = 1                  # floor on r (1 = Huginn's scheme, no floor)
    max_depth: int = 128
    # depth curriculum (Raven retrofit recipe): the sampler's mean rises linearly from depth_warmup_start to
    # mean_recurrence over the first depth_warmup_frac of max_steps; cheap shallow steps while the model is
    # still learning token statistics, Huginn's scheme unchanged afterwards (0 = off)
    depth_warmup_frac: float = 0.3
    depth_warmup_start: int = 4
    init_scale: float = 1.0             # training initial state: like-init (0 = zero state)
    # data
    seq_len: int = 512
    batch_size: int = 4
    long_seq_len: int = 2048            # every ``long_every``-th step trains positions up to long_seq_len
    long_every: int = 8
    val_fraction: float = 0.02
    # optimisation
    lr: float = 1.5e-3
    min_lr_frac: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    # Schedules run on steps (max_steps) so a run is the same on any machine; without max_steps the cosine runs
    # on wall-clock time.  time_budget_s is otherwise only a safety stop (the card says when it cut a run short).
    time_budget_s: float = 82 * 60
    max_steps: int | None = 1500        # ~62 min with 2 threads on the 2-core CPU this recipe was made on
    seed: int = 0
    device: str = "cpu"
    threads: int = 2                    # CPU threads (0: leave torch's default)
    share_cpu: bool = True              # drop to 1 thread while other processes load the machine
    autocast_bf16: bool = False
    eval_tokens: int = 16384            # held-out tokens for the final validation loss / agreement
    sample_tokens: int = 64             # greedy sample length in the model card
    log_every: int = 10

    def validate(self) -> "TrainConfig":
        """Refuse a run that would fail late or train nothing, before the corpus and tokenizer are built."""
        positive = ("vocab_size", "n_embd", "n_heads", "intermediate_size", "n_core", "mean_recurrence",
                    "backprop_depth", "min_depth", "max_depth", "seq_len", "batch_size", "long_seq_len", "eval_tokens")
        for name in positive:
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 (or null: the cosine runs over the time budget), got "
                             f"{self.max_steps}")
        if not self.lr > 0 or not 0 <= self.min_lr_frac <= 1:
            raise ValueError(f"lr must be > 0 and min_lr_frac in [0, 1], got {self.lr}, {self.min_lr_frac}")
        if self.min_depth > self.max_depth:
            raise ValueError(f"min_depth ({self.min_depth}) > max_depth ({self.max_depth})")
        if self.n_embd % self.n_heads:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_heads ({self.n_heads})")
        from ..model.checkpoint import resolve_device      # the same device check as load_model
        try:
            resolve_device(self.device)
        except ValueError as err:
            raise ValueError(f"{err}; preset {self.preset!r} trains on {self.device!r} - pass --device cpu to run "
                             "it on the CPU") from None
        return self

    def model_config(self, bos: int, eos: int, pad: int) -> LoopedConfig:
        d = self.n_embd
        return LoopedConfig(
            family="huginn", vocab_size=self.vocab_size, n_embd=d, n_heads=self.n_heads, n_kv_heads=self.n_heads,
            head_dim=d // self.n_heads, intermediate_size=self.intermediate_size, n_prelude=self.n_prelude,
            n_core=self.n_core, n_coda=self.n_coda, mean_recurrence=self.mean_recurrence, norm_eps=1e-6,
            qk_bias=True, rope_theta=self.rope_theta, tie_embeddings=True, embed_scale=math.sqrt(d),
            init_std=math.sqrt(2 / (5 * d)), block_size=self.block_size, bos_token_id=bos, eos_token_id=[eos],
            pad_token_id=pad).validate()


PRESETS: dict[str, TrainConfig] = {
    # the bundled model: 2-core CPU, fp32, <= 90 minutes including tokenizer, data and evaluation
    "tiny": TrainConfig(),
    # a few seconds: tests and smoke runs
    "micro": TrainConfig(preset="micro", vocab_size=512, n_embd=32, n_heads=2, intermediate_size=64, block_size=256,
                         mean_recurrence=4, backprop_depth=2, max_depth=8, seq_len=64, batch_size=2,
                         long_seq_len=128, long_every=4, warmup_steps=2, time_budget_s=120, max_steps=6,
                         eval_tokens=256, sample_tokens=8, log_every=1, threads=1),
    # a larger model for a lent GPU (bf16 autocast)
    "cuda-small": TrainConfig(preset="cuda-small", vocab_size=8192, n_embd=512, n_heads=8, intermediate_size=1408, n_core=4,
                              n_prelude=2, n_coda=2, seq_len=2048, batch_size=16, long_seq_len=4096,
                              lr=1e-3, warmup_steps=100, device="cuda", threads=0, autocast_bf16=True,
                              eval_tokens=65536),
}


# ---------------------------------------------------------------------------------------------------------------
# Depth sampler
# ---------------------------------------------------------------------------------------------------------------

def sample_depth(rng: np.random.Generator, mean: float, sigma: float = 0.5, backprop: int = 8,
                 min_depth: int = 1, max_depth: int = 128) -> tuple[int, int]:
    """Huginn's randomised recurrence (research/huginn.md section 1): rate ~ LogNormal(ln(mean) - sigma^2/2,
    sigma), r = Poisson(rate) + 1 (so E[r] ~ mean + 1), clipped to [min_depth, max_depth].
    Returns (n, k): n = max(r - backprop, 0) steps without gradient, then k = min(backprop, r) with gradient."""
    rate = rng.lognormal(math.log(mean) - sigma ** 2 / 2, sigma)
    r = int(min(max(rng.poisson(rate) + 1, min_depth), max_depth))
    k = min(backprop, r)
    return r - k, k


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer and data
# ---------------------------------------------------------------------------------------------------------------

def train_tokenizer(texts, vocab_size: int):
    """Byte-level BPE (HF ``tokenizers``) with Huginn's special-token names; the post-processor prepends BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, bos)])
    return tok


def save_tokenizer(tok, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {**special, "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True, "add_eos_token": False,
         "model_max_length": 4096}, indent=2) + "\n")


def encode_documents(tok, docs, counts: dict | None = None) -> np.ndarray:
    """One token stream: BOS text EOS per document (uint16).  ``counts`` (optional) receives tokens per source."""
    eos = tok.token_to_id(EOS)
    out = []
    for doc, enc in zip(docs, tok.encode_batch([d.text for d in docs])):
        out.append(np.asarray(enc.ids + [eos], dtype=np.uint16))     # encode() adds BOS
        if counts is not None:
            counts[doc.source] = counts.get(doc.source, 0) + len(out[-1])
    return np.concatenate(out)


def get_batch(stream: np.ndarray, rng: np.random.Generator, batch: int, T: int, device) -> tuple[Tensor, Tensor]:
    starts = rng.integers(0, len(stream) - T - 1, size=batch)
    x = np.stack([stream[s: s + T + 1] for s in starts]).astype(np.int64)
    x = torch.from_numpy(x).to(device)
    return x[:, :-1], x[:, 1:]


# ---------------------------------------------------------------------------------------------------------------
# Model init, forward with random depth, evaluation
# ---------------------------------------------------------------------------------------------------------------

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


def initial_states(model: LoopedLM, B: int, T: int, init_scale: float, seed: int) -> Tensor:
    """[B, T, d] like-init states, a different seed per sequence (the model's own per-position draw)."""
    pos = torch.arange(T)
    return torch.stack([model.initial_state(pos, init_scale, seed + b) for b in range(B)])


def looped_loss(model: LoopedLM, x: Tensor, y: Tensor, n: int, k: int, init_scale: float, seed: int) -> Tensor:
    """Cross-entropy of the depth-(n+k) readout; the first n core steps run without gradient (truncated BPTT)."""
    B, T = x.shape
    span = model.span(0, 0, T)
    inj = model.prelude(x, span)
    h = initial_states(model, B, T, init_scale, seed).to(inj.dtype)
    with torch.no_grad():
        for _ in range(n):
            h = model.core_step(h, inj, span)
    for _ in range(k):
        h = model.core_step(h, inj, span)
    logits = model.readout(h, span)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


@torch.no_grad()
def depth_readouts(model: LoopedLM, ids: Tensor, depths, init_scale: float = 1.0, seed: int = 0
                   ) -> dict[int, Tensor]:
    """Teacher-forced logits of the depth-d readout for every d in ``depths`` (one pass: the readout is taken
    along the way).  ids [T] or [B, T] -> {d: logits [B, T, V]}."""
    ids = ids if ids.dim() == 2 else ids[None]
    B, T = ids.shape
    span = model.span(0, 0, T)
    inj = model.prelude(ids, span)
    h = model.initial_state(torch.arange(T), init_scale, seed).expand(B, T, -1).to(inj.dtype)
    out = {}
    for r in range(1, max(depths) + 1):
        h = model.core_step(h, inj, span)
        if r in depths:
            out[r] = model.readout(h, span)
    return out


@torch.no_grad()
def depth_agreement(model: LoopedLM, ids: Tensor, depths=(1, 2, 4, 8, 16), R: int | None = None,
                    init_scale: float = 1.0, seed: int = 0, window: int = 512) -> dict:
    """How often the depth-d readout's argmax equals the depth-R readout's (teacher-forced on ``ids``, a 1-D
    token tensor cut into ``window``-token rows), and the loss at every depth.  Same initial states as decoding
    (``init_scale``, ``seed``).  Returns {"agreement": {d: frac}, "loss": {d: nats}, "tokens": n}."""
    R = model.R if R is None else R
    ids = ids.reshape(-1)
    rows = ids[: len(ids) // window * window].view(-1, window) if len(ids) >= window else ids[None]
    want = sorted(set(depths) | {R})
    agree = {d: 0 for d in want}
    loss = {d: 0.0 for d in want}
    count = 0
    for row in rows:
        logits = depth_readouts(model, row.to(model.device), want, init_scale, seed)
        target = logits[R][0, :-1].argmax(-1)
        y = row[1:].to(model.device)
        for d in want:
            z = logits[d][0, :-1]
            agree[d] += int((z.argmax(-1) == target).sum())
            loss[d] += float(F.cross_entropy(z, y, reduction="sum"))
        count += len(y)
    return {"agreement": {d: agree[d] / count for d in want}, "loss": {d: loss[d] / count for d in want},
            "tokens": count, "R": R}


def pool_metrics(parts: list[dict]) -> dict:
    """Token-weighted union of ``depth_agreement`` results (exact: both are per-token averages)."""
    n = sum(p["tokens"] for p in parts)
    depths = parts[0]["agreement"].keys()
    return {key: {d: sum(p[key][d] * p["tokens"] for p in parts) / n for d in depths}
            for key in ("agreement", "loss")} | {"tokens": n, "R": parts[0]["R"]}


# ---------------------------------------------------------------------------------------------------------------
# The training loop
# ---------------------------------------------------------------------------------------------------------------

def run_fraction(cfg: TrainConfig, step: int, elapsed: float) -> float:
    """Fraction of the run done: by steps when max_steps is set (machine-independent), else by wall-clock."""
    frac = step / cfg.max_steps if cfg.max_steps is not None else elapsed / cfg.time_budget_s
    return min(max(frac, 0.0), 1.0)


def mean_depth_at(cfg: TrainConfig, frac: float) -> float:
    """The depth sampler's mean at run fraction ``frac``: the curriculum ramp, then mean_recurrence."""
    if cfg.depth_warmup_frac <= 0 or frac >= cfg.depth_warmup_frac:
        return float(cfg.mean_recurrence)
    start = min(cfg.depth_warmup_start, cfg.mean_recurrence)
    return start + (cfg.mean_recurrence - start) * frac / cfg.depth_warmup_frac


def lr_at(cfg: TrainConfig, step: int, elapsed: float) -> float:
    """Linear warmup over steps, then cosine to min_lr_frac * lr over max_steps (or the wall-clock budget)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = run_fraction(cfg, step, elapsed)
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


def share_threads(threads: int) -> None:
    """On a shared CPU an OpenMP thread that waits for a busy core stalls every op of the step (measured here: a
    2-thread step took 3x a 1-thread one while other jobs ran), so use ``threads`` only when the 1-minute load
    average, less our own threads, says the other cores are idle."""
    others = os.getloadavg()[0] - torch.get_num_threads()
    torch.set_num_threads(threads if others < 0.5 else 1)


def train(cfg: TrainConfig, out: str | Path, data_dir: str | Path | None = None, docs=None,
          progress: bool = True, pilots: dict[str, dict] | None = None) -> dict:
    """Build corpus + tokenizer, train, save the checkpoint folder into ``out`` (config.json, model.safetensors,
    tokenizer files, generation_config.json) plus ``train_log.csv``, ``train_summary.json`` and the model card
    ``README.md`` (which tabulates ``pilots``: name -> an earlier run's train_summary.json)."""
    from tqdm import tqdm

    from ..model.checkpoint import save_checkpoint
    from .corpus import build_corpus, corpus_stats, split_corpus

    cfg.validate()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    device = torch.device(cfg.device)

    docs = build_corpus(data_dir) if docs is None else docs
    train_docs, val_docs = split_corpus(docs, cfg.val_fraction, cfg.seed)
    tok = train_tokenizer((d.text for d in train_docs), cfg.vocab_size)
    save_tokenizer(tok, out)
    train_counts: dict[str, int] = {}
    val_counts: dict[str, int] = {}
    train_ids = encode_documents(tok, train_docs, train_counts)
    val_ids = encode_documents(tok, val_docs, val_counts)
    bos, eos, pad = (tok.token_to_id(t) for t in (BOS, EOS, PAD))

    mcfg = replace(cfg.model_config(bos, eos, pad), vocab_size=tok.get_vocab_size())
    model = LoopedLM(mcfg).to(device)
    init_weights(model)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=cfg.betas,
                            fused=device.type == "cuda")
    setup_s = time.time() - t_start

    log_path = out / "train_log.csv"
    fields = ["step", "elapsed_s", "lr", "depth", "backprop", "seq_len", "loss", "tokens", "tokens_per_s",
              "threads"]
    log_f = open(log_path, "w", newline="")
    log = csv.DictWriter(log_f, fieldnames=fields)
    log.writeheader()
    by_steps = cfg.max_steps is not None
    bar = tqdm(total=cfg.max_steps if by_steps else int(cfg.time_budget_s), unit="step" if by_steps else "s",
               desc="train", disable=not progress,
               bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} {unit} [{elapsed}<{remaining}{postfix}]")
    tokens = 0
    step = 0
    t0 = time.time()
    ema = None
    while True:
        elapsed = time.time() - t0
        if elapsed >= cfg.time_budget_s or (cfg.max_steps is not None and step >= cfg.max_steps):
            break
        lr = lr_at(cfg, step, elapsed)
        if cfg.threads > 1 and cfg.share_cpu and device.type == "cpu" and step % 10 == 0:
            share_threads(cfg.threads)
        for g in opt.param_groups:
            g["lr"] = lr
        T, B = cfg.seq_len, cfg.batch_size
        if cfg.long_every and step % cfg.long_every == cfg.long_every - 1:
            T, B = cfg.long_seq_len, max(1, cfg.batch_size * cfg.seq_len // cfg.long_seq_len)
        x, y = get_batch(train_ids, rng, B, T, device)
        mean_r = mean_depth_at(cfg, run_fraction(cfg, step, elapsed))
        n, k = sample_depth(rng, mean_r, cfg.depth_sigma, cfg.backprop_depth, cfg.min_depth, cfg.max_depth)
        seed = int(rng.integers(0, 2 ** 31))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.autocast_bf16):
            loss = looped_loss(model, x, y, n, k, cfg.init_scale, seed)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        tokens += B * T
        lv = loss.detach().item()
        if not math.isfinite(lv):
            raise RuntimeError(f"training diverged at step {step} (loss {lv})")
        ema = lv if ema is None else 0.95 * ema + 0.05 * lv
        now = time.time() - t0
        log.writerow(dict(step=step, elapsed_s=round(now, 2), lr=f"{lr:.3e}", depth=n + k, backprop=k, seq_len=T,
                          loss=round(lv, 4), tokens=tokens, tokens_per_s=round(tokens / max(now, 1e-9), 1),
                          threads=torch.get_num_threads()))
        if step % cfg.log_every == 0:
            log_f.flush()
        bar.set_postfix_str(f"step {step} loss {ema:.3f} r={n + k} {tokens / max(now, 1e-9):.0f} tok/s")
        bar.update(1 if by_steps else min(now, cfg.time_budget_s) - bar.n)
    bar.close()
    log_f.close()
    train_s = time.time() - t0

    model.eval()
    save_checkpoint(model, out)
    write_generation_config(out, eos)
    t_eval = time.time()
    window = min(512, cfg.seq_len)
    val = {}
    for name, sources in (("code", ("stdlib", "mbpp")), ("gsm8k", ("gsm8k",))):
        part = [d for d in val_docs if d.source in sources]
        if not part:
            continue
        ids = encode_documents(tok, part)[: cfg.eval_tokens]
        val[name] = depth_agreement(model, torch.from_numpy(ids.astype(np.int64)), R=cfg.mean_recurrence,
                                    init_scale=cfg.init_scale, window=min(window, len(ids)))
    val["all"] = pool_metrics(list(val.values()))
    summary = {
        "config": asdict(cfg), "model": mcfg.to_dict(), "parameters": model.num_parameters(),
        "weights_bytes": (out / "model.safetensors").stat().st_size,
        "corpus": corpus_stats(docs), "train_documents": len(train_docs), "val_documents": len(val_docs),
        "train_tokens": train_counts, "val_tokens": val_counts,
        "steps": step, "tokens_seen": tokens, "setup_s": round(setup_s, 1), "train_s": round(train_s, 1),
        "eval_s": round(time.time() - t_eval, 1), "tokens_per_s": round(tokens / max(train_s, 1e-9), 1),
        "val": val["all"], "val_by_source": val, "torch": torch.__version__, "threads": torch.get_num_threads(),
    }
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_training(out, summary)
    write_model_card(out, summary, sample_generations(out, max_new_tokens=cfg.sample_tokens),
                     pilots)
    return summary


PAPER_HUGINN_AGREEMENT = {1: 0.4722, 2: 0.6362, 4: 0.7937, 8: 0.9127}   # paper Table 6, Huginn, Aligned


def plot_training(folder: Path, summary: dict) -> Path:
    """``train_loss.png``: left, the per-step loss of ``train_log.csv`` (and its 50-step mean) against tokens
    seen; right, how the held-out depth-d readout agrees with depth R, next to the paper's Huginn-0125."""
    from ..eval.probes.common import pyplot

    rows = list(csv.DictReader(open(Path(folder) / "train_log.csv")))
    tokens = np.array([float(r["tokens"]) for r in rows])
    loss = np.array([float(r["loss"]) for r in rows])
    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    ax.plot(tokens, loss, lw=0.5, alpha=0.35, color="tab:blue", label="one step")
    if len(loss) >= 50:
        ax.plot(tokens[49:], np.convolve(loss, np.ones(50) / 50, mode="valid"), color="tab:blue",
                label="50-step mean")
    R = summary["val"]["R"]
    val_loss = {int(d): x for d, x in summary["val"]["loss"].items()}       # int keys in memory, str from JSON
    ax.axhline(val_loss[R], color="tab:red", ls="--", lw=1, label=f"held-out, depth {R}")
    ax.set(xlabel="training tokens", ylabel="cross-entropy (nats)",
           title=f"training loss ({summary['train_s'] / 60:.0f} min, {summary['threads']} thread(s))")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    for name, v in summary["val_by_source"].items():
        agree = sorted((int(d), x) for d, x in v["agreement"].items() if int(d) < R)
        bx.plot([d for d, _ in agree], [x for _, x in agree], marker="o", lw=2 if name == "all" else 1,
                label={"all": "this model (pooled)"}.get(name, name))
    bx.plot(list(PAPER_HUGINN_AGREEMENT), list(PAPER_HUGINN_AGREEMENT.values()), marker="s", ls="--",
            color="gray", label="Huginn-0125 (paper)")
    bx.set_xscale("log", base=2)
    bx.set(xlabel="readout depth d", ylabel=f"agreement with depth {R}", ylim=(0, 1.02),
           title="held-out: depth-d vs depth-R argmax")
    bx.grid(alpha=0.3)
    bx.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path = Path(folder) / "train_loss.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_generation_config(folder: Path, eos: int) -> None:
    path = Path(folder) / "generation_config.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    # Tuned decoder defaults (benchmarks/tune_wave.py) and their provenance survive a retrain into the same folder.
    keep = {k: old[k] for k in ("dasspec", "dasspec_tuning") if k in old}
    path.write_text(json.dumps({"eos_token_id": eos, "do_sample": False, "dasspec": {}, **keep}, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------------------------
# Model card
# ---------------------------------------------------------------------------------------------------------------

CARD_DEPTHS = (1, 2, 4, 8, 16)
SAMPLE_PROMPTS = (
    "def fibonacci(n):",
    "Question: A baker makes 24 muffins and sells 3 boxes of 6 muffins. How many muffins are left?\nAnswer:",
)


def sample_generations(folder: Path, prompts=SAMPLE_PROMPTS, max_new_tokens: int = 64) -> list[dict]:
    """Greedy (AR, depth R) continuations from the saved folder, loaded the way users load it."""
    import dasspec

    model = dasspec.load_model(folder, device="cpu", dtype="float32")
    out = []
    for p in prompts:
        res = dasspec.generate(model, p, method="ar", max_new_tokens=max_new_tokens)
        out.append({"prompt": p, "text": res.text, "tokens_per_s": round(res.stats.tokens_per_second, 1)})
    return out


def _pilot_row(summary: dict, name: str) -> str:
    c, v = summary["config"], summary["val"]
    a = {int(k): x for k, x in v["agreement"].items()}
    loss = {int(k): x for k, x in v["loss"].items()}
    ramp = c.get("depth_warmup_frac") or 0
    recipe = (f"d={c['n_embd']}, core {c['n_core']}, mean r {c['mean_recurrence']}"
              + (f" (ramp from {c['depth_warmup_start']} over {ramp:.0%})" if ramp else "")
              + f", k {c['backprop_depth']}, floor {c['min_depth']}, init {c['init_scale']:g}, "
              f"T {c['seq_len']}x{c['batch_size']}, lr {c['lr']:g}, "
              + (f"cosine over {c['max_steps']} steps" if c["max_steps"] else "cosine over wall-clock"))
    return (f"| {name} | {recipe} | {summary['train_s'] / 60:.1f} | {summary['tokens_seen']:,} | "
            + " | ".join(f"{a[d]:.3f}" if d in a else "-" for d in CARD_DEPTHS)
            + f" | {loss[summary['val']['R']]:.3f} |")


def write_model_card(folder: Path, summary: dict, samples: list[dict], pilots: dict[str, dict] | None = None
                     ) -> Path:
    """README.md in ``folder`` from what the run measured (train_summary.json) - no number is typed in."""
    s, c, m = summary, summary["config"], summary["model"]
    R = s["val"]["R"]
    lines = [
        "# dasspec-tiny", "",
        "A small looped (recurrent-depth) language model in the Huginn-0125 layout, trained from scratch by "
        "`dasspec train` so that dasspec works with no download: `dasspec.load_model()` / "
        "`dasspec generate --prompt ...` use it when no `--model` is given. It is a test and demo model: "
        "it writes Python-looking code and GSM8K-looking text, but it is not good at either.", "",
        "## Model", "",
        f"* Huginn layout through `dasspec.model.looped.LoopedLM` (`family=huginn`): embedding x sqrt(d), prelude "
        f"{m['n_prelude']} / shared core {m['n_core']} / coda {m['n_coda']} sandwich blocks, linear adapter on "
        "[state, prelude output], qk_bias, interleaved RoPE, ln_f after the loop and after the coda, tied head.",
        f"* d = {m['n_embd']}, {m['n_heads']} heads of {m['head_dim']}, gated-SiLU MLP {m['intermediate_size']}, "
        f"vocabulary {m['vocab_size']}, context {m['block_size']} positions (RoPE base {m['rope_theta']:g}).",
        f"* Inference depth R = {R} (`mean_recurrence`); like-init initial state std sqrt(2/(5d)) = "
        f"{m['init_std']:.4f} (x embed scale {m['embed_scale']:.1f}).",
        f"* {s['parameters']:,} parameters; weights {s['weights_bytes'] / 2 ** 20:.1f} MiB (fp32 safetensors).", "",
        "## Training corpus (offline)", "",
        "| source | documents | characters | train tokens | held-out tokens |", "|---|---|---|---|---|",
    ]
    for src, st in s["corpus"].items():
        lines.append(f"| {src} | {st['documents']:,} | {st['chars']:,} | {s['train_tokens'].get(src, 0):,} | "
                     f"{s['val_tokens'].get(src, 0):,} |")
    lines += [
        "",
        "* `stdlib`: the Python standard library `.py` files of the interpreter that ran the recipe (test suites "
        "excluded); `gsm8k`: GSM8K **train** as `Question: ...\\nAnswer: ...\\n#### N` (calculator annotations "
        "removed); `mbpp`: MBPP **train** (task_ids 601-974) as comment + tests + code.",
        "* No evaluation split is trained on: documents containing a GSM8K-test, MATH-500, HumanEval or MBPP 11-510 "
        "prompt are dropped (`dasspec.train.corpus.contamination`, word 13-gram probes; it removes the MBPP-train "
        "tasks whose text duplicates an MBPP-test task). `tests/test_corpus.py` re-checks the corpus.",
        f"* Held-out: {c['val_fraction']:.0%} of the documents of every source ({s['val_documents']} documents).",
        f"* Tokenizer: byte-level BPE (HF `tokenizers`, digits split) trained on the training documents; special "
        "tokens `<|begin_text|>` (prepended by the post-processor), `<|end_text|>` (EOS, appended after every "
        "document), `<|pad|>`.", "",
        "## Training", "",
        f"* `dasspec train --out DIR` (preset `{c['preset']}`, seed {c['seed']}): {s['steps']:,} steps, "
        f"{s['tokens_seen']:,} tokens in {s['train_s'] / 60:.1f} min of training (+{s['setup_s'] / 60:.1f} min "
        f"corpus/tokenizer, +{s['eval_s'] / 60:.1f} min evaluation), {s['tokens_per_s']:.0f} tokens/s on "
        f"{c['device']} with {s['threads']} thread(s), torch {s['torch']}.",
        f"* Depth: every step draws r from Huginn's log-normal-Poisson scheme (mean {c['mean_recurrence']}, "
        f"sigma {c['depth_sigma']}, r in [{c['min_depth']}, {c['max_depth']}]), starts from a fresh like-init "
        f"random state (scale {c['init_scale']:g}), runs r - k core steps without gradient and back-propagates "
        f"through the last k = min({c['backprop_depth']}, r); loss on the depth-r readout only."
        + (f" Curriculum (the Raven retrofit code's `mean_recurrence_schedule`): the sampler's mean rises linearly from "
           f"{c['depth_warmup_start']} to {c['mean_recurrence']} over the first {c['depth_warmup_frac']:.0%} of "
           "the steps." if c.get("depth_warmup_frac") else ""),
        f"* Sequences of {c['seq_len']} tokens x {c['batch_size']}, every {c['long_every']}th step "
        f"{c['long_seq_len']} tokens; AdamW (betas {tuple(c['betas'])}, weight decay {c['weight_decay']}), "
        f"peak lr {c['lr']:g}, {c['warmup_steps']} warmup steps then cosine to {c['min_lr_frac']:g}x over "
        + (f"{c['max_steps']:,} steps, grad clip {c['grad_clip']}. The schedules run on steps, so a faster or "
           "slower machine runs the same schedule (only the duration changes, and float rounding with the CPU)."
           if c["max_steps"] is not None else
           f"the wall-clock budget ({c['time_budget_s'] / 60:.0f} min), grad clip {c['grad_clip']}. The step "
           "count depends on the machine's speed and load; for a machine-independent run of the same length use "
           f"`--set max_steps={s['steps']}`."),
        *([f"* **Stopped early** by the {c['time_budget_s'] / 60:.0f}-minute safety budget at step {s['steps']} "
           f"of {c['max_steps']}."] if c["max_steps"] is not None and s["steps"] < c["max_steps"] else []),
        "",
        "## Depth: validation loss and agreement of the depth-d readout with depth R", "",
        f"Teacher-forced on held-out documents (up to {c['eval_tokens']:,} tokens of code and of GSM8K, windows "
        f"of {min(512, c['seq_len'])} tokens), initial state as in "
        f"training (init_scale {c['init_scale']:g}, seed 0; 1 = like-init, the decoding default); agreement = "
        f"fraction of positions whose depth-d argmax equals the depth-{R} argmax "
        "(`dasspec.train.recipe.depth_agreement`).", "",
    ]
    depths = sorted({*CARD_DEPTHS, R})
    lines += ["| held-out text | tokens | " + " | ".join(f"d={d}" for d in depths) + " |",
              "|---|---|" + "---|" * len(depths)]
    label = {"all": "pooled", "code": "code (stdlib + mbpp)", "gsm8k": "gsm8k"}
    for key, unit in (("agreement", ""), ("loss", " (nats)")):
        for name, v in s["val_by_source"].items():
            x = {int(k): y for k, y in v[key].items()}
            lines.append(f"| {label.get(name, name)}: {key}{unit} | {v['tokens']:,} | "
                         + " | ".join(f"{x[d]:.3f}" for d in depths) + " |")
    lines += ["", "For comparison, the paper reports an aligned depth-d draft of Huginn-0125 agreeing with its "
              "depth-32 target about 0.47 / 0.64 / 0.79 / 0.91 at d = 1 / 2 / 4 / 8.", ""]
    if (Path(folder) / "train_loss.png").exists():
        lines += ["![training loss](train_loss.png)", ""]
    if pilots:
        lines += ["## Pilot runs (how the recipe was chosen)", "",
                  "Each row is a run of the same script with the listed changes; agreement with depth R "
                  "on the pooled held-out text.", "",
                  "| run | recipe | train min | tokens | " + " | ".join(f"d={d}" for d in CARD_DEPTHS)
                  + f" | loss at R |", "|---|---|---|---|" + "---|" * (len(CARD_DEPTHS) + 1)]
        lines += [_pilot_row(p, name) for name, p in pilots.items()]
        lines += [_pilot_row(s, "**this model**"), ""]
    lines += ["## Samples (greedy, depth R, `method=\"ar\"`)", ""]
    for smp in samples:
        lines += ["```text", smp["prompt"] + smp["text"], "```",
                  f"({smp['tokens_per_s']} tokens/s on this machine)", ""]
    lines += ["## Files", "",
              "`config.json` (Huginn-style), `model.safetensors`, `tokenizer.json` + `tokenizer_config.json` + "
              "`special_tokens_map.json`, `generation_config.json` (EOS; the `dasspec` section holds tuned "
              "decoder defaults), `train_log.csv` (per-step loss), `train_loss.png` (its plot), `train_summary.json` "
              "(everything above).", ""]
    path = Path(folder) / "README.md"
    path.write_text("\n".join(lines))
    return path



# ---------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------

def _parse_override(item: str) -> tuple[str, object]:
    if "=" not in item:
        raise SystemExit(f"--set expects NAME=VALUE, got {item!r}")
    name, value = item.split("=", 1)
    if name not in TrainConfig.__dataclass_fields__:
        raise SystemExit(f"unknown training field {name!r}; fields: {', '.join(TrainConfig.__dataclass_fields__)}")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def cmd_train(args: argparse.Namespace) -> int:
    cfg = PRESETS[args.preset]
    over = dict(_parse_override(s) for s in args.set)
    if args.device:
        over["device"] = args.device
    if args.minutes is not None:
        over["time_budget_s"] = 60 * args.minutes
    if args.seed is not None:
        over["seed"] = args.seed
    if "betas" in over:
        over["betas"] = tuple(over["betas"])
    cfg = replace(cfg, **over)
    pilots = {Path(d).name: json.loads((Path(d) / "train_summary.json").read_text()) for d in args.pilots}
    summary = train(cfg, args.out, data_dir=args.data, pilots=pilots)
    agree = summary["val"]["agreement"]
    print(f"saved {args.out}: {summary['parameters']:,} parameters, {summary['steps']} steps, "
          f"{summary['tokens_seen']:,} tokens in {summary['train_s'] / 60:.1f} min; val loss at R "
          f"{summary['val']['loss'][summary['val']['R']]:.3f}; agreement with depth R: "
          + ", ".join(f"d={d}: {a:.3f}" for d, a in agree.items()))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train the bundled looped model (or a bigger preset on a GPU)")
    p.add_argument("--out", required=True, help="output folder (checkpoint + train_log.csv + train_summary.json)")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--data", default=None, help="evaluation-data folder holding gsm8k/ and mbpp/ "
                                                "(default: $DASSPEC_DATA or ../shared/data)")
    p.add_argument("--device", default=None, help="cpu (default for tiny) or cuda")
    p.add_argument("--minutes", type=float, default=None, help="wall-clock safety stop (default 82); with --set max_steps=null the "
                                                           "cosine runs over this budget instead of over steps")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="override any TrainConfig field, e.g. --set mean_recurrence=16 (repeatable)")
    p.add_argument("--pilots", nargs="*", default=[], metavar="DIR",
                   help="earlier runs (folders with train_summary.json) to tabulate in the model card")
    p.set_defaults(func=cmd_train)
