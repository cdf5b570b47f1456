"""``dasspec generate --model PATH --prompt TEXT [--method ar] [--max-new-tokens N] [--num-steps R]`` end to end on a
tiny random checkpoint with a tiny BPE tokenizer.json: streamed text equals the API's, errors exit with a message."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import dasspec
from dasspec.cli import main
from reference_impl import fake_hf_cache, write_checkpoint, write_tokenizer

TEXT = "Shallow queries read"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("cli") / "tiny-raven", "raven-llama", vocab_size=320,
                            mean_recurrence=3, tokenizer=write_tokenizer("raven-llama"))


@pytest.fixture(scope="module")
def api(folder):
    """What the library produces for the same request (the CLI must print exactly this)."""
    model = dasspec.load_model(folder, device="cpu")
    return dasspec.generate(model, TEXT, method="ar", max_new_tokens=8, num_steps=2)


def console_script() -> list[str]:
    exe = shutil.which("dasspec", path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", "dasspec.cli"]


def test_end_to_end_subprocess(folder, api):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(console_script() + ["generate", "--model", str(folder), "--prompt", TEXT, "--method", "ar",
                                              "--max-new-tokens", "8", "--num-steps", "2"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == TEXT + api.text + "\n"
    assert f"[ar] {len(api.tokens)} tokens" in proc.stderr and f"stop: {api.stop_reason}" in proc.stderr


def test_streams_the_same_text_in_process(folder, api, capsys):
    rc = main(["generate", "--model", str(folder), "--prompt", TEXT, "--max-new-tokens", "8", "--num-steps", "2"])
    out = capsys.readouterr()
    assert rc == 0 and out.out == TEXT + api.text + "\n"


def test_quiet_stats_json_and_stdin(folder, api, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "stdin", io.StringIO(TEXT))
    stats = tmp_path / "stats.json"
    rc = main(["generate", "--model", str(folder), "--max-new-tokens", "8", "--num-steps", "2", "--quiet",
               "--stats-json", str(stats)])
    out = capsys.readouterr()
    assert rc == 0 and out.out == api.text + "\n"
    data = json.loads(stats.read_text())
    assert data["tokens"] == api.tokens and data["text"] == api.text and data["method"] == "ar"


def test_hf_repo_id_from_cache(folder, api, capsys, monkeypatch, tmp_path):
    fake_hf_cache(tmp_path / "hub", "someone/tiny-raven", folder)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    rc = main(["generate", "--model", "someone/tiny-raven", "--prompt", TEXT, "--max-new-tokens", "8",
               "--num-steps", "2"])
    assert rc == 0 and capsys.readouterr().out == TEXT + api.text + "\n"


@pytest.mark.parametrize("argv,message", [
    (["--num-steps", "0"], "num_steps must be >= 1, got 0"),
    (["--max-new-tokens", "0"], "max_new_tokens must be >= 1, got 0"),
    (["--max-new-tokens", "200000"], "exceeds the model context"),
    (["--dtype", "float32", "--set", "gamma=3"], "method 'ar' does not take gamma"),
    (["--method", "das-wave", "--gamma", "4", "--w-init", "5"], "w_init (5) must be <= gamma (4)"),
    (["--method", "das-wave", "--seed-branch", "-1"], "seed_branch must be an integer >= 0"),
    (["--method", "das-wave", "--guesses", "anchor", "--seed-branch", "4"], "seed_branch needs a seed"),
])
def test_bad_arguments_exit_2_with_message(folder, capsys, argv, message):
    rc = main(["generate", "--model", str(folder), "--prompt", TEXT] + argv)
    out, err = capsys.readouterr()
    assert rc == 2 and message in err and err.startswith("dasspec: error:")
    assert out == ""                    # the prompt is echoed with the first token, so nothing precedes the error


def test_bad_model_path(tmp_path, capsys):
    rc = main(["generate", "--model", str(tmp_path / "nope"), "--prompt", TEXT])
    err = capsys.readouterr().err
    assert rc == 2 and "does not exist" in err and "nope" in err


def test_model_without_tokenizer(tmp_path):
    bare = write_checkpoint(tmp_path / "bare", "raven-olmo")
    with pytest.raises(SystemExit, match="no tokenizer.json"):
        main(["generate", "--model", str(bare), "--prompt", TEXT])
