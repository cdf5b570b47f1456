"""Mechanism probes (dasspec/probes): each probe on tiny inputs, checked against hand-computed cases and against the
decoders it explains."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dasspec.methods.sequential import propose_sequential
from dasspec.model.policy import parse_policy
from dasspec.eval.data import DataError
from dasspec.eval.probes import channels, common, cost, factorial, grid, maturity, sweep
from dasspec.eval.probes.teacher import TeacherForced, scored_rows
from dasspec.testing import Stepper, random_model


@pytest.fixture(scope="module")
def model():
    return random_model("huginn", mean_recurrence=4)


@pytest.fixture(scope="module")
def trajs(model):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 97, (7,), generator=g).tolist() for _ in range(2)]
    return common.greedy_trajectories(model, prompts, 8, progress=False)


# --- maturity ---------------------------------------------------------------------------------------------------

def test_cosine_to_final_hand_case():
    # one head, two positions, hd 2: position 0 moves from (1,0) to (1,1), position 1 stays at (0,1)
    d1 = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).view(1, 1, 2, 2)
    d2 = torch.tensor([[1.0, 1.0], [0.0, 1.0]]).view(1, 1, 2, 2)
    cos = maturity.cosine_to_final([d1, d2])
    assert torch.allclose(cos, torch.tensor([[1 / math.sqrt(2), 1.0], [1.0, 1.0]]))


def test_maturity_rows_and_capture_restored(model, trajs):
    rows = maturity.run(model, trajs, progress=False)
    R = model.R
    mean = [r for r in rows if r["layer"] == "mean"]
    assert [r["r"] for r in mean] == list(range(1, R + 1))
    assert all(abs(mean[-1][f"cos_{c}"] - 1) < 1e-5 for c in "qkv")       # depth R against itself
    assert all(-1 <= r[f"cos_{c}"] <= 1 + 1e-6 for r in rows for c in "qkv")
    assert mean[0]["cos_v"] < 0.999                                        # a random core does move v
    assert mean[0]["positions"] == sum(len(t.tokens) for t in trajs)
    per_layer = [r for r in rows if r["layer"] != "mean" and r["r"] == 1]
    assert mean[0]["cos_q"] == pytest.approx(np.mean([r["cos_q"] for r in per_layer]))
    assert all(not blk.attn._forward_hooks for blk in model.transformer.core_block)     # hooks removed


def test_maturity_captures_what_the_depth_cache_stores(model, trajs):
    """The probe's k and v at every core layer and depth r are the K/V a full-depth prefill writes into the depth
    cache at depth r (an independent path: the cache write, not the probe's hooks)."""
    ids = trajs[0].tokens
    captured = maturity.capture_qkv(model, ids)
    tf = TeacherForced(model, ids)
    T = len(ids)
    for layer in range(model.config.n_core):
        assert len(captured[layer]) == model.R
        for r in range(model.R):
            _, k, v = captured[layer][r]
            torch.testing.assert_close(k[0], tf.cache.core_k[layer, r, :, :T], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v[0], tf.cache.core_v[layer, r, :, :T], rtol=1e-5, atol=1e-5)


# --- teacher forcing: channels and grid ------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["huginn", "raven-llama"])
def test_aligned_draft_is_plain_depth_d_forward(family):
    m = random_model(family, mean_recurrence=4)
    ids = torch.randint(2, 97, (23,), generator=torch.Generator().manual_seed(1))
    tf = TeacherForced(m, ids, chunk=7)                  # chunks of 7 exercise the scratch-row masks
    with torch.inference_mode():
        assert torch.allclose(tf.logits, m(ids[None])[0], atol=1e-5)
        for d in (1, 3):
            ref = m(ids[None], num_steps=d)[0]
            assert (tf.draft_logits(d, "aligned", coda="aligned") - ref).abs().max() < 1e-4
        # at d = R the aligned draft is the target itself, with either coda
        assert (tf.draft_logits(m.R, "aligned") - tf.logits).abs().max() < 1e-4
        rows = range(5, 20)
        assert tf.agreement(m.R, "aligned", rows) == (15, 15)


def test_draft_depends_on_read_policy(model):
    ids = torch.randint(2, 97, (20,), generator=torch.Generator().manual_seed(2))
    tf = TeacherForced(model, ids)
    a = tf.draft_logits(1, "aligned")
    v = tf.draft_logits(1, "deep-v")
    assert torch.allclose(a[0], v[0], atol=1e-5)        # position 0 has no prefix: the policy cannot matter
    assert (a[1:] - v[1:]).abs().max() > 1e-3


@pytest.mark.parametrize("policy", ["aligned", "deep-v", "deep-k", "deep-kv"])
def test_probe_draft_equals_sequential_decoder(model, policy):
    """At every anchor of an AR run, the probe's depth-d draft token is the one propose_sequential drafts."""
    prompt = torch.randint(2, 97, (6,), generator=torch.Generator().manual_seed(4)).tolist()
    d = 2
    dec = Stepper(model, prompt, 8, width=2)
    anchors, drafted = [], []
    dec.prefill()
    while not dec.done:
        anchors.append(dec.n)
        with torch.inference_mode():
            drafted.append(int(propose_sequential([dec.ctx], d, [1], parse_policy(policy))[0][0]))
        dec.step()                                # AR step: the trajectory is the target's own
    tokens = torch.tensor(prompt + dec.generated)
    tf = TeacherForced(model, tokens[:-1])
    rows = scored_rows(len(prompt), len(tokens))
    assert anchors[: len(rows)] == list(rows)
    pred = tf.draft_logits(d, policy, rows).argmax(-1).tolist()
    assert pred == drafted[: len(rows)]


def test_channels_own_depth_is_100_percent_and_counts(model, trajs):
    rows = channels.run(model, trajs, depths=[1, model.R], progress=False)
    by = {(r["policy"], r["d"]): r for r in rows}
    assert by["aligned", model.R]["agreement"] == 1.0              # reads the target's own depths
    n = sum(t.new_tokens - 1 for t in trajs)
    assert all(r["positions"] == n for r in rows)
    assert all(r["forced_vs_ar_mismatch"] == 0 for r in rows)
    r = by["deep-kv", 1]
    assert r["gain_vs_aligned"] == pytest.approx(r["agreement"] - by["aligned", 1]["agreement"])
    assert r["ci_low"] <= r["agreement"] <= r["ci_high"]
    with pytest.raises(ValueError, match="draft depths must lie in 1..R"):
        channels.run(model, trajs, depths=[model.R + 1], progress=False)


def test_grid_corners_are_the_named_policies(model, trajs):
    d = 2
    ch = {r["policy"]: r["agreement"] for r in channels.run(model, trajs, depths=[d], progress=False)}
    g = {(r["d_K"], r["d_V"]): r["agreement"]
         for r in grid.run(model, trajs, d, ["r", 1, "R"], ["r", "R"], progress=False)}
    assert len(g) == 6
    assert g["r", "r"] == ch["aligned"] and g["r", "R"] == ch["deep-v"]
    assert g["R", "r"] == ch["deep-k"] and g["R", "R"] == ch["deep-kv"]
    full = grid.run(model, trajs, model.R, ["r"], ["r"], progress=False)
    assert full[0]["agreement"] == 1.0
    assert grid.default_axis(8) == ["r", 1, 2, 4, "R"]
    with pytest.raises(ValueError, match="outside 1..R"):
        grid.parse_axis("r,9", 8)


# --- factorial ---------------------------------------------------------------------------------------------------

def test_interaction_hand_cases():
    zero = {cell: 0.0 for cell in factorial.COMBOS}
    assert factorial.interaction({**zero, (1, 1, 1): 4.0}) == 1.0
    assert factorial.interaction({**zero, (0, 0, 0): 4.0}) == -1.0
    assert factorial.interaction({**zero, (1, 1, 0): 4.0}) == -1.0
    # main effects and two-way interactions only: no three-way interaction
    additive = {(c, k, v): 1 + 2 * c + 3 * k + 5 * v + 7 * k * v + 11 * c * k for c, k, v in factorial.COMBOS}
    assert factorial.interaction(additive) == 0.0
    # K/V interaction present only with carry: E = (interaction with carry) / 4
    carried = {(c, k, v): 8.0 * c * k * v for c, k, v in factorial.COMBOS}
    assert factorial.interaction(carried) == 2.0


def test_factorial_tiny_run(model, tmp_path):
    prompts = [torch.randint(2, 97, (6,), generator=torch.Generator().manual_seed(5)).tolist()]
    rows, summary = factorial.run(model, prompts, 6, gamma=4, rounds=3, w_init=2, k=1, progress=False)
    assert [(r["carry"], r["deep_k"], r["deep_v"]) for r in rows] == factorial.COMBOS
    assert all(r["G"] >= r["A"] and r["G"] >= 1 for r in rows)
    Y = {(r["carry"], r["deep_k"], r["deep_v"]): r["G"] for r in rows}
    assert summary["E_cKV"] == pytest.approx(factorial.interaction(Y))
    factorial.write(rows, summary, tmp_path, common.model_setup(model, None))
    assert {p.name for p in tmp_path.iterdir()} == {"factorial.md", "factorial.csv", "factorial.png"}


# --- timing statistics, sweep and cost -----------------------------------------------------------------------

def _res(n, t, accepted=(1,), target=(1,)):
    stats = SimpleNamespace(new_tokens=n, wall_time=t, accepted=list(accepted), target_tokens=list(target))
    return SimpleNamespace(stats=stats, tokens=[1] * n)


def test_speedup_is_mean_of_paired_throughput_ratios():
    ar = [_res(10, 2.0), _res(20, 2.0)]            # 5 and 10 tokens/s
    arm = [_res(10, 1.0), _res(20, 0.5)]           # 10 and 40 tokens/s -> ratios 2 and 4
    assert common.speedup_ratios(arm, ar).tolist() == [2.0, 4.0]
    assert common.speedup_ratios(arm, ar).mean() == 3.0
    # A and G: means over prompts of the per-prompt means (eq. 9-10), not pooled over verifications
    two = [_res(1, 1, (2, 4), (0, 1)), _res(1, 1, (1,), (1,))]
    assert common.mean_A(two) == 2.0
    assert common.mean_G(two) == pytest.approx((3.5 + 2.0) / 2)
    assert common.bootstrap_ci(np.array([3.0, 3.0, 3.0])) == (3.0, 3.0)
    lo, hi = common.bootstrap_ci(np.array([1, 2, 3, 4]), np.array([2, 2, 2, 2]))
    assert 0.5 <= lo <= 1.25 <= hi <= 2.0
    with pytest.raises(ValueError, match="paired runs differ"):
        common.speedup_ratios(arm, ar[:1])


def test_sweep_plan_and_tiny_run(model, tmp_path):
    base = dict(gamma=4, rounds=3, w_init=2, k=1)
    points = sweep.plan(base, {"k": [1, 2], "gamma": [4], "w_init": [1]})
    assert [(k, v) for k, v, _ in points] == [("k", 1), ("k", 2), ("gamma", 4), ("w_init", 1)]
    with pytest.raises(ValueError, match="W_init"):
        sweep.plan(base, {"w_init": [8]})
    prompts = [torch.randint(2, 97, (6,), generator=torch.Generator().manual_seed(6)).tolist()]
    rows = sweep.run(model, prompts, 5, base, {"k": [1, 2]}, progress=False)
    assert [r["value"] for r in rows] == [1, 2]
    assert all(r["same_tokens_as_ar"] == 1 and r["speedup"] > 0 and r["A"] >= 0 for r in rows)
    sweep.write(rows, tmp_path, common.model_setup(model, None))
    assert (tmp_path / "sweep.png").stat().st_size > 0


def test_cost_tiny_run(model, tmp_path):
    prompts = [torch.randint(2, 97, (6,), generator=torch.Generator().manual_seed(7)).tolist()]
    with pytest.raises(ValueError, match="1..R-1"):
        cost.run(model, prompts, 5, self_spec_depth=model.R, progress=False)
    rows = cost.run(model, prompts, 6, self_spec_depth=2, mature_depth=1, block=3, progress=False)
    assert [(r["drafter"], r["d"], r["policy"], r["block"]) for r in rows] == [
        ("self-spec", 2, "aligned", 3), ("mature-spec", 1, "deep-kv", 3)]
    for r in rows:
        assert r["same_tokens_as_ar"] == 1 and r["draft_ms_per_request"] > 0
        assert r["draft_ms_per_token"] == pytest.approx(r["draft_ms_per_request"] / 6)
    cost.write(rows, tmp_path, common.model_setup(model, None))
    assert "Table 14" in (tmp_path / "cost.md").read_text()


# --- CLI ---------------------------------------------------------------------------------------------------------

def test_probe_prompts_are_zero_shot_gsm8k_test_questions_in_file_order(eval_data):
    DATA = eval_data("gsm8k/test.jsonl")
    lines = (DATA / "gsm8k" / "test.jsonl").read_text().splitlines()
    questions = [json.loads(line)["question"] for line in lines[3:5]]
    assert common.gsm8k_prompts(2, DATA, offset=3) == [f"Question: {q}\nAnswer:" for q in questions]
    with pytest.raises(ValueError, match=f"only 2 questions after offset {len(lines) - 2}"):
        common.gsm8k_prompts(3, DATA, offset=len(lines) - 2)


def test_probe_cli_without_a_data_folder_says_how_to_set_one(monkeypatch, tmp_path, capsys):
    from dasspec.cli import main

    monkeypatch.delenv("DASSPEC_DATA", raising=False)
    with pytest.raises(DataError, match="no data folder: pass --data DIR or set DASSPEC_DATA"):
        common.gsm8k_prompts(1)
    assert main(["probe", "channels", "--prompts", "1", "--out", str(tmp_path), "--no-progress"]) == 2
    assert "no data folder: pass --data DIR or set DASSPEC_DATA" in capsys.readouterr().err
    # the target depth is checked first, before any data is read
    assert main(["probe", "channels", "--num-steps", "0", "--out", str(tmp_path), "--no-progress"]) == 2
    assert "num_steps must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("num_steps, message", [(2.5, "whole number"), (0, ">= 1")])
def test_probes_validate_the_target_depth(model, trajs, num_steps, message):
    with pytest.raises(ValueError, match=f"num_steps must be (a )?{message}"):
        channels.run(model, trajs, depths=[1], num_steps=num_steps, progress=False)
    with pytest.raises(ValueError, match=f"num_steps must be (a )?{message}"):
        maturity.run(model, trajs, num_steps=num_steps, progress=False)
    with pytest.raises(ValueError, match=f"num_steps must be (a )?{message}"):
        common.model_setup(model, num_steps)


def test_cli_probe_writes_md_csv_png(tmp_path, eval_data):
    DATA = eval_data("gsm8k/test.jsonl")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from dasspec.model.checkpoint import save_checkpoint
    from dasspec.cli import main

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    questions = common.gsm8k_prompts(20, DATA)
    tok.train_from_iterator(questions, trainer)
    folder = tmp_path / "model"
    m = random_model("huginn", mean_recurrence=4, vocab_size=tok.get_vocab_size(), block_size=512,
                     eos_token_id=[0])
    save_checkpoint(m, folder)
    tok.save(str(folder / "tokenizer.json"))
    out = tmp_path / "out"
    for argv in (["channels", "--depths", "1,4"], ["maturity"]):
        assert main(["probe", *argv, "--model", str(folder), "--prompts", "1", "--max-new-tokens", "4",
                     "--out", str(out), "--data", str(DATA), "--no-progress"]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"channels.md", "channels.csv", "channels.png", "maturity.md", "maturity.csv", "maturity.png"} <= names
    assert "| Deep K/V |" in (out / "channels.md").read_text()
    assert main(["probe", "channels", "--model", str(folder), "--prompts", "1", "--depths", "9",
                 "--out", str(out), "--data", str(DATA), "--no-progress"]) == 2


def test_wave_probe_budget_resolves_like_generate():
    """factorial/sweep budgets: flags over the model's tuned defaults, with generate's rules - a tuned W_init
    yields to a smaller --gamma, a tuned seed branch / copy run to --guesses anchor - and explicit flags win."""
    import argparse

    from dasspec.eval.probes.cli import WAVE_BUDGET, _wave_budget

    model = random_model("huginn", mean_recurrence=4)
    model.generation_defaults = {"dasspec": {"das-wave": {"gamma": 48, "w_init": 48, "rounds": 4, "k": 1,
                                                          "guesses": "copy", "trim": True, "seed_branch": 24,
                                                          "copy_run": True, "early_stop": True}}}

    def budget(**flags):
        return _wave_budget(argparse.Namespace(**({k: None for k in WAVE_BUDGET} | flags)), model, 4)

    assert budget() == {"gamma": 48, "rounds": 4, "w_init": 48, "k": 1, "guesses": "copy", "trim": True,
                        "seed_branch": 24, "copy_run": True, "early_stop": True}
    assert budget(gamma=8)["w_init"] == 8
    anchor = budget(guesses="anchor", trim=False)
    assert (anchor["seed_branch"], anchor["copy_run"], anchor["trim"]) == (0, False, False)
    assert budget(seed_branch=0, copy_run=False) | {"seed_branch": 24, "copy_run": True} == budget()
    with pytest.raises(ValueError, match="seed_branch needs a seed"):
        budget(guesses="anchor", seed_branch=4)
