"""Log-probabilities of given tokens under the full-depth target: the scoring behind ``dasspec eval``'s
log-likelihood requests and the server's ``logprobs`` / ``echo``.

Every number comes from a plain full forward, ``model(ids, num_steps=..., init_scale=..., seed=...)`` (no cache,
no drafting): position t's log-softmax over the vocabulary scores token t + 1.  That is the target every decoding
method is verified against, so the log-probabilities of a decoded text are the same whichever method decoded it.

Several sequences share one forward: they are right-padded to the longest of their group (causal attention never
lets a position see the padding after it), in groups of at most ``max_batch`` sequences and ``max_tokens`` padded
positions.  A padded row equals the same sequence's own forward to float32 rounding (the batched products sum in a
different order), not bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..model.looped import LoopedLM

# padded positions of one scoring forward: bounds its float32 logits (positions x vocabulary x 4 bytes)
MAX_SCORE_TOKENS = 8192


@dataclass
class Scored:
    """One sequence's scores: ``logprobs[t]`` = log p(ids[t + 1] | ids[: t + 1]) (len(ids) - 1 entries),
    ``greedy[t]`` whether ids[t + 1] is the target's argmax there, ``top[t]`` the ``top`` most likely tokens there
    as (token id, log-probability), most likely first (empty when ``top`` is 0)."""
    ids: list[int]
    logprobs: list[float]
    greedy: list[bool]
    top: list[list[tuple[int, float]]] = field(default_factory=list)


def _groups(lengths: Sequence[int], max_batch: int, max_tokens: int) -> list[list[int]]:
    """Indices grouped for one forward each: longest first, so a group pads to its first member."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        g = groups[-1] if groups else None
        if g is not None and len(g) < max_batch and lengths[g[0]] * (len(g) + 1) <= max_tokens:
            g.append(i)
        else:
            groups.append([i])
    return groups


@torch.no_grad()
def score(model: LoopedLM, seqs: Sequence[Sequence[int]], *, num_steps: int | None = None, init_scale: float = 1.0,
          seed: int = 0, exit_threshold: float | None = None, exit_at_step: int | None = None, top: int = 0,
          max_batch: int = 8, max_tokens: int = MAX_SCORE_TOKENS) -> list[Scored]:
    """The full-depth target's log-probability of every token of each sequence after its first (see ``Scored``),
    in input order.  ``seed`` / ``init_scale`` / ``num_steps`` / the exit options are those of the forward (and of
    ``dasspec.generate``: the same values give the target that decoding was verified against)."""
    V = model.config.vocab_size
    ctx = model.config.block_size
    seqs = [list(s) for s in seqs]
    for s in seqs:
        if not s:
            raise ValueError("a sequence to score is empty")
        if len(s) > ctx:
            raise ValueError(f"a sequence of {len(s)} tokens is longer than the model's context ({ctx})")
        bad = [t for t in s if not 0 <= t < V]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {V})")
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= V:
        raise ValueError(f"top must be a whole number in [0, {V}], got {top!r}")
    out: list[Scored | None] = [None] * len(seqs)
    for group in _groups([len(s) for s in seqs], max(1, max_batch), max(1, max_tokens)):
        T = len(seqs[group[0]])
        pad = [seqs[i] + [0] * (T - len(seqs[i])) for i in group]
        ids = torch.tensor(pad, dtype=torch.long, device=model.device)
        logits = model(ids, num_steps=num_steps, init_scale=init_scale, seed=seed, exit_threshold=exit_threshold,
                       exit_at_step=exit_at_step)
        logp = torch.log_softmax(logits.float(), dim=-1)                  # [B, T, V]
        for row, i in enumerate(group):
            n = len(seqs[i])
            lp = logp[row, : n - 1]
            nxt = ids[row, 1:n]
            chosen = lp.gather(-1, nxt[:, None])[:, 0]
            best = lp.max(-1).values
            tops: list[list[tuple[int, float]]] = []
            if top:
                v, k = lp.topk(top, dim=-1)
                tops = [list(zip(kk, vv)) for kk, vv in zip(k.tolist(), v.tolist())]
            out[i] = Scored(seqs[i], chosen.tolist(), (chosen >= best).tolist(), tops)
    return out  # type: ignore[return-value]
