"""DAS-Wave (paper sec. 3.3, Appendix B.2): carried parallel refinement with depth-asynchronous prefix reads.

One block, anchor x_t fixed at position n:

    Z = [x_t, x_t, ...]                 provisional guesses seeded by repeating the anchor (guesses="anchor", the
                                        paper's) or from earlier text (guesses="lookup" / "copy")
    H = initial states                  newly active positions start from the checkpoint's initialisation
    for j in 0..J-1:
        W_j = min(gamma, W_init + j)    the window grows by one position per round
        e = P(Z[:W_j])                  guesses changed, so the prelude is recomputed (on CPU from the first change)
        k times: H[:W_j] = F(H[:W_j], e)   all active positions in parallel, verified prefix read per policy
        Z[1:W_j+1] = argmax H(H[:W_j])  shifted readout: position i proposes token i+1
    verify(x_t, y_1..y_w = Z[1..w])     independent full-depth target (verify.py)

Latent states are carried across rounds (``carry=False`` re-initialises them every round); provisional K/V live
in scratch rows and are overwritten by the next round.  Read depths: Deep K/V by default.  For the depth-relative
policies the "draft depth" r of an update is the wave clock - the number of updates the anchor has received
(j*k + u + 1, capped at R) - since carried states have no single recurrence depth; without carry every state
restarts each round, so r = u + 1.

``guesses="lookup"`` (our extension, not in the paper) starts the window from the text that followed the earliest
earlier occurrence of the longest suffix n-gram, n <= max_ngram (``drafters/pld.find_draft``), anchor repetition
after it.  Refinement then starts near the Jacobi fixed point whenever the output repeats earlier text (a cycle of
period p > 1 costs the anchor-seeded wave about one round per position); the verifier, so the output, is
unchanged.  ``guesses="copy"`` copies from the *latest* occurrence instead and continues into the copy
(``drafters/pld.find_copy``), so a run of one token or a cycle of period p seeds the whole window.

``trim=True`` (also ours) sends the verifier only the proposals up to and including the first one the last round
changed: every later proposal was read out from a window that still held the old guess there, so it is right only
by chance, and the full-depth verifier pays R passes for every position it tests.

``seed_branch=L`` (also ours; needs a lookup/copy seed) verifies the seed's first L tokens beside the wave's
chain, as a two-branch tree that shares their common prefix (``verify.verify_tree``).  Shallow rounds drift off a
seed that full depth would accept whole: on the bundled model's digit runs and cycles the wave kept about J
positions of a 48-token seed the target accepted entirely.  The verifier, not the draft, then picks the longer
accepted branch.  Where the chain and the seed share fewer than 2 leading tokens the branch is cut to 4 tokens
past their common prefix: in replayed blocks such a seed was accepted further than the chain in 6-9% of cases
(against 71-93% when they share 2-4), and every verified position costs R passes of width.

``copy_run=True`` (also ours) skips the rounds while the text is being copied: after a block that committed the
whole seed it tested, the next block verifies its seed alone (a chain, as prompt lookup does), COPY_RUN_GROWTH
times the usual seed length of it, and the first seed that is not accepted whole brings the rounds back.  On the
development prompts a whole seed was followed by another in 53 of 54 cases (``benchmarks/wave_blocks.py``), and
such blocks are where the rounds only cost time.

``early_stop=True`` (also ours) ends a block's rounds after the first round whose readout changed no guess; J is
then a cap.  A seed is always drawn at max(w, seed_branch) tokens, so a narrow window (the bundled model's
gamma = 8: trim rarely keeps more than a few proposals, and causal attention means later window positions never
change them) still verifies a long seed beside its chain.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..model.config import LoopedConfig
from ..decoding import Decoding
from ..drafters.pld import PromptLookup, find_copy, find_draft
from ..methods import MethodSpec, positive_int, register
from ..model.policy import ReadPolicy, parse_policy
from ..verify import TreeLayout, verify_chain, verify_tree

# guesses knob -> how a block's window is seeded (None: repeat the anchor, the paper's)
SEEDERS = {"anchor": None, "lookup": find_draft, "copy": find_copy}
# seed_branch: a seed whose first SEED_AGREE tokens the wave's chain does not share is tested for only SEED_PROBE
# tokens past the common prefix (docs/performance.md: on replayed blocks such seeds beat the chain in 6-9% of cases).
SEED_AGREE, SEED_PROBE = 2, 4
# copy_run: blocks of a copy run verify seeds this many times the seed length max(w, seed_branch) (144 tokens with
# the bundled model's defaults; on its development prompts 2x took 8% longer, doubling per block from 1x 9%).
COPY_RUN_GROWTH = 6


def wave_width(gamma: int, rounds: int, w_init: int) -> int:
    """Active width after the last round = number of proposals w."""
    return min(gamma, w_init + rounds - 1)


def propose_wave(dec: Decoding, gamma: int, rounds: int, w_init: int, k: int, policy: ReadPolicy,
                 carry: bool = True, incremental: bool | None = None, guesses: np.ndarray | None = None,
                 trim: bool = False, early_stop: bool = False) -> Tensor:
    """The w proposals of one block (fewer with ``trim``).  ``guesses`` (host tokens) replace the first anchor
    copies in the initial window.  ``early_stop``: stop after a round that changed no guess.  One host sync per
    round finds the first changed guess, for early stop, ``trim`` and the CPU's incremental prelude alike."""
    model, cache, R = dec.model, dec.cache, dec.R
    n = dec.n
    w = wave_width(gamma, rounds, w_init)
    Z = dec.tokens[n: n + w + 1]              # Z[0] is the anchor; guesses live in the token scratch
    Z[1:] = Z[0]
    if guesses is not None and len(guesses):
        m = min(len(guesses), w)
        Z[1: m + 1] = torch.from_numpy(guesses[:m]).to(Z.device)
    H = dec.h0[:, n: n + w].clone()           # carried states; inactive positions still hold their init
    # The depth r of an update for depth-relative policies: with carry, updates the anchor has had so far (the
    # wave clock); without carry the states restart every round, so u + 1.
    reads = [policy.depths(min(R, (j * k if carry else 0) + u + 1), R) for j in range(rounds) for u in range(k)]
    # On CPU the prelude is recomputed only from the first guess that changed: the prelude is causal and its
    # scratch K/V for the unchanged head of the window are still valid.  Finding that guess syncs with the host,
    # which on a GPU (latency-bound, possibly graph-captured) costs more than recomputing the window.
    if incremental is None:
        incremental = model.device.type == "cpu" and not dec.static
    inj = H.new_empty(H.shape) if incremental else None
    fresh = updates = 0                       # incremental: Z[:fresh] is what the prelude rows in ``inj`` saw
    for j in range(rounds):
        W = min(gamma, w_init + j)
        if not carry and j:
            H[:, :W] = dec.h0[:, n: n + W]
        span = dec.span(n, W)
        if incremental:
            if fresh < W:
                inj[:, fresh:W] = model.prelude(Z[fresh:W].unsqueeze(0), dec.span(n + fresh, W - fresh), cache)
            e = inj[:, :W]
        else:
            e = model.prelude(Z[:W].unsqueeze(0), span, cache)
        h = H[:, :W]
        for u in range(k):
            h = model.core_step(h, e, span, cache, read=reads[j * k + u])
        H[:, :W] = h
        new = model.readout(h, span, cache)[0].argmax(-1)
        updates += k * W
        last = j == rounds - 1
        if incremental or early_stop or (trim and last and rounds > 1):     # one host sync for all three uses
            changed = (new != Z[1: W + 1]).nonzero()
            c = int(changed[0, 0]) if len(changed) else W                  # the first proposal this round changed
            if early_stop and not last and c == W:
                w, last = W, True      # a round that changed no guess: stop here, with the whole window
            elif trim and last and rounds > 1:
                w = min(c + 1, W)
            fresh = min(c + 1, W)      # Z[c + 1] is the first guess that changes; the prelude saw Z[:W]
        Z[1: W + 1] = new
        if last:
            break
    dec.stats.draft_passes += (j + 1) * k
    dec.stats.draft_updates += updates
    return Z[1: w + 1]


def run_wave(dec: Decoding, knobs: dict) -> None:
    g, J, w0, k = knobs["gamma"], knobs["rounds"], knobs["w_init"], knobs["k"]
    policy, carry = knobs["policy"], knobs["carry"]
    dec.prefill()
    w = wave_width(g, J, w0)
    seed_len = max(w, knobs["seed_branch"])    # the window's guesses, and the seed branch past the window
    with dec.timer("draft"):
        find = SEEDERS[knobs["guesses"]]
        lookup = PromptLookup(dec, knobs["max_ngram"], seed_len, find) if find else None
    device = dec.tokens.device
    copying = False            # copy_run: the last block's seed was accepted whole
    while not dec.done:
        with dec.timer("draft"):
            ask = COPY_RUN_GROWTH * seed_len if copying else seed_len
            guesses = lookup.propose(dec, ask) if lookup is not None else None
            seeded = guesses is not None and len(guesses) > 0
            proposals = layout = None
            if copying and seeded:             # no rounds: verify the seed as it is (a chain, plus bonus token)
                tested = guesses
                dec.tokens[dec.n + 1: dec.n + 1 + len(tested)] = torch.from_numpy(tested).to(device)
                layout = TreeLayout.chain(len(tested) + 1, device)
            else:
                proposals = propose_wave(dec, g, J, w0, k, policy, carry, guesses=guesses, trim=knobs["trim"],
                                         early_stop=knobs["early_stop"])
                tested = guesses[: knobs["seed_branch"]] if seeded and knobs["seed_branch"] else guesses
                if knobs["seed_branch"] and seeded:
                    layout = seed_branch_layout(dec, proposals, guesses, knobs["seed_branch"], device)
        start = len(dec.generated)
        if layout is None:
            verify_chain(dec, proposals)
        else:
            verify_tree(dec, layout)
        if knobs["copy_run"]:
            copying = seeded and dec.generated[start: start + len(tested)] == tested.tolist()


def seed_branch_layout(dec: Decoding, proposals: Tensor, seed: np.ndarray, max_len: int,
                       device: torch.device | str) -> TreeLayout | None:
    """Write [anchor, proposals, seed[m:L]] into the token scratch (m = their common prefix, L = up to ``max_len``
    seed tokens) and return the tree whose two branches are the wave's chain and the seed, sharing the first m
    nodes (``TreeLayout.fork``).  None when the seed adds nothing past the chain (verify the chain alone)."""
    n = dec.n
    budget = dec.budget - 1
    wv = min(int(proposals.numel()), budget)
    L = min(len(seed), budget, max_len)
    prop = proposals[:wv].tolist()
    m = 0
    while m < min(wv, L) and prop[m] == seed[m]:
        m += 1
    if m < SEED_AGREE:          # chain and seed part at once: the seed is rarely right there, so probe it briefly
        L = min(L, m + SEED_PROBE)
    if L <= m:
        return None
    extra = L - m
    dec.tokens[n + 1 + wv: n + 1 + wv + extra] = torch.from_numpy(seed[m:L]).to(device)
    return TreeLayout.fork(wv, m, extra, device)


def _validate(knobs: dict, R: int) -> dict:
    positive_int(knobs, "gamma", "rounds", "w_init", "k")
    if knobs["w_init"] > knobs["gamma"]:
        raise ValueError(f"w_init ({knobs['w_init']}) must be <= gamma ({knobs['gamma']})")
    for name in ("carry", "trim", "copy_run", "early_stop"):
        if not isinstance(knobs[name], bool):
            raise ValueError(f"{name} must be true or false, got {knobs[name]!r}")
    if knobs["guesses"] not in SEEDERS:
        raise ValueError(f"guesses must be one of {', '.join(SEEDERS)}, got {knobs['guesses']!r}")
    positive_int(knobs, "max_ngram")
    sb = knobs["seed_branch"]
    if isinstance(sb, bool) or not isinstance(sb, int) or sb < 0:
        raise ValueError(f"seed_branch must be an integer >= 0 (0 = off), got {sb!r}")
    for name in ("seed_branch", "copy_run"):
        if knobs[name] and knobs["guesses"] == "anchor":
            raise ValueError(f"{name} needs a seed: use guesses=lookup or guesses=copy (anchor has none)")
    knobs["policy"] = parse_policy(knobs["policy"])
    knobs["policy"].depths(1, R)
    return knobs


def _defaults(cfg: LoopedConfig) -> dict:
    # Paper Table 5: gamma=32, J=24, W_init=2, k=2 (Huginn) / k=1 (Raven), Deep K/V, carry on, anchor-seeded.
    return {"gamma": 32, "rounds": 24, "w_init": 2, "k": 2 if cfg.family == "huginn" else 1,
            "policy": "deep-kv", "carry": True, "guesses": "anchor", "max_ngram": 3, "trim": False,
            "seed_branch": 0, "copy_run": False, "early_stop": False}


def _fit(knobs: dict, explicit: set) -> None:
    # A tuned default W_init (the bundled model's is 8) must not turn a caller's smaller gamma into an error.
    if "w_init" not in explicit and isinstance(knobs["gamma"], int) and knobs["w_init"] > knobs["gamma"] >= 1:
        knobs["w_init"] = knobs["gamma"]
    # Likewise a tuned seed branch does not apply when the caller asks for the paper's anchor-seeded window.
    if knobs.get("guesses") == "anchor":
        for name, off in (("seed_branch", 0), ("copy_run", False)):
            if name not in explicit:
                knobs[name] = off


register(MethodSpec("das-wave", run_wave, _defaults, _validate,
                    lambda kn: wave_width(kn["gamma"], kn["rounds"], kn["w_init"]) + kn["seed_branch"],
                    doc="DAS-Wave: carried parallel refinement + Deep K/V prefix reads + full-depth verifier",
                    aliases=("wave",), fit=_fit))
