"""Requests at the engine's edges (issue 51): a request running to the end of the model context beside others, a
wide drafter preempted in a small pool, a prompt larger than the free blocks beside short requests.  Each finishes
with its own AR tokens, and nothing beside it is lost.  Small models with a short context keep them cheap."""

from __future__ import annotations

import pytest
import torch

import dasspec
from dasspec.engine.api.engine import Engine
from dasspec.testing import random_model

CONTEXT = 96


@pytest.fixture(scope="module")
def model():
    return random_model("huginn", seed=11, mean_recurrence=4, n_prelude=1, n_core=1, n_coda=1, block_size=CONTEXT)


def _repeating(vocab: int, length: int, period: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (period,), generator=g).repeat(-(-length // period))[:length].tolist()


# --- 1. DAS-Wave (and auto) to the end of the context -------------------------------------------------------------

WAVES = [("das-wave", {}),                                      # gamma 32 > the room left near the end
         ("das-wave", {"gamma": 24, "w_init": 8, "rounds": 6, "guesses": "copy", "seed_branch": 8, "trim": True,
                       "copy_run": True, "early_stop": True}),
         ("auto", {"arms": "das-wave", "explore": 1.0, "calibrate": False})]


@pytest.mark.parametrize("method,knobs", WAVES, ids=["wave", "wave-tuned", "auto"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_window_near_the_end_of_the_context_is_capped(model, method, knobs, sampled):
    """prompt + max_new_tokens = the context: DAS-Wave's window (gamma 32 by default) would run rows past the last
    position in the request's last blocks.  Alone and in a batch beside a short request, every answer is AR's."""
    long = _repeating(model.config.vocab_size, CONTEXT - 16, 9, seed=0)
    short = _repeating(model.config.vocab_size, 12, 5, seed=1)
    opts = dict(do_sample=True, temperature=0.8, top_p=0.95) if sampled else {}
    refs = [dasspec.generate(model, p, "ar", max_new_tokens=16, eos=False, seed=3, **opts).tokens
            for p in (short, long)]
    alone = dasspec.generate(model, long, method, max_new_tokens=16, eos=False, seed=3, **opts, **knobs)
    assert alone.tokens == refs[1]
    both = dasspec.generate_batch(model, [short, long], method, max_new_tokens=16, eos=False, seed=3, **opts, **knobs)
    assert [o.tokens for o in both] == refs


@pytest.mark.parametrize("method", ["pld", "sam", "lookahead", "token-recycling", "mature-spec", "self-spec"])
def test_every_other_drafter_runs_to_the_end_of_the_context(model, method):
    """The other drafters cap their widths by the room and the context already: the same request, alone and beside
    a short one, gives AR's tokens with each of them (greedy)."""
    long = _repeating(model.config.vocab_size, CONTEXT - 16, 9, seed=0)
    short = _repeating(model.config.vocab_size, 12, 5, seed=1)
    refs = [dasspec.generate(model, p, "ar", max_new_tokens=16, eos=False).tokens for p in (short, long)]
    assert dasspec.generate(model, long, method, max_new_tokens=16, eos=False).tokens == refs[1]
    both = dasspec.generate_batch(model, [short, long], method, max_new_tokens=16, eos=False)
    assert [o.tokens for o in both] == refs


# --- 2. a wide drafter preempted in a small pool -------------------------------------------------------------------

def _record_plans(engine: Engine) -> list:
    """Every plan the engine's scheduler makes from now on."""
    plans, schedule = [], engine.scheduler.schedule

    def spy():
        plan, ended = schedule()
        plans.append(plan)
        return plan, ended

    engine.scheduler.schedule = spy
    return plans


@pytest.mark.parametrize("method", ["token-recycling", "lookahead"])
def test_a_wide_drafter_swaps_back_in_with_ar_steps(model, method):
    """A pool of 6 blocks of 8 rows: each request (12 + 24 rows) fits it alone, but not with its drafter's scratch
    (81 and 40 verifier inputs), so a preempted request must come back with its anchor's rows and take AR steps
    (as the decode path does) instead of waiting for a width that never frees.  Real swaps happen (rows to host
    memory and back, not roll-backs of a just-admitted prompt) and every answer is its own AR decode."""
    prompts = [_repeating(model.config.vocab_size, 12, 5, seed=i) for i in range(3)]
    for sampled in (False, True):
        opts = dict(do_sample=True, temperature=0.8) if sampled else {}
        refs = [dasspec.generate(model, p, "ar", max_new_tokens=24, eos=False, seed=i, **opts).tokens
                for i, p in enumerate(prompts)]
        engine = Engine(model, method, max_batch=3, block_size=8, kv_budget=6 * 8)
        assert engine.pool.blocks_for(12 + 1 + engine._default.width) > engine.pool.capacity_blocks
        plans = _record_plans(engine)
        ids = [engine.add(p, max_new_tokens=24, eos=False, seed=i, **opts) for i, p in enumerate(prompts)]
        while engine.has_work:
            engine.step()
        assert [engine.result(i).tokens for i in ids] == refs, sampled
        swaps = sum(len(p.swap_out) for p in plans)
        assert swaps > 0 and swaps == sum(len(p.swap_in) for p in plans)
        assert engine.pool.available == engine.pool.capacity_blocks


# --- 3. a prompt larger than the free blocks beside short requests ----------------------------------------------

class _Streamer:
    def __init__(self):
        self.chunks: list[list[int]] = []

    def put(self, t):
        self.chunks.append(t[0].tolist())

    def end(self):
        pass


def test_a_prompt_larger_than_the_free_blocks_is_admitted_once_and_blocks_no_one(model):
    """A pool of 12 blocks of 8 rows, 6 of them held by a long decode: a 60-token prompt (8 blocks) does not fit
    beside it.  It is admitted once, when its prefill fits (its streamer sees the prompt once, no request rolls
    itself back), short requests behind it start meanwhile - at most max_batch of them pass it, then it is served
    first - and every answer is its own AR decode."""
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    first = torch.randint(2, V, (8,), generator=g).tolist()
    big = torch.randint(2, V, (60,), generator=g).tolist()
    shorts = [torch.randint(2, V, (4,), generator=g).tolist() for _ in range(5)]
    engine = Engine(model, "ar", max_batch=3, block_size=8, kv_budget=12 * 8)
    a = engine.add(first, max_new_tokens=70, eos=False)
    for _ in range(40):
        engine.step()
    assert engine.pool.available - engine.pool.blocks_for(len(big)) < 1     # it does not fit now
    streamer = _Streamer()
    b = engine.add(big, max_new_tokens=4, eos=False, streamer=streamer)
    cs = [engine.add(p, max_new_tokens=4, eos=False) for p in shorts]
    started, finished, step = {}, {}, 0
    while engine.has_work:
        step += 1
        for ev in engine.step():
            if ev.started:
                started[ev.id] = step
            if ev.finished:
                finished[ev.id] = step
    outs = {i: engine.result(i).tokens for i in [a, b, *cs]}
    assert streamer.chunks[0] == big and sum(streamer.chunks[1:], []) == outs[b]   # the prompt once, then its tokens
    assert engine.scheduler.preemptions == 0
    assert finished[cs[0]] < finished[a]                                    # not blocked behind the big prompt
    assert sum(started[c] < started[b] for c in cs) <= engine.max_batch     # it is not passed for ever
    assert started[b] <= max(started[c] for c in cs)                         # ... then served first
    refs = {i: dasspec.generate(model, p, "ar", max_new_tokens=n, eos=False).tokens
            for i, p, n in [(a, first, 70), (b, big, 4)] + [(c, p, 4) for c, p in zip(cs, shorts)]}
    assert outs == refs


# --- 5. bounds, seeds, ties, the prefix cache's settings -----------------------------------------------------------

def test_a_contiguous_paged_read_or_write_stays_within_the_sequences_blocks():
    """A sequence whose blocks lie in order is read and written as one slice of the pool: a range past its backed
    rows would be another sequence's rows (here blocks 3.. of the pool), so it is refused, not served."""
    from dasspec.model.attention import PagedKV, Span
    from dasspec.model.cache import BlockTable

    B, H, hd = 4, 2, 3
    pool_k = torch.arange(H * 8 * B * hd, dtype=torch.float32).reshape(H, 8 * B, hd)
    pool_v = -pool_k
    table = BlockTable(B, 4 * B, "cpu")
    table.append([1, 2])                                  # rows 0..7 of the sequence = pool rows 4..11
    assert table.base == B
    kv = PagedKV(pool_k, pool_v, pool_k, pool_v, table)
    k, _ = kv.own(0, 2 * B)
    assert torch.equal(k, pool_k[:, B: 3 * B])
    for lo, hi in ((0, 2 * B + 1), (B, 3 * B), (-1, 2)):
        with pytest.raises(IndexError, match="outside the sequence"):
            kv.own(lo, hi)
        with pytest.raises(IndexError, match="outside the sequence"):
            kv.prefix(lo, hi)
    before = pool_k.clone()
    span = Span(n=2 * B, start=2 * B, W=1, rot=None)
    with pytest.raises(IndexError, match="outside the sequence"):
        kv.store(span, torch.ones(H, 1, hd), torch.ones(H, 1, hd))
    assert torch.equal(pool_k, before)                    # block 3's rows are untouched
    # the same write in a ragged call (a batch, or a request alone on a CPU) is refused as well, not put in the
    # null block
    from dasspec.model.attention import BatchKV, RaggedSpan
    rot = (torch.ones(1, hd), torch.ones(1, hd))
    with pytest.raises(IndexError, match="outside the sequence"):
        BatchKV([kv]).store(RaggedSpan.of([Span(n=2 * B, start=2 * B, W=1, rot=rot)]), torch.ones(H, 1, hd),
                            torch.ones(H, 1, hd))
    assert torch.equal(pool_k, before)
