"""DAS-Wave (paper sec. 3.3, Appendix B.2): carried parallel refinement with depth-asynchronous prefix reads.

One block, anchor x_t fixed at position n (``refine``):

    Z = [x_t, x_t, ...]                 provisional guesses, seeded by repeating the anchor (the paper's)
    H = initial states                  newly active positions start from the checkpoint's initialisation
    for j in 0..J-1:
        W_j = min(gamma, W_init + j)    the window grows by one position per round
        e = P(Z[:W_j])                  guesses changed, so the prelude is recomputed
        k times: H[:W_j] = F(H[:W_j], e)   all active positions in parallel, verified prefix read per policy
        Z[1:W_j+1] = H(H[:W_j])         shifted readout: position i proposes token i+1
    verify(x_t, y_1..y_w = Z[1..w])     independent full-depth target (engine/verify.py)

Latent states are carried across rounds (``carry=False`` re-initialises them every round); provisional K/V live
in scratch rows and are overwritten by the next round.  Read depths: Deep K/V by default.  For the depth-relative
policies the "draft depth" r of an update is the wave clock - the number of updates the anchor has received
(j*k + u + 1, capped at R) - since carried states have no single recurrence depth; without carry every state
restarts each round, so r = u + 1.

Our extensions, each a knob and a named function below (not in the paper; docs/performance.md has what each was
measured to buy):

* ``guesses``: "lookup" seeds the window with the text that followed the earliest earlier occurrence of the longest
  suffix n-gram (``pld.find_draft``), "copy" with a periodic copy of the latest one (``pld.find_copy``), so
  refinement starts near the Jacobi fixed point whenever the output repeats earlier text.
* ``trim``: verify only the proposals up to the first one the last round changed - later ones were read out from a
  window that still held the old guess there (``refine``).
* ``seed_branch=L``: verify the seed's first L tokens beside the wave's chain, as a two-branch tree sharing their
  common prefix, so the verifier (not shallow rounds that drifted off it) picks the longer accepted branch
  (``seed_branch_layout``).
* ``copy_run``: after a block that committed the whole seed it tested, verify the next seed without rounds (a
  chain, as prompt lookup does), COPY_RUN_GROWTH times as long, until a seed is not accepted whole
  (``WaveDrafter.propose``).
* ``early_stop``: end a block's rounds after the first round whose readout changed no guess; J becomes a cap.

A seed is drawn at max(w, seed_branch) tokens, so a narrow window still verifies a long seed beside its chain.
On a CPU the prelude is recomputed only from the first guess that changed (its scratch K/V before it are still
valid; finding it syncs with the host, which a GPU pays more for than recomputing the window).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from ..engine.draft import Draft, Drafter, TreeLayout, Verdict
from ..engine.request import Request
from ..model.policy import ReadPolicy, parse_policy
from . import Method, register
from .knobs import FAMILY, Knobs, boolean, knob, one_of, positive_int
from .pld import PromptLookup, find_copy, find_draft

# guesses knob -> how a block's window is seeded (None: repeat the anchor, the paper's)
SEEDERS = {"anchor": None, "lookup": find_draft, "copy": find_copy}
# seed_branch: a seed whose first SEED_AGREE tokens the chain does not share is rarely accepted past them, so it is
# tested for only SEED_PROBE tokens past the common prefix.
SEED_AGREE, SEED_PROBE = 2, 4
# copy_run: seeds of a copy run are this many times the usual seed length.
COPY_RUN_GROWTH = 6


@dataclass(frozen=True)
class WaveKnobs(Knobs):
    method = "das-wave"
    gamma: int = knob(32, "DAS-Wave: verifier capacity gamma, the widest active window")
    rounds: int = knob(24, "DAS-Wave: refinement rounds J per block", short="-J")
    w_init: int = knob(2, "DAS-Wave: initial active width W_init")
    k: int = knob(FAMILY, "DAS-Wave: core updates per round", short="-k")
    policy: str | ReadPolicy = knob("deep-kv", "prefix read policy: aligned | deep-v (mature-v) | deep-k | deep-kv | "
                                    "k=..,v=..", parse=str)
    carry: bool = knob(True, "DAS-Wave: carry latent states across rounds (off: re-initialise every round)")
    guesses: str = knob("anchor", "DAS-Wave window seed: anchor (repeat it, the paper's) | lookup (prompt lookup) | "
                        "copy (periodic copy of the latest match)", choices=tuple(SEEDERS))
    max_ngram: int = knob(3, "longest suffix n-gram matched in the text (prompt lookup, DAS-Wave seeds)")
    trim: bool = knob(False, "DAS-Wave: verify only up to the first proposal the last round changed")
    seed_branch: int = knob(0, "DAS-Wave: verify up to N tokens of the window's seed as a second branch (0 = off)")
    copy_run: bool = knob(False, "DAS-Wave: after a block whose seed was accepted whole, verify the next seed "
                          "without rounds")
    early_stop: bool = knob(False, "DAS-Wave: stop a block's rounds after one that changed no guess (J becomes a "
                            "cap)")

    @property
    def w(self) -> int:
        """Active width after the last round = the number of proposals."""
        return min(self.gamma, self.w_init + self.rounds - 1)

    @classmethod
    def fit(cls, values: dict, explicit: set, R: int) -> dict:
        # A tuned default W_init (the bundled model's is 8) must not turn a caller's smaller gamma into an error.
        g = values["gamma"]
        if "w_init" not in explicit and isinstance(g, int) and values["w_init"] > g >= 1:
            values["w_init"] = g
        # Likewise a tuned seed branch does not apply when the caller asks for the paper's anchor-seeded window.
        if values["guesses"] == "anchor":
            for name, off in (("seed_branch", 0), ("copy_run", False)):
                if name not in explicit:
                    values[name] = off
        return values

    def validate(self, R: int) -> "WaveKnobs":
        positive_int(self, "gamma", "rounds", "w_init", "k", "max_ngram")
        positive_int(self, "seed_branch", minimum=0)
        if self.w_init > self.gamma:
            raise ValueError(f"w_init ({self.w_init}) must be <= gamma ({self.gamma})")
        boolean(self, "carry", "trim", "copy_run", "early_stop")
        one_of(self, "guesses", SEEDERS)
        for name in ("seed_branch", "copy_run"):
            if getattr(self, name) and self.guesses == "anchor":
                raise ValueError(f"{name} needs a seed: use guesses=lookup or guesses=copy (anchor has none)")
        policy = parse_policy(self.policy)
        policy.depths(1, R)
        return replace(self, policy=policy)


def read_depths(kn: WaveKnobs, R: int) -> list:
    """The prefix-read depths of a core update by its depth r (the wave clock), r = 1..R (index 0 unused)."""
    return [None] + [kn.policy.depths(r, R) for r in range(1, R + 1)]


def refine(req: Request, kn: WaveKnobs, guesses: np.ndarray | None, H: Tensor, inj: Tensor | None,
           notes: dict, reads: list) -> Tensor:
    """The paper's block: J rounds of k parallel core updates over a growing window; returns the proposals (a view
    of the token scratch; fewer with ``trim``).  ``guesses`` (host tokens) replace the first anchor copies.  ``H``
    [1, w, d] holds the carried states; ``inj`` [1, w, d] the prelude rows when recomputed incrementally (CPU).
    One host sync per round finds the first changed guess, for early stop, trim and the incremental prelude.
    ``reads``: ``read_depths(kn, R)``, built once per request (by the drafter)."""
    n, R, k, J = req.n, req.R, kn.k, kn.rounds
    w = kn.w
    req.scratch(w)                                # checks the window fits the cache
    Z = req.tokens[n: n + w + 1]                  # Z[0] is the anchor; the guesses live in the token scratch
    Z[1:] = Z[0]
    if guesses is not None and len(guesses):
        m = min(len(guesses), w)
        Z[1: m + 1] = torch.from_numpy(guesses[:m]).to(Z.device)
    H.copy_(req.h0[:, n: n + w])                  # inactive positions hold their init until they join
    incremental = inj is not None
    fresh = updates = 0                           # incremental: Z[:fresh] is what the prelude rows in ``inj`` saw
    changed_at: list[int] = []
    for j in range(J):
        W = min(kn.gamma, kn.w_init + j)
        if not kn.carry and j:
            H[:, :W] = req.h0[:, n: n + W]
        span = req.span(n, W)
        if incremental:
            if fresh < W:
                inj[:, fresh:W] = req.prelude(Z[fresh:W].unsqueeze(0), req.span(n + fresh, W - fresh))
            e = inj[:, :W]
        else:
            e = req.prelude(Z[:W].unsqueeze(0), span)
        h = H[:, :W]
        clock = j * k if kn.carry else 0
        for u in range(k):
            h = req.core_step(h, e, span, reads[min(R, clock + u + 1)])
        H[:, :W] = h
        new = req.choose(req.readout(h, span)[0], n)
        updates += k * W
        last = j == J - 1
        if incremental or kn.early_stop or (kn.trim and last and J > 1):    # one host sync for all three uses
            diff = (new != Z[1: W + 1]).nonzero()
            c = int(diff[0, 0]) if len(diff) else W                        # the first proposal this round changed
            changed_at.append(c)
            if kn.early_stop and not last and c == W:
                w, last = W, True      # a round that changed no guess: stop here, with the whole window
            elif kn.trim and last and J > 1:
                w = min(c + 1, W)
            fresh = min(c + 1, W)      # Z[c + 1] is the first guess that changes; the prelude saw Z[:W]
        Z[1: W + 1] = new
        if last:
            break
    req.stats.count("draft", (j + 1) * k, updates)
    notes.update(rounds=j + 1, changed_at=changed_at)
    return Z[1: w + 1]


def seed_branch_layout(req: Request, proposals: Tensor, seed: np.ndarray, max_len: int) -> TreeLayout | None:
    """Write [anchor, proposals, seed[m:L]] into the token scratch (m = their common prefix, L = up to ``max_len``
    seed tokens) and return the tree whose two branches are the wave's chain and the seed, sharing the first m
    nodes (``TreeLayout.fork``).  None when the seed adds nothing past the chain (verify the chain alone)."""
    budget = req.budget - 1
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
    req.scratch(wv + extra)[wv:] = torch.from_numpy(seed[m:L]).to(req.tokens.device)
    return TreeLayout.fork(wv, m, extra, req.tokens.device)


class WaveDrafter(Drafter):
    name = "das-wave"
    width_knobs = ("gamma", "rounds", "w_init", "seed_branch")

    def __init__(self, knobs: WaveKnobs):
        self.knobs = knobs
        self.seed_len = max(knobs.w, knobs.seed_branch)      # the window's guesses, and the branch past the window
        self.width = knobs.w + knobs.seed_branch + 1

    def start(self, req: Request) -> None:
        kn = self.knobs
        find = SEEDERS[kn.guesses]
        self.lookup = PromptLookup(req, kn.max_ngram, self.seed_len, find) if find else None
        self.copying = False              # copy_run: the last block's seed was accepted whole
        self.tested: np.ndarray | None = None
        d = req.model.config.n_embd
        self.H = req.h0.new_empty(1, kn.w, d)              # carried states, reused by every block
        incremental = req.model.device.type == "cpu" and not req.runtime.static_shapes
        self.inj = req.h0.new_empty(1, kn.w, d) if incremental else None
        self.reads = read_depths(kn, req.R)

    def propose(self, req: Request) -> Draft:
        kn = self.knobs
        ask = COPY_RUN_GROWTH * self.seed_len if self.copying else self.seed_len
        seed = self.lookup.propose(req, ask) if self.lookup is not None else None
        notes = {"seed": seed, "asked": ask}
        if self.copying and seed is not None and len(seed):        # a copy run: the seed alone, no rounds
            self.tested = seed
            notes["kind"] = "copy-run"
            return Draft(seed, bonus=True, notes=notes)
        proposals = refine(req, kn, seed, self.H, self.inj, notes, self.reads)
        seeded = seed is not None and len(seed) > 0
        self.tested = (seed[: kn.seed_branch] if kn.seed_branch else seed) if seeded else None
        layout = seed_branch_layout(req, proposals, seed, kn.seed_branch) if seeded and kn.seed_branch else None
        if layout is None:
            notes["kind"] = "chain"
            return Draft(proposals, notes=notes)
        notes["kind"] = "seed-branch"
        return Draft(req.scratch(layout.size - 1), layout=layout, notes=notes)

    def observe(self, req: Request, verdict: Verdict) -> None:
        if self.knobs.copy_run:
            t = self.tested
            self.copying = t is not None and verdict.tokens[: len(t)] == t.tolist()


register(Method("das-wave", WaveKnobs, WaveDrafter, aliases=("wave",)))
