"""DAS-Wave (paper sec. 3.3, Appendix B.2): carried parallel refinement with depth-asynchronous prefix reads.

One block, anchor x_t fixed at position n (``refine``):

    Z = [x_t, x_t, ...]                 provisional guesses, seeded by repeating the anchor (the paper's)
    H = initial states                  newly active positions start from the checkpoint's initialisation
    for j in 0..J-1:
        W_j = min(gamma, W_init + j)    the window grows by one position per round
        e = P(Z[:W_j])                  guesses changed, so the prelude is recomputed
        k times: H[:W_j] = F(H[:W_j], e)   all active positions in parallel, verified prefix read per policy
        Z[1:W_j+1] = H(H[:W_j])         shifted readout: position i proposes token i+1
    verify(x_t, y_1..y_w = Z[1..w])     independent full-depth target (engine/core/verify.py)

Latent states are carried across rounds (``carry=False`` re-initialises them every round); provisional K/V live
in scratch rows and are overwritten by the next round.  Read depths: Deep K/V by default.  For the depth-relative
policies the "draft depth" r of an update is the wave clock - the number of updates the anchor has received
(j*k + u + 1, capped at R) - since carried states have no single recurrence depth; without carry every state
restarts each round, so r = u + 1.

Our extensions, each a knob and a named function below (not in the paper; docs/performance-journal.md has what each was
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

from ..engine.drafting import Batch, Draft, DraftContext, Drafter, Session, TreeLayout, Verdict, greedy
from ..model import decode_kernel
from ..model.policy import ReadPolicy, parse_policy
from . import Method, register
from .knobs import FAMILY, Knobs, Most, boolean, knob, one_of, positive_int
from .pld import MAX_NGRAM, PromptLookup, find_copy, find_draft

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
    gamma: int = knob(32, "DAS-Wave: verifier capacity gamma, the widest active window", most=Most(
        "the context - 1", "the window and its anchor are verified in one pass", lambda kn, s: s.context - 1))
    rounds: int = knob(24, "DAS-Wave: refinement rounds J per block", short="-J", most=Most(
        "gamma + ceil(R / k)", "after gamma rounds every guess of a window without carry has reached its fixed "
        "point (guess i is final after round i), and ceil(R / k) rounds later every carried state has had the "
        "target's R core updates: more rounds only repeat work", lambda kn, s: kn.gamma + -(-s.R // kn.k)))
    w_init: int = knob(2, "DAS-Wave: initial active width W_init", most=Most(
        "gamma", "the window starts no wider than it may grow", lambda kn, s: kn.gamma))
    k: int = knob(FAMILY, "DAS-Wave: core updates per round", short="-k",
                  most=Most("R", "one round then already gives every state the target's depth",
                            lambda kn, s: s.R))
    policy: str | ReadPolicy = knob("deep-kv", "prefix read policy: aligned | deep-v (mature-v) | deep-k | deep-kv | "
                                    "k=..,v=..", parse=str)
    carry: bool = knob(True, "DAS-Wave: carry latent states across rounds (off: re-initialise every round)")
    guesses: str = knob("anchor", "DAS-Wave window seed: anchor (repeat it, the paper's) | lookup (prompt lookup) | "
                        "copy (periodic copy of the latest match)", choices=tuple(SEEDERS))
    max_ngram: int = knob(3, "longest suffix n-gram matched in the text (prompt lookup, DAS-Wave seeds)",
                          most=MAX_NGRAM)
    trim: bool = knob(False, "DAS-Wave: verify only up to the first proposal the last round changed")
    seed_branch: int = knob(0, "DAS-Wave: verify up to N tokens of the window's seed as a second branch (0 = off)",
                            most=Most("the context - 1 - the window min(gamma, w_init + rounds - 1)",
                                      "the branch is verified with the window and its anchor in one pass",
                                      lambda kn, s: s.context - 1 - kn.w))
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


def _cat(parts: list[Tensor]) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def aligned_depths(step_reads: list[tuple[int, int]]) -> list[int] | None:
    """The depths of a round's updates where each stores where it reads, at one depth (kappa = nu): they are the
    target's steps at those depths, which a family runs in one call (``Batch.recur``); None where an update reads K
    and V at different depths (one ``core_step`` per update)."""
    return [kappa for kappa, nu in step_reads] if all(kappa == nu for kappa, nu in step_reads) else None


def refine(sessions: list["WaveSession"], kn: WaveKnobs, seeds: list[np.ndarray | None],
           notes: list[dict]) -> list[Tensor]:
    """The paper's block for every session at once, rounds in lockstep: J rounds of k parallel core updates over a
    growing window; returns each session's proposals (a view of its token scratch; fewer with ``trim``).
    ``seeds`` (host tokens) replace the first anchor copies.  Each session's ``H`` [1, w, d] holds its carried
    states and ``inj`` its prelude rows when recomputed incrementally (CPU).  One host sync per round (for every
    session) finds each first changed guess, for early stop, trim and the incremental prelude; a session that
    stops early, or whose request must stop (``stopping``), leaves the batch."""
    reqs = [s.ctx for s in sessions]
    R, k, J, w = reqs[0].R, kn.k, kn.rounds, kn.w
    B = len(sessions)
    # Each window is capped by its request's room: proposals past it are never verified, and near the end of the
    # context the rows past it lie beyond the last position (prompt + max_new_tokens <= the context).  Rows read
    # only rows before them, so the proposals within the cap are those of the uncapped window (up to early stop,
    # which then looks at the capped window only).
    cap = [max(1, min(w, req.room, req.depth_limit + 1)) for req in reqs]
    Z = []
    for s, req, seed, c in zip(sessions, reqs, seeds, cap):
        z = req.draft_slots(c)                    # z[0] is the anchor; the guesses live in the token scratch
        z[1:] = z[0]
        if seed is not None and len(seed):
            m = min(len(seed), c)
            z[1: m + 1] = torch.from_numpy(seed[:m]).to(z.device)
        Z.append(z)
    incremental = sessions[0].inj is not None
    reads = sessions[0].reads
    greedy_all = all(r.choose is greedy for r in reqs)
    fresh = [0] * B                               # incremental: Z[:fresh] is what the prelude rows in ``inj`` saw
    updates, rounds, out_w = [0] * B, [0] * B, list(cap)
    changed_at: list[list[int]] = [[] for _ in range(B)]
    live = list(range(B))
    for j in range(J):
        live = [i for i in live if reqs[i].stopping() is None]
        if not live:
            break
        W_all = min(kn.gamma, kn.w_init + j)
        Ws = {i: min(W_all, cap[i]) for i in live}               # this round's window of each session
        joined = 0 if j == 0 or not kn.carry else min(kn.gamma, kn.w_init + j - 1)   # rows starting this round
        last = j == J - 1
        group = [reqs[i] for i in live]
        batch = Batch(group, [r.n for r in group], [Ws[i] for i in live])
        if incremental:
            pre = [i for i in live if fresh[i] < Ws[i]]
            if pre:
                pb = Batch([reqs[i] for i in pre], [reqs[i].n + fresh[i] for i in pre],
                           [Ws[i] - fresh[i] for i in pre])
                for i, part in zip(pre, pb.split(pb.prelude(pb.ids()), dim=1)):
                    sessions[i].inj[:, fresh[i]:Ws[i]] = part
            e = _cat([sessions[i].inj[:, :Ws[i]] for i in live])
        else:
            e = batch.prelude(batch.ids())
        for i, e_i in zip(live, batch.split(e, dim=1)):          # new rows (all, without carry) start here
            W, new = Ws[i], min(joined, cap[i])
            if new < W:
                r = reqs[i]
                sessions[i].H[:, new:W] = r.start_state(r.initial(r.n + new, W - new), e_i[:, new:W])
        h = _cat([sessions[i].H[:, :Ws[i]] for i in live])
        clock = j * k if kn.carry else 0
        step_reads = [reads[min(R, clock + u + 1)] for u in range(k)]
        depths = aligned_depths(step_reads)
        if depths is not None:
            h = batch.recur(h, e, depths)
        else:
            for read in step_reads:
                h = batch.core_step(h, e, read)
        logits = batch.readout(h)[0]
        if greedy_all:
            news = batch.split(decode_kernel.argmax(logits))
        else:
            news = [reqs[i].choose(z, reqs[i].n) for i, z in zip(live, batch.split(logits))]
        for i, part in zip(live, batch.split(h, dim=1)):
            sessions[i].H[:, :Ws[i]] = part
            updates[i] += k * Ws[i]
            rounds[i] = j + 1
        if incremental or kn.early_stop or (kn.trim and last and J > 1):    # one host sync for all three uses
            firsts = []
            for i, new in zip(live, news):
                diff = new != Z[i][1: Ws[i] + 1]
                firsts.append(torch.where(diff.any(), diff.int().argmax(), Ws[i]))
            firsts = (firsts[0].view(1) if len(firsts) == 1 else torch.stack(firsts)).tolist()
            still = []
            for i, new, c in zip(live, news, firsts):       # c: the first proposal this round changed
                W = Ws[i]
                changed_at[i].append(c)
                Z[i][1: W + 1] = new
                fresh[i] = min(c + 1, W)    # Z[c + 1] is the first guess that changes; the prelude saw Z[:W]
                if kn.early_stop and not last and c == W:
                    out_w[i] = W            # a round that changed no guess: stop here, with the whole window
                    continue
                if kn.trim and last and J > 1:
                    out_w[i] = min(c + 1, W)
                still.append(i)
            live = still
        else:
            for i, new in zip(live, news):
                Z[i][1: Ws[i] + 1] = new
        if last:
            break
    for i, req in enumerate(reqs):
        req.count(rounds[i] * k, updates[i])
        notes[i].update(rounds=rounds[i], changed_at=changed_at[i])
    return [Z[i][1: out_w[i] + 1] for i in range(B)]


def seed_branch_layout(req: DraftContext, proposals: Tensor, seed: np.ndarray, max_len: int) -> TreeLayout | None:
    """Write [anchor, proposals, seed[m:L]] into the token scratch (m = their common prefix, L = up to ``max_len``
    seed tokens) and return the tree whose two branches are the wave's chain and the seed, sharing the first m
    nodes (``TreeLayout.fork``).  None when the seed adds nothing past the chain (verify the chain alone)."""
    budget = req.room - 1                   # every node of the tree is a verifier input (the budget rule)
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
    req.scratch(wv + extra)[wv:] = torch.from_numpy(seed[m:L]).to(req.device)
    return TreeLayout.fork(wv, m, extra, req.device)


class WaveSession(Session):
    """One request's DAS-Wave state: its text index for seeds, the carried states and prelude rows of its window
    (reused by every block), and whether its last seed was accepted whole (copy runs)."""

    def __init__(self, drafter: "WaveDrafter", req: DraftContext):
        super().__init__(drafter, req)
        kn = drafter.knobs
        find = SEEDERS[kn.guesses]
        self.lookup = PromptLookup(req, kn.max_ngram, drafter.seed_len, find) if find else None
        self.copying = False              # copy_run: the last block's seed was accepted whole
        self.tested: np.ndarray | None = None
        d = req.config.n_embd
        like = req.initial(0, 1)
        self.H = like.new_empty(1, kn.w, d)                # carried states, reused by every block
        incremental = req.device.type == "cpu" and not req.static_shapes
        self.inj = like.new_empty(1, kn.w, d) if incremental else None
        self.reads = drafter.reads(req.R)

    def observe(self, verdict: Verdict) -> None:
        if self.drafter.knobs.copy_run:
            t = self.tested
            self.copying = t is not None and verdict.tokens[: len(t)] == t.tolist()


class WaveDrafter(Drafter):
    name = "das-wave"
    width_knobs = ("gamma", "rounds", "w_init", "seed_branch")
    session = WaveSession

    def __init__(self, knobs: WaveKnobs):
        self.knobs = knobs
        self.seed_len = max(knobs.w, knobs.seed_branch)      # the window's guesses, and the branch past the window
        self.width = knobs.w + knobs.seed_branch + 1
        if knobs.copy_run:                                   # a copy run: a seed of up to this many, plus bonus
            self.reach = max(self.width, COPY_RUN_GROWTH * self.seed_len + 1)
        self._reads: dict[int, list] = {}

    def reads(self, R: int) -> list:
        """``read_depths`` at depth R, built once per R and shared by the sessions."""
        r = self._reads.get(R)
        if r is None:
            r = self._reads[R] = read_depths(self.knobs, R)
        return r

    def propose_batch(self, sessions: list[WaveSession]) -> list[Draft]:
        kn = self.knobs
        drafts: list[Draft | None] = [None] * len(sessions)
        refining = []                                            # (index, session, seed, notes)
        for i, s in enumerate(sessions):
            ask = COPY_RUN_GROWTH * self.seed_len if s.copying else self.seed_len
            seed = s.lookup.propose(s.ctx, ask) if s.lookup is not None else None
            notes = {"seed": seed, "asked": ask}
            if s.copying and seed is not None and len(seed):     # a copy run: the seed alone, no rounds
                s.tested = seed
                notes["kind"] = "copy-run"
                drafts[i] = Draft(seed, bonus=True, notes=notes)
            else:
                refining.append((i, s, seed, notes))
        if refining:
            props = refine([r[1] for r in refining], kn, [r[2] for r in refining], [r[3] for r in refining])
            for (i, s, seed, notes), proposals in zip(refining, props):
                seeded = seed is not None and len(seed) > 0
                s.tested = (seed[: kn.seed_branch] if kn.seed_branch else seed) if seeded else None
                layout = seed_branch_layout(s.ctx, proposals, seed, kn.seed_branch) if seeded and kn.seed_branch \
                    else None
                if layout is None:
                    notes["kind"] = "chain"
                    drafts[i] = Draft(proposals, notes=notes, in_place=True)
                else:
                    notes["kind"] = "seed-branch"
                    drafts[i] = Draft(s.ctx.scratch(layout.size - 1), layout=layout, notes=notes, in_place=True)
        return drafts


register(Method("das-wave", WaveKnobs, WaveDrafter, aliases=("wave",)))
