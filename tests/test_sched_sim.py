"""benchmarks/sched_sim.py: the real scheduler driven by a fake executor on a tiny trace (no model, seconds) - every
request ends with its own answer length, every block comes back, and the paged pool runs more requests at once
than the old contiguous reservation on a chat trace."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from dasspec.engine.core.blocks import BlockPool


def _sim():
    name = "bench_sched_sim"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "benchmarks" / "sched_sim.py"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod                  # dataclasses look their module up
        spec.loader.exec_module(mod)
    return sys.modules[name]


def _family(sim, positions: int = 4400):
    """Huginn-like costs, a small pool (one request of the whole context fits): a few chat requests fill it."""
    return sim.Family("tiny", 32, 4096, 2_787_840, 0, positions, a=0.03, b=2.6e-4, c=8.3e-7)


@pytest.mark.parametrize("method", ["ar", "das-wave"])
def test_every_request_finishes_with_its_answer_and_every_block_returns(method):
    sim = _sim()
    fam = _family(sim)
    trace = sim.chat_trace(24, fam.context, np.random.default_rng(1), rate=None)
    drafter = sim.methods(3.5)[method]
    pool = BlockPool.accounting(fam.positions, 16, fam.bytes_per_token)
    res = sim.run_after(fam, trace, drafter, 16, 64, 512, seed=0, pool=pool)
    assert res["unfinished"] == 0 and res["wrong_lengths"] == 0
    assert res["tokens"] == sum(r.answer for r in trace)
    assert pool.in_use == 0 and pool.available == pool.capacity_blocks      # every block back (some cached)
    assert res["prefix_hit"] > 0                                            # system prompts are shared
    before = sim.run_before(fam, trace, drafter, 64, seed=0, chat_1024=False)
    assert before["tokens"] == res["tokens"]
    assert res["mean_running"] >= before["mean_running"]
    assert res["mean_decoding"] >= before["mean_decoding"]
    assert res["max_held"] <= fam.positions + 16 and before["max_held"] <= fam.positions


def test_the_checks_catch_a_pool_that_never_frees(monkeypatch):
    """The mutation the invariants are there for: blocks never return, so the pool fills and the run stalls or
    ends with blocks held."""
    sim = _sim()
    fam = _family(sim)
    trace = sim.chat_trace(24, fam.context, np.random.default_rng(1), rate=None)
    monkeypatch.setattr(BlockPool, "free", lambda self, blocks: None)
    pool = BlockPool.accounting(fam.positions, 16, fam.bytes_per_token)
    try:
        res = sim.run_after(fam, trace, sim.methods(3.5)["ar"], 16, 64, 512, seed=0, pool=pool)
    except (RuntimeError, AssertionError):
        return
    assert res["unfinished"] or pool.in_use


def test_the_gated_variant_and_the_accounting_pool():
    sim = _sim()
    fam = _family(sim)
    trace = sim.eval_trace(16, fam.context, np.random.default_rng(2), rate=None)
    res = sim.run_after(fam, trace, sim.methods(3.5)["ar"], 32, 64, 512, seed=0, scheduler=sim.GatedScheduler)
    assert res["unfinished"] == 0 and res["wrong_lengths"] == 0 and res["blocks_left"] == 0
    assert res["prefix_hit"] > 0.5                                          # 900 shared tokens of ~1000
    pool = BlockPool.accounting(100, 16, 1000)
    assert pool.capacity_blocks == 7 and "7 blocks of 16 positions" in pool.describe()
    with pytest.raises(RuntimeError, match="accounting"):
        pool.tensors()


def test_the_real_configs_bytes_per_token():
    sim = _sim()
    if not (sim.CHECKPOINTS / "huginn-0125" / "config.json").exists():
        pytest.skip(f"no checkpoint files in {sim.CHECKPOINTS}")
    huginn = sim.family("huginn-0125", 400)
    assert huginn.bytes_per_token == 2 * 55 * 96 * 2 * (4 * 32 + 2 + 2)    # ~2.8 MB per token in bfloat16
    ouro = sim.family("ouro-1.4b", 400)
    assert ouro.bytes_per_token == 2 * 16 * 128 * 2 * 24 * 4
    assert 20_000 < huginn.positions < 30_000 and 80_000 < ouro.positions < 110_000


def test_the_fake_executor_answers_as_the_real_one():
    """The real engine (a tiny random model, AR, a pool small enough to preempt, shared prompt prefixes) and the
    simulation of the same requests get the same plan at every step: same starts, blocks, prompt rows, rooms and
    swaps - so the fake executor's answers drive the scheduler exactly as the real executor's do."""
    import torch

    from dasspec.engine.api.engine import Engine
    from dasspec.testing import random_model

    sim = _sim()
    model = random_model("huginn", seed=2, mean_recurrence=3, n_prelude=1, n_core=1, n_coda=1)
    engine = Engine(model, "ar", max_batch=4, kv_budget=64, block_size=4, max_step_tokens=16)
    rng = np.random.default_rng(3)
    shared = rng.integers(3, model.config.vocab_size, 9).tolist()
    prompts = [(shared if i % 2 else []) + rng.integers(3, model.config.vocab_size, int(n)).tolist()
               for i, n in enumerate(rng.integers(3, 16, 6))]
    news = [int(n) for n in rng.integers(4, 14, 6)]
    real: list = []
    schedule = engine.scheduler.schedule

    def recorded():
        plan, ended = schedule()
        real.append(sim.plan_summary(plan))
        return plan, ended

    engine.scheduler.schedule = recorded
    for p, n in zip(prompts, news):
        engine.add(p, max_new_tokens=n, eos=False)
    with torch.inference_mode():
        while engine.has_work:
            engine.step()
    assert engine.scheduler.preemptions > 0 and engine.scheduler.shared_rows > 0   # the case is not trivial

    fam = sim.Family("tiny", 3, model.config.block_size, 1, 0, 64, a=1e-3, b=1e-5, c=1e-8)
    trace = [sim.Req(i, 0.0, p, n, n, n) for i, (p, n) in enumerate(zip(prompts, news))]
    simulated: list = []
    res = sim.run_after(fam, trace, sim.SimDrafter("ar", engine._default.width), 4, 4, 16, seed=0,
                        record=simulated)
    assert res["unfinished"] == 0 and res["wrong_lengths"] == 0
    assert simulated == real
