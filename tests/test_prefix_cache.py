"""PrefixCache: copied rows equal a full prefill's (up to float rounding), only the rest of the prompt is run, every
method stays equal to AR under the cache, and requests with other settings are refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import dasspec
from dasspec.eval.bench.runner import dev_prompts
from dasspec.model.checkpoint import BUNDLED_DIR
from dasspec.engine.request import Request
from dasspec.engine.prefix_cache import common_prefix
from dasspec.engine.stopping import StopRule
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


@pytest.fixture(scope="module")
def model():
    return random_model("raven-llama", seed=7, mean_recurrence=6, n_prelude=1, n_core=2, n_coda=1)


def _prompts(vocab: int, prefix_len: int, count: int) -> tuple[list[int], list[list[int]]]:
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(2, vocab, (prefix_len // 3,), generator=g).repeat(4)[:prefix_len].tolist()
    tails = [torch.randint(2, vocab, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
             for _ in range(count)]
    return prefix, [prefix + t for t in tails]


def _prefilled(model, prompt, **kw) -> Request:
    dec = Request(model, prompt, StopRule(4), num_steps=kw.pop("num_steps", None), init_scale=1.0, seed=3, **kw)
    with torch.inference_mode():
        dec.prefill()
    return dec


def test_copied_rows_equal_a_full_prefill(model):
    prefix, (prompt, *_) = _prompts(model.config.vocab_size, 20, 1)
    pc = dasspec.PrefixCache(model, prefix, init_scale=1.0, seed=3)
    full, cached = _prefilled(model, prompt), _prefilled(model, prompt, prefix_cache=pc)
    P, R = len(prompt), model.R
    assert cached.stats.cached_tokens == 20 and full.stats.cached_tokens == 0
    assert cached.stats.prefill_updates == R * (P - 20) and full.stats.prefill_updates == R * P
    assert cached.n == full.n == P and cached.generated == full.generated
    for a, b in zip(full.cache.tensors(), cached.cache.tensors()):
        torch.testing.assert_close(b[..., :P, :], a[..., :P, :], rtol=1e-4, atol=1e-5)
    # A prompt that *is* the cached prefix still runs its last token (for the first logits).
    same = _prefilled(model, prefix, prefix_cache=pc)
    assert same.stats.cached_tokens == 19 and same.generated == _prefilled(model, prefix).generated


def test_only_the_common_prefix_is_reused(model):
    prefix, (prompt, *_) = _prompts(model.config.vocab_size, 20, 1)
    pc = dasspec.PrefixCache(model, prefix, init_scale=1.0, seed=3)
    other = prompt[:9] + [(prompt[9] + 1) % model.config.vocab_size] + prompt[10:]
    assert _prefilled(model, other, prefix_cache=pc).stats.cached_tokens == 9
    unrelated = [(t + 1) % model.config.vocab_size for t in prompt]
    dec = _prefilled(model, unrelated, prefix_cache=pc)
    assert dec.stats.cached_tokens == 0 and dec.generated == _prefilled(model, unrelated).generated
    assert common_prefix([prompt, other, prompt]) == 9 and common_prefix([prompt]) == len(prompt)


def test_every_method_equals_ar_under_a_prefix_cache(model):
    prefix, prompts = _prompts(model.config.vocab_size, 24, 8)
    for init_scale in (0.0, 1.0):
        pc = dasspec.PrefixCache(model, prefix, init_scale=init_scale, seed=1)
        drafted = 0
        for prompt in prompts:
            kw = dict(max_new_tokens=12, init_scale=init_scale, seed=1, eos=False, prefix_cache=pc)
            ref = dasspec.generate(model, prompt, "ar", **kw)
            assert ref.stats.cached_tokens == 24 and len(ref.tokens) == 12
            for method, knobs in CASES:
                out = dasspec.generate(model, prompt, method, **kw, **knobs)
                assert out.tokens == ref.tokens, (init_scale, prompt, method, knobs)
                assert out.stats.cached_tokens == 24
                drafted += sum(out.stats.accepted)
        assert drafted > 0


def test_requests_with_other_settings_are_refused(model):
    prefix, (prompt, *_) = _prompts(model.config.vocab_size, 10, 1)
    pc = dasspec.PrefixCache(model, prefix, num_steps=4, init_scale=0.5, seed=2)
    assert len(pc) == 10 and pc.nbytes > 0
    ok = dict(num_steps=4, init_scale=0.5, seed=2, max_new_tokens=3, prefix_cache=pc)
    assert dasspec.generate(model, prompt, **ok).stats.cached_tokens == 10
    for change, word in ((dict(num_steps=6), "num_steps 6"), (dict(init_scale=1.0), "init_scale"),
                         (dict(seed=0), "seed 0")):
        with pytest.raises(ValueError, match=word):
            dasspec.generate(model, prompt, **{**ok, **change})
    other = random_model("raven-llama", seed=8, mean_recurrence=6, n_prelude=1, n_core=2, n_coda=1)
    with pytest.raises(ValueError, match="another model"):
        dasspec.generate(other, prompt, **ok)
    moved = random_model("raven-llama", seed=7, mean_recurrence=6, n_prelude=1, n_core=2, n_coda=1)
    pc_moved = dasspec.PrefixCache(moved, prefix, num_steps=4, init_scale=0.5, seed=2)
    moved.to(torch.float64)
    with pytest.raises(ValueError, match="float64"):
        dasspec.generate(moved, prompt, **{**ok, "prefix_cache": pc_moved})
    with pytest.raises(ValueError, match="empty prefix"):
        dasspec.PrefixCache(model, [])
    with pytest.raises(ValueError, match="context"):
        dasspec.PrefixCache(model, [3] * (model.config.block_size + 1))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        dasspec.PrefixCache(model, [model.config.vocab_size])


def test_caches_that_do_not_fit_fail_before_any_work(model, monkeypatch):
    """A request (or a prefix cache) whose depth cache would exceed 90% of the free memory is refused up front,
    with the bytes it needs in the message."""
    from dasspec.engine import memory
    from dasspec.model.cache import bytes_per_token

    per = bytes_per_token(model.config, model.R, model.dtype)
    cfg, size = model.config, torch.finfo(model.dtype).bits // 8
    layers = cfg.n_core * model.R + cfg.n_prelude + cfg.n_coda      # core layers at every depth, prelude, coda
    assert per == layers * 2 * cfg.n_kv_heads * cfg.head_dim * size    # K and V, every KV head
    monkeypatch.setattr(memory, "available_memory", lambda device: 10 * per)
    monkeypatch.delenv("DASSPEC_IGNORE_MEMORY", raising=False)
    with pytest.raises(dasspec.CacheCapacityError, match=r"needs 42.0 KiB \(1792 B/token x 24 positions at R=6\) but only 17.5 KiB"):
        dasspec.generate(model, [3] * 4, max_new_tokens=18)       # 4 + 18 + 2 scratch rows
    with pytest.raises(dasspec.CacheCapacityError, match="shorter prefix"):
        dasspec.PrefixCache(model, [3] * 12)
    assert dasspec.generate(model, [3] * 4, max_new_tokens=2).tokens        # 8 rows fit


def test_bundled_model_few_shot_prompts_under_a_prefix_cache():
    """The shipped setting end to end: GSM8K 2-shot prompts (182 shared tokens), the bundled model at full depth with
    its tuned DAS-Wave defaults (seed branch, copy runs, wide GEMM attention) and SAM, each equal to AR under the
    same prefix cache; the first token's logits match an uncached prefill."""
    data = Path(os.environ.get("DASSPEC_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
    if not (BUNDLED_DIR / "config.json").exists() or not (data / "gsm8k").exists():
        pytest.skip("needs the bundled model and the GSM8K data")
    model = dasspec.load_model()
    prompts = dev_prompts(model, "gsm8k", 3, 40, ["gsm8k=2"], str(data))
    shared = common_prefix([p.ids for p in prompts])
    assert shared > 100
    pc = dasspec.PrefixCache(model, prompts[0].ids[:shared])
    for p in prompts:
        kw = dict(max_new_tokens=40, stop=list(p.task.stop), prefix_cache=pc)
        ref = dasspec.generate(model, p.ids, "ar", **kw)
        assert ref.stats.cached_tokens == shared
        for method in ("das-wave", "sam"):
            assert dasspec.generate(model, p.ids, method, **kw).tokens == ref.tokens, method
    full, cached = _first_logits(model, prompts[0].ids), _first_logits(model, prompts[0].ids, pc)
    torch.testing.assert_close(cached, full, rtol=1e-4, atol=1e-4)


def _first_logits(model, prompt, pc=None):
    """The prefill's last-row logits, with the prompt's common prefix with ``pc`` copied in (when given)."""
    dec = Request(model, prompt, StopRule(1), prefix_cache=pc)
    m = pc.reusable(prompt) if pc is not None else 0
    with torch.inference_mode():
        if m:
            dec.cache.load_prefix(pc.cache, m)
        return dec.target_pass(m, len(prompt) - m, logit_rows=slice(-1, None), phase="prefill")
