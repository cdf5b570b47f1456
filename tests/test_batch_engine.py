"""The batched engine: many requests decoded at once, every answer exactly its own batch-1 full-depth AR decode
(float32) - whatever else shares the batch, whenever it joined or left, whether others were cancelled; the paged
pool (a request that can never fit alone is refused, others take blocks as they write); events; generate_batch's
contract."""

from __future__ import annotations

import pytest
import torch

import dasspec
from dasspec.engine.api.engine import Engine
from dasspec.engine.core.policy import SpeculationPolicy
from dasspec.model.cache import CacheCapacityError
from dasspec.testing import random_model

# Every method, with knobs small enough for R = 4 random checkpoints (DAS-Wave with every extension on).
METHODS = [("ar", {}), ("self-spec", {"draft_depth": 2, "block": 4}),
           ("mature-spec", {"draft_depth": 2, "block": 3, "policy": "deep-v"}),
           ("das-wave", {"gamma": 6, "rounds": 4, "w_init": 2, "k": 1}),
           ("das-wave", {"gamma": 6, "rounds": 4, "w_init": 6, "k": 1, "guesses": "copy", "trim": True,
                         "seed_branch": 6, "copy_run": True, "early_stop": True}),
           ("pld", {}), ("lookahead", {"window": 3, "ngram": 3, "guess_set": 3}), ("token-recycling", {}),
           ("sam", {})]


def _prompts(vocab: int, count: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        L = int(torch.randint(2, 40, (1,), generator=g))
        base = torch.randint(2, vocab, (max(2, L // 4),), generator=g)
        out.append(base.repeat(5)[:L].tolist() if i % 2 else torch.randint(2, vocab, (L,), generator=g).tolist())
    return out


def _run(engine: Engine, schedule: dict[int, list], cancel_at: dict[int, list[int]] | None = None):
    """Step ``engine``, adding ``schedule[step]`` requests (kwargs dicts) before that step and cancelling the
    requests numbered ``cancel_at[step]``; returns {request number: (result, tokens seen in events)}."""
    ids, seen, finished, step = {}, {}, {}, 0
    while engine.has_work or any(s >= step for s in schedule):
        for i, kw in enumerate(schedule.get(step, [])):
            num = len(ids)
            ids[num] = engine.add(**kw)
        for num in (cancel_at or {}).get(step, []):
            engine.cancel(ids[num])
        for ev in engine.step():
            seen.setdefault(ev.id, []).extend(ev.tokens)
            if ev.finished:
                finished[ev.id] = ev.reason
        step += 1
        assert step < 2000
    out = {}
    for num, rid in ids.items():
        res = engine.result(rid)
        assert finished[rid] == res.stop_reason
        out[num] = (res, seen.get(rid, []))
    return out


@pytest.mark.parametrize("family", ["huginn", "raven-llama", "raven-olmo"])
def test_mixed_arrivals_caps_and_cancellations_equal_each_requests_own_ar(family):
    """Requests of every method join at different steps with different prompt lengths and caps, some are
    cancelled, long prompts are prefilled in chunks beside running decodes; every finished request's tokens are
    its own batch-1 AR decode, a cancelled one's a prefix of it; the events carry exactly the committed tokens."""
    model = random_model(family, seed=4, mean_recurrence=4, n_prelude=1, n_core=1, n_coda=1)
    prompts = _prompts(model.config.vocab_size, 12, seed=9)
    reqs = [dict(prompt=p, max_new_tokens=4 + (i * 5) % 13, seed=i, init_scale=float(i % 2), eos=False)
            for i, p in enumerate(prompts)]
    refs = [dasspec.generate(model, r["prompt"], "ar", **{k: v for k, v in r.items() if k != "prompt"}).tokens
            for r in reqs]
    accepted = 0
    for mi, (method, knobs) in enumerate(METHODS):
        engine = Engine(model, method, knobs, max_batch=4, block_size=8, max_step_tokens=24, kv_budget=4 * 96)
        sched = {0: reqs[:5], 2: reqs[5:8], 5: reqs[8:10], 9: reqs[10:]}
        cancelled = {1: [1 + mi % 3], 6: [8]}
        out = _run(engine, sched, cancelled)
        for num, (res, seen) in out.items():
            assert seen == res.tokens, (method, num)
            if res.stop_reason == "cancelled":
                assert res.tokens == refs[num][: len(res.tokens)], (family, method, num)
            else:
                assert res.tokens == refs[num], (family, method, knobs, num)
            accepted += sum(res.stats.accepted)
        assert {r.stop_reason for r, _ in out.values()} >= {"cancelled", "max_new_tokens"}
        assert engine.pool.available == engine.pool.capacity_blocks        # every block came back
    assert accepted > 0


def test_sampled_batch_equals_each_requests_own_sampled_ar():
    """Sampling with per-request seeds and settings: each request samples what it samples alone."""
    model = random_model("huginn", seed=6, mean_recurrence=4, n_prelude=1, n_core=1, n_coda=1)
    prompts = _prompts(model.config.vocab_size, 6, seed=3)
    settings = [dict(temperature=0.7), dict(temperature=1.0, top_k=5), dict(temperature=1.3, top_p=0.9),
                dict(temperature=1.0, min_p=0.05), dict(temperature=0.5), dict(temperature=1.0)]
    for method, knobs in METHODS[:5] + [("pld", {}), ("sam", {})]:
        engine = Engine(model, method, knobs, max_batch=6)
        reqs = [dict(prompt=p, max_new_tokens=10, seed=20 + i, do_sample=True, eos=False, **s)
                for i, (p, s) in enumerate(zip(prompts, settings))]
        reqs[-1] = dict(prompt=prompts[-1], max_new_tokens=10, eos=False)          # greedy beside sampled ones
        out = _run(engine, {0: reqs})
        for num, (res, _) in out.items():
            kw = {k: v for k, v in reqs[num].items() if k != "prompt"}
            assert res.tokens == dasspec.generate(model, reqs[num]["prompt"], "ar", **kw).tokens, (method, num)


def test_bundled_model_batch_with_stop_strings_equals_generate():
    """The bundled model (real tokenizer): stop strings and EOS inside verified chunks, text cut as generate
    cuts it, for the engine's default method and AR."""
    model = dasspec.load_model()
    tok = model.tokenizer
    texts = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):",
             "Question: Tom has 3 apples and buys 5 more. How many apples?\nAnswer:", "for i in range(10):"]
    stops = [["\n\n"], None, ["return"], ["\n"], [":"]]
    for method in ("ar", "das-wave"):
        outs = dasspec.generate_batch(model, texts, method, max_new_tokens=[24, 30, 16, 20, 28], stop=stops,
                                      num_steps=8, max_batch=3)
        for text, s, cap, out in zip(texts, stops, [24, 30, 16, 20, 28], outs):
            ref = dasspec.generate(model, text, "ar", max_new_tokens=cap, stop=s, num_steps=8)
            assert (out.tokens, out.text, out.stop_reason) == (ref.tokens, ref.text, ref.stop_reason), (method, text)


def test_generate_batch_options_per_prompt_and_order():
    model = random_model("raven-llama", seed=1, mean_recurrence=3, n_prelude=1, n_core=1, n_coda=1)
    prompts = _prompts(model.config.vocab_size, 5, seed=1)
    outs = dasspec.generate_batch(model, prompts, "pld", max_new_tokens=[3, 9, 5, 1, 7], seed=[5, 4, 3, 2, 1],
                                  eos=False, max_batch=2)
    for p, cap, seed, out in zip(prompts, [3, 9, 5, 1, 7], [5, 4, 3, 2, 1], outs):
        assert out.tokens == dasspec.generate(model, p, "ar", max_new_tokens=cap, seed=seed, eos=False).tokens
    assert [len(o.tokens) for o in outs] == [3, 9, 5, 1, 7]
    same = torch.tensor([[5, 6, 7], [9, 3, 4]])                   # a [B, T] tensor of prompts
    assert [o.tokens for o in dasspec.generate_batch(model, same, max_new_tokens=4, eos=False)] == \
        [dasspec.generate(model, row, max_new_tokens=4, eos=False).tokens for row in same.tolist()]
    padded = {"input_ids": [[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]], "attention_mask": [[0, 0, 1, 1, 1], [1] * 5]}
    assert dasspec.generate_batch(model, padded, max_new_tokens=3, eos=False)[0].tokens == \
        dasspec.generate(model, [5, 6, 7], max_new_tokens=3, eos=False).tokens
    with pytest.raises(ValueError, match="max_new_tokens: 2 values for 5 prompts"):
        dasspec.generate_batch(model, prompts, max_new_tokens=[3, 4])
    with pytest.raises(ValueError, match="max_new_tokens must be a whole number"):
        dasspec.generate_batch(model, prompts, max_new_tokens=[3, 4, 2.5, 1, 1])
    with pytest.raises(ValueError, match="list of prompts"):
        dasspec.generate_batch(model, "one prompt")
    with pytest.raises(ValueError, match="one prompt's token ids: wrap it"):
        dasspec.generate_batch(model, [5, 6, 7])
    assert dasspec.generate_batch(model, []) == []


def test_a_closed_batch_prefills_in_fewer_steps_than_a_server(monkeypatch):
    """generate_batch's step budget is a closed batch's (nobody waits on a first token): 8 prompts of 100 tokens,
    800 rows past a server's 512-row default, prefill in one step; the same tokens at any budget, and a bad one
    refused."""
    from dasspec.engine.api import engine as engine_module, generate as generate_module
    model = random_model("raven-llama", seed=2, mean_recurrence=3, n_prelude=1, n_core=1, n_coda=1)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, model.config.vocab_size, (100,), generator=g).tolist() for _ in range(8)]
    steps = []

    class Counted(Engine):
        def step(self):
            steps.append(self)
            return super().step()

    monkeypatch.setattr(generate_module, "Engine", Counted)
    runs = {}
    for budget in (None, engine_module.MAX_STEP_TOKENS, 7):
        steps.clear()
        opts = {} if budget is None else {"max_step_tokens": budget}
        runs[budget] = ([o.tokens for o in dasspec.generate_batch(model, prompts, max_new_tokens=2, eos=False,
                                                                  **opts)], len(steps))
    assert runs[None][0] == runs[engine_module.MAX_STEP_TOKENS][0] == runs[7][0]
    assert runs[None][1] == 2 < runs[engine_module.MAX_STEP_TOKENS][1] < runs[7][1]   # the prefill, one more token
    with pytest.raises(ValueError, match="max_step_tokens must be a whole number"):
        dasspec.generate_batch(model, prompts, max_step_tokens=0)


def test_pool_refuses_only_what_never_fits_alone_and_runs_the_rest_together():
    """A request larger than the whole pool is refused by add; the others hold only what they write, so several
    run at once in a pool that could not hold two of their worst cases."""
    model = random_model("huginn", seed=2, mean_recurrence=3, n_prelude=1, n_core=1, n_coda=1)
    prompts = _prompts(model.config.vocab_size, 4, seed=2)
    engine = Engine(model, "pld", max_batch=4, kv_budget=64)
    with pytest.raises(CacheCapacityError, match=r"needs up to 70 cache positions .* pool holds 4 blocks of 16 "
                                                 r"positions \(64 positions"):
        engine.add(list(range(2, 52)), max_new_tokens=20)
    ids = [engine.add(p[:20], max_new_tokens=30, eos=False) for p in prompts]   # worst case 62 rows each
    most = 0
    while engine.has_work:
        engine.step()
        most = max(most, len(engine.running))
    assert most >= 2
    for rid, p in zip(ids, prompts):
        assert engine.result(rid).tokens == dasspec.generate(model, p[:20], max_new_tokens=30, eos=False).tokens


def test_block_pool_references_lru_and_eviction():
    """Blocks are referenced, freed, kept keyed while unreferenced (least recently freed evicted first), found by
    key only along an unbroken run, never freed twice; consecutive blocks are handed out in order."""
    from dasspec.engine.core.blocks import BlockPool, block_keys

    model = random_model("huginn", mean_recurrence=2)
    pool = BlockPool(model, 2, 64, block_size=16)               # 4 blocks (+ the null block)
    a = pool.allocate(2)
    assert a == [1, 2] and pool.allocate(1, after=a[-1]) == [3] and pool.available == 1
    keys = block_keys(list(range(40)), 16, b"salt", 2)
    assert keys != block_keys(list(range(40)), 16, b"other", 2)          # the salt is part of every key
    assert block_keys(list(range(16)) + [99] * 16, 16, b"salt", 2)[0] == keys[0]
    pool.register(1, keys[0]), pool.register(2, keys[1])
    pool.free([1, 2, 3])
    assert pool.available == 4 and pool.cached == 2
    assert pool.lookup([b"?" * 32, keys[1]]) == [] and pool.lookup(keys) == [1, 2]   # a run from the first key
    pool.free([1, 2])
    assert pool.allocate(2) == [3, 4]                                    # free blocks before cached ones
    assert pool.allocate(1) == [1] and pool.evictions == 1               # then the least recently freed
    assert pool.lookup(keys) == []                                       # its key is gone, so is the run
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([3]), pool.free([3])


def test_cancel_and_timeout_stop_at_the_next_step():
    model = random_model("huginn", seed=3, mean_recurrence=3)
    engine = Engine(model, "das-wave", {"gamma": 4, "rounds": 3}, max_batch=2)
    a = engine.add([5, 6, 7], max_new_tokens=40, eos=False)
    b = engine.add([8, 9], max_new_tokens=40, eos=False, timeout=1e-9)         # out of time at once
    c = engine.add([3, 4], max_new_tokens=40, eos=False)                       # waits: max_batch 2
    engine.cancel(c)                                                           # never starts
    events = engine.step()
    assert {(e.id, e.reason) for e in events if e.finished} == {(b, "timeout"), (c, "cancelled")}
    engine.step()
    engine.cancel(a)
    assert [(e.id, e.reason) for e in engine.step()] == [(a, "cancelled")]
    assert not engine.has_work
    res = engine.result(a)
    assert 0 < len(res.tokens) < 40
    assert res.tokens == dasspec.generate(model, [5, 6, 7], max_new_tokens=40, eos=False).tokens[: len(res.tokens)]
    assert engine.result(c).tokens == [] and engine.result(b).stop_reason == "timeout"
    with pytest.raises(KeyError):
        engine.result(a)


def test_speculation_policy_changes_speed_never_tokens():
    """The engine may stop speculating as the batch grows (off_above) or narrow drafts (max_tokens): the same
    tokens, fewer (or no) proposals."""
    model = random_model("raven-olmo", seed=5, mean_recurrence=4, n_prelude=1, n_core=1, n_coda=1)
    prompts = _prompts(model.config.vocab_size, 6, seed=4)
    ref = [dasspec.generate(model, p, "ar", max_new_tokens=12, eos=False).tokens for p in prompts]
    proposed = {}
    for name, policy in (("always", None), ("off", SpeculationPolicy(off_above=2)),
                         ("narrow", SpeculationPolicy(max_tokens=6))):
        outs = dasspec.generate_batch(model, prompts, "pld", max_new_tokens=12, eos=False, max_batch=6, policy=policy,
                                      num_pred=8)
        assert [o.tokens for o in outs] == ref, name
        proposed[name] = sum(sum(o.stats.proposed) for o in outs)
    assert proposed["always"] > proposed["narrow"] > 0 and proposed["off"] < proposed["narrow"]


def test_a_read_policy_given_to_generate_batch_is_the_drafters_as_in_generate():
    """``policy`` is generate's prefix-read knob and generate_batch's speculation policy: a read policy given to
    generate_batch reaches the drafter (each answer equals generate's with it, and the drafts differ from the
    default's), and the engine refuses anything but a SpeculationPolicy by name (it raised an AttributeError from
    inside a step)."""
    model = random_model("huginn", seed=5, mean_recurrence=4, n_prelude=1, n_core=1, n_coda=1)
    prompts = _prompts(model.config.vocab_size, 3, seed=4)
    own = [dasspec.generate(model, p, "self-spec", max_new_tokens=10, eos=False, policy="deep-v") for p in prompts]
    outs = dasspec.generate_batch(model, prompts, "self-spec", max_new_tokens=10, eos=False, policy="deep-v")
    plain = dasspec.generate_batch(model, prompts, "self-spec", max_new_tokens=10, eos=False)
    assert [o.tokens for o in outs] == [o.tokens for o in own] == [o.tokens for o in plain]
    assert [o.stats.accepted for o in outs] == [o.stats.accepted for o in own]
    assert [o.stats.accepted for o in outs] != [o.stats.accepted for o in plain]
    with pytest.raises(TypeError, match="SpeculationPolicy"):
        Engine(model, policy="deep-v")


def test_cancellation_is_effective_inside_a_drafting_step(monkeypatch):
    """A request cancelled (or out of time) while DAS-Wave refines its window stops at the next round - the
    other requests' rounds go on - and it is not verified: the budget bounds a step, not only the steps.  The
    executor asks its own request state (``Request.stopping``: the cancel that reached it, the deadline the plan
    carried) before every round."""
    from dasspec.engine.base.request import Request

    model = random_model("huginn", seed=3, mean_recurrence=3, n_prelude=1, n_core=1, n_coda=1)
    engine = Engine(model, "das-wave", {"gamma": 8, "rounds": 10, "w_init": 8, "k": 1}, max_batch=2)
    a = engine.add([5, 6, 7], max_new_tokens=30, eos=False)
    b = engine.add([8, 9, 4], max_new_tokens=30, eos=False)
    engine.step()                                        # both prefilled
    asked = {}
    real = Request.stopping

    def stopping(req):
        asked[req.rid] = asked.get(req.rid, 0) + 1
        if req.rid == a and asked[a] == 5:               # asked before every round: a's client hangs up in round 5
            engine.cancel(a)                             # (the server's worker would, from its thread)
        return real(req)

    monkeypatch.setattr(Request, "stopping", stopping)
    events = engine.step()
    monkeypatch.setattr(Request, "stopping", real)
    assert [(e.id, e.reason) for e in events if e.finished] == [(a, "cancelled")]
    res_a = engine.result(a)
    assert res_a.stats.draft_passes == 4 and res_a.stats.verify_events == 0       # 4 rounds, never verified
    while engine.has_work:
        engine.step()
    res_b = engine.result(b)
    assert res_b.tokens == dasspec.generate(model, [8, 9, 4], max_new_tokens=30, eos=False).tokens
    assert res_b.stats.draft_passes >= 10                                         # its rounds ran on


def test_a_failing_request_fails_alone_and_a_failing_step_keeps_what_it_had_done(monkeypatch):
    """A request whose streamer raises fails alone (reason error, the error kept); the others decode on.  A step
    that raises keeps the events it had made (a cancelled request's), the running requests are aborted (and their
    results can be discarded unread), and every block comes back to the pool."""
    import dasspec.engine.core.executor as executor_mod

    model = random_model("huginn", seed=4, mean_recurrence=3, n_prelude=1, n_core=1, n_coda=1)
    engine = Engine(model, "pld", max_batch=3)
    a = engine.add([5, 6, 7, 8], max_new_tokens=20, eos=False)
    b = engine.add([9, 10, 11], max_new_tokens=20, eos=False)
    engine.step()
    engine.step()

    class Broken:
        def put(self, value):
            raise RuntimeError("streamer broke")

        def end(self):
            pass

    c = engine.add([3, 4], max_new_tokens=5, eos=False, streamer=Broken())
    events = {ev.id: ev for ev in engine.step()}
    assert events[c].finished and events[c].reason == "error"
    assert "streamer broke" in str(engine.result(c).error)
    assert not any(ev.finished for rid, ev in events.items() if rid != c)        # a and b go on
    engine.cancel(a)
    monkeypatch.setattr(executor_mod, "loop_step", lambda *args: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        engine.step()
    assert engine.abort_running() == [b]
    events = {ev.id: ev for ev in engine.take_events()}
    assert events[a].finished and events[a].reason == "cancelled"
    assert events[b].finished and events[b].reason == "error"
    assert engine.result(a).stats.stop_reason == "cancelled"
    engine.discard(b)
    assert not engine.has_work and engine.take_events() == [] and not engine._table and not engine._results
    assert engine.pool.available == engine.pool.capacity_blocks        # every block back


def test_static_shapes_and_a_prefix_cache_in_a_batch():
    """A batched engine with fixed-shape calls (attention over every row a request may use, through its block
    table, under a mask) and requests sharing a prefix cache: the same tokens as each request alone."""
    model = random_model("huginn", seed=9, mean_recurrence=3, n_prelude=1, n_core=1, n_coda=1)
    shared = list(range(10, 40))
    prompts = [shared + p for p in _prompts(model.config.vocab_size, 4, seed=12)]
    refs = [dasspec.generate(model, p, "ar", max_new_tokens=8, eos=False).tokens for p in prompts]
    for runtime in (dasspec.Runtime(static_shapes=True), None):
        pc = dasspec.PrefixCache(model, shared, runtime=runtime)      # a cache's rows are computed as its requests'
        outs = dasspec.generate_batch(model, prompts, "das-wave", max_new_tokens=8, eos=False, prefix_cache=pc,
                                      runtime=runtime, max_batch=4, gamma=4, rounds=3)
        assert [o.tokens for o in outs] == refs, runtime
        assert all(o.stats.cached_tokens == 16 for o in outs)         # the prefix's one full block
