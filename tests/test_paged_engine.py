"""The paged engine: requests take blocks as they write and give them back; when blocks run out the most recently
admitted request is swapped out (its rows to host memory) and resumes with exactly its own tokens; a per-step token
budget decides when prompt blocks run, never where a prompt is cut, so running streams keep committing while a long
prompt prefills; rows a request never wrote are never read (static shapes zero the blocks they get); a request's
blocks may lie anywhere in the pool."""

from __future__ import annotations

import pytest
import torch

import dasspec
from dasspec.engine.api.engine import Engine
from dasspec.testing import random_model

METHODS = [("ar", {}), ("mature-spec", {"draft_depth": 2, "block": 3}),
           ("das-wave", {"gamma": 6, "rounds": 3, "w_init": 6, "k": 1, "guesses": "copy", "seed_branch": 4}),
           ("pld", {}), ("token-recycling", {}), ("sam", {}), ("lookahead", {"window": 3, "ngram": 3,
                                                                            "guess_set": 3})]


def _prompts(vocab: int, count: int, seed: int, lo: int = 10, hi: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        L = int(torch.randint(lo, hi, (1,), generator=g))
        base = torch.randint(2, vocab, (max(2, L // 4),), generator=g)
        out.append(base.repeat(5)[:L].tolist() if i % 2 else torch.randint(2, vocab, (L,), generator=g).tolist())
    return out


def _drain(engine: Engine, ids: list[int]) -> list:
    while engine.has_work:
        engine.step()
    return [engine.result(i) for i in ids]


@pytest.fixture(scope="module")
def model():
    return random_model("huginn", seed=11, mean_recurrence=4, n_prelude=1, n_core=1, n_coda=1)


def _record_plans(engine: Engine) -> list:
    """The list every plan the engine's scheduler makes from now on is appended to."""
    plans = []
    schedule = engine.scheduler.schedule

    def spy():
        plan, ended = schedule()
        plans.append(plan)
        return plan, ended

    engine.scheduler.schedule = spy
    return plans


@pytest.mark.parametrize("sampled,budget", [(False, 32), (True, 32), (False, 6)],
                         ids=["greedy", "sampled", "greedy-depth-slices"])
def test_preempted_requests_resume_with_their_own_tokens(model, sampled, budget):
    """A pool far too small for every request at once: requests are swapped out and back in, mid-prefill and
    mid-decode (with a budget of 6, also in the middle of a block's depth slices: the block starts over), and every
    answer is still its own batch-1 AR decode (its rows come back bit for bit)."""
    prompts = _prompts(model.config.vocab_size, 6, seed=3)
    kw = dict(max_new_tokens=40, eos=False)
    if sampled:
        kw.update(do_sample=True, temperature=0.8)
    refs = [dasspec.generate(model, p, "ar", seed=i, **kw).tokens for i, p in enumerate(prompts)]
    preempted = 0
    for method, knobs in METHODS:
        engine = Engine(model, method, knobs, max_batch=6, block_size=8, kv_budget=160, max_step_tokens=budget)
        ids = [engine.add(p, seed=i, **kw) for i, p in enumerate(prompts)]
        outs = _drain(engine, ids)
        assert [o.tokens for o in outs] == refs, method
        preempted += engine.scheduler.preemptions
        assert engine.pool.available == engine.pool.capacity_blocks
    assert preempted >= len(METHODS), "the pool never ran out: preemption went untested"


def test_swapped_rows_come_back_bit_for_bit(model):
    """save / restore through a block table: the rows a preempted request had, into other blocks."""
    engine = Engine(model, "ar", max_batch=2, block_size=8, kv_budget=200)
    rid = engine.add(list(range(3, 30)), max_new_tokens=5, eos=False)
    with torch.inference_mode():
        engine.step()
        req = engine.executor.requests[rid]
        before = req.cache.save()
        blocks = req.cache.table.clear()
        new = engine.pool.allocate(len(blocks))
        assert not set(new) & set(blocks)
        req.cache.table.append(new)
        req.cache.restore(before)
        assert all(torch.equal(a, b) for a, b in zip(before, req.cache.save()))


def test_the_step_budget_decides_when_prompt_blocks_run_not_where_they_are_cut(model):
    """Each step verifies the running requests' drafts first, then prompt blocks with what is left of
    max_step_tokens; prefill ranges start on block boundaries; a decoding request commits a token at every step
    while a long prompt prefills beside it; the long prompt's answer is its own AR decode."""
    from dasspec.engine.core import scheduler as sched

    short = [5, 6, 7, 8]
    long = _prompts(model.config.vocab_size, 1, seed=5, lo=180, hi=181)[0]
    engine = Engine(model, "ar", max_batch=2, block_size=8, max_step_tokens=24)
    a = engine.add(short, max_new_tokens=60, eos=False)
    engine.step()                                            # a is decoding
    b = engine.add(long, max_new_tokens=4, eos=False)
    plans = []
    real = sched.Scheduler.schedule

    def spy(self):
        plan, ended = real(self)
        plans.append(plan)
        return plan, ended

    sched.Scheduler.schedule = spy
    try:
        committed = []
        while engine._table[b].computed < len(long):
            evs = engine.step()
            committed.append(sum(len(e.tokens) for e in evs if e.id == a))
    finally:
        sched.Scheduler.schedule = real
    assert len(plans) >= len(long) // 24                     # the prompt took several steps
    for plan in plans:
        pre = [w.prefill for w in plan.work if w.prefill]
        decode_rows = sum(1 for w in plan.work if w.prefill is None and w.room)
        assert all(s % 8 == 0 for s, _ in pre)               # block boundaries, whatever the budget
        assert sum(e - s for s, e in pre) + decode_rows <= 24
    assert all(c >= 1 for c in committed)                    # the stream never stalled
    outs = _drain(engine, [a, b])
    assert outs[1].tokens == dasspec.generate(model, long, max_new_tokens=4, eos=False).tokens
    assert outs[0].tokens == dasspec.generate(model, short, max_new_tokens=60, eos=False).tokens


def test_depth_slices_of_a_prompt_block_write_the_rows_the_whole_block_writes(model):
    """When the budget left is less than a block, the block runs as depth slices (core steps (r0, r1] per step,
    its state carried on the request): the decoding stream commits a token at every step, no step is charged more
    than max_step_tokens, and the prompt's rows at every depth are bit for bit those a whole-block prefill writes;
    the answers are their own AR decodes."""
    prompt = _prompts(model.config.vocab_size, 1, seed=12, lo=37, hi=38)[0]
    short = [5, 6, 7]
    R = model.config.mean_recurrence

    def prefill(budget: int):
        engine = Engine(model, "ar", max_batch=2, block_size=8, max_step_tokens=budget)
        a = engine.add(short, max_new_tokens=60, eos=False)
        engine.step()                                        # a is decoding
        b = engine.add(prompt, max_new_tokens=4, eos=False)
        plans, committed = _record_plans(engine), []
        with torch.inference_mode():
            while engine._table[b].computed < len(prompt):
                evs = engine.step()
                committed.append(sum(len(e.tokens) for e in evs if e.id == a))
        rows = engine.executor.requests[b].cache.save()
        return rows, plans, committed, [o.tokens for o in _drain(engine, [a, b])]

    whole, _, _, outs_whole = prefill(512)
    sliced, plans, committed, outs = prefill(5)
    slices = [(w.prefill[1] - w.prefill[0], w.depths) for p in plans for w in p.work if w.depths is not None]
    assert len(slices) >= 4 * 2 and all(0 <= r0 < r1 <= R for _, (r0, r1) in slices)
    # 1 row of the 5 verifies the AR request (its one input), 4 are left: a block of 8 rows gets R / 2 core steps
    assert all(r1 - r0 == R // 2 for size, (r0, r1) in slices if size == 8)
    for plan in plans:
        charged = sum(1 for w in plan.work if w.prefill is None and w.room)
        charged += sum(w.prefill[1] - w.prefill[0] if w.depths is None
                       else -(-(w.prefill[1] - w.prefill[0]) * (w.depths[1] - w.depths[0]) // R)
                       for w in plan.work if w.prefill)
        assert charged <= 5
    assert all(c >= 1 for c in committed)                    # the stream never stalled
    assert len(whole) == len(sliced) and all(torch.equal(x, y) for x, y in zip(whole, sliced))
    refs = [dasspec.generate(model, p, max_new_tokens=n, eos=False).tokens for p, n in ((short, 60), (prompt, 4))]
    assert outs == outs_whole == refs


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static-shapes"])
def test_rows_left_by_earlier_requests_never_leak(model, static):
    """A pool full of NaN (what a diverged earlier request may leave): requests that get those blocks decode their
    own AR tokens - eager attention reads only rows the request wrote, static shapes zero every block handed out."""
    prompts = _prompts(model.config.vocab_size, 3, seed=8)
    refs = [dasspec.generate(model, p, "ar", max_new_tokens=12, eos=False).tokens for p in prompts]
    runtime = dasspec.Runtime(static_shapes=True) if static else None
    engine = Engine(model, "das-wave", {"gamma": 4, "rounds": 2, "k": 1}, max_batch=3, block_size=8,
                    runtime=runtime)
    for t in engine.pool.tensors():
        t[..., 8:, :] = float("nan")                         # every block but the null block
    ids = [engine.add(p, max_new_tokens=12, eos=False) for p in prompts]
    assert [o.tokens for o in _drain(engine, ids)] == refs


def test_blocks_anywhere_in_the_pool_give_the_same_rows(model):
    """A request whose blocks are scattered (read by a gather) computes bit for bit the rows of one whose blocks
    lie in order (read as a slice)."""
    prompt = _prompts(model.config.vocab_size, 1, seed=9, lo=35, hi=36)[0]

    def rows(scatter: bool):
        engine = Engine(model, "ar", max_batch=1, block_size=8, kv_budget=8 * 16)
        if scatter:                                          # hold every other block while the request runs
            held = engine.pool.allocate(16)
            engine.pool.free(held[::2])
        rid = engine.add(prompt, max_new_tokens=6, eos=False)
        with torch.inference_mode():
            for _ in range(4):
                engine.step()
        cache = engine.executor.requests[rid].cache
        return cache.table.base, cache.save()

    base_a, a = rows(False)
    base_b, b = rows(True)
    assert base_a is not None and base_b is None             # a slice in one, a gather in the other
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_requests_that_grow_side_by_side_keep_their_blocks_in_order(model):
    """A sequence that cannot continue in place starts halfway into the longest free run, so requests decoding side
    by side each grow into free blocks of their own and read their rows as one slice of the pool, not a gather."""
    prompts = _prompts(model.config.vocab_size, 4, seed=13)
    engine = Engine(model, "ar", max_batch=4, block_size=8, kv_budget=8 * 128)
    ids = [engine.add(p, max_new_tokens=60, eos=False) for p in prompts]
    with torch.inference_mode():
        for _ in range(50):
            engine.step()
        tables = [engine.executor.requests[i].cache.table for i in ids]
    assert all(len(t.blocks) >= 5 for t in tables) and all(t.base is not None for t in tables)


def test_a_sequence_that_starts_anew_gets_its_blocks_in_order():
    """Halfway into the longest free run, but never so far that ``n`` blocks taken at once leave the run: a swap-in
    or a multi-block admission stays one slice of the pool."""
    from dasspec.engine.core.blocks import BlockPool

    pool = BlockPool.accounting(40 * 16, 16, 1)
    held = pool.allocate(pool.capacity_blocks)
    pool.free([b for b in held if 20 <= b < 30])            # free run 20..29, block 19 still in use
    assert pool.allocate(10) == list(range(20, 30))
    pool.free([b for b in held if 30 <= b < 40])            # free run 30..39 behind block 29: halfway in
    assert pool.allocate(2) == [35, 36]


def test_prompts_that_cannot_run_this_step_are_not_admitted_to_sit(model):
    """Admission waits while the budget left cannot move a request's prompt: a request under an exit rule (which
    never runs depth slices) waits for a whole block of budget; a short prompt the budget covers runs whole at once."""
    from dasspec.testing import random_model

    ouro = random_model("ouro", seed=2)
    vocab = ouro.config.vocab_size
    long, others = _prompts(vocab, 1, seed=14, lo=60, hi=61)[0], _prompts(vocab, 3, seed=15, lo=5, hi=7)
    engine = Engine(ouro, "ar", max_batch=4, block_size=8, max_step_tokens=12)
    plans = _record_plans(engine)
    ids = [engine.add(long, max_new_tokens=4, eos=False, exit_threshold=0.5)]
    ids += [engine.add(p, max_new_tokens=4, eos=False, exit_threshold=0.5) for p in others[:2]]
    ids.append(engine.add(others[2], max_new_tokens=4, eos=False))
    outs = _drain(engine, ids)
    for plan in plans:
        started = {s.id for s in plan.start}
        assert all(w.prefill is not None for w in plan.work if w.id in started)   # nobody admitted to sit idle
    refs = [dasspec.generate(ouro, p, max_new_tokens=4, eos=False, **kw).tokens
            for p, kw in zip([long] + others, [dict(exit_threshold=0.5)] * 3 + [{}])]
    assert [o.tokens for o in outs] == refs

    # 1 decode row, then a long prompt's block of 8, then 6 rows left: a 5-token prompt runs whole at once
    engine = Engine(model, "ar", max_batch=3, block_size=8, max_step_tokens=15)
    a = engine.add([5, 6, 7], max_new_tokens=30, eos=False)
    engine.step()
    b = engine.add(long, max_new_tokens=4, eos=False)
    engine.step()
    plans = _record_plans(engine)
    c = engine.add(others[0][:5], max_new_tokens=4, eos=False)
    engine.step()
    assert [(w.prefill, w.depths) for w in plans[0].work if w.id == c] == [((0, 5), None)]
    outs = _drain(engine, [a, b, c])
    assert outs[2].tokens == dasspec.generate(model, others[0][:5], max_new_tokens=4, eos=False).tokens


def test_more_requests_run_at_once_than_their_worst_cases_fit(model):
    """Concurrency: chat-like requests with a large allowance (the rest of the context) that stop early hold only
    what they write, so many run at once in a pool that holds two of their worst cases."""
    prompts = _prompts(model.config.vocab_size, 8, seed=10)
    ctx = model.config.block_size
    engine = Engine(model, "ar", max_batch=8, block_size=8, kv_budget=2 * ctx + 64)
    ids = [engine.add(p, max_new_tokens=ctx - len(p), stop=[p[0]], eos=False) for p in prompts]
    most = 0
    while engine.has_work:
        engine.step()
        most = max(most, len(engine.running))
    assert most >= 6
    refs = [dasspec.generate(model, p, "ar", max_new_tokens=ctx - len(p), stop=[p[0]], eos=False).tokens
            for p in prompts]
    assert [engine.result(i).tokens for i in ids] == refs


def test_a_request_that_fills_the_whole_pool_finishes(model):
    """Prompt + max_new_tokens exactly the pool: near the end there is no room for the drafter's scratch, so the
    request takes plain AR steps there - it is never refused for its draft width - and still equals AR."""
    prompt = _prompts(model.config.vocab_size, 1, seed=12, lo=20, hi=21)[0]
    engine = Engine(model, "das-wave", {"gamma": 8, "rounds": 3, "w_init": 8, "k": 1}, max_batch=1, block_size=16,
                    kv_budget=64)
    rid = engine.add(prompt, max_new_tokens=64 - len(prompt), eos=False)
    out = _drain(engine, [rid])[0]
    assert out.tokens == dasspec.generate(model, prompt, "ar", max_new_tokens=64 - len(prompt), eos=False).tokens


@pytest.mark.parametrize("method", ["ar", "das-wave"])
def test_generate_batchs_default_pool_holds_every_running_request_without_preemption(model, method, monkeypatch):
    """``generate_batch``'s default ``kv_budget`` is room for the ``max_batch`` largest requests at once, counted in
    whole blocks (a request holds its rows in blocks), so no request is preempted and each still gets its own AR."""
    import dasspec.engine.api.generate as gen
    engines = []
    monkeypatch.setattr(gen, "Engine", lambda *a, **k: engines.append(Engine(*a, **k)) or engines[-1])
    prompts = _prompts(model.config.vocab_size, 6, seed=11, lo=17, hi=47)     # lengths that are not whole blocks
    alone = [dasspec.generate(model, p, "ar", max_new_tokens=21, eos=False).tokens for p in prompts]
    got = dasspec.generate_batch(model, prompts, method, max_new_tokens=21, eos=False, max_batch=6)
    assert [r.tokens for r in got] == alone
    assert engines[-1].cache_usage()["preemptions"] == 0
