"""Overlap scheduling (``Engine(overlap=True)``, issue 52): the scheduler plans step n + 1 while step n executes
(on the executor's thread, or in its process) and step n's outputs are processed while step n + 1 runs.  The plan
counts on what step n surely does (its prompt rows, at least one token per decoding request) and backs the most it
may commit; a request that step n ends runs one wasted step whose tokens are dropped.  Whatever the pool, the token
budget or the executor, every request's tokens, stop reason and streamed events equal the engine's without overlap
- for every method, greedy and sampled, with stop rules, prefix sharing, depth-sliced prefills and preemption."""

from __future__ import annotations

import pytest

from dasspec.engine.api.engine import Engine
from dasspec.testing import random_model

METHODS = [("ar", {}), ("self-spec", {"draft_depth": 2, "block": 3}), ("mature-spec", {"draft_depth": 2, "block": 3}),
           ("das-wave", {"gamma": 4, "rounds": 3, "w_init": 2, "k": 1}), ("pld", {}),
           ("lookahead", {"window": 3, "ngram": 3, "guess_set": 3}), ("token-recycling", {}), ("sam", {}),
           ("auto", {"calibrate": False})]


@pytest.fixture(scope="module")
def model():
    return random_model("huginn", seed=7, mean_recurrence=4, n_prelude=1, n_core=1, n_coda=1, vocab_size=256)


SHARED = [3, 4, 5, 6, 7, 8, 9, 10] * 3                 # three full blocks of 8 two requests share


def _prompts() -> list[list[int]]:
    return [SHARED + [11, 12], [5, 6, 7, 5, 6, 7, 5, 6, 7] * 2, [8, 9, 4], SHARED + [13], [2, 3] * 10,
            [9, 1, 9, 1] * 4, list(range(20, 61)), [7, 7, 8] * 5, [30, 31, 32, 30, 31, 32, 30]]


def _run(model, overlap: bool, executor: str = "local", cancel: tuple[int, int] | None = None,
         stops: dict | None = None, **engine_kw):
    """Every method's request, mixed in one engine (greedy and sampled alternating, budgets of 10-26 tokens):
    per request its tokens, stop reason and the tokens its events streamed; the engine's preemptions.  ``cancel``:
    (request, step) cancelled after that step; ``stops``: request -> its stop token ids."""
    prompts = _prompts()
    with Engine(model, "ar", max_batch=4, block_size=8, overlap=overlap, executor=executor, **engine_kw) as engine:
        ids = []
        for j, (m, k) in enumerate(METHODS):
            sampled = dict(do_sample=True, temperature=0.9, seed=j) if j % 2 else {}
            stop = (stops or {}).get(j)
            ids.append(engine.add(prompts[j % len(prompts)], method=m, knobs=k, max_new_tokens=10 + 2 * j,
                                  eos=False, stop=stop, **sampled))
        streamed = {i: [] for i in ids}
        steps = 0
        while engine.has_work:
            for e in engine.step():
                streamed[e.id] += list(e.tokens)
            steps += 1
            if cancel is not None and steps == cancel[1]:
                engine.cancel(ids[cancel[0]])
        res = [engine.result(i) for i in ids]
        return [(r.tokens, r.stats.stop_reason, streamed[i]) for i, r in zip(ids, res)], \
            engine.scheduler.preemptions


@pytest.mark.parametrize("pool", [dict(), dict(kv_budget=168), dict(max_step_tokens=6)],
                         ids=["roomy", "tight-pool", "sliced-prefill"])
def test_overlap_gives_every_request_the_same_tokens_and_events(model, pool):
    first, _ = _run(model, False, **pool)
    stops = {j: [first[j][0][4]] for j in (0, 3, 5, 7)}      # a token each decodes midway: its stop rule ends it
    plain, _ = _run(model, False, stops=stops, **pool)
    got, preempted = _run(model, True, stops=stops, **pool)
    assert got == plain
    assert all(toks for toks, _, _ in got) and {r for _, r, _ in got} == {"max_new_tokens", "eos"}
    if "kv_budget" in pool:
        assert preempted > 0                                 # the tight pool preempts (planned ahead, more often)


def test_a_cancel_with_a_step_in_flight_keeps_a_prefix_and_spares_the_others(model):
    plain, _ = _run(model, False)
    got, _ = _run(model, True, cancel=(3, 2))
    toks, reason, streamed = got[3]
    assert reason == "cancelled" and toks == plain[3][0][:len(toks)] and streamed == toks
    assert got[:3] + got[4:] == plain[:3] + plain[4:]


@pytest.mark.parametrize("executor", ["local", "process"])
def test_a_cancel_of_the_only_request_with_a_step_in_flight(model, executor):
    """The step planned beside the cancel holds only the cancelled request, which drafting leaves out: nothing is
    left to verify, and the step runs nothing (found by review: ``IndexError`` in ``Batch`` from an empty pass)."""
    with Engine(model, "ar", max_batch=1, block_size=8, overlap=True, executor=executor) as engine:
        a = engine.add(_prompts()[0], max_new_tokens=12, eos=False)
        b = engine.add(_prompts()[2], max_new_tokens=12, eos=False)
        engine.step()
        engine.step()
        engine.cancel(a)
        while engine.has_work:
            engine.step()
        assert engine.result(a).stats.stop_reason == "cancelled"
        assert len(engine.result(b).tokens) == 12


def test_overlap_with_the_executor_in_its_own_process(model):
    plain, _ = _run(model, False, kv_budget=168)
    got, _ = _run(model, True, executor="process", kv_budget=168)
    assert got == plain


def test_a_request_whose_setup_fails_fails_alone_with_a_step_in_flight(model, monkeypatch):
    """The plan made beside the step in which a request's setup fails still holds its next prompt block; the
    executor skips what it does not hold and the request fails alone (fails when the executor looks it up)."""
    import dasspec.engine.core.executor as executor_mod

    real = executor_mod.Request

    def setup(model_, tokens, *a, **k):
        if len(tokens) == 41:                         # the long prompt: three blocks and more to prefill
            raise RuntimeError("no room for it")
        return real(model_, tokens, *a, **k)
    plain, _ = _run(model, False)
    monkeypatch.setattr(executor_mod, "Request", setup)
    got, _ = _run(model, True)
    failed = [i for i, p in enumerate(_prompts()) for j in range(len(METHODS)) if j % len(_prompts()) == i
              and len(p) == 41]
    assert failed and all(got[j][1] == "error" and not got[j][0] for j in failed)
    assert [g for j, g in enumerate(got) if j not in failed] == [p for j, p in enumerate(plain) if j not in failed]


def test_a_failing_step_with_a_step_planned_ahead_aborts_cleanly(model, monkeypatch):
    """A step that raises with the next one planned beside it: ``abort_running`` ends every request, the pool gets
    every block back and the engine is idle (nothing replays the dropped plan)."""
    import dasspec.engine.core.executor as executor_mod

    engine = Engine(model, "das-wave", {"gamma": 4, "rounds": 3, "w_init": 2, "k": 1}, max_batch=3, block_size=8,
                    overlap=True)
    ids = [engine.add(p, max_new_tokens=20, eos=False) for p in _prompts()[:5]]
    for _ in range(3):
        engine.step()
    monkeypatch.setattr(executor_mod, "loop_step", lambda *args: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        engine.step()
    aborted = engine.abort_running()
    assert aborted
    monkeypatch.undo()
    while engine.has_work:                            # the requests that never started run now
        engine.step()
    for i in ids:
        r = engine.result(i)
        assert (r.stats.stop_reason == "error") == (i in aborted)
    assert engine.pool.available == engine.pool.capacity_blocks
    engine.close()


def _all(model, method, knobs, overlap, prompts, new, **kw):
    with Engine(model, method, knobs, max_batch=4, block_size=8, overlap=overlap, **kw) as engine:
        ids = [engine.add(p, max_new_tokens=new, eos=False) for p in prompts]
        while engine.has_work:
            engine.step()
        null = max(float(t[..., :engine.pool.B, :].abs().max()) for t in engine.pool.tensors())
        return [engine.result(i).tokens for i in ids], engine.scheduler.preemptions, null


@pytest.mark.parametrize("method,knobs,kv_budget", [
    ("self-spec", {"draft_depth": 3, "block": 8}, 88), ("pld", {}, 128),
    ("das-wave", {"gamma": 4, "rounds": 3, "w_init": 2, "k": 1, "copy_run": True, "guesses": "copy"}, 120)],
    ids=["swapped-beside-its-step", "swapped-back-at-once", "copy-runs"])
def test_a_plan_made_ahead_backs_what_the_step_in_flight_may_leave(model, method, knobs, kv_budget):
    """Pools tight enough that the plan made beside a step preempts a request whose step is in flight (and would
    swap it straight back in, sized from rows not yet applied), and DAS-Wave copy runs committing past the drafter's
    width: the same tokens as without overlap, nothing written to the null block (fails when a request swapped out
    beside its step is swapped back in by the same plan, or when a step's most is counted from its most rows)."""
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10] * 3 + [11, 12], [5, 6, 7] * 6, [8, 9, 4], [2, 3] * 10, [9, 1, 9, 1] * 4,
               list(range(20, 61)), [7, 7, 8] * 5]
    plain, _, _ = _all(model, method, knobs, False, prompts, 40, kv_budget=kv_budget)
    got, preempted, null = _all(model, method, knobs, True, prompts, 40, kv_budget=kv_budget)
    assert got == plain and null == 0.0
    assert preempted > 0


def test_a_prefix_cache_outlives_the_plan_that_names_it(model, monkeypatch):
    """A request copying from a prefix cache starts in the plan in flight and is cancelled meanwhile: the host thread
    ends it (the cache's last user) while the executor sets it up - the cache stays until the executor is done with
    that plan (fails when it is dropped at once: the step raises KeyError)."""
    import time

    import dasspec.engine.core.executor as executor_mod
    from dasspec.engine.api.prefix_cache import PrefixCache

    prefix = list(range(30, 54))
    pc = PrefixCache(model, prefix, block_size=8)
    with Engine(model, "ar", max_batch=4, block_size=8, overlap=True) as engine:
        a = engine.add(list(range(1, 10)), max_new_tokens=30, eos=False)
        engine.step()
        engine.step()
        s = engine.add(prefix + [7, 8, 9], max_new_tokens=5, eos=False, prefix_cache=pc)
        engine.step()                                 # the plan made beside this step starts s: in flight now
        assert [x.id for x in engine._inflight.start] == [s]
        engine.cancel(s)
        real = executor_mod.Executor._execute

        def late(self, plan, out):
            time.sleep(0.3)                           # the host thread ends s first
            return real(self, plan, out)
        monkeypatch.setattr(executor_mod.Executor, "_execute", late)
        engine.step()
        monkeypatch.undo()
        while engine.has_work:
            engine.step()
        assert engine.result(s).stats.stop_reason == "cancelled"
        assert engine.result(a).stats.stop_reason == "max_new_tokens" and not engine._prefix_caches


def test_a_streamer_that_fails_at_its_end_fails_nothing_else(model):
    """A streamer whose ``end`` raises (on the engine's host thread under overlap): its error is kept in its
    result, no step is replayed, the other request decodes to its end (fails when the host thread's error drops the
    step's output and leaves its plan in flight)."""
    class Bad:
        def put(self, t):
            pass

        def end(self):
            raise ValueError("streamer end failed")

    for overlap in (False, True):
        with Engine(model, "ar", max_batch=4, block_size=8, overlap=overlap) as engine:
            a = engine.add([1, 2, 3], max_new_tokens=2, eos=False, streamer=Bad())
            b = engine.add(list(range(20, 45)), max_new_tokens=12, eos=False)
            while engine.has_work:
                engine.step()
            ra, rb = engine.result(a), engine.result(b)
            assert "streamer end failed" in str(ra.error) and len(ra.tokens) == 2, overlap
            assert rb.error is None and len(rb.tokens) == 12, overlap


def test_no_step_commits_more_than_the_plan_made_beside_it_backed(model, monkeypatch):
    """The invariant the plans made ahead rest on: what a step commits for a request is at most the most its flight
    recorded (DAS-Wave's copy runs commit past its width; fails when that most is counted from the most rows the
    steps before may leave instead of the fewest)."""
    from dasspec.engine.core import scheduler as scheduler_mod

    over, seen = [], []
    real = scheduler_mod.Scheduler.update

    def update(self, plan, out):
        table = {x.id: x for x in list(self.running) + list(self.waiting)}
        for w in plan.work:
            e, o = table.get(w.id), out.requests.get(w.id)
            if e is not None and o is not None and plan.step in e.flight and w.prefill is None:
                seen.append(len(o.tokens))
                if len(o.tokens) > e.flight[plan.step][2]:
                    over.append((plan.step, w.id, len(o.tokens), e.flight[plan.step][2]))
        return real(self, plan, out)
    monkeypatch.setattr(scheduler_mod.Scheduler, "update", update)
    prompts = [[5, 6, 7] * 6, [2, 3] * 10, [9, 1, 9, 1] * 4, [7, 7, 8] * 5, [4] * 6, [1, 2, 3, 4] * 5]
    knobs = {"gamma": 4, "rounds": 3, "w_init": 2, "k": 1, "copy_run": True, "guesses": "copy"}
    for kv_budget in (120, 160):
        _all(model, "das-wave", knobs, True, prompts, 60, kv_budget=kv_budget)
    assert not over and max(seen) > 5                 # (copy runs did commit past the width of 5)
