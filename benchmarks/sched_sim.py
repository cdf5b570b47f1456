"""The paged engine's scheduler on a simulated 80 GB GPU: Huginn-0125 and Ouro-1.4B at their real bytes per token.

    python benchmarks/sched_sim.py --out benchmarks/records/performance/sched-sim          # every model, trace, method, block size
    python benchmarks/sched_sim.py --requests 40 --blocks 16 --out /tmp/s    # a quick look

No model runs.  The real ``Scheduler`` (``dasspec/engine/core/scheduler.py``) plans every step on an accounting-only
``BlockPool`` (``BlockPool.accounting``: the books of a pool of the GPU's size, no tensors), and a fake executor
answers each ``StepPlan`` with a ``StepOutput``: prompt rows materialised as planned (the first token when a prompt
ends), and per decoding request a number of committed tokens - 1 for AR, a draw (geometric, mean ``--accept``,
at most the drafter's width) for a speculative stand-in - until the request's own answer length, where it emits
EOS and the scheduler's stop rule ends it.  Entries are built as ``Engine.add`` builds them: a ``StopRule`` with
``max_new_tokens`` and EOS, a drafter stand-in (``.name``, ``.width``), the salt of ``prefix_salt`` and block keys
from the prompt tokens, so traces whose prompts start alike share prefix blocks.

"Before" is the engine before the paged cache (commit b1b14e7, ``dasspec/engine/pool.py``): each request reserves
``rows_needed`` = prompt + max_new_tokens + width + 1 positions as one contiguous range (first fit) for its whole
life, admitted first in first out, nothing shared, prompts prefilled 512 rows per request per step.  Both sides see
the same trace, the same per-request draws and the same clock.

The clock (assumptions, stated in docs/performance-journal.md, "Paged depth cache by simulation"): a step takes
    a + b * rows + c * positions_read + swap,
``a`` the weight traffic of one full-depth pass (every core layer's weights read once per recurrence at HBM
bandwidth), ``b`` the compute of one verifier or prefill row (2 FLOP per parameter applied, at a sustained
``--tflops``), ``c`` reading one position's K/V at every depth (attention reads each request's context once per
step), ``swap`` the PCIe copy of preempted rows (out and back).  Drafting is not charged: the throughput columns
compare memory policies under one method, not methods.

``GatedScheduler`` (engine "after-gated", ``--gated B ...``) is a variant the simulation suggests, not the engine's:
admission waits until the step's token budget can prefill a block of the request.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dasspec.engine.core.blocks import BlockPool, prefix_salt  # noqa: E402
from dasspec.engine.api.engine import MAX_STEP_TOKENS  # noqa: E402
from dasspec.engine.base.request import rows_needed  # noqa: E402
from dasspec.engine.base.contract import DrafterKey, RequestOutput, StepOutput, StepPlan  # noqa: E402
from dasspec.engine.core.scheduler import Entry, Scheduler  # noqa: E402
from dasspec.engine.core.stopping import StopRule  # noqa: E402
from dasspec.model.cache import bytes_per_token  # noqa: E402
from dasspec.model.config import LoopedConfig  # noqa: E402

CHECKPOINTS = ROOT.parent / "shared" / "checkpoints"
GPU_BYTES = 80 * 2**30          # an 80 GB GPU (H100 / A100 80GB: 80 GiB)
GPU_SHARE = 0.9                 # of it for weights + depth cache (the rest: activations, workspace, CUDA context)
HBM_BW = 3.35e12                # B/s, H100 SXM
PCIE_BW = 25e9                  # B/s, host <-> device (swap of a preempted request's rows)
OLD_PREFILL_CHUNK = 512         # the old engine's prompt rows per request per step (b1b14e7)
EOS, TOKEN = 0, 1               # what the fake executor commits
BLOCK_SIZES = (8, 16, 32, 64, 128)


# --- the models --------------------------------------------------------------------------------------------------
@dataclass
class Family:
    name: str
    R: int
    context: int
    bytes_per_token: int
    weight_bytes: int           # bfloat16
    positions: int              # the pool: GPU_SHARE of the GPU minus the weights, in positions
    a: float                    # s per step
    b: float                    # s per row
    c: float                    # s per position read


def _params(cfg: LoopedConfig) -> tuple[int, int]:
    """(parameters of one layer, parameters outside the layers) from the config's shapes."""
    d, hd = cfg.n_embd, cfg.head_dim
    attn = d * cfg.n_heads * hd + 2 * d * cfg.n_kv_heads * hd + cfg.n_heads * hd * d
    layer = attn + 3 * d * cfg.intermediate_size
    embed = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
    return layer, embed


def family(folder: str, tflops: float) -> Family:
    cfg = LoopedConfig.from_hf(json.loads((CHECKPOINTS / folder / "config.json").read_text()))
    R = cfg.mean_recurrence
    bpt = bytes_per_token(cfg, R, torch.bfloat16)
    layer, embed = _params(cfg)
    index = CHECKPOINTS / folder / "model.safetensors.index.json"
    if index.exists():          # Huginn: the real shard map (float32) -> bfloat16
        weight_bytes = json.loads(index.read_text())["metadata"]["total_size"] // 2
    else:
        weight_bytes = 2 * (layer * cfg.n_layers + embed)
    positions = int((GPU_SHARE * GPU_BYTES - weight_bytes) // bpt)
    core, rest = layer * cfg.n_core, layer * (cfg.n_prelude + cfg.n_coda) + embed
    a = 2 * (core * R + rest) / HBM_BW                 # every core layer's weights read once per recurrence
    b = 2 * (core * R + rest) / (tflops * 1e12)        # 2 FLOP per parameter applied, per row
    return Family(folder, R, cfg.block_size, bpt, weight_bytes, positions, a, b, bpt / HBM_BW)


# --- traces ------------------------------------------------------------------------------------------------------
@dataclass
class Req:
    id: int
    arrival: float
    prompt: list[int]
    answer: int                 # tokens it generates (EOS the last), <= max_new_tokens
    max_new: int                # what the request asks for (the new engine)
    max_new_1024: int           # ... with chat's old default of 1024 when max_tokens is absent


def _lognormal(rng, median: float, sigma: float, lo: int, hi: int, n: int) -> np.ndarray:
    return np.clip(np.round(rng.lognormal(math.log(median), sigma, n)), lo, hi).astype(int)


def chat_trace(n: int, context: int, rng, rate: float | None) -> list[Req]:
    """Chat: prompts lognormal around 300 tokens, answers around 200 (cut at 1024), max_tokens absent (the rest
    of the context, OpenAI's rule); 60% start with one of 4 system prompts (150-600 tokens); Poisson arrivals at
    ``rate`` per simulated second (None: all at once)."""
    systems = [rng.integers(3, 30000, int(L)).tolist() for L in (150, 300, 450, 600)]
    user = _lognormal(rng, 300, 0.9, 8, 3000, n)
    answer = _lognormal(rng, 200, 0.8, 1, 1024, n)
    which = rng.choice(len(systems) + 1, n, p=[0.15] * 4 + [0.4])
    t = np.cumsum(rng.exponential(1 / rate, n)) if rate else np.zeros(n)
    out = []
    for i in range(n):
        prompt = (systems[which[i]] if which[i] < len(systems) else []) + rng.integers(3, 30000, user[i]).tolist()
        prompt = prompt[: context - 2]
        rest = context - len(prompt)
        out.append(Req(i, float(t[i]), prompt, int(min(answer[i], rest)), rest, min(1024, rest)))
    return out


def eval_trace(n: int, context: int, rng, rate: float | None) -> list[Req]:
    """A few-shot eval (GSM8K 8-shot): ~900 shared tokens of exemplars + a question lognormal around 90 tokens;
    answers around 150 tokens; max_new_tokens 256; all at once."""
    shots = rng.integers(3, 30000, 900).tolist()
    q = _lognormal(rng, 90, 0.4, 20, 400, n)
    answer = _lognormal(rng, 150, 0.5, 10, 256, n)
    t = np.cumsum(rng.exponential(1 / rate, n)) if rate else np.zeros(n)
    return [Req(i, float(t[i]), shots + rng.integers(3, 30000, q[i]).tolist(), int(answer[i]), 256, 256)
            for i in range(n)]


TRACES = {"chat": chat_trace, "gsm8k-8shot": eval_trace}


# --- decoding methods --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SimDrafter:
    """A drafter stand-in: what the scheduler reads (``name``, ``width``), and how many tokens a step commits."""

    name: str
    width: int
    accept: float = 1.0          # mean tokens committed per decoding step (geometric, at most width)

    def draws(self, rng, n: int) -> list[int]:
        """Tokens committed by each of (at most) ``n`` decoding steps."""
        if self.width <= 1 or self.accept <= 1:
            return [1] * n
        return np.minimum(rng.geometric(1 / self.accept, n), self.width).tolist()


def methods(accept: float) -> dict[str, SimDrafter]:
    # das-wave's default knobs: w = min(gamma 32, w_init 2 + rounds 24 - 1) = 25, width = w + 1 (wave.py)
    return {"ar": SimDrafter("ar", 1), "das-wave": SimDrafter("das-wave", 26, accept)}


class Decode:
    """Each request's stream of commit draws (seeded by request id: the same in every configuration) and its
    tokens: TOKEN until its answer length, where EOS."""

    def __init__(self, drafter: SimDrafter, seed: int):
        self.drafter, self.seed = drafter, seed
        self._draws: dict[int, list[int]] = {}       # per request, its draws (one per decoding step, in order)
        self._next: dict[int, int] = {}

    def tokens(self, r: Req, done: int, room: int, cap: int | None) -> list[int]:
        draws = self._draws.get(r.id)
        if draws is None:
            draws = self._draws[r.id] = self.drafter.draws(np.random.default_rng([self.seed, r.id]), r.answer)
        i = self._next.get(r.id, 0)
        self._next[r.id] = i + 1
        k = 1 if cap == 0 else draws[i]
        k = max(1, min(k, room))
        return self._mark(r, done, k)

    @staticmethod
    def _mark(r: Req, done: int, k: int) -> list[int]:
        return [EOS if done + i + 1 >= r.answer else TOKEN for i in range(k)]

    def first(self, r: Req) -> list[int]:
        return self._mark(r, 0, 1)


def step_time(fam: Family, rows: int, read: int, swapped: int) -> float:
    return fam.a + fam.b * rows + fam.c * read + swapped * fam.bytes_per_token / PCIE_BW


# --- metrics -----------------------------------------------------------------------------------------------------
@dataclass
class Meter:
    """Time-weighted over the simulated run (each step weighs its duration)."""

    t: float = 0.0
    steps: int = 0
    running: float = 0.0
    decoding: float = 0.0       # running requests past their prompt
    max_running: int = 0
    sat_t: float = 0.0          # time with requests waiting (the pool or the budget, not the load, limits)
    sat_running: float = 0.0
    held: float = 0.0           # positions held (blocks x B, or reserved ranges)
    written: float = 0.0        # positions materialised (distinct: a shared block once)
    max_held: int = 0
    tokens: int = 0
    latency: list = field(default_factory=list)
    ttft: list = field(default_factory=list)

    def sample(self, dt: float, running: int, decoding: int, held: int, written: int, queued: int) -> None:
        self.t += dt
        self.steps += 1
        self.running += dt * running
        self.decoding += dt * decoding
        if queued:
            self.sat_t += dt
            self.sat_running += dt * running
        self.held += dt * held
        self.written += dt * written
        self.max_running = max(self.max_running, running)
        self.max_held = max(self.max_held, held)

    def summary(self, positions: int, **extra) -> dict:
        T = self.t or 1.0
        return dict(steps=self.steps, sim_seconds=round(self.t, 3), mean_running=round(self.running / T, 2),
                    mean_decoding=round(self.decoding / T, 2), max_running=self.max_running,
                    saturated_running=round(self.sat_running / self.sat_t, 2) if self.sat_t else None,
                    saturated_share=round(self.sat_t / T, 3), mean_held=round(self.held / T), max_held=self.max_held,
                    held_share=round(self.held / T / positions, 3),
                    fragmentation=round(1 - self.written / self.held, 3) if self.held else 0.0,
                    tokens=self.tokens, tokens_per_s=round(self.tokens / T, 1),
                    mean_latency=round(float(np.mean(self.latency)), 3) if self.latency else None,
                    mean_ttft=round(float(np.mean(self.ttft)), 3) if self.ttft else None, **extra)


# --- after: the real scheduler, a fake executor --------------------------------------------------------------------
class FakeExecutor:
    """Consumes the scheduler's ``StepPlan`` like ``executor.Executor`` and answers a ``StepOutput``; keeps its
    own per-request state (rows materialised, tokens committed) and charges the step to the clock."""

    def __init__(self, fam: Family, decode: Decode, reqs: dict[int, Req]):
        self.fam, self.decode, self.reqs = fam, decode, reqs
        self.prefilled: dict[int, int] = {}
        self.done: dict[int, int] = {}
        self.saved: dict[int, int] = {}
        self.segments = 0           # prompt blocks prefilled (one attention segment each on the real engine)

    def rows_of(self, rid: int) -> int:
        d = self.done.get(rid, 0)
        return self.prefilled[rid] if not d else len(self.reqs[rid].prompt) + d - 1

    def execute(self, plan: StepPlan, B: int) -> tuple[StepOutput, float]:
        out, swapped, rows, read, extra = StepOutput(), 0, 0, 0, 0.0
        for rid in plan.swap_out:
            self.saved[rid] = n = self.rows_of(rid)
            swapped += n
        for s in plan.start:
            self.prefilled[s.id], self.done[s.id] = s.cached, 0
        for rid, _ in plan.swap_in:
            swapped += self.saved.pop(rid)
        for w in plan.work:
            r, o = self.reqs[w.id], RequestOutput(w.id)
            out.requests[w.id] = o
            if w.prefill is not None:
                a, b = w.prefill
                if a != self.prefilled[w.id]:
                    raise RuntimeError(f"request {w.id}: prefill planned from row {a}, {self.prefilled[w.id]} done")
                if w.depths is not None:            # a depth slice: its share of the block's core steps, in a call
                    r0, r1 = w.depths                 # of its own (the core's weights read again: a share of a step)
                    rows += -(-(b - a) * (r1 - r0) // self.fam.R)
                    read += -(-b * (r1 - r0) // self.fam.R)
                    extra += self.fam.a * (r1 - r0) / self.fam.R
                    if r1 < self.fam.R:
                        continue
                    self.segments += 1
                else:
                    self.segments += -(-(b - a) // B)
                    rows += b - a
                    read += b
                o.prefilled = b - a
                self.prefilled[w.id] = b
                if b == len(r.prompt):
                    o.tokens = self.decode.first(r)
                    self.done[w.id] = 1
            elif self.done.get(w.id):
                room = w.room if not w.cap else min(w.room, w.cap + 1)
                read += self.rows_of(w.id)
                o.tokens = self.decode.tokens(r, self.done[w.id], room, w.cap)
                rows += 1 if w.cap == 0 else self.decode.drafter.width
                o.verdict = (len(o.tokens) - 1, len(o.tokens) - 1, True)
                self.done[w.id] += len(o.tokens)
        return out, step_time(self.fam, rows, read, swapped) + extra


def entry(r: Req, drafter: SimDrafter, fam: Family, salt: bytes, max_new: int) -> Entry:
    """As ``Engine.add`` builds it."""
    rule = StopRule(max_new, [EOS], prompt=r.prompt)
    return Entry(r.id, list(r.prompt), rule, drafter, DrafterKey(drafter.name),
                 rows_needed(fam.context, len(r.prompt), max_new, drafter.width), salt, None)


def plan_summary(plan: StepPlan) -> tuple:
    """What a plan decides: who starts (and how many rows it shares), each request's blocks, prompt rows and room,
    who is swapped out and in (tests compare the real engine's plans with the simulation's)."""
    return (tuple((s.id, s.cached) for s in plan.start),
            tuple((w.id, tuple(w.new_blocks), w.prefill, w.depths, w.room) for w in plan.work),
            tuple(plan.swap_out), tuple((i, tuple(b)) for i, b in plan.swap_in))


class GatedScheduler(Scheduler):
    """A variant the simulation suggests (not the engine's): admit a request only when this step's token budget
    lets it prefill at least one block.  The engine's scheduler admits every waiting request it has a batch slot
    and a first block for, even when the budget is spent, so requests sit admitted without prefill, their partial
    prompts fill the pool, and decoding requests growing into it preempt them (swaps)."""

    def _admit(self, e, budget, plan, planned):
        if budget < self.pool.B and (plan.rows or any(w.prefill is None and w.room for w in plan.work)):
            return False
        return super()._admit(e, budget, plan, planned)


def run_after(fam: Family, trace: list[Req], drafter: SimDrafter, B: int, max_batch: int, max_step_tokens: int,
              seed: int, pool: BlockPool | None = None, scheduler: type[Scheduler] = Scheduler,
              record: list | None = None) -> dict:
    """The trace through the real scheduler and the fake executor; ``record``: a list each step's plan is added
    to (``plan_summary``)."""
    pool = pool or BlockPool.accounting(fam.positions, B, fam.bytes_per_token)
    sched = scheduler(pool, max_batch, max_step_tokens, R=fam.R)
    salt = prefix_salt(fam.R, 1.0, 0, None, torch.bfloat16, B)
    reqs = {r.id: r for r in trace}
    ex = FakeExecutor(fam, Decode(drafter, seed), reqs)
    pending = deque(sorted(trace, key=lambda r: (r.arrival, r.id)))
    entries, clock, m, first, cpu = {}, 0.0, Meter(), {}, 0.0
    finished: dict[int, Entry] = {}
    while pending or sched.has_work:
        while pending and pending[0].arrival <= clock:
            r = pending.popleft()
            entries[r.id] = e = entry(r, drafter, fam, salt, r.max_new)
            sched.add(e)
        if not sched.has_work:
            clock = pending[0].arrival
            continue
        t = time.perf_counter()
        plan, ended = sched.schedule()
        cpu += time.perf_counter() - t
        assert not ended
        if not plan.work and not plan.swap_out and not plan.swap_in:
            if not pending:
                raise RuntimeError(f"stalled at step {sched.steps}: nothing runs and nothing will arrive")
            clock = max(clock, pending[0].arrival)
            continue
        if record is not None:
            record.append(plan_summary(plan))
        out, dt = ex.execute(plan, B)
        running = sched.running
        refs = sum(len(e.blocks) for e in running)
        if refs < pool.in_use:
            raise AssertionError(f"step {sched.steps}: {pool.in_use} blocks in use, {refs} referenced")
        written = sum(e.n for e in running) - B * (refs - pool.in_use)      # a shared (full) block once
        queued = any(e.status == "waiting" for e in sched.waiting)
        m.sample(dt, len(running), sum(1 for e in running if e.generated), pool.in_use * B, written, queued)
        clock += dt
        t = time.perf_counter()
        _, done = sched.update(plan, out)
        done += sched.stopped()
        cpu += time.perf_counter() - t
        for e in running:
            if e.generated and e.id not in first:
                first[e.id] = clock
        for e in done:
            finished[e.id] = e
            m.tokens += len(e.generated)
            m.latency.append(clock - reqs[e.id].arrival)
            m.ttft.append(first.get(e.id, clock) - reqs[e.id].arrival)
    prompt_rows = sched.shared_rows + sched.prefilled_rows
    return m.summary(fam.positions, preemptions=sched.preemptions, mean_blocks=round(m.held / (m.t or 1) / B),
                     prefix_hit=round(sched.shared_rows / prompt_rows, 3) if prompt_rows else 0.0,
                     evictions=pool.evictions, blocks_left=pool.in_use,
                     segments_per_request=round(ex.segments / len(trace), 1),
                     scheduler_ms_per_step=round(1e3 * cpu / max(m.steps, 1), 2),
                     wrong_lengths=sum(len(finished[r.id].generated) != r.answer for r in trace if r.id in finished),
                     unfinished=len(trace) - len(finished))


# --- before: the old engine's memory model (b1b14e7) ---------------------------------------------------------------
class Ranges:
    """The old ``KVPool``: contiguous ranges, first fit, merged on release."""

    def __init__(self, rows: int):
        self.free = [(0, rows)]

    def allocate(self, n: int) -> int | None:
        for i, (s, k) in enumerate(self.free):
            if k >= n:
                self.free[i:i + 1] = [(s + n, k - n)] if k > n else []
                return s
        return None

    def release(self, s: int, n: int) -> None:
        self.free.append((s, n))
        self.free.sort()
        merged = [self.free[0]]
        for a, k in self.free[1:]:
            if merged[-1][0] + merged[-1][1] == a:
                merged[-1] = (merged[-1][0], merged[-1][1] + k)
            else:
                merged.append((a, k))
        self.free = merged


def run_before(fam: Family, trace: list[Req], drafter: SimDrafter, max_batch: int, seed: int,
               chat_1024: bool) -> dict:
    decode = Decode(drafter, seed)
    pool = Ranges(fam.positions)
    pending = deque(sorted(trace, key=lambda r: (r.arrival, r.id)))
    queue: deque[Req] = deque()
    running: list[dict] = []
    clock, m = 0.0, Meter()
    while pending or queue or running:
        while pending and pending[0].arrival <= clock:
            queue.append(pending.popleft())
        while queue and len(running) < max_batch:                    # first in, first served: the head waits
            r = queue[0]
            max_new = r.max_new_1024 if chat_1024 else r.max_new
            need = rows_needed(fam.context, len(r.prompt), max_new, drafter.width)
            if need > fam.positions:
                raise RuntimeError(f"request {r.id} needs {need} positions, the pool holds {fam.positions}")
            start = pool.allocate(need)
            if start is None:
                break
            queue.popleft()
            running.append(dict(r=r, start=start, rows=need, prefilled=0, done=0, max_new=max_new))
        if not running:
            clock = pending[0].arrival
            continue
        rows = read = 0
        ended = []
        for x in running:
            r, P = x["r"], len(x["r"].prompt)
            if x["prefilled"] < P:
                C = OLD_PREFILL_CHUNK
                end = min(P, (x["prefilled"] // C + 1) * C)
                rows += end - x["prefilled"]
                read += end
                x["prefilled"] = end
                if end == P:
                    x["done"] = 1
                    x["first"] = True
            else:
                read += P + x["done"] - 1
                toks = decode.tokens(r, x["done"], x["max_new"] - x["done"], None)
                rows += drafter.width
                x["done"] += len(toks)
            if x["done"] >= r.answer:
                ended.append(x)
        dt = step_time(fam, rows, read, 0)
        held = sum(x["rows"] for x in running)
        written = sum(x["prefilled"] if not x["done"] else len(x["r"].prompt) + x["done"] - 1 for x in running)
        m.sample(dt, len(running), sum(1 for x in running if x["done"]), held, written, len(queue))
        clock += dt
        for x in running:
            if x.pop("first", False):
                x["ttft"] = clock - x["r"].arrival
        for x in ended:
            running.remove(x)
            pool.release(x["start"], x["rows"])
            m.tokens += x["r"].answer
            m.latency.append(clock - x["r"].arrival)
            m.ttft.append(x["ttft"])
    return m.summary(fam.positions, preemptions=0, prefix_hit=0.0)


# --- the study -----------------------------------------------------------------------------------------------------
def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for results.json, results.md, concurrency.png")
    ap.add_argument("--models", nargs="+", default=["huginn-0125", "ouro-1.4b"])
    ap.add_argument("--traces", nargs="+", default=list(TRACES), choices=list(TRACES))
    ap.add_argument("--methods", nargs="+", default=["ar", "das-wave"], choices=["ar", "das-wave"])
    ap.add_argument("--blocks", nargs="*", type=int, default=list(BLOCK_SIZES))
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per trace (default: the pool's positions / 250, within 100..300)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    ap.add_argument("--rate", type=float, default=None,
                    help="chat arrivals per simulated second (Poisson); default: all at once")
    ap.add_argument("--max-batch", type=int, default=256, help="batch slots (the engine's default is 8)")
    ap.add_argument("--max-step-tokens", type=int, default=MAX_STEP_TOKENS)
    ap.add_argument("--accept", type=float, default=3.5, help="das-wave stand-in: mean tokens per step")
    ap.add_argument("--tflops", type=float, default=400.0, help="sustained bf16 TFLOP/s of the GPU")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gated", nargs="*", type=int, default=[16], metavar="B",
                    help="also run GatedScheduler (admission gated by the step budget) at these block sizes")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    fams = {name: family(name, args.tflops) for name in args.models}
    tasks = []
    for name, fam in fams.items():
        gb = 1e9 / fam.bytes_per_token
        print(f"{name}: R={fam.R}, {fam.bytes_per_token:,} B/token, weights {fam.weight_bytes / 1e9:.2f} GB, "
              f"pool {fam.positions:,} positions ({fam.positions * fam.bytes_per_token / 1e9:.1f} GB, "
              f"{gb:.0f} positions/GB), {requests(fam, args.requests)} requests per trace; step = "
              f"{fam.a * 1e3:.2f} ms + {fam.b * 1e3:.3f} ms/row + {fam.c * 1e6:.3f} us/position read", flush=True)
        for tname in args.traces:
            for mname in args.methods:
                befores = [("before-1024", True), ("before-rest", False)] if tname == "chat" else [("before", False)]
                tasks += [(name, tname, mname, label, None) for label, _ in befores]
                tasks += [(name, tname, mname, "after", B) for B in args.blocks]
                tasks += [(name, tname, mname, "after-gated", B) for B in args.gated if B]
    runs = []
    if args.jobs > 1:
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(args.jobs) as pool:
            for r in pool.map(run_task, tasks, [args] * len(tasks)):
                runs.append(r)
                _progress(r)
    else:
        for t in tasks:
            runs.append(run_task(t, args))
            _progress(runs[-1])
    results = dict(date=time.strftime("%Y-%m-%d"), args=vars(args), gpu_bytes=GPU_BYTES, gpu_share=GPU_SHARE,
                   hbm_bw=HBM_BW, pcie_bw=PCIE_BW, families={k: asdict(v) for k, v in fams.items()},
                   runs=runs, ratios=ratios(runs), seconds=round(time.perf_counter() - t0, 1))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(markdown(results))
    if not args.no_plot:
        plot(results, out / "concurrency.png")
    print(f"wrote {out}/results.json, results.md{'' if args.no_plot else ', concurrency.png'} "
          f"in {results['seconds']} s", flush=True)
    return results


def requests(fam: Family, n: int | None) -> int:
    """Requests per trace: enough for several pool-fulls (about 800 positions a chat request)."""
    return n if n is not None else int(min(300, max(100, fam.positions // 250)))


def run_task(task: tuple, args) -> dict:
    name, tname, mname, engine, B = task
    t = time.perf_counter()
    fam = family(name, args.tflops)
    trace = TRACES[tname](requests(fam, args.requests), fam.context, np.random.default_rng(args.seed),
                          args.rate if tname == "chat" else None)
    d = methods(args.accept)[mname]
    if engine.startswith("after"):
        res = run_after(fam, trace, d, B, args.max_batch, args.max_step_tokens, args.seed,
                        scheduler=GatedScheduler if engine == "after-gated" else Scheduler)
    else:
        res = run_before(fam, trace, d, args.max_batch, args.seed, engine == "before-1024")
    return dict(model=name, trace=tname, method=mname, engine=engine, B=B, requests=len(trace), **res,
                wall_s=round(time.perf_counter() - t, 2))


def _progress(r: dict) -> None:
    dt = r["wall_s"]
    b = f"B={r['B']:<3}" if r["B"] else "     "
    print(f"  {r['model']:<11} {r['trace']:<11} {r['method']:<8} {r['engine']:<11} {b} running mean "
          f"{r['mean_running']:6.1f} max {r['max_running']:3}  decoding {r['mean_decoding']:6.1f}  "
          f"frag {r['fragmentation']:.3f}  hit {r['prefix_hit']:.2f}  preempt {r['preemptions']:3}  {r['tokens_per_s']:8.0f} tok/s  ({dt:.1f} s)",
          flush=True)


def ratios(runs: list[dict]) -> list[dict]:
    """After / before per (model, trace, method, B): concurrency and throughput."""
    out = []
    for a in (r for r in runs if r["engine"].startswith("after")):
        for b in runs:
            if b["engine"].startswith("before") and (b["model"], b["trace"], b["method"]) == (a["model"], a["trace"],
                                                                                     a["method"]):
                out.append(dict(model=a["model"], trace=a["trace"], method=a["method"], engine=a["engine"],
                                B=a["B"], vs=b["engine"], running=round(a["mean_running"] / b["mean_running"], 2),
                                decoding=round(a["mean_decoding"] / b["mean_decoding"], 2),
                                throughput=round(a["tokens_per_s"] / b["tokens_per_s"], 2)))
    return out


def markdown(res: dict) -> str:
    lines = [f"# Scheduler simulation, {res['date']}", "",
             f"GPU {res['gpu_bytes'] / 2**30:.0f} GiB, {res['gpu_share']:.0%} for weights + cache; HBM "
             f"{res['hbm_bw'] / 1e12:.2f} TB/s, PCIe {res['pcie_bw'] / 1e9:.0f} GB/s; arguments {res['args']}", "",
             "| model | R | bytes/token | weights (GB) | pool positions | positions/GB | blocks/GB at B=16 | "
             "a (ms/step) | b (ms/row) | c (us/position) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for f in res["families"].values():
        lines.append(f"| {f['name']} | {f['R']} | {f['bytes_per_token']:,} | {f['weight_bytes'] / 1e9:.2f} | "
                     f"{f['positions']:,} | {1e9 / f['bytes_per_token']:.0f} | {1e9 / f['bytes_per_token'] / 16:.1f} "
                     f"| {f['a'] * 1e3:.2f} | {f['b'] * 1e3:.3f} | {f['c'] * 1e6:.3f} |")
    lines += ["", "running: admitted requests (batch slot and blocks held); decoding: those past their prompt; "
              "saturated: mean running while requests wait; blocks: mean held; fragmentation: 1 - positions "
              "written / positions held; segments: prompt blocks prefilled per request (one attention segment "
              "each); scheduler ms/step: this CPU's wall time in Scheduler.schedule + update; all means weighted by "
              "simulated time.", "",
              "| model | trace | method | engine | B | running mean | max | decoding mean | saturated | blocks | "
              "held share | fragmentation | prefix hit | preemptions | segments/req | tok/s | latency (s) | "
              "TTFT (s) | scheduler ms/step |", "|" + "---|" * 19]
    for r in res["runs"]:
        lines.append(f"| {r['model']} | {r['trace']} | {r['method']} | {r['engine']} | {r['B'] or ''} | "
                     f"{r['mean_running']} | {r['max_running']} | {r['mean_decoding']} | {r['saturated_running']} | "
                     f"{r.get('mean_blocks', '')} | {r['held_share']} | {r['fragmentation']} | "
                     f"{r['prefix_hit']} | {r['preemptions']} | {r.get('segments_per_request', '')} | "
                     f"{r['tokens_per_s']:.0f} | {r['mean_latency']} | {r['mean_ttft']} | "
                     f"{r.get('scheduler_ms_per_step', '')} |")
    lines += ["", "After / before (mean running, mean decoding, throughput):", "",
              "| model | trace | method | engine | B | vs | running | decoding | throughput |", "|" + "---|" * 9]
    for q in res["ratios"]:
        lines.append(f"| {q['model']} | {q['trace']} | {q['method']} | {q['engine']} | {q['B']} | {q['vs']} | "
                     f"{q['running']}x | {q['decoding']}x | {q['throughput']}x |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = res["runs"]
    models = list(dict.fromkeys(r["model"] for r in runs))
    traces = list(dict.fromkeys(r["trace"] for r in runs))
    fig, axes = plt.subplots(len(models), len(traces), figsize=(5.5 * len(traces), 3.8 * len(models)),
                             squeeze=False)
    styles = {"before-1024": ":", "before-rest": "--", "before": "--"}
    for i, mo in enumerate(models):
        for j, tr in enumerate(traces):
            ax = axes[i][j]
            for k, me in enumerate(dict.fromkeys(r["method"] for r in runs)):
                sel = [r for r in runs if (r["model"], r["trace"], r["method"]) == (mo, tr, me)]
                after = [r for r in sel if r["engine"] == "after"]
                color = f"C{k}"
                if after:
                    ax.plot([r["B"] for r in after], [r["mean_decoding"] for r in after], "o-", color=color,
                            label=f"{me}: paged (after)")
                    ax.plot([r["B"] for r in after], [r["mean_running"] for r in after], ".", color=color, alpha=0.4,
                            label=f"{me}: paged, admitted (incl. waiting for prefill)")
                for r in sel:
                    if r["engine"] == "after-gated":
                        ax.plot([r["B"]], [r["mean_decoding"]], "*", ms=11, color=color,
                                label=f"{me}: paged, admission gated")
                    elif r["engine"] != "after":
                        ax.axhline(r["mean_decoding"], color=color, ls=styles[r["engine"]],
                                   label=f"{me}: {r['engine']}")
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted({r["B"] for r in runs if r["engine"] == "after"}))
            ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.set_title(f"{mo}, {tr}")
            ax.set_xlabel("block size B (positions)")
            ax.set_ylabel("mean requests decoding")
            ax.set_ylim(bottom=0)
    seen: dict = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, h)
    fig.legend(list(seen.values()), list(seen), loc="lower center", ncol=4, fontsize=7)
    fig.suptitle(f"Concurrent requests on an 80 GB GPU, before (contiguous reservation) and after (paged), "
                 f"{res['date']}", fontsize=10)
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
