"""Prefix sharing: prompt blocks computed by one request and reused by another hold bit for bit the rows the second
would have computed alone (every block is its own attention segment, its key the tokens up to its end and the
request's salt); only whole blocks are shared, only along an unbroken run from the first; requests whose rows
would differ (another init_scale, state seed, depth) share nothing; a ``PrefixCache`` carries blocks across
engines; every method stays equal to AR with shared blocks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import dasspec
from dasspec.engine.api.engine import Engine
from dasspec.engine.api.prefix_cache import common_prefix
from dasspec.eval.bench.runner import dev_prompts
from dasspec.model.checkpoint import BUNDLED_DIR
from dasspec.testing import random_model

# Small knobs so that every method drafts within a 12-token budget on an R = 6 model.
CASES = [
    ("self-spec", {"draft_depth": 2, "block": 4}),
    ("mature-spec", {"draft_depth": 2, "block": 4}),
    ("das-wave", {"gamma": 8, "rounds": 3, "w_init": 4, "k": 1}),
    ("das-wave", {"gamma": 8, "rounds": 3, "w_init": 8, "k": 1, "guesses": "copy", "trim": True,
                  "seed_branch": 4, "copy_run": True}),
    ("pld", {}), ("lookahead", {}), ("token-recycling", {}), ("sam", {}),
]
B = 8                      # block size of these tests' engines


def _drain_engine(engine: Engine) -> None:
    with torch.inference_mode():
        while engine.has_work:
            engine.step()


@pytest.fixture(scope="module")
def model():
    return random_model("raven-llama", seed=7, mean_recurrence=6, n_prelude=1, n_core=2, n_coda=1)


def _prompts(vocab: int, prefix_len: int, count: int) -> tuple[list[int], list[list[int]]]:
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(2, vocab, (prefix_len // 3,), generator=g).repeat(4)[:prefix_len].tolist()
    tails = [torch.randint(2, vocab, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
             for _ in range(count)]
    return prefix, [prefix + t for t in tails]


def _alone_rows(model, prompt, **kw) -> list[torch.Tensor]:
    eng = Engine(model, "ar", max_batch=1, block_size=B, kv_budget=len(prompt) + 4 * B)
    rid = eng.add(prompt, max_new_tokens=4, eos=False, **kw)
    with torch.inference_mode():
        for _ in range(200):
            if eng._table[rid].generated:
                break
            eng.step()
    assert eng._table[rid].generated, "never prefilled"
    return eng.executor.requests[rid].cache.save()


def _shared_run(model, first, later, **kw_later):
    """``first`` decodes in an engine, then ``later`` joins it; ``later``'s rows (once prefilled), its stats entry
    and the engine."""
    eng = Engine(model, "ar", max_batch=2, block_size=B, kv_budget=8 * B * 4)
    a = eng.add(first, max_new_tokens=6, eos=False)
    with torch.inference_mode():
        eng.step()                                  # a is prefilled: its full prompt blocks are keyed
        b = eng.add(later, max_new_tokens=6, eos=False, **kw_later)
        for _ in range(200):
            if eng._table[b].generated:
                break
            eng.step()
    assert eng._table[b].generated, "never prefilled"
    return eng.executor.requests[b].cache.save(), eng._table[b], eng


def test_shared_blocks_hold_the_rows_a_request_computes_alone(model):
    prefix, (p1, p2, *_) = _prompts(model.config.vocab_size, 20, 3)
    rows, entry, eng = _shared_run(model, p1, p2)
    assert entry.cached == 16 and eng.scheduler.shared_rows == 16   # 2 full blocks of the 20
    alone = _alone_rows(model, p2)
    assert len(rows) == len(alone)
    for got, own in zip(rows, alone):
        assert torch.equal(got, own)                                       # bit for bit, every depth


def test_only_blocks_whose_whole_prefix_matches_are_shared(model):
    """A prompt whose second block equals another's but whose first differs shares nothing (a block's key is the
    tokens up to its end); one that differs inside block 1 shares block 0 only."""
    prefix, (p1, *_) = _prompts(model.config.vocab_size, 24, 1)
    V = model.config.vocab_size
    first_differs = [(p1[0] + 1) % V] + p1[1:]
    rows, entry, _ = _shared_run(model, p1, first_differs)
    assert entry.cached == 0
    for got, own in zip(rows, _alone_rows(model, first_differs)):
        assert torch.equal(got, own)
    second_differs = p1[:10] + [(p1[10] + 1) % V] + p1[11:]
    _, entry, _ = _shared_run(model, p1, second_differs)
    assert entry.cached == B
    assert common_prefix([p1, second_differs, p1]) == 10 and common_prefix([p1]) == len(p1)
    # Block 0 of W is cached (from Y) and a block with W's block-1 tokens is cached too (from Z, after another
    # block 0): W shares block 0 only - the second block's rows depend on what came before it.
    A, Bt, C = p1[:B], p1[B: 2 * B], [(t + 3) % V for t in p1[:B]]
    D = [(t + 5) % V for t in Bt]
    Y, Z, W = A + D + [7, 8, 9], C + Bt + [7, 8], A + Bt + [9, 9, 9]
    eng = Engine(model, "ar", max_batch=1, block_size=B, kv_budget=8 * B * 4)
    with torch.inference_mode():
        for prompt in (Y, Z):
            rid = eng.add(prompt, max_new_tokens=2, eos=False)
            while eng.has_work:
                eng.step()
            eng.result(rid)
        w = eng.add(W, max_new_tokens=6, eos=False)
        while not eng._table[w].generated:
            eng.step()
    assert eng._table[w].cached == B
    assert all(torch.equal(x, y) for x, y in zip(eng.executor.requests[w].cache.save(), _alone_rows(model, W)))


@pytest.mark.parametrize("change", [dict(init_scale=0.5), dict(state_seed=3), dict(num_steps=4)])
def test_requests_whose_rows_differ_share_nothing(model, change):
    """The salt of a block's key: the initial states' scale and seed, the depth (and the exit rule, the dtype)."""
    prefix, (p1, p2, *_) = _prompts(model.config.vocab_size, 20, 3)
    if "num_steps" in change:
        eng = Engine(model, "ar", max_batch=2, block_size=B, num_steps=4)
        assert eng.R == 4                             # an engine has one depth: compare keys across engines
        from dasspec.engine.core.blocks import prefix_salt
        assert prefix_salt(4, 1.0, 0, None, model.dtype, B) != prefix_salt(6, 1.0, 0, None, model.dtype, B)
        return
    rows, entry, _ = _shared_run(model, p1, p2, **change)
    assert entry.cached == 0
    for got, own in zip(rows, _alone_rows(model, p2, **change)):
        assert torch.equal(got, own)


def test_sampled_requests_with_different_seeds_share_prompt_blocks(model):
    """The sampling seed does not touch the initial states, so sampled requests share a few-shot prefix - and each
    is still its own AR sampling decode."""
    prefix, prompts = _prompts(model.config.vocab_size, 24, 4)
    kw = dict(max_new_tokens=10, eos=False, do_sample=True, temperature=0.9)
    refs = [dasspec.generate(model, p, "ar", seed=s, **kw).tokens for s, p in enumerate(prompts)]
    eng = Engine(model, "das-wave", {"gamma": 8, "rounds": 3, "w_init": 4, "k": 1}, max_batch=4, block_size=B)
    ids = [eng.add(p, seed=s, **kw) for s, p in enumerate(prompts)]
    while eng.has_work:
        eng.step()
    outs = [eng.result(i) for i in ids]
    assert [o.tokens for o in outs] == refs
    assert sum(o.stats.cached_tokens for o in outs) == 3 * 24     # the first computes, the others share 3 blocks


def test_every_method_equals_ar_with_shared_blocks(model):
    prefix, prompts = _prompts(model.config.vocab_size, 24, 6)
    for init_scale in (0.0, 1.0):
        kw = dict(max_new_tokens=12, init_scale=init_scale, eos=False)
        refs = [dasspec.generate(model, p, "ar", **kw).tokens for p in prompts]
        drafted = 0
        for method, knobs in CASES:
            outs = dasspec.generate_batch(model, prompts, method, max_batch=3, **kw, **knobs)
            assert [o.tokens for o in outs] == refs, (init_scale, method, knobs)
            assert sum(o.stats.cached_tokens for o in outs) >= 3 * 16
            drafted += sum(sum(o.stats.accepted) for o in outs)
        assert drafted > 0


def test_a_prefix_cache_carries_blocks_across_engines(model):
    """``PrefixCache``: an engine of its own holding the prefix's full blocks; each generate call copies them (rows
    bit for bit those it would compute) and prefills only the rest; requests with other settings are refused."""
    prefix, (prompt, *_) = _prompts(model.config.vocab_size, 40, 1)
    pc = dasspec.PrefixCache(model, prefix, block_size=B)
    assert len(pc) == 40 and pc.nbytes == 5 * pc.engine.pool.bytes_per_block
    P, R = len(prompt), model.R
    with pytest.raises(ValueError, match="block size 16 \\(cache: 8\\)"):     # generate's engine: blocks of 16
        dasspec.generate(model, prompt, max_new_tokens=4, prefix_cache=pc)
    eng = Engine(model, "ar", block_size=B, max_batch=1)
    rid = eng.add(prompt, max_new_tokens=4, eos=False, prefix_cache=pc)
    with torch.inference_mode():
        while not eng._table[rid].generated:
            eng.step()
    rows = eng.executor.requests[rid].cache.save()
    alone = _alone_rows(model, prompt)
    assert all(torch.equal(a, b) for a, b in zip(rows, alone))
    assert eng._table[rid].cached == 40 and eng.output.stats(rid).prefill_updates == R * (P - 40)
    ok = dict(max_new_tokens=3)
    for change, word in ((dict(init_scale=1.5), "init_scale"), (dict(state_seed=2), "state_seed 2")):
        with pytest.raises(ValueError, match=word):
            eng.add(prompt, prefix_cache=pc, **ok, **change)
    other = random_model("raven-llama", seed=8, mean_recurrence=6, n_prelude=1, n_core=2, n_coda=1)
    with pytest.raises(ValueError, match="another model"):
        Engine(other, "ar", block_size=B).add(prompt, prefix_cache=pc, **ok)
    with pytest.raises(ValueError, match="empty prefix"):
        dasspec.PrefixCache(model, [])
    with pytest.raises(ValueError, match="context"):
        dasspec.PrefixCache(model, [3] * (model.config.block_size + 1))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        dasspec.PrefixCache(model, [model.config.vocab_size])



def test_a_prefix_cache_is_refused_under_another_runtime_or_thread_count(model, monkeypatch):
    """Rows computed with static shapes, or at another torch thread count where torch's kernels compute them, may
    round differently from the rows a request computes itself: such a request is refused with the difference named;
    one built for the request's runtime serves it (its answer is its own AR decode).  Where dasspec's kernels compute
    every row (eager float32 on a CPU), the thread count changes no bit and the cache serves at any thread count."""
    from dasspec.model import decode_kernel

    prefix, (prompt, *_) = _prompts(model.config.vocab_size, 40, 1)
    pc = dasspec.PrefixCache(model, prefix, block_size=B)
    eng = Engine(model, "ar", block_size=B, max_batch=1, runtime=dasspec.Runtime(static_shapes=True))
    with pytest.raises(ValueError, match="runtime static_shapes=True"):
        eng.add(prompt, max_new_tokens=3, prefix_cache=pc)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert decode_kernel.thread_invariant(model.device, model.dtype) == decode_kernel.available()
        if decode_kernel.available():
            _serves(Engine(model, "ar", block_size=B, max_batch=1), pc, model, prompt)
        monkeypatch.setattr(decode_kernel, "thread_invariant", lambda *a, **k: False)
        with pytest.raises(ValueError, match=f"{threads + 1} torch threads \\(cache: {threads}\\)"):
            Engine(model, "ar", block_size=B, max_batch=1).add(prompt, max_new_tokens=3, prefix_cache=pc)
    finally:
        torch.set_num_threads(threads)
    _serves(eng, dasspec.PrefixCache(model, prefix, block_size=B, runtime=dasspec.Runtime(static_shapes=True)), model,
            prompt)


def _serves(engine: Engine, pc, model, prompt: list[int]) -> None:
    """``engine`` takes ``pc``'s 40 cached tokens for ``prompt`` and answers its own AR decode."""
    rid = engine.add(prompt, max_new_tokens=6, eos=False, prefix_cache=pc)
    _drain_engine(engine)
    assert engine._table[rid].cached == 40
    assert engine.result(rid).tokens == dasspec.generate(model, prompt, "ar", max_new_tokens=6, eos=False).tokens


def test_blocks_copied_from_a_prefix_cache_are_keyed_only_once_they_hold_the_rows(model, monkeypatch):
    """A request whose set-up fails before its PrefixCache blocks are copied leaves them unkeyed: the next request
    with that prefix copies (or computes) them again instead of sharing blocks that never got their rows."""
    from dasspec.engine.core import executor as ex

    prefix, (prompt, *_) = _prompts(model.config.vocab_size, 40, 1)
    pc = dasspec.PrefixCache(model, prefix, block_size=B)
    eng = Engine(model, "ar", block_size=B, max_batch=2)
    real, calls = ex.Request, []

    def failing(*args, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("set-up failed")
        return real(*args, **kw)

    monkeypatch.setattr(ex, "Request", failing)
    first = eng.add(prompt, max_new_tokens=4, eos=False, prefix_cache=pc)
    _drain_engine(eng)
    assert eng.result(first).stats.stop_reason == "error"
    second = eng.add(prompt, max_new_tokens=4, eos=False, prefix_cache=pc)
    _drain_engine(eng)
    assert eng.result(second).tokens == dasspec.generate(model, prompt, max_new_tokens=4, eos=False).tokens


def test_caches_that_do_not_fit_fail_before_any_work(model, monkeypatch):
    """A pool whose depth cache would exceed 90% of the free memory is refused up front, with the bytes it needs in
    the message."""
    from dasspec.model import memory
    from dasspec.model.cache import bytes_per_token

    per = bytes_per_token(model.config, model.R, model.dtype)
    cfg, size = model.config, torch.finfo(model.dtype).bits // 8
    layers = cfg.n_core * model.R + cfg.n_prelude + cfg.n_coda      # core layers at every depth, prelude, coda
    assert per == layers * 2 * cfg.n_kv_heads * cfg.head_dim * size    # K and V, every KV head
    monkeypatch.setattr(memory, "available_memory", lambda device: 40 * per)
    monkeypatch.delenv("DASSPEC_IGNORE_MEMORY", raising=False)
    # 4 + 18 + 2 scratch rows -> 2 blocks of 16, + the null block: 48 positions
    with pytest.raises(dasspec.CacheCapacityError, match=r"needs 84.0 KiB \(1792 B/token x 48 positions at R=6\) "
                                                          r"but only 70.0 KiB"):
        dasspec.generate(model, [3] * 4, max_new_tokens=18)
    assert dasspec.generate(model, [3] * 4, max_new_tokens=2).tokens        # 8 rows: one block + null block fit


def test_bundled_model_few_shot_prompts_share_their_exemplars():
    """The shipped setting end to end: GSM8K 2-shot prompts, the bundled model at full depth with its tuned DAS-Wave
    defaults and SAM, decoded together: the exemplars' blocks are prefilled once, and every answer equals AR."""
    data = Path(os.environ.get("DASSPEC_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
    if not (BUNDLED_DIR / "config.json").exists() or not (data / "gsm8k").exists():
        pytest.skip("needs the bundled model and the GSM8K data")
    model = dasspec.load_model()
    prompts = dev_prompts(model, "gsm8k", 3, 40, ["gsm8k=2"], str(data))
    shared = common_prefix([p.ids for p in prompts])
    assert shared > 100
    kw = dict(max_new_tokens=40, stop=[list(p.task.stop) for p in prompts])
    refs = [dasspec.generate(model, p.ids, "ar", max_new_tokens=40, stop=list(p.task.stop)).tokens for p in prompts]
    for method in ("das-wave", "sam"):
        outs = dasspec.generate_batch(model, [p.ids for p in prompts], method, max_batch=3, **kw)
        assert [o.tokens for o in outs] == refs, method
        assert sum(o.stats.cached_tokens for o in outs) == 2 * (shared // 16) * 16
