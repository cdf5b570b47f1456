"""IQuest-Loop's windowed depths in the engine's pool (``window_kv``, on by default): a row holds one depth, each
request keeps its depth-1 rows in blocks and every depth r >= 2 in a ring of a few blocks that positions reuse past
the window.  Every method must emit the tokens of the full layout (every depth of every row kept, ``window_kv=False``)
on requests that run many rings past the window - prompts of two whole prefill chunks and more, several windowed
depths (loop_num 3), trees (compacted rows), preemption (rows swapped out and back), depth slices, the executor in
its own process and static shapes - while the pool holds fewer bytes.  AR on the full layout is the remote code's
decode (tests/test_iquest_decoding.py)."""

from __future__ import annotations

import pytest
import torch

import dasspec
from dasspec.engine.api.engine import Engine
from dasspec.engine.base.runtime import Runtime
from dasspec.engine.core.blocks import WINDOW_PREFILL_ROWS, block_keys, call_rows, prefix_salt
from iquest_reference import write_iquest_checkpoint

B = 8                   # blocks of 8 positions: a ring is a few blocks, and a prompt spans several
NEW = 48
METHODS = [("ar", {}), ("self-spec", {}), ("mature-spec", {}), ("das-wave", {}), ("das-wave", {"k": 2, "rounds": 4}),
           ("token-recycling", {}), ("lookahead", {"window": 3, "ngram": 3, "guess_set": 3}), ("pld", {}),
           ("auto", {})]


@pytest.fixture(scope="module", params=[2, 3], ids=["loops2", "loops3"])
def model(request, tmp_path_factory):
    folder = write_iquest_checkpoint(tmp_path_factory.mktemp("iquest") / "m", vocab_size=320, seed=4, window=8,
                                     loop_num=request.param)
    return dasspec.load_model(folder, device="cpu", dtype=torch.float32)


def prompts(vocab: int) -> list[list[int]]:
    """Past two whole prefill chunks (a ring then holds a chunk and the window before it), a repetitive one (the
    lookup drafters find copies), and a short one."""
    assert WINDOW_PREFILL_ROWS < 70
    g = torch.Generator().manual_seed(2)
    base = torch.randint(3, vocab, (10,), generator=g).tolist()
    return [torch.randint(3, vocab, (2 * WINDOW_PREFILL_ROWS + 22,), generator=g).tolist(), base * 14, base[:5]]


def run(model, method, knobs=None, ps=None, window_kv=True, sampled=False, **engine):
    eng = Engine(model, method, knobs, max_batch=3, block_size=B, window_kv=window_kv, **engine)
    opts = dict(do_sample=True, temperature=0.8) if sampled else {}
    try:
        ids = [eng.add(p, max_new_tokens=NEW, eos=False, seed=i, **opts) for i, p in enumerate(ps)]
        peak = 0
        while eng.has_work:
            eng.step()
            peak = max(peak, eng.pool.in_use)
        return [eng.result(i).tokens for i in ids], eng, peak
    finally:
        eng.close()


def test_every_method_on_rings_equals_the_full_layout(model):
    ps = prompts(model.config.vocab_size)
    ref, full, full_peak = run(model, "ar", ps=ps, window_kv=False)
    assert full.pool.cache.core_k.shape[1] == model.R
    for method, knobs in METHODS:
        got, eng, peak = run(model, method, knobs, ps)
        assert got == ref, (method, knobs)
        assert eng.pool.cache.core_k.shape[1] == 1 and eng.pool.window == 8
        if method == "ar":    # the same requests in fewer bytes: depth >= 2 rows past the window are not kept
            assert peak * eng.pool.bytes_per_block < full_peak * full.pool.bytes_per_block
    for sampled_method in ("das-wave", "token-recycling"):
        ref_s = run(model, "ar", ps=ps, window_kv=False, sampled=True)[0]
        assert run(model, sampled_method, ps=ps, sampled=True)[0] == ref_s, sampled_method


def test_swapped_out_sliced_and_remote_requests_keep_their_window_rows(model):
    """A pool that swaps requests out past the window (their rings' last rows go to the host and come back), prompt
    blocks run as depth slices under a small step budget, the executor in its own process, static shapes."""
    ps = prompts(model.config.vocab_size)
    ref = run(model, "ar", ps=ps, window_kv=False)[0]
    swapped = 0
    for method in ("ar", "das-wave", "token-recycling"):
        got, eng, _ = run(model, method, ps=ps, kv_budget=2 * WINDOW_PREFILL_ROWS + 48, max_step_tokens=12)
        assert got == ref, method
        swapped += eng.scheduler.preemptions
    assert swapped >= 2, "the pool never ran out: swapping rings went untested"
    assert run(model, "das-wave", ps=ps, executor="process")[0] == ref
    assert run(model, "das-wave", ps=ps[1:], runtime=Runtime(static_shapes=True))[0] == ref[1:]


def test_a_request_prefills_as_many_rows_a_step_as_its_rings_hold(model):
    """A windowed request's prompt chunk is what its rings hold beside the window's rows before it: past the
    ring's size, the span less those rows (first chunk the whole span, the next ones ``window - 1`` less); where
    its rings never wrap (prompt + max_new_tokens within a ring), the whole prompt in one step - not a fixed 64
    rows.  Tokens as on the full layout."""
    long_prompt, _, short = prompts(model.config.vocab_size)
    short = (short * 20)[:70]
    ref = [run(model, "ar", ps=[p], window_kv=False)[0][0] for p in (long_prompt, short)]
    for p, new, want in ((long_prompt, NEW, None), (short, 1, [(0, 70)])):
        eng = Engine(model, "ar", max_batch=1, block_size=B, max_step_tokens=4096)
        chunks, execute = [], eng.executor.execute
        eng.executor.execute = lambda plan: chunks.extend(w.prefill for w in plan.work if w.prefill) or execute(plan)
        try:
            rid = eng.add(p, max_new_tokens=new, eos=False)
            while eng.has_work:
                eng.step()
            assert eng.result(rid).tokens == ref[0 if want is None else 1][:new]
        finally:
            eng.close()
        if want is None:        # a wrapping ring: its span, then its span less the window's rows (whole blocks)
            span = eng.pool.ring_blocks(call_rows(B, 0)) // (model.R - 1) * B
            later = (span - (eng.pool.window - 1)) // B * B
            want = [(0, span), (span, span + later), (span + later, len(p))]
            assert span > WINDOW_PREFILL_ROWS and len(p) > span + later
        assert chunks == want


def test_a_draft_reads_the_prefix_at_its_own_depth(model):
    """Rows of depth >= 2 past the window are gone: a Deep K/V read from depth 1 reads depth 1 (the target's own
    loop-1 rows), through the depth-1 table; a call at depth 2 reads its ring."""
    eng = Engine(model, "mature-spec", {"policy": "deep-kv"}, max_batch=1, block_size=B)
    eng.add(prompts(model.config.vocab_size)[0], max_new_tokens=4, eos=False)
    eng.step()
    cache = eng.executor.requests[0].cache
    deep = cache.core_kv(0, (model.R, model.R), (1, 1))
    assert deep.one_source and deep.table is cache.table
    ring = cache.core_kv(0, (2, 2), (2, 2))
    assert ring.table is cache.rings[0] and ring.table is not cache.table
    eng.close()


@pytest.fixture
def leaning_on_the_window(model):
    """The model with every gate at sigmoid(-6): loop r >= 2 reads mostly its own rows inside the window, so rows
    missing there change tokens (with the fixture's random gates they barely move the logits)."""
    from dasspec.model.families.iquest import LoopGate
    gates = [m for m in model.modules() if isinstance(m, LoopGate)]
    saved = [g.bias.detach().clone() for g in gates]
    with torch.no_grad():
        for g in gates:
            g.bias.fill_(-6.0)
    yield model
    with torch.no_grad():
        for g, b in zip(gates, saved):
            g.bias.copy_(b)


def sharing_prompts(vocab: int) -> list[list[int]]:
    """Four prompts on 62 common tokens (7 whole blocks of 8), one on its first 30 (3 blocks), one alone."""
    g = torch.Generator().manual_seed(5)
    common = torch.randint(2, vocab, (62,), generator=g).tolist()
    tail = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in (3, 5, 7, 20, 9, 40)]
    return [common + t for t in tail[:4]] + [common[:30] + tail[4], tail[5]]


def default_salt(model) -> bytes:
    """What a request with the default options keys its prompt blocks with besides their tokens."""
    return prefix_salt(model.R, 1.0, 0, model.exit_rule(None, None, model.R), model.dtype, B)


def rows_at_start(model, ps, method, knobs=None):
    """Run a windowed engine; per request that started on shared blocks, its ring rows (K and V of every core layer)
    at every windowed depth for the window's positions before its first computed row, read right after its first
    step - and the tokens."""
    eng = Engine(model, method, knobs, max_batch=3, block_size=B)
    seen, execute = [], eng.executor.execute

    def probe(plan):
        out = execute(plan)
        for s in plan.start:
            if s.window_rows:
                cache = eng.executor.requests[s.id].cache
                at = torch.arange(max(0, s.cached - eng.pool.window + 1), s.cached)
                for r in range(2, model.R + 1):
                    rows = cache.rings[r - 2].rows[at]
                    seen.append((s.id, at, r, eng.pool.cache.core_k[:, 0, :, rows].clone(),
                                 eng.pool.cache.core_v[:, 0, :, rows].clone()))
        return out

    eng.executor.execute = probe
    try:
        ids = [eng.add(p, max_new_tokens=NEW, eos=False) for p in ps]
        while eng.has_work:
            eng.step()
        return seen, [eng.result(i).tokens for i in ids]
    finally:
        eng.close()


def test_prompt_blocks_are_shared_with_their_window_rows(leaning_on_the_window):
    """A windowed pool shares prompt blocks: a request that completes prompt blocks keeps their rows at depths >= 2
    (copied out of its rings into blocks left cached), and a later request that starts alike references the depth-1
    blocks and copies the window's rows before them into its rings - bit for bit the rows the full layout computed
    for those positions.  Its tokens are the full layout's - every method, greedy and sampled, preempted, the
    executor in its own process, static shapes, overlap - and it shares as many rows as the full layout does.
    Mutations shown failing: no copy into the rings, the rows of the block before, a window one block short."""
    model = leaning_on_the_window
    ps = sharing_prompts(model.config.vocab_size)
    ref, full, _ = run(model, "ar", ps=ps, window_kv=False)
    assert full.scheduler.shared_rows == 3 * 7 * B + 3 * B
    salt = default_salt(model)
    for method in ("ar", "das-wave"):
        seen, got = rows_at_start(model, ps, method)
        assert got == ref and len(seen) == 4 * (model.R - 1), method
        for rid, at, r, k, v in seen:           # the full layout's rows, in its cached prompt blocks
            keys = block_keys(ps[rid], B, salt, len(ps[rid]) // B)
            rows = torch.tensor([full.pool._block_of[keys[p // B]] * B + p % B for p in at.tolist()])
            assert torch.equal(k, full.pool.cache.core_k[:, r - 1, :, rows]), (method, rid, r)
            assert torch.equal(v, full.pool.cache.core_v[:, r - 1, :, rows]), (method, rid, r)
    for method, knobs in METHODS:
        got, eng, _ = run(model, method, knobs, ps)
        assert got == ref, (method, knobs)
        assert eng.scheduler.shared_rows == full.scheduler.shared_rows, method
        assert eng.pool.cached > 0
    ref_s = run(model, "ar", ps=ps, window_kv=False, sampled=True)[0]
    assert run(model, "das-wave", ps=ps, sampled=True)[0] == ref_s
    got, eng, _ = run(model, "das-wave", ps=ps, kv_budget=2 * WINDOW_PREFILL_ROWS + 48, max_step_tokens=12)
    assert got == ref and eng.scheduler.preemptions >= 1 and eng.scheduler.shared_rows > 0
    for engine in (dict(executor="process"), dict(runtime=Runtime(static_shapes=True)), dict(overlap=True)):
        got, eng, _ = run(model, "das-wave", ps=ps, **engine)
        assert got == ref and eng.scheduler.shared_rows == full.scheduler.shared_rows, engine
    outs = dasspec.generate_batch(model, ps, max_new_tokens=NEW, eos=False, max_batch=3)
    assert [o.tokens for o in outs] == ref and sum(o.stats.cached_tokens for o in outs) > 0


def test_a_run_whose_window_rows_are_gone_is_shared_shorter(leaning_on_the_window):
    """A request shares the longest run of cached prompt blocks whose window rows (at every depth >= 2) are cached
    as well: the window rows of the run's last block evicted, it shares one block less, with the same tokens."""
    from dasspec.engine.core.blocks import window_key
    model = leaning_on_the_window
    first, second = sharing_prompts(model.config.vocab_size)[:2]
    ref = run(model, "ar", ps=[second], window_kv=False)[0]
    eng = Engine(model, "ar", max_batch=2, block_size=B)
    try:
        eng.add(first, max_new_tokens=4, eos=False)
        while eng.has_work:
            eng.step()
        pool, keys = eng.pool, block_keys(second, B, default_salt(model), len(second) // B)
        for r in range(2, model.R + 1):                 # evicted: the window rows of block 6 (the run's last)
            b = pool._block_of.pop(window_key(keys[6], r))
            del pool._key_of[b], pool._lru[b]
            pool._free.add(b)
        rid = eng.add(second, max_new_tokens=NEW, eos=False)
        while eng.has_work:
            eng.step()
        assert eng.result(rid).tokens == ref[0]
        assert eng.scheduler.shared_rows == 6 * B
    finally:
        eng.close()


def test_a_request_that_fits_the_pool_alone_starts_though_its_window_rows_would_not(leaning_on_the_window):
    """The window rows a shared run copies from are blocks a starting request holds beside its own: where they do
    not fit beside them, it starts without sharing instead of waiting for good.  (Found by review: "the engine
    planned a step that moves no request".)"""
    model = leaning_on_the_window
    first, second = sharing_prompts(model.config.vocab_size)[:2]
    ref = run(model, "ar", ps=[second], window_kv=False)[0][0][:2]
    eng = Engine(model, "ar", max_batch=1, block_size=B, kv_budget=72)    # room for the second and its ring alone
    try:
        eng.add(first[:57], max_new_tokens=1, eos=False)                   # keeps its blocks' window rows
        while eng.has_work:
            eng.step()
        rid = eng.add(second, max_new_tokens=2, eos=False)
        while eng.has_work:
            eng.step()
        assert eng.result(rid).tokens == ref and eng.scheduler.shared_rows == 0
    finally:
        eng.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_a_failing_step_gives_back_the_blocks_it_held_for_window_rows(model, monkeypatch, overlap):
    """A step that raises while it holds blocks for the window rows it was to keep (and, the second time, the shared
    ones a starting request was to copy): ``abort_running`` gives every block back and registers none of them, and
    the requests added afterwards share and emit the full layout's tokens.  (Mutation shown failing: no
    ``drop_holds`` in ``abort_running``.)"""
    import dasspec.engine.core.executor as executor_mod
    ps = sharing_prompts(model.config.vocab_size)[:3]
    ref = run(model, "ar", ps=ps, window_kv=False)[0]
    engine = Engine(model, "ar", max_batch=3, block_size=B, overlap=overlap)
    step = executor_mod.loop_step
    try:
        # the first time the producer's first step fails (rows to keep); the requests that had not started run
        # after it and keep their rows, so the second time every request starts on shared blocks (rows to copy)
        for kind in ("kept", "borrowed"):
            ids = [engine.add(p, max_new_tokens=NEW, eos=False) for p in ps]
            monkeypatch.setattr(executor_mod, "loop_step",
                                lambda *args: (_ for _ in ()).throw(RuntimeError("boom")))
            with pytest.raises(RuntimeError, match="boom"):
                engine.step()
            monkeypatch.setattr(executor_mod, "loop_step", step)
            assert any(getattr(held, kind) for held in engine.scheduler._holds.values())
            keys = set(engine.pool._block_of)
            engine.abort_running()
            assert set(engine.pool._block_of) == keys and not engine.scheduler._holds   # none of them registered
            while engine.has_work:
                engine.step()
            for i in ids:
                engine.discard(i)
            assert engine.pool.available == engine.pool.capacity_blocks
        ids = [engine.add(p, max_new_tokens=NEW, eos=False) for p in ps]
        while engine.has_work:
            engine.step()
        assert [engine.result(i).tokens for i in ids] == ref and engine.scheduler.shared_rows > 0
    finally:
        engine.close()


def test_a_prefix_cache_needs_the_full_layout(model):
    """A ``PrefixCache`` holds every depth of every row: a windowed engine refuses one with a message naming the
    switch, and ``generate`` given one builds the full layout."""
    prefix = sharing_prompts(model.config.vocab_size)[0][:32]
    p = sharing_prompts(model.config.vocab_size)[0]
    pc = dasspec.PrefixCache(model, prefix)
    with pytest.raises(ValueError, match="window_kv"):
        Engine(model, "ar", block_size=B).add(p, prefix_cache=pc)
    ref = run(model, "ar", ps=[p], window_kv=False)[0][0]
    assert dasspec.generate(model, p, max_new_tokens=NEW, eos=False, prefix_cache=pc).tokens == ref


def test_a_window_as_long_as_the_context_keeps_the_full_layout(tmp_path):
    """A ring that would hold the whole context saves nothing (and is taken whole at admission): such a model's
    engine keeps every depth of every row, taken as tokens are written."""
    folder = write_iquest_checkpoint(tmp_path / "m", vocab_size=320, seed=4, window=200,
                                     config_edits={"max_position_embeddings": 256})
    wide = dasspec.load_model(folder, device="cpu", dtype=torch.float32)
    eng = Engine(wide, "ar", block_size=B)
    assert eng.window is None and eng.pool.cache.core_k.shape[1] == wide.R


def test_a_ring_swapped_back_in_holds_what_it_held(model, monkeypatch):
    """Torch's attention path (a GPU's; a CPU without the kernels) reads every ring row up to a call's end and masks
    the window, so a swapped-in ring must hold again every row it held - not another request's values left in its
    new blocks (NaN here, as a diverged request's would be).  (Found by review: only the last window - 1 rows came
    back.)"""
    from dasspec.model import cache as C
    from dasspec.model import decode_kernel
    monkeypatch.setattr(decode_kernel, "available", lambda: False)
    g = torch.Generator().manual_seed(2)
    ps = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in (60, 30, 30, 30, 30)]
    ref = run(model, "ar", ps=ps, window_kv=False)[0]
    save = C.PagedCache.save

    def save_and_poison(self, device="cpu"):      # the blocks it leaves are written by a request gone wrong
        out = save(self, device)
        for tensors, table in self._depth_tables():
            rows = torch.tensor([b * table.B + i for b in table.blocks for i in range(table.B)], dtype=torch.long)
            for t in tensors:
                t.index_fill_(-2, rows, float("nan"))
        return out

    monkeypatch.setattr(C.PagedCache, "save", save_and_poison)
    got, eng, _ = run(model, "ar", ps=ps, kv_budget=160, max_step_tokens=16)
    assert eng.scheduler.preemptions >= 1 and got == ref


def test_a_wider_method_than_the_engine_s_runs_on_rings_for_ar_steps(model):
    """The engine adds rings for its default method on top of ``kv_budget``; a request with a wider method needs
    longer rings for its drafts.  Where they do not fit it takes the rings of AR steps and decodes by AR steps (as a
    request whose draft scratch does not fit does): accepted at any kv_budget the full layout accepts, swapped back
    in alone in the pool, its tokens its own.  (Found by review: refused at such a budget, and once preempted never
    swapped back in - "the engine planned a step that moves no request".)"""
    wide = {"gamma": 64, "w_init": 64, "seed_branch": 64, "copy_run": False}
    g = torch.Generator().manual_seed(20)
    a, x = (torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in (4, 40))
    ref = dasspec.generate(model, x, max_new_tokens=30, eos=False).tokens
    eng = Engine(model, "ar", max_batch=2, block_size=B, kv_budget=16 * B)
    eng.add(a, max_new_tokens=6, eos=False)
    rid = eng.add(x, max_new_tokens=30, eos=False, method="das-wave", knobs=wide)
    while eng.has_work:
        eng.step()
    assert eng.result(rid).tokens == ref
    prompt = list(range(3, 3 + 150))                 # fits the full layout's pool exactly: the windowed one too
    rows = len(prompt) + 29
    for window_kv in (False, True):
        eng = Engine(model, "ar", max_batch=1, block_size=B, kv_budget=rows, window_kv=window_kv)
        rid = eng.add(prompt, max_new_tokens=29, eos=False, method="token-recycling")
        while eng.has_work:
            eng.step()
        assert len(eng.result(rid).tokens) == 29


def test_torch_attention_reads_only_the_window(model, monkeypatch):
    """On torch's attention path (a GPU's; a CPU without the kernels) a windowed depth reads the rows of its window
    and the call's own, never the whole prefix through the ring (which would gather n rows at every layer and read
    rows the ring has reused), and the tokens are the full layout's."""
    from dasspec.model import attention, decode_kernel
    from dasspec.model.cache import RingTable
    monkeypatch.setattr(decode_kernel, "available", lambda: False)
    ps = prompts(model.config.vocab_size)
    ref = run(model, "ar", ps=ps, window_kv=False)[0]
    spans: list[int] = []
    own = attention.PagedKV.own

    def recorded(self, lo, hi):
        if isinstance(self.table, RingTable):
            spans.append((hi if hi is not None else self.table.capacity) - lo)
        return own(self, lo, hi)

    monkeypatch.setattr(attention.PagedKV, "own", recorded)
    for method in ("ar", "das-wave", "token-recycling"):
        got, eng, _ = run(model, method, ps=ps)
        assert got == ref, method
    # at most a ring's span (the window and the widest call: a prompt chunk as long as the ring holds, or a draft's
    # rows), far fewer than the longest request's
    width = dasspec.build_drafter(model, "token-recycling").width
    span = eng.pool.ring_blocks(call_rows(B, width)) // (model.R - 1) * B
    assert spans and max(spans) <= span < len(ps[0]), (max(spans), span)


@pytest.mark.parametrize("window_kv", [True, False], ids=["rings", "full"])
def test_loops_in_one_call_have_the_bits_of_the_modules_ops(model, window_kv, monkeypatch):
    """A batched call's loops run as one kernel call (``loop_recur_rows``: at depth 1 Llama's layers, past it the
    mixed attention's - projections, the depth's own K/V stores, the gate, global attention over depth 1 and local
    attention inside the window, the mix, the output product - and the MLP), and the mixed attention alone where the
    loops' call does not apply (``loop_mix_rows``); every loop output and every layer output of every step - prompt
    chunks past the window, decode rows, verification chains, DAS-Wave's windows and depth slices - and every token
    are bit for bit those of the modules' own ops - also a call whose loops start past depth 1 (each call's loops
    split in two: ``loop_recur_rows``' ``first`` > 1) and a layer whose norms have an eps of their own."""
    from dasspec.model import decode_kernel
    from dasspec.model.families.iquest import IQuestLoop, LoopCoderBlock
    ps = prompts(model.config.vocab_size)
    kernels = ("loop_recur_rows", "loop_mix_rows")
    for norm in (model.transformer.core_block[1].norm_1, model.transformer.core_block[1].norm_2):
        monkeypatch.setattr(norm, "eps", 1e-2)
    firsts = []

    def run_with(path: str, method: str):
        loops, layers, rows = [], [], {k: [] for k in kernels}
        # a block's hook keeps the loops on the layer calls: the layers' outputs are recorded where the loops' call
        # is off anyway
        hooks = [m.register_forward_hook(lambda m, a, o: layers.append(o.clone())) for m in model.modules()
                 if isinstance(m, LoopCoderBlock) and path not in ("loops", "split")]
        with monkeypatch.context() as mp:
            real_recur = type(model).recur

            def recur(self, h, inj, span, cache=None, depths=None, reads=None):
                steps = list(depths if depths is not None else range(1, self.R + 1))
                if path == "split" and cache is not None and len(steps) > 1 and reads is None:
                    h = real_recur(self, h, inj, span, cache, steps[:1])
                    steps = steps[1:]
                y = real_recur(self, h, inj, span, cache, steps, reads)
                loops.append(y.clone())
                return y
            mp.setattr(type(model), "recur", recur)
            for k in kernels:
                mp.setattr(decode_kernel, k, lambda x, *a, _k=k, _f=getattr(decode_kernel, k): rows[_k].append(
                    x.shape[0]) or _f(x, *a))
            real_loops = decode_kernel.loop_recur_rows
            mp.setattr(decode_kernel, "loop_recur_rows", lambda x, first, *a: firsts.append(first) or real_loops(
                x, first, *a))
            if path not in ("loops", "split"):
                mp.setattr(IQuestLoop, "recur_rows", lambda *a: None)
            if path == "ops":
                mp.setattr(LoopCoderBlock, "mixed_rows", lambda *a: None)
            tokens = run(model, method, ps=ps, window_kv=window_kv)[0]
        for h in hooks:
            h.remove()
        return tokens, loops, layers, rows

    def took(rows):    # prompt chunks, and the decode steps' few rows (not only the prefill)
        return bool(rows) and max(rows) >= WINDOW_PREFILL_ROWS and min(rows) < 16

    for method in ("ar", "self-spec", "das-wave"):
        tokens_ops, loops_ops, layers_ops, _ = run_with("ops", method)
        for path in ("mix", "loops", "split"):
            firsts.clear()
            tokens, loops, layers, rows = run_with(path, method)
            assert tokens == tokens_ops, (method, path)
            assert len(loops) == len(loops_ops) and all(torch.equal(a, b) for a, b in zip(loops, loops_ops)), (
                method, path)
            if path == "mix":
                assert len(layers) == len(layers_ops) and all(torch.equal(a, b) for a, b in zip(layers, layers_ops))
            assert took(rows["loop_recur_rows"]) == (path != "mix") and took(rows["loop_mix_rows"]) == (
                path == "mix"), (method, path)
            # loops starting past depth 1: the split calls, and DAS-Wave's rounds at depth 2
            assert (max(firsts, default=0) > 1) == (path == "split" or (path, method) == ("loops", "das-wave")), (
                method, path)
