"""What a trained model is measured on: the held-out loss at every depth, how often the depth-d readout's argmax
equals the depth-R one (what the random-depth training buys a speculative decoder), and greedy samples."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

import dasspec

from ..model.looped import LoopedLM
from .config import TrainConfig
from .corpus import Document
from .prepare import encode_documents

SAMPLE_PROMPTS = (
    "def fibonacci(n):",
    "Question: A baker makes 24 muffins and sells 3 boxes of 6 muffins. How many muffins are left?\nAnswer:",
)
HELD_OUT_GROUPS = (("code", ("stdlib", "mbpp")), ("gsm8k", ("gsm8k",)))


@torch.no_grad()
def depth_readouts(model: LoopedLM, ids: Tensor, depths, init_scale: float = 1.0, seed: int = 0
                   ) -> dict[int, Tensor]:
    """Teacher-forced logits of the depth-d readout for every d in ``depths`` (one pass: the recurrence runs in
    segments between consecutive depths).  ids [T] or [B, T] -> {d: logits [B, T, V]}."""
    ids = ids if ids.dim() == 2 else ids[None]
    B, T = ids.shape
    span = model.span(0, 0, T)
    inj = model.prelude(ids, span)
    h0 = model.initial_state(torch.arange(T), init_scale, seed).expand(B, T, -1).to(inj.dtype)
    h = model.start_state(h0, inj)
    out, done = {}, 0
    for d in sorted(set(depths)):
        h = model.recur(h, inj, span, None, range(done + 1, d + 1))
        out[d], done = model.readout(h, span), d
    return out


@torch.no_grad()
def depth_agreement(model: LoopedLM, ids: Tensor, depths=(1, 2, 4, 8, 16), R: int | None = None,
                    init_scale: float = 1.0, seed: int = 0, window: int = 512) -> dict:
    """How often the depth-d readout's argmax equals the depth-R readout's (teacher-forced on ``ids``, a 1-D
    token tensor cut into ``window``-token rows), and the loss at every depth.  Same initial states as decoding
    (``init_scale``, ``seed``).  Returns {"agreement": {d: frac}, "loss": {d: nats}, "tokens": n, "R": R}."""
    R = model.depth(R)
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


def held_out_metrics(model: LoopedLM, tok, val_docs: list[Document], cfg: TrainConfig) -> dict[str, dict]:
    """``depth_agreement`` on up to ``eval_tokens`` held-out tokens of code and of GSM8K, and pooled ("all")."""
    window = min(512, cfg.seq_len)
    val = {}
    for name, sources in HELD_OUT_GROUPS:
        part = [d for d in val_docs if d.source in sources]
        if not part:
            continue
        ids = encode_documents(tok, part)[: cfg.eval_tokens]
        val[name] = depth_agreement(model, torch.from_numpy(ids.astype(np.int64)), R=cfg.mean_recurrence,
                                    init_scale=cfg.init_scale, window=min(window, len(ids)))
    val["all"] = pool_metrics(list(val.values()))
    return val


def sample_generations(folder: Path, prompts=SAMPLE_PROMPTS, max_new_tokens: int = 64) -> list[dict]:
    """Greedy (AR, depth R) continuations from the saved folder, loaded the way users load it."""
    model = dasspec.load_model(folder, device="cpu", dtype="float32")
    out = []
    for p in prompts:
        res = dasspec.generate(model, p, method="ar", max_new_tokens=max_new_tokens)
        out.append({"prompt": p, "text": res.text, "tokens_per_s": round(res.stats.tokens_per_second, 1)})
    return out
