"""The training recipe: tokenizer files, the depth sampler, a few real training steps that save a checkpoint
``dasspec.load_model`` reads back, and a run that is stopped and resumed ending exactly where an uninterrupted
one does."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

import dasspec
from dasspec.testing import random_model
from dasspec.train.corpus import Document
from dasspec.train import PRESETS, TrainConfig, depth_agreement, train
from dasspec.train.loop import Interrupted
from dasspec.train.prepare import BOS, EOS, PAD, save_tokenizer, train_tokenizer
from dasspec.train.resume import ResumeError, open_state
from dasspec.train.schedule import lr_at, mean_depth_at, run_fraction, sample_depth

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "Question: Tom has 3 apples and buys 4 more. How many apples does he have?\nAnswer: 3 + 4 = 7\n#### 7\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
] * 8


def test_tokenizer_round_trip_and_special_ids(tmp_path):
    tok = train_tokenizer(TEXTS, vocab_size=300)
    save_tokenizer(tok, tmp_path)
    t = dasspec.load_tokenizer(tmp_path)
    assert (t.bos_id, t.eos_ids, t.pad_id) == (tok.token_to_id(BOS), [tok.token_to_id(EOS)], tok.token_to_id(PAD))
    assert len({t.bos_id, t.eos_ids[0], t.pad_id}) == 3
    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)  # é ✓\n"
    ids = t.encode(text)
    assert ids[0] == t.bos_id and t.bos_id not in ids[1:]
    assert t.decode(ids) == text                       # byte-level: exact, even for unseen characters
    assert t.encode(text, add_special_tokens=False) == ids[1:]
    assert json.loads((tmp_path / "special_tokens_map.json").read_text())["eos_token"] == EOS


def test_depth_sampler_follows_huginn_scheme():
    rng = np.random.default_rng(0)
    draws = [sample_depth(rng, 32, 0.5, 8) for _ in range(4000)]
    r = np.array([n + k for n, k in draws])
    assert all(k == min(8, n + k) and n == max(n + k - 8, 0) for n, k in draws)
    assert 31.0 < r.mean() < 35.0                      # E[Poisson(LogNormal)] + 1 = 33
    assert r.min() >= 1 and np.quantile(r, 0.05) < 20 and np.quantile(r, 0.95) > 50
    floored = [sample_depth(rng, 32, 0.5, 8, min_depth=12, max_depth=40) for _ in range(2000)]
    assert min(n + k for n, k in floored) >= 12 and max(n + k for n, k in floored) <= 40


def test_schedules_run_on_steps_when_max_steps_is_set():
    cfg = TrainConfig(max_steps=1000, time_budget_s=60, lr=1e-3, warmup_steps=10, min_lr_frac=0.1,
                      mean_recurrence=32, depth_warmup_frac=0.25, depth_warmup_start=4)
    # elapsed time does not move a step-based schedule: the same run on a slow or a fast machine
    assert lr_at(cfg, 500, elapsed=1.0) == lr_at(cfg, 500, elapsed=1e6) == pytest.approx(0.55e-3)
    assert lr_at(cfg, 4, 0.0) == pytest.approx(0.5e-3) and lr_at(cfg, 1000, 0.0) == pytest.approx(1e-4)
    assert [mean_depth_at(cfg, run_fraction(cfg, s, 1e6)) for s in (0, 125, 250, 900)] == [4, 18, 32, 32]
    # without max_steps the cosine runs on wall-clock time, and the curriculum with it
    wall = replace(cfg, max_steps=None)
    assert run_fraction(wall, 10 ** 6, 30.0) == 0.5 and lr_at(wall, 500, 30.0) == pytest.approx(0.55e-3)
    assert mean_depth_at(replace(cfg, depth_warmup_frac=0.0), 0.0) == 32      # curriculum off


def test_training_smoke_saves_a_loadable_checkpoint(tmp_path, monkeypatch):
    docs = [Document("stdlib", f"d{i}.py", t) for i, t in enumerate(TEXTS * 4)]
    cfg = replace(PRESETS["micro"], max_steps=25, lr=1e-2, warmup_steps=3, val_fraction=0.1, eval_tokens=128,
                  depth_warmup_start=1, depth_warmup_frac=0.4)
    means = []
    spy = lambda rng, mean, *a: means.append(mean) or sample_depth(rng, mean, *a)      # noqa: E731
    monkeypatch.setattr("dasspec.train.loop.sample_depth", spy)
    summary = train(cfg, tmp_path, docs=docs, progress=False)
    # the loop draws every step's depth from the curriculum's mean: 1 -> mean_recurrence over 10 steps, then flat
    assert means == pytest.approx([1 + 3 * s / 10 for s in range(10)] + [4.0] * 15)
    with open(tmp_path / "train_log.csv") as f:
        losses = [float(row["loss"]) for row in csv.DictReader(f)]
    assert len(losses) == 25 and all(math.isfinite(x) for x in losses)
    assert np.mean(losses[-5:]) < losses[0] - 0.5       # it learns the repeated texts
    model = dasspec.load_model(tmp_path, device="cpu")
    assert model.config.family == "huginn" and model.R == cfg.mean_recurrence
    assert model.tokenizer is not None and model.tokenizer.eos_ids == model.config.eos_token_id
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == model.config.eos_token_id[0] and gen["dasspec"] == {}
    ids = torch.tensor(model.tokenizer.encode(TEXTS[0] + TEXTS[2]))
    m = depth_agreement(model, ids, depths=(1, 2), window=len(ids))
    assert m["agreement"][model.R] == 1.0 and set(m["agreement"]) == {1, 2, model.R}
    assert summary["val"]["tokens"] > 0 and summary["steps"] == 25
    assert (tmp_path / "train_loss.png").stat().st_size > 0
    assert "![training loss](train_loss.png)" in (tmp_path / "README.md").read_text()
    # a finished run leaves no resume state, and the same command again says so instead of retraining
    assert not (tmp_path / "resume.pt").exists() and summary["resumed_at"] == []
    with pytest.raises(ResumeError, match="already finished"):
        train(cfg, tmp_path, docs=docs, progress=False)


def test_depth_agreement_counts_argmax_matches():
    model = random_model("huginn", seed=1)
    ids = torch.randint(0, model.config.vocab_size, (40,))
    m = depth_agreement(model, ids, depths=(1, 8), R=8, window=40)
    assert m["agreement"][8] == 1.0 and m["tokens"] == 39
    with torch.no_grad():
        a = model(ids[None], num_steps=1)[0, :-1].argmax(-1)
        b = model(ids[None], num_steps=8)[0, :-1].argmax(-1)
    assert m["agreement"][1] == pytest.approx(float((a == b).float().mean()))


def test_presets_build_valid_huginn_configs():
    for name, cfg in PRESETS.items():
        mc = cfg.model_config(0, 1, 2)
        assert mc.family == "huginn" and mc.tie_embeddings and mc.qk_bias, name
        assert mc.embed_scale == pytest.approx(math.sqrt(cfg.n_embd))
        assert mc.init_std == pytest.approx(math.sqrt(2 / (5 * cfg.n_embd)))
    tiny = PRESETS["tiny"].model_config(0, 1, 2)
    assert tiny.block_size >= 4096 and tiny.mean_recurrence == 32 and tiny.head_dim * tiny.n_heads == tiny.n_embd
    assert PRESETS["tiny"].max_steps is not None        # the shipped recipe runs on steps: same run on any machine
    assert isinstance(PRESETS["tiny"], TrainConfig)


@pytest.mark.parametrize("override,message", [
    (dict(max_steps=0), "max_steps must be >= 1"),
    (dict(lr=-1.0), "lr must be > 0"),
    (dict(batch_size=0), "batch_size must be >= 1"),
    (dict(min_depth=9, max_depth=8), r"min_depth \(9\) > max_depth \(8\)"),
    (dict(n_embd=30, n_heads=4), "multiple of n_heads"),
    (dict(checkpoint_every=-1), "checkpoint_every must be >= 0"),
    (dict(time_budget_s=-60.0), "time_budget_s must be a positive number of seconds, got -60.0"),
    (dict(time_budget_s=0), "time_budget_s must be a positive number of seconds, got 0"),
    # issue 29: every field is checked before the corpus, not ~40 s into it or never
    (dict(threads=-3), "threads must be >= 0"),
    (dict(threads=10**5), "threads 100000 is more than the"),
    (dict(lr=math.inf), "lr must be > 0 and finite, got inf"),
    (dict(grad_clip=math.nan), "grad_clip must be a finite number >= 0"),
    (dict(grad_clip=-1.0), "grad_clip must be a finite number >= 0"),
    (dict(weight_decay=-5.0), "weight_decay must be a finite number >= 0"),
    (dict(mean_recurrence=9, max_depth=8), r"mean_recurrence \(9\) must lie in \[min_depth, max_depth\]"),
    (dict(val_fraction=1.0), r"val_fraction must be a number in \(0, 0.5\], got 1.0"),
    (dict(betas=(0.9, 1.5)), r"betas must be two numbers in \[0, 1\)"),
    (dict(seq_len=10**6), r"seq_len \(1000000\) must be <= block_size"),
    (dict(vocab_size=100), "vocab_size must be >= 259"),
])
def test_bad_training_settings_fail_before_the_corpus_is_built(override, message, tmp_path, monkeypatch):
    from dasspec.train import corpus

    def no_corpus(*a, **k):
        raise AssertionError("the corpus was built before the settings were checked")

    monkeypatch.setattr(corpus, "build_corpus", no_corpus)
    with pytest.raises(ValueError, match=message):
        train(replace(PRESETS["micro"], **override), tmp_path, progress=False)


def test_every_training_setting_is_checked():
    """A field without a rule would again be accepted silently: each one's wrong type is refused by name."""
    from dataclasses import fields

    for f in fields(TrainConfig):
        if f.name in ("device", "preset"):              # text: any name, checked by what it names
            continue
        with pytest.raises(ValueError, match=f.name):
            replace(PRESETS["micro"], **{f.name: "x"}).validate()


def test_gpu_preset_on_a_cpu_only_machine_says_so():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="pass --device cpu"):
        PRESETS["cuda-small"].validate()
    assert PRESETS["tiny"].validate() is PRESETS["tiny"]


def test_training_without_a_data_folder_says_how_to_set_one(tmp_path, monkeypatch):
    from dasspec.eval.data import DataError

    monkeypatch.delenv("DASSPEC_DATA", raising=False)
    with pytest.raises(DataError, match="pass --data DIR or set DASSPEC_DATA"):
        train(PRESETS["micro"], tmp_path / "model", progress=False)
    assert list(tmp_path.iterdir()) == []                   # nothing to resume from: no model.partial either


def _log_rows(path) -> list[dict]:
    """train_log.csv without its time columns."""
    with open(path) as f:
        return [{k: v for k, v in row.items() if k not in ("elapsed_s", "tokens_per_s")} for row in csv.DictReader(f)]


def test_stopped_and_resumed_run_ends_with_the_uninterrupted_weights(tmp_path, monkeypatch, capsys):
    """Ctrl-C at step 6 (saved at the step boundary), a hard kill inside step 11 (the periodic state of step 8
    stands), two resumes: the same weights and the same log as one uninterrupted 12-step run."""
    import signal

    from dasspec.train import run

    docs = [Document("stdlib", f"d{i}.py", t) for i, t in enumerate(TEXTS * 4)]
    cfg = replace(PRESETS["micro"], max_steps=12, checkpoint_every=4, lr=1e-2, warmup_steps=3, val_fraction=0.1)
    finished = {}

    def finish(cfg, work, model, data, p, *args):         # evaluation and card are the smoke test's business
        finished[work.name] = ({k: v.clone() for k, v in model.state_dict().items()}, p)
        return {}

    monkeypatch.setattr(run, "finish", finish)

    def stop_during(step: int, how):
        """Make the depth draw of ``step`` (counted in this session) send SIGINT or raise."""
        calls = []

        def spy(*args):
            calls.append(1)
            if len(calls) == step:
                how()
            return sample_depth(*args)
        monkeypatch.setattr("dasspec.train.loop.sample_depth", spy)

    def killed():
        raise RuntimeError("killed")

    train(cfg, tmp_path / "whole", docs=docs, progress=False)
    out, partial = tmp_path / "stopped", tmp_path / "stopped.partial"
    stop_during(6, lambda: signal.raise_signal(signal.SIGINT))
    with pytest.raises(Interrupted, match="stopped at step 6"):
        train(cfg, out, docs=docs, progress=False)
    assert len(_log_rows(partial / "train_log.csv")) == 6 and (partial / "resume.pt").exists()
    assert not out.exists()                                 # no folder that looks like a model until it is one
    with pytest.raises(ResumeError, match=r"lr \(saved 0.01, now 0.02\).*--fresh"):
        train(replace(cfg, lr=2e-2), out, docs=docs, progress=False)
    stop_during(5, killed)                                  # steps 7-10 run, step 11 dies half-way
    with pytest.raises(RuntimeError, match="killed"):
        train(cfg, out, docs=docs, progress=False)
    assert len(_log_rows(partial / "train_log.csv")) == 10     # rows 9-10 are past the saved state
    monkeypatch.setattr("dasspec.train.loop.sample_depth", sample_depth)
    train(cfg, out, docs=docs, progress=False)
    said = capsys.readouterr().out
    assert "resuming" in said and "from step 6 of 12" in said and "from step 8 of 12" in said
    whole, stopped = finished["whole.partial"], finished["stopped.partial"]
    assert whole[0].keys() == stopped[0].keys() and all(torch.equal(whole[0][k], stopped[0][k]) for k in whole[0])
    assert _log_rows(tmp_path / "whole" / "train_log.csv") == _log_rows(out / "train_log.csv")
    assert (stopped[1].step, stopped[1].tokens, stopped[1].resumed_at) == (12, whole[1].tokens, [6, 8])
    with open(out / "train_log.csv") as f:
        elapsed = [float(row["elapsed_s"]) for row in csv.DictReader(f)]
    assert elapsed == sorted(elapsed)                       # training time continues across resumes
    assert not partial.exists() and not (out / "resume.pt").exists()       # moved into place, state dropped
    partial.mkdir()
    (partial / "resume.pt").write_bytes(b"a stopped run")
    assert open_state(partial, cfg, fresh=True) is None and not partial.exists()          # --fresh


def test_cli_passes_fresh_and_reports_a_stop(monkeypatch, capsys):
    from dasspec.cli import main

    seen = {}

    def stopped(cfg, out, data_dir=None, pilots=None, fresh=False, force=False):
        seen.update(cfg=cfg, fresh=fresh, force=force)
        raise Interrupted("stopped at step 3; run the same command again to resume")

    monkeypatch.setattr("dasspec.train.run.train", stopped)
    assert main(["train", "--out", "x", "--preset", "micro", "--fresh", "--force", "--set", "checkpoint_every=7",
                 "--set", "betas=[0.8,0.9]"]) == 130
    assert seen["fresh"] and seen["force"] and seen["cfg"].preset == "micro"
    assert seen["cfg"].checkpoint_every == 7 and seen["cfg"].betas == (0.8, 0.9)
    assert capsys.readouterr().err == ("dasspec: interrupted: stopped at step 3; run the same command again to "
                                       "resume\n")
