"""Sequential self-speculation (draft depth d, block b) and Mature-Spec.

Each block drafts b tokens one after another, each with d core steps from its own initial state; step j reads the
verified prefix at depths (kappa, nu) = policy(j, R) and the earlier drafts of this block at depth j (their K/V
from the same draft step, stored in scratch rows).  Self-speculation uses Aligned reads (kappa = nu = j);
Mature-Spec uses Deep K/V (kappa = nu = R); Deep V (Mature-V), Deep K or explicit depths are knobs.
The b proposals go to the independent full-depth verifier.
"""

from __future__ import annotations

from torch import Tensor

from ..model.config import LoopedConfig
from ..decoding import Decoding
from ..methods import MethodSpec, positive_int, register
from ..model.policy import ReadPolicy, parse_policy
from ..verify import verify_chain


def propose_sequential(dec: Decoding, d: int, b: int, policy: ReadPolicy) -> Tensor:
    """Draft b tokens after the anchor at depth d; returns them (a view of the token scratch)."""
    model, cache, tokens = dec.model, dec.cache, dec.tokens
    n, R = dec.n, dec.R
    reads = [policy.depths(j, R) for j in range(1, d + 1)]       # hoisted out of the token loop
    for i in range(b):
        row = n + i
        span = dec.span(row, 1)
        inj = model.prelude(tokens[row: row + 1].unsqueeze(0), span, cache)
        h = dec.h0[:, row: row + 1]
        for j, read in enumerate(reads, 1):
            h = model.core_step(h, inj, span, cache, read=read, own=(j, j))
        tokens[row + 1] = model.readout(h, span, cache)[0, -1].argmax()
    dec.stats.draft_passes += b * d
    dec.stats.draft_updates += b * d
    return tokens[n + 1: n + 1 + b]


def run_sequential(dec: Decoding, knobs: dict) -> None:
    d, b, policy = knobs["draft_depth"], knobs["block"], knobs["policy"]
    dec.prefill()
    while not dec.done:
        with dec.timer("draft"):
            proposals = propose_sequential(dec, d, min(b, dec.budget), policy)
        verify_chain(dec, proposals)


def _validate(knobs: dict, R: int) -> dict:
    positive_int(knobs, "draft_depth", "block")
    if knobs["draft_depth"] >= R:
        raise ValueError(f"draft_depth must be < R (num_steps={R}), got {knobs['draft_depth']}")
    knobs["policy"] = parse_policy(knobs["policy"])
    knobs["policy"].depths(knobs["draft_depth"], R)          # explicit depths must lie in 1..R
    return knobs


def _self_spec_defaults(cfg: LoopedConfig) -> dict:
    # Paper Table 5: Huginn d=8, b=8; Raven d=4, b=16.
    d, b = (8, 8) if cfg.family == "huginn" else (4, 16)
    return {"draft_depth": d, "block": b, "policy": "aligned"}


def _mature_spec_defaults(cfg: LoopedConfig) -> dict:
    # Paper Table 5: Huginn d=4, b=8; Raven d=4, b=16; Deep K/V reads.
    return {"draft_depth": 4, "block": 8 if cfg.family == "huginn" else 16, "policy": "deep-kv"}


register(MethodSpec("self-spec", run_sequential, _self_spec_defaults, _validate, lambda k: k["block"],
                    doc="sequential self-speculation: draft depth d, block b, aligned prefix reads"))
register(MethodSpec("mature-spec", run_sequential, _mature_spec_defaults, _validate, lambda k: k["block"],
                    doc="sequential self-speculation with Deep K/V (or any) verified-prefix reads"))
