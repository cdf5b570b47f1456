"""S (eq. 8), A (eq. 9), G (eq. 10) and the bootstrap CIs on synthetic numbers with known answers."""

import math

import numpy as np
import pytest

from dasspec.eval.bench import metrics
from dasspec.eval.bench.report import summarize


def test_speedup_is_the_mean_of_per_prompt_ratios_not_a_ratio_of_means():
    # prompt 1: method 2x faster; prompt 2: method 2x slower.  Eq. (8): (2 + 0.5) / 2 = 1.25.
    r = metrics.throughput_ratios(n_a=[10, 10], t_a=[1.0, 4.0], n_ar=[10, 10], t_ar=[2.0, 2.0])
    assert r.tolist() == [2.0, 0.5]
    assert metrics.speedup(r) == pytest.approx(1.25)      # pooled throughput would give (20/5) / (20/4) = 0.8


def test_ratio_uses_tokens_per_second_of_each_arm():
    # a method that stops earlier (fewer tokens) in the same time is slower per token
    r = metrics.throughput_ratios([5], [1.0], [10], [1.0])
    assert r.tolist() == [0.5]


def test_ratio_rejects_bad_inputs():
    with pytest.raises(ValueError, match="> 0"):
        metrics.throughput_ratios([1], [0.0], [1], [1.0])
    with pytest.raises(ValueError, match="AR produced no tokens"):
        metrics.throughput_ratios([1], [1.0], [0], [1.0])
    with pytest.raises(ValueError, match="one entry per prompt"):
        metrics.throughput_ratios([1, 2], [1.0], [1], [1.0])
    with pytest.raises(ValueError):
        metrics.speedup([])


def test_accepted_length_and_committed_progress_by_hand():
    assert metrics.accepted_length([2, 4]) == 3.0
    assert metrics.accepted_length([]) is None                      # B_p = 0: undefined, not zero
    assert metrics.committed_progress([2, 4], [1, 0]) == 3.5         # (2+1 + 4+0) / 2
    assert metrics.committed_progress([], []) is None
    with pytest.raises(ValueError, match="one entry per verification"):
        metrics.committed_progress([1, 2], [1])
    # A = mean over prompts with B_p > 0 (eq. 9): prompts [2,4] -> 3, [0] -> 0, [] -> excluded
    per_prompt = [metrics.accepted_length(a) for a in ([2, 4], [0], [])]
    assert metrics.mean_over_prompts(per_prompt) == 1.5
    assert metrics.mean_over_prompts([None, None]) is None


def test_bootstrap_two_point_distribution_has_known_percentiles():
    # Resampling [1, 3]: the mean is 1 w.p. 1/4, 2 w.p. 1/2, 3 w.p. 1/4, so the 2.5% / 97.5% points are 1 and 3.
    assert metrics.bootstrap_ci([1.0, 3.0], seed=0) == (1.0, 3.0)
    lo, hi = metrics.bootstrap_ci([1.0, 3.0], level=0.4, seed=0)     # 30% / 70% points are both 2
    assert (lo, hi) == (2.0, 2.0)


def test_bootstrap_constant_values_give_a_point_interval():
    assert metrics.bootstrap_ci([1.7] * 12) == (pytest.approx(1.7), pytest.approx(1.7))


def test_bootstrap_matches_normal_theory_for_a_large_sample():
    rng = np.random.default_rng(1)
    x = rng.normal(2.0, 1.0, 400)
    lo, hi = metrics.bootstrap_ci(x, seed=3)
    half = 1.96 * x.std() / math.sqrt(x.size)
    assert lo == pytest.approx(x.mean() - half, abs=0.1 * half)
    assert hi == pytest.approx(x.mean() + half, abs=0.1 * half)


def percentile_bootstrap(x: np.ndarray, n_resamples: int, seed: int, level: float = 0.95) -> tuple[float, float]:
    """The textbook percentile bootstrap of the mean, written out independently of dasspec (own RNG stream, one
    resample at a time, np.percentile)."""
    rng = np.random.default_rng(seed)
    means = [x[rng.integers(0, x.size, x.size)].mean() for _ in range(n_resamples)]
    tail = 100 * (1 - level) / 2
    return float(np.percentile(means, tail)), float(np.percentile(means, 100 - tail))


@pytest.mark.parametrize("level", [0.95, 0.8])
def test_bootstrap_agrees_with_a_straightforward_percentile_bootstrap(level):
    x = np.random.default_rng(0).exponential(1.0, 40)          # skewed: a symmetric shortcut would show
    lo, hi = metrics.bootstrap_ci(x, seed=5, level=level)
    ref_lo, ref_hi = percentile_bootstrap(x, 40_000, seed=123, level=level)
    tol = 0.1 * x.std() / math.sqrt(x.size)                    # ~4 Monte Carlo standard errors of an endpoint
    assert lo == pytest.approx(ref_lo, abs=tol) and hi == pytest.approx(ref_hi, abs=tol)
    assert hi - x.mean() > x.mean() - lo                       # a right-skewed mean has the longer upper tail


def test_bootstrap_is_reproducible_per_seed_and_precise_at_the_default_resamples():
    x = np.random.default_rng(0).exponential(1.0, 40)
    assert metrics.bootstrap_ci(x, seed=5) == metrics.bootstrap_ci(x, seed=5)   # seeded: reports can be rebuilt
    los = np.array([metrics.bootstrap_ci(x, seed=s)[0] for s in range(30)])
    assert len(set(los)) == len(los)                           # the seed is what varies a resample
    # The default resample count keeps an endpoint's seed-to-seed spread (it shrinks as 1 / sqrt(resamples)) well
    # below the sampling error it reports; a fifth as many resamples would not pass this bound.
    assert los.std() < 0.03 * x.std() / math.sqrt(x.size)


def test_bootstrap_rejects_a_level_outside_0_1():
    for level in (0.0, 1.0, 95):
        with pytest.raises(ValueError, match="level"):
            metrics.bootstrap_ci([1.0, 2.0], level=level)


def test_percentile_interval_covers_the_true_mean_about_95_percent_of_the_time():
    rng = np.random.default_rng(7)
    hits = 0
    trials = 300
    for _ in range(trials):
        x = rng.normal(1.0, 0.5, 40)
        lo, hi = metrics.bootstrap_ci(x, n_resamples=1000, seed=int(rng.integers(1 << 30)))
        hits += lo <= 1.0 <= hi
    assert 0.88 <= hits / trials <= 0.99


def test_iid_indices_cover_the_sample_uniformly():
    idx = metrics.bootstrap_indices(7, 7000, np.random.default_rng(0))
    assert idx.shape == (7000, 7)
    counts = np.bincount(idx.ravel(), minlength=8)
    assert counts[7] == 0 and (np.abs(counts[:7] / idx.size - 1 / 7) < 0.01).all()


def test_moving_block_indices_are_whole_blocks_with_uniform_starts():
    n, block, B = 23, 5, 4000
    idx = metrics.bootstrap_indices(n, B, np.random.default_rng(0), block=block)
    assert idx.shape == (B, n)
    starts = idx[:, ::block]                                   # ceil(23 / 5) = 5 blocks, the last one cut to 3
    assert starts.shape == (B, 5)
    for k in range(5):                                         # each block: consecutive requests from its start
        chunk = idx[:, k * block:(k + 1) * block]
        assert (chunk == starts[:, k:k + 1] + np.arange(chunk.shape[1])).all()
    # a block never runs off the stream, and every start 0..n-block is drawn about equally often
    counts = np.bincount(starts.ravel(), minlength=n)
    assert counts[n - block + 1:].sum() == 0
    assert (np.abs(counts[:n - block + 1] / starts.size - 1 / (n - block + 1)) < 0.01).all()
    # blocks are drawn independently: the second start does not follow the first
    assert abs(np.corrcoef(starts[:, 0], starts[:, 1])[0, 1]) < 0.05


def test_moving_block_with_at_most_block_items_resamples_the_whole_stream():
    idx = metrics.bootstrap_indices(3, 50, np.random.default_rng(0), block=5)
    assert (idx == np.arange(3)).all()


def test_moving_block_with_the_whole_stream_as_one_block_is_degenerate():
    x = [1.0, 2.0, 3.0]
    assert metrics.bootstrap_ci(x, block=5) == (pytest.approx(2.0), pytest.approx(2.0))


def test_moving_block_widens_the_interval_for_a_dependent_stream():
    # AR(1) with rho = 0.9: i.i.d. resampling ignores the dependence and is too narrow; blocks of 5 keep part of it.
    rng = np.random.default_rng(0)
    x = np.zeros(400)
    for i in range(1, x.size):
        x[i] = 0.9 * x[i - 1] + rng.normal()
    iid = np.subtract(*metrics.bootstrap_ci(x, seed=1)[::-1])
    mbb = np.subtract(*metrics.bootstrap_ci(x, seed=1, block=5)[::-1])
    assert mbb > 1.5 * iid
    # and on independent data the two agree roughly
    y = rng.normal(size=400)
    iid_y = np.subtract(*metrics.bootstrap_ci(y, seed=1)[::-1])
    mbb_y = np.subtract(*metrics.bootstrap_ci(y, seed=1, block=5)[::-1])
    assert mbb_y == pytest.approx(iid_y, rel=0.25)


def test_summarize_speedup_picks_the_bootstrap_by_statefulness():
    r = list(np.linspace(1.0, 3.0, 20))
    assert metrics.summarize_speedup(r)["bootstrap"] == "paired"
    s = metrics.summarize_speedup(r, stateful=True)
    assert s["bootstrap"] == "moving-block(5)"
    assert s["S"] == pytest.approx(2.0) and s["n"] == 20 and s["lo"] < 2.0 < s["hi"]


def test_short_stateful_stream_shrinks_the_block_instead_of_collapsing_the_interval():
    r = [1.2, 1.9, 1.4, 1.7]                     # 4 requests < one block of 5
    s = metrics.summarize_speedup(r, stateful=True)
    assert s["bootstrap"] == "moving-block(2)"
    assert s["lo"] < s["S"] < s["hi"]


def _rec(task, pid, idx, method, n, t, passes, accepted, target, tokens, stateful=False, session="s1"):
    return {"task": task, "prompt_id": pid, "prompt_index": idx, "method": method, "new_tokens": n,
            "wall_time": t, "sequential_passes": passes, "accepted": accepted, "target_tokens": target,
            "tokens": tokens, "stop_reason": "max_new_tokens", "stateful": stateful, "session": session}


def test_summary_pairs_each_prompt_with_its_own_ar_record():
    recs = [
        _rec("t", "p0", 0, "ar", 4, 2.0, 32, [0, 0, 0], [1, 1, 1], [5, 6, 7, 8]),
        _rec("t", "p0", 0, "fast", 4, 1.0, 16, [2], [1], [5, 6, 7, 8]),
        _rec("t", "p1", 1, "ar", 4, 1.0, 32, [0, 0, 0], [1, 1, 1], [1, 2, 3, 4]),
        _rec("t", "p1", 1, "fast", 4, 2.0, 8, [1, 0], [1, 1], [1, 2, 3, 9]),     # differs at token 3
        _rec("t", "p2", 2, "fast", 4, 1.0, 8, [3], [0], [1, 1, 1, 1]),           # no AR for p2 yet
    ]
    s = summarize(recs, n_resamples=200)
    c = s.cells[("t", "fast")]
    assert c["n"] == 2
    assert c["S"] == pytest.approx((2.0 + 0.5) / 2)
    assert c["pass_speedup"] == pytest.approx((2.0 + 4.0) / 2)
    assert c["A"] == pytest.approx((2 + 0.5) / 2)
    assert c["G"] == pytest.approx((3 + 1.5) / 2)
    assert c["matches"] == 1
    assert [(m["prompt_id"], m["first_mismatch"]) for m in s.mismatches] == [("p1", 3)]
    assert len(s.unpaired) == 1 and s.unpaired[0]["prompt_id"] == "p2"
    ar = s.cells[("t", "ar")]
    assert ar["S"] == 1.0 and ar["lo"] == 1.0 and ar["hi"] == 1.0 and ar["A"] == 0.0


def test_report_says_when_the_prefill_bounds_every_speedup():
    """Every method runs AR's prefill, so S_p <= t_AR / t_prefill (Amdahl).  A task where the mean of that bound is
    low (outputs stopped after a few tokens) gets a note naming it; one whose decode dominates gets none; the detail
    table shows each cell's mean output length."""
    from dasspec.eval.bench.report import markdown

    def pair(task, pid, idx, n, t_ar, prefill):
        toks = list(range(n))
        ar = _rec(task, pid, idx, "ar", n, t_ar, 32 * n, [0] * n, [1] * n, toks)
        fast = _rec(task, pid, idx, "fast", n, t_ar * 0.9, 32 + 8, [n - 1], [1], toks)
        for r in (ar, fast):
            r.update(prefill_time=prefill, prompt_tokens=100 + idx)
        return [ar, fast]

    recs = pair("short", "a", 0, 3, 1.0, 0.8) + pair("short", "b", 1, 2, 1.0, 0.5) \
        + pair("long", "c", 0, 64, 4.0, 0.4) + pair("long", "d", 1, 64, 4.0, 0.4)
    s = summarize(recs, n_resamples=100)
    assert s.cells[("short", "ar")]["ar_prefill_share"] == pytest.approx(0.65)
    assert s.cells[("short", "fast")]["prefill_bound"] == pytest.approx((1 / 0.8 + 1 / 0.5) / 2)   # not 1 / 0.65
    assert s.cells[("long", "ar")]["prefill_bound"] == pytest.approx(10.0)
    text = markdown(s, {})
    notes = text.split("## Notes", 1)[1]
    assert ("short: AR spends 65% of its time in the prefill (outputs of 2.5 tokens on average after prompts of "
            "100), which every method runs alike, so even a decoder that took no time after it would reach only "
            "about 1.62x here") in notes
    assert "long:" not in notes
    assert "| short | fast | 2 |" in text and "| 2.5 |" in text and "| 64.0 |" in text
