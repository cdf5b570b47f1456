"""Lossless where users run (issue 51): every request's tokens equal its own batch-1 AR decode at ONE thread - at
one thread and at two, alone and in batches of 1, 3 and 8 with every method (and ``auto``) mixed in one engine,
with chunked and shared prefills, and preempted and resumed in a small pool - on a model whose shapes take every
product and attention path the small fixtures of the other suites never reach:

* weights at or above 2^18 elements (``PACK_THRESHOLD``, where products once switched from MKL to oneDNN: the
  MLP's fc 2304 x 256, proj 256 x 1152, the embedding and the untied head 2048 x 256) beside weights below it (Wqkv
  768 x 256, the attention's proj 256 x 256, the adapter); the MLP's proj sums rows of 1,152 values, which a decode
  step of 5-8 rows takes through AVX-512's wide register block (``WIDE_K``) and every other call through the 4-row
  blocks;
* prompts past 128 keys (``KEY_LIMIT``, where causal rows once switched from the row kernel to SDPA) beside short
  ones, chains ending on either side of it,
  Token Recycling's and Lookahead's trees, DAS-Wave's windows, prompt blocks and wide verification blocks (the GEMM
  attention path).

A near-tie head makes a token depend on every bit of its row: the head is one shared row plus 1e-5 of the random
ones, so the logits' spread is at the level of float32 rounding and the argmax is decided there (in exact
arithmetic the argmax is the random head's).  Any difference in a row's bits - a product or an attention that
summed in another order because of the batch, the thread count or the verifier's shape - then changes tokens
within a few positions, where a plain random model would carry it unseen.  Sampling is tested with top-k 2 so
its choice set is decided at that level too (Gumbel noise over the whole vocabulary would hide it).

The same tests run on four families, so the one-call layer kernels each takes are under the near tie too:
Huginn's sandwich layers (the bundled model's layout; interleaved RoPE), Ouro's peri-norm loop (``recur_rows``
over "peri" layers, T = 4), Nanbeige's pre-norm loop (the same over "pre" layers, T = 2) and IQuest-Loop's gated
loop 2 over a sliding window (``loop_recur_rows``, the windowed pool's rings, T = 2) - and on Ouro's in bfloat16,
whose near tie sits at bfloat16's rounding (``NEAR_TIE_OF``; with torch's kernels, 15 of its 36 cases fail).

Every comparison is exact (token ids equal).  ``tests/conftest.py`` pins one thread; the two-thread cases set two
and the autouse fixture there restores one.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

import dasspec
from dasspec.engine.api.engine import Engine
from dasspec.testing import random_model

NEW = 8                      # new tokens per request
PACK_THRESHOLD = 1 << 18     # the shapes where the old kernels changed path: still covered on both sides
KEY_LIMIT = 128
WIDE_K = (1024, 4096)      # dasspec/csrc/isa_body.h's WIDE_K_MIN / MAX: rows longer than MIN, at most MAX
THREADS = (1, 2)
NEAR_TIE = 1e-5              # the head's random part, against its shared row (the float32 rounding level)
SAMPLED = dict(do_sample=True, temperature=0.7, top_k=2)


def methods(R: int) -> list[tuple[str, dict]]:
    """Every method (knobs small enough for R = 4, or R = 2) and auto; the wide drafters' trees and DAS-Wave's
    windows included."""
    d = R // 2
    return [("ar", {}), ("self-spec", {"draft_depth": d, "block": 4}),
            ("mature-spec", {"draft_depth": d, "block": 3}),
            ("das-wave", {"gamma": 6, "rounds": 4, "w_init": 2, "k": 1}),
            ("pld", {}), ("lookahead", {"window": 3, "ngram": 3, "guess_set": 3}), ("token-recycling", {}),
            ("sam", {}), ("auto", {})]


NAMES = [m for m, _ in methods(4)]     # the same at every depth: only the knobs follow R
# The near-tie fixtures: weights on both sides of PACK_THRESHOLD (the MLP's, the untied head), R = 4 or T = 2.
SHAPES = dict(vocab_size=2048, n_embd=256, n_heads=4, n_kv_heads=4, head_dim=64, intermediate_size=1152,
              tie_embeddings=False, block_size=512)
FAMILIES = {"huginn": dict(mean_recurrence=4), "ouro": dict(n_kv_heads=2, mean_recurrence=4),
            "nanbeige": dict(n_kv_heads=2, head_dim=96), "iquest-loop": dict(n_kv_heads=2, loop_window=16)}
# bfloat16: Ouro's fixture with its weights in bfloat16, the head's random part at bfloat16's rounding level (its
# rows must stay distinct after rounding); each product's output is rounded once, so near-equal logits tie and the
# argmax is decided by that rounding.
CASES = {**{f: (f, torch.float32) for f in FAMILIES}, "ouro-bf16": ("ouro", torch.bfloat16)}
NEAR_TIE_OF = {torch.float32: NEAR_TIE, torch.bfloat16: 2.0 ** -4}
# Mixed lengths: three past KEY_LIMIT (one a prompt of repeats, for the lookup drafters), one ending on it.
LENGTHS = (150, 9, 133, 40, 200, 3, 127, 70, 24)


def _model(case: str = "huginn"):
    family, dtype = CASES[case]
    model = random_model(family, seed=5, **{**SHAPES, **FAMILIES[family]})
    with torch.no_grad():
        head = model.lm_head.weight
        shared = head[0].clone()
        head.mul_(NEAR_TIE_OF[dtype]).add_(shared)
    return model.to(dtype)


def _prompts(vocab: int, lengths=LENGTHS, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, L in enumerate(lengths):
        if i % 2 == 0 and L > 20:      # repeats, so the lookup drafters draft and trees are verified
            out.append(torch.randint(3, vocab, (L // 5,), generator=g).repeat(6)[:L].tolist())
        else:
            out.append(torch.randint(3, vocab, (L,), generator=g).tolist())
    return out


@contextmanager
def threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _reference(model, prompts, sampled: bool) -> list[list[int]]:
    """Each prompt's own batch-1 AR decode at one thread (the prompt's index as its seed)."""
    opts = SAMPLED if sampled else {}
    with threads(1):
        return [dasspec.generate(model, p, "ar", max_new_tokens=NEW, eos=False, seed=i, **opts).tokens
                for i, p in enumerate(prompts)]


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    """(model, prompts, each prompt's reference greedy and sampled, the methods' knobs for the model's depth)."""
    model = _model(request.param)
    prompts = _prompts(model.config.vocab_size)
    return model, prompts, {s: _reference(model, prompts, s) for s in (False, True)}, methods(model.depth(None))


def test_the_fixture_takes_every_path(case):
    """The shapes are what the module's docstring says (a guard against a fixture that drifts to small shapes):
    weights on both sides of the packing threshold, one whose rows the wide block sums, prompts on both sides of
    the kernel's key limit."""
    model, prompts, _, _ = case
    sizes = [p.numel() for p in model.parameters() if p.dim() == 2]
    assert any(n >= PACK_THRESHOLD for n in sizes) and any(n < PACK_THRESHOLD for n in sizes)
    assert model.lm_head.weight.numel() >= PACK_THRESHOLD
    # (the wide block is float32's, on AVX-512 CPUs: the bfloat16 case has the shape but not the block)
    assert any(WIDE_K[0] < p.shape[1] <= WIDE_K[1] for p in model.parameters() if p.dim() == 2)
    assert any(len(p) > KEY_LIMIT for p in prompts)
    assert any(len(p) + NEW < KEY_LIMIT for p in prompts)


def _mismatches(outs: list[list[int]], refs: list[list[int]], labels) -> list:
    return [(label, next((j for j, (a, b) in enumerate(zip(o, r)) if a != b), min(len(o), len(r))))
            for o, r, label in zip(outs, refs, labels) if o != r]


# AR alone at one thread is the reference itself: only its two-thread case can fail.
ALONE = [(m, t) for m in NAMES for t in THREADS if (m, t) != ("ar", 1)]


@pytest.mark.parametrize("method,n_threads", ALONE, ids=[f"{m}-{t}thr" for m, t in ALONE])
def test_each_method_alone(case, method, n_threads):
    """``dasspec.generate`` of two prompts (past the key limit; ending its decode past it), greedy, and of one
    sampled: AR's tokens at one thread."""
    model, prompts, refs, known = case
    knobs = dict(known)[method]
    picks = [0, 6]
    with threads(n_threads):
        outs = [dasspec.generate(model, prompts[i], method, max_new_tokens=NEW, eos=False, seed=i, **knobs).tokens
                for i in picks]
        sampled = dasspec.generate(model, prompts[2], method, max_new_tokens=NEW, eos=False, seed=2, **SAMPLED,
                                   **knobs).tokens
    bad = _mismatches(outs + [sampled], [refs[False][i] for i in picks] + [refs[True][2]],
                      [f"greedy prompt {i}" for i in picks] + ["sampled prompt 2"])
    assert not bad, f"{method} at {n_threads} thread(s): (request, first differing position) {bad}"


def _engine_run(engine: Engine, requests: list[tuple[int, str, dict]], sampled: bool, prompts, **add) -> list:
    opts = SAMPLED if sampled else {}
    with torch.inference_mode():
        rids = [engine.add(prompts[j], method=m, knobs=k, max_new_tokens=NEW, eos=False, seed=j, **opts, **add)
                for j, m, k in requests]
        while engine.has_work:
            engine.step()
    return [engine.result(r).tokens for r in rids]


@pytest.mark.parametrize("n_threads", THREADS, ids=lambda t: f"{t}thr")
@pytest.mark.parametrize("sampled,B", [(False, 1), (False, 3), (False, 8), (True, 8)],
                         ids=("greedy-1", "greedy-3", "greedy-8", "sampled-8"))
def test_batches_of_every_method_mixed(case, B, sampled, n_threads):
    """One engine, nine requests of mixed lengths, each with another method (every method and auto), at most B at
    a time: each request's tokens are its own batch-1 AR decode at one thread."""
    model, prompts, refs, known = case
    requests = [(j % len(prompts), *known[j % len(known)]) for j in range(max(len(prompts), len(known)))]
    with threads(n_threads):
        outs = _engine_run(Engine(model, "ar", max_batch=B), requests, sampled, prompts)
    bad = _mismatches(outs, [refs[sampled][j] for j, _, _ in requests],
                      [f"prompt {j} ({len(prompts[j])} tokens) by {m}" for j, m, _ in requests])
    assert not bad, f"B={B}, {n_threads} thread(s): (request, first differing position) {bad}"


@pytest.mark.parametrize("n_threads", THREADS, ids=lambda t: f"{t}thr")
@pytest.mark.parametrize("method", ("das-wave", "auto"))
def test_generate_batch(case, method, n_threads):
    """``dasspec.generate_batch`` of every prompt at max_batch 8 (the public batched call), greedy."""
    model, prompts, refs, known = case
    knobs = dict(known)[method]
    with threads(n_threads):
        outs = [o.tokens for o in dasspec.generate_batch(model, prompts, method, max_new_tokens=NEW, eos=False,
                                                         max_batch=8, **knobs)]
    bad = _mismatches(outs, refs[False], [f"prompt {j} ({len(p)} tokens)" for j, p in enumerate(prompts)])
    assert not bad, f"{method}, {n_threads} thread(s): (request, first differing position) {bad}"


WIDE = 64                    # requests decoding at once in the widest batch


def test_a_batch_of_64_requests_at_two_threads(case):
    """64 requests at once in one engine (each prompt seven or eight times, each time with the next method and every
    third pass over the prompts sampled, so every method meets several prompts, greedy and sampled), two threads:
    each request's tokens are its own batch-1 AR decode at one thread."""
    model, prompts, refs, known = case
    P = len(prompts)
    requests = [(j % P, *known[(j + j // P) % len(known)]) for j in range(WIDE)]
    sampled = [(j // P) % 3 == 2 for j in range(WIDE)]
    engine = Engine(model, "ar", max_batch=WIDE, kv_budget=WIDE * 512, max_step_tokens=1 << 15)   # all at once
    with threads(2), torch.inference_mode():
        rids = [engine.add(prompts[p], method=m, knobs=k, max_new_tokens=NEW, eos=False, seed=p,
                           **(SAMPLED if s else {})) for (p, m, k), s in zip(requests, sampled)]
        widest = 0
        while engine.has_work:
            engine.step()
            widest = max(widest, len(engine.scheduler.running))
    outs = [engine.result(r).tokens for r in rids]
    assert widest == WIDE
    bad = _mismatches(outs, [refs[s][p] for (p, _, _), s in zip(requests, sampled)],
                      [f"request {i}: prompt {p} by {m}{' sampled' if s else ''}"
                       for i, ((p, m, _), s) in enumerate(zip(requests, sampled))])
    assert not bad, f"(request, first differing position) {bad}"


@pytest.mark.parametrize("n_threads", THREADS, ids=lambda t: f"{t}thr")
def test_chunked_and_shared_prefills(case, n_threads):
    """Prompts that share their first 144 tokens (nine blocks of 16): prefilled in chunks under a small step
    budget (depth slices), the shared blocks computed once in the engine, and through a ``PrefixCache`` built at
    one thread in another engine - every answer its own batch-1 AR decode at one thread."""
    model, _, _, known = case
    base = _prompts(model.config.vocab_size, lengths=(144, 30, 12, 60), seed=9)
    prompts = [base[0] + tail for tail in base[1:]] + [base[0][:150]]
    refs = _reference(model, prompts, False)
    with threads(1):
        pc = dasspec.PrefixCache(model, base[0], block_size=16)
    picked = [(m, dict(known)[m]) for m in ("das-wave", "token-recycling", "auto", "ar")]
    requests = [(j, *picked[j]) for j in range(len(prompts))]
    with threads(n_threads):
        engine = Engine(model, "ar", max_batch=4, block_size=16, max_step_tokens=24)
        chunked = _engine_run(engine, requests, False, prompts)
        assert engine.scheduler.shared_rows >= 2 * 144      # (IQuest-Loop's windowed pool too: its window rows)
        # a PrefixCache holds every depth of every row: on IQuest-Loop the engine's full layout takes it
        full = {"window_kv": False} if model.config.loop_window else {}
        cached = _engine_run(Engine(model, "ar", max_batch=2, block_size=16, **full), requests, False, prompts,
                             prefix_cache=pc)
    labels = [f"prompt {j} by {m}" for j, m, _ in requests]
    bad = _mismatches(chunked, refs, [f"chunked {x}" for x in labels])
    bad += _mismatches(cached, refs, [f"prefix-cached {x}" for x in labels])
    assert not bad, f"{n_threads} thread(s): (request, first differing position) {bad}"


def _count_swaps(engine: Engine) -> list[int]:
    """[swaps out] counted from every plan the engine's scheduler makes (real swaps of computed rows, not a
    request rolled back in the step that admitted it)."""
    swaps = [0]
    schedule = engine.scheduler.schedule

    def spy():
        plan, ended = schedule()
        swaps[0] += len(plan.swap_out)
        return plan, ended

    engine.scheduler.schedule = spy
    return swaps


@pytest.mark.parametrize("sampled,n_threads", [(False, 1), (False, 2), (True, 2)],
                         ids=("greedy-1thr", "greedy-2thr", "sampled-2thr"))
def test_preempted_and_resumed_in_a_small_pool(case, sampled, n_threads):
    """A pool of 352 positions (22 blocks of 16) for eighteen requests, each prompt and each method twice: requests
    are swapped out and back in (counted: real swaps, not roll-backs), and every answer is its own
    batch-1 AR decode at one thread.  Which pool size swaps is not monotonic (a tighter pool admits fewer requests at
    once) and auto's choices follow its measured timings, so where one pool happens to swap nothing the next is
    tried; every run's answers are checked."""
    model, prompts, refs, known = case
    requests = [(j % len(prompts), *known[(j + j // len(prompts)) % len(known)]) for j in range(2 * len(prompts))]
    bad, swapped = [], 0
    for pool in (352, 480, 320):
        engine = Engine(model, "ar", max_batch=8, block_size=16, kv_budget=pool)
        swaps = _count_swaps(engine)
        with threads(n_threads):
            outs = _engine_run(engine, requests, sampled, prompts)
        bad += _mismatches(outs, [refs[sampled][j] for j, _, _ in requests],
                           [f"pool {pool}: prompt {j} by {m}" for j, m, _ in requests])
        swapped += swaps[0]
        if swapped:
            break
    assert swapped > 0, "nothing was swapped out: preemption went untested"
    assert not bad, f"{n_threads} thread(s): (request, first differing position) {bad}"
