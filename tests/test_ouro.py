"""Ouro against an independent plain re-implementation of upstream's forward (tests/reference_impl.py,
``OuroReference``) on a random HF Ouro folder: max |d logit| <= 1e-4 in float32 for T = 1..4 - the default target
(the last step), every ``exit_at_step`` and several ``exit_threshold`` values - identical greedy continuations,
and the exit targets through the depth cache chunk by chunk (as a verifier computes them).  The last tests show the
tolerance has teeth and pin upstream's pitfalls."""

from __future__ import annotations

import pytest
import torch

import dasspec
from dasspec.model.cache import DepthCache
from dasspec.model.exit import ExitRule
from dasspec.testing import random_model
from reference_impl import OuroReference, write_ouro_checkpoint

TOL = 1e-4
STEPS = (1, 2, 3, 4)
TAUS = (0.3, 0.6, 0.97)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = write_ouro_checkpoint(tmp_path_factory.mktemp("ouro") / "m", seed=3, n_shards=2)
    return dasspec.load_model(folder, device="cpu", dtype=torch.float32), OuroReference(folder)


def ids_of(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_last_step_matches_upstream_for_T_1_to_4(pair):
    model, ref = pair
    ids = ids_of(40, seed=1)
    errs = {T: err(model(ids, num_steps=T), ref(ids, T, use_early_exit_gate=False)) for T in STEPS}
    assert max(errs.values()) <= TOL, f"max |dlogit| by T: {errs}"
    assert model.R == 4 and torch.equal(model(ids), model(ids, num_steps=4))       # total_ut_steps is the default


def test_exit_at_step_matches_upstream(pair):
    model, ref = pair
    ids = ids_of(32, seed=2)
    errs = {(T, s): err(model(ids, num_steps=T, exit_at_step=s), ref(ids, T, exit_at_step=s))
            for T in STEPS for s in range(T)}
    assert max(errs.values()) <= TOL, errs
    assert err(model(ids, exit_at_step=0), model(ids, exit_at_step=3)) > 100 * TOL     # the steps differ


def test_exit_threshold_matches_upstream(pair):
    model, ref = pair
    ids = ids_of(48, seed=3)
    chosen = set()
    for T in STEPS:
        for tau in TAUS:
            want, steps = ref(ids, T, exit_threshold=tau, return_exit_steps=True)
            got = model(ids, num_steps=T, exit_threshold=tau)
            assert err(got, want) <= TOL, (T, tau)
            chosen.update(steps.flatten().tolist())
    assert chosen == {0, 1, 2, 3}, "the positions must exit at every step, or the rule is barely tested"


def chunked(model, ids: torch.Tensor, R: int, rule: ExitRule | None) -> tuple[torch.Tensor, DepthCache]:
    """Logits of every position through the depth cache, as a prefill, then AR steps and blocks over the verified
    prefix (``full_depth`` as AR and verification run it), and the cache it leaves (zeroed first: a freed cache's
    memory would otherwise carry another run's K/V into rows this run never wrote)."""
    cache = DepthCache(model.config, R, ids.shape[1], "cpu", torch.float32, zeroed=True)
    rows = []
    with torch.inference_mode():
        for w in (10, 1, 1, 1, 5, 6):
            n = cache.n
            h0 = model.initial_state(torch.arange(n, n + w)).unsqueeze(0)
            rows.append(model.full_depth(ids[:, n: n + w], h0, model.span(n, n, w), cache, R, exit=rule)[0])
            cache.commit(w)
    return torch.cat(rows), cache


@pytest.mark.parametrize("exit", [{"exit_threshold": 0.5}, {"exit_at_step": 1}], ids=["tau", "step"])
def test_exit_targets_through_the_cache(pair, exit):
    """The exit rule inside ``full_depth`` over the depth cache gives the uncached forward's logits, and leaves the
    cache as the default target does: every step of every position still runs and stores its K/V, so drafts that
    read deep K/V of the prefix find it whatever the target."""
    model, _ = pair
    ids, R = ids_of(24, seed=4), 4
    logits, cache = chunked(model, ids, R, model.exit_rule(**exit))
    assert err(logits, model(ids, num_steps=R, **exit)[0]) <= TOL
    default_logits, default_cache = chunked(model, ids, R, None)
    assert err(default_logits, model(ids, num_steps=R)[0]) <= TOL
    assert torch.equal(cache.core_k, default_cache.core_k) and torch.equal(cache.core_v, default_cache.core_v)


@pytest.mark.parametrize("T", [1, 4])
def test_greedy_continuations_identical(pair, T):
    model, ref = pair
    seen = set()
    for seed in (5, 6):
        prompt = ids_of(10, seed=seed)[0].tolist()
        want = ref.greedy(prompt, 8, T, use_early_exit_gate=False)
        got = dasspec.generate(model, prompt, method="ar", max_new_tokens=8, num_steps=T, eos=False)
        assert got.tokens == want, (T, seed)
        for exit in ({"exit_threshold": 0.5}, {"exit_at_step": T - 1}):
            seq = list(prompt)
            for _ in range(8):
                seq.append(int(model(torch.tensor([seq]), num_steps=T, **exit)[0, -1].argmax()))
            assert seq[len(prompt):] == ref.greedy(prompt, 8, T, **exit), (T, seed, exit)
        seen.update(want)
    assert len(seen) >= 3, "degenerate continuations would make this comparison vacuous"


# --- the tolerance has teeth, and upstream's pitfalls ---------------------------------------------------------------

def test_pitfall_final_norm_only_after_the_loop(pair, monkeypatch):
    model, ref = pair
    monkeypatch.setattr(ref, "norm_every_step", False)
    ids = ids_of(16, seed=7)
    assert err(model(ids, num_steps=4), ref(ids, 4, use_early_exit_gate=False)) > 100 * TOL


def test_pitfall_exit_at_step_is_0_based(pair):
    model, ref = pair
    ids = ids_of(16, seed=8)
    assert err(model(ids, exit_at_step=1), ref(ids, 4, exit_at_step=2)) > 100 * TOL


def test_pitfall_upstream_default_reads_config_threshold_1(tmp_path):
    """Upstream's forward falls back to config.json's early_exit_threshold (1.0 in the published files), which
    exits early wherever the cumulative exit probability rounds to 1 - here a saturated gate at step 0.  dasspec's
    default is the last step (the issue's, vLLM's); exit_threshold=1.0 reproduces upstream's default."""
    folder = write_ouro_checkpoint(tmp_path / "m", seed=4, edit={"model.early_exit_gate.bias": torch.tensor([40.0])})
    model, ref = dasspec.load_model(folder, device="cpu"), OuroReference(folder)
    ids = ids_of(12, seed=9)
    upstream_default, steps = ref(ids, return_exit_steps=True)
    assert steps.eq(0).all()
    assert err(model(ids, exit_threshold=1.0), upstream_default) <= TOL
    assert err(model(ids), ref(ids, use_early_exit_gate=False)) <= TOL
    assert err(model(ids), upstream_default) > 100 * TOL


# --- the exit options: refused where they have no meaning, named when malformed ----------------------------------

def test_families_without_a_gate_refuse_the_exit_options():
    model = random_model("raven-llama")
    ids = torch.tensor([[1, 2, 3]])
    for exit in ({"exit_threshold": 0.5}, {"exit_at_step": 0}):
        with pytest.raises(ValueError, match="need a model with an early-exit gate .Ouro.; a raven-llama model has "
                                             "none"):
            model(ids, num_steps=2, **exit)


@pytest.mark.parametrize("exit,message", [
    ({"exit_threshold": 1.5}, r"exit_threshold must be a number in \[0, 1\], got 1.5"),
    ({"exit_threshold": float("nan")}, r"exit_threshold must be a number in \[0, 1\], got nan"),
    ({"exit_threshold": True}, r"exit_threshold must be a number in \[0, 1\], got True"),
    ({"exit_threshold": "0.5"}, r"exit_threshold must be a number in \[0, 1\], got '0.5'"),
    ({"exit_at_step": -1}, "exit_at_step must be a whole number >= 0 .0-based., got -1"),
    ({"exit_at_step": 1.0}, "exit_at_step must be a whole number >= 0 .0-based., got 1.0"),
    ({"exit_at_step": 4}, r"exit_at_step=4 is beyond the 4 recurrence steps of this call \(0-based: 0..3\)"),
    ({"exit_at_step": 2, "num_steps": 2}, "exit_at_step=2 is beyond the 2 recurrence steps"),
    ({"exit_at_step": 1, "exit_threshold": 0.5}, "give exit_threshold or exit_at_step, not both"),
])
def test_bad_exit_options_are_named(pair, exit, message):
    model, _ = pair
    with pytest.raises(ValueError, match=message):
        model(ids_of(4, seed=0), **exit)


def test_exit_rule_alone():
    assert ExitRule.of() is None
    with pytest.raises(ValueError, match="needs exit_threshold or exit_at_step"):
        ExitRule()
    gates = [torch.tensor([[5.0, -5.0]]), torch.tensor([[0.0, -5.0]]), torch.tensor([[0.0, 0.0]])]
    # position 0 exits at step 0 (sigmoid(5) > 0.9); position 1 never reaches 0.9 before the last step
    assert ExitRule(threshold=0.9).exit_steps(gates).tolist() == [[0, 2]]
    assert ExitRule(threshold=0.0).exit_steps(gates).tolist() == [[0, 0]]
    # float32 leaves this position's last cumulative probability at 1 - 6e-8: tau = 1.0 is never reached, and the
    # position reads the last step (upstream's fallback)
    gates = [torch.tensor([[-1.4]]), torch.tensor([[-1.4]]), torch.tensor([[-0.8]])]
    assert ExitRule(threshold=1.0).exit_steps(gates).tolist() == [[2]]
