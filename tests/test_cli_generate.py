"""``dasspec generate --model PATH --prompt TEXT [--method ar] [--max-new-tokens N] [--num-steps R]`` end to end on a
tiny random checkpoint with a tiny BPE tokenizer.json: streamed text equals the API's, errors exit with a message."""

from __future__ import annotations

import io
import json
import os
import re
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


def test_trace_explains_every_block_of_auto(folder, capsys, tmp_path):
    """``--trace FILE``: a JSON line per verified block; under auto each names its arm, the rule that decided and the
    estimates it compared, and the committed tokens add up to the output."""
    trace, stats = tmp_path / "trace.jsonl", tmp_path / "stats.json"
    rc = main(["generate", "--model", str(folder), "--prompt", TEXT, "--max-new-tokens", "12", "--num-steps", "2",
               "--method", "auto", "--no-calibrate", "--quiet", "--trace", str(trace), "--stats-json",
               str(stats)])
    capsys.readouterr()
    assert rc == 0
    blocks = [json.loads(line) for line in trace.read_text().splitlines()]
    assert blocks and all(b["notes"]["auto"] in ("ar", "das-wave", "sam", "pld") and b["notes"]["rule"] for b in blocks)
    assert any("estimates" in b["notes"] for b in blocks)
    tokens = json.loads(stats.read_text())["tokens"]
    committed = [t for b in blocks for t in b["committed"]]       # (the first token comes from the prefill)
    assert committed[: len(tokens) - 1] == tokens[1:]


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


def test_model_without_tokenizer(tmp_path, capsys):
    bare = write_checkpoint(tmp_path / "bare", "raven-olmo")
    assert main(["generate", "--model", str(bare), "--prompt", TEXT]) == 2
    assert capsys.readouterr().err == (f"dasspec: error: {bare}: no tokenizer.json next to the weights; cannot "
                                       "encode the prompt\n")


# --- hostile input: a message that names it, exit code 2, nothing printed or written -------------------------------

@pytest.mark.parametrize("argv,message", [
    (["--prompt", "def f(x):\udcff"], r"--prompt is not UTF-8 text \(byte 0xff at character 10\)"),
    (["--prompt", TEXT, "--stop", "\udce9"], r"--stop is not UTF-8 text \(byte 0xe9 at character 1\)"),
])
def test_command_line_text_that_is_not_utf8(folder, capsys, argv, message):
    """Python hands bytes that are not UTF-8 in argv over as lone surrogates (PEP 383): refused, not a traceback
    from inside the tokenizer."""
    assert main(["generate", "--model", str(folder)] + argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and re.fullmatch(f"dasspec: error: {message}.*\n", err)


def test_stdin_that_is_not_utf8(folder, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"def f(x):\n\xff\xfe"), encoding="utf-8"))
    assert main(["generate", "--model", str(folder)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("dasspec: error: stdin is not UTF-8 text (byte 0xff at offset 10)")


@pytest.mark.parametrize("where", ["a folder", "under a file"])
def test_stats_json_that_cannot_be_written_fails_before_generating(folder, capsys, tmp_path, monkeypatch, where):
    monkeypatch.setattr(dasspec, "load_model", lambda *a, **k: pytest.fail("the model was loaded first"))
    target = tmp_path if where == "a folder" else tmp_path / "file.txt" / "stats.json"
    (tmp_path / "file.txt").write_text("x")
    assert main(["generate", "--model", str(folder), "--prompt", TEXT, "--stats-json", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dasspec: error: --stats-json {target}: ") and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]


def test_ctrl_c_exits_130_with_one_line(folder, capsys, monkeypatch):
    """SIGINT while tokens stream: the streamed line is ended, then one line on stderr, exit code 130."""
    import signal

    from dasspec.cli import TextStreamer

    put = TextStreamer.put

    def interrupted(self, chunk):
        put(self, chunk)
        if self.ids:                                    # after the first generated token
            signal.raise_signal(signal.SIGINT)
    monkeypatch.setattr(TextStreamer, "put", interrupted)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)     # what a command-line process has
    try:
        assert main(["generate", "--model", str(folder), "--prompt", TEXT, "--max-new-tokens", "8",
                     "--num-steps", "2"]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    out, err = capsys.readouterr()
    assert out.startswith(TEXT) and out.endswith("\n") and err == "dasspec: interrupted\n"


def test_threads_default_to_one_on_a_loaded_cpu(folder, capsys, monkeypatch):
    """Without --threads, generate runs torch's thread count lowered to the cores the load average leaves idle."""
    import torch

    from dasspec import host

    monkeypatch.setattr(host, "usable_cores", lambda: 2)
    monkeypatch.setattr(host.os, "getloadavg", lambda: (3.0, 3.0, 3.0))
    torch.set_num_threads(2)
    assert main(["generate", "--model", str(folder), "--prompt", TEXT, "--max-new-tokens", "1"]) == 0
    assert torch.get_num_threads() == 1
    assert main(["generate", "--model", str(folder), "--prompt", TEXT, "--max-new-tokens", "1", "--threads", "2"]) == 0
    assert torch.get_num_threads() == 2
    capsys.readouterr()
    assert main(["generate", "--model", str(folder), "--prompt", TEXT, "--threads", "0"]) == 2
    assert capsys.readouterr().err == "dasspec: error: --threads must be >= 1, got 0\n"


def test_every_generate_flag_has_help_and_shows_its_default(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag, shown in [("--method METHOD", "(default: ar"), ("--max-new-tokens MAX_NEW_TOKENS", "(default: 128)"),
                        ("--device DEVICE", "(default: CUDA when available, else CPU)"),
                        ("--dtype {float32,bfloat16,float16}", "(default: bfloat16 on CUDA, float32 on CPU)"),
                        ("--threads THREADS", "(default: torch's, lowered to the cores")]:
        help_text = text.split(f" {flag} ", 1)[1].split(" --", 1)[0]
        assert shown in help_text, flag


def test_exit_options_on_ouro_and_refused_elsewhere(folder, capsys, tmp_path):
    """--exit-threshold / --exit-at-step reach the target (the printed text is the API's at that target), a bad
    value is named before the model loads, and a model without an exit gate refuses both with a message."""
    from reference_impl import write_ouro_checkpoint

    ouro_folder = write_ouro_checkpoint(tmp_path / "ouro", vocab_size=320, seed=3, tokenizer=write_tokenizer("ouro"))
    ouro = dasspec.load_model(ouro_folder, device="cpu")
    last = dasspec.generate(ouro, TEXT, max_new_tokens=6).text
    for flag, value, target in (("--exit-at-step", "1", {"exit_at_step": 1}),
                                ("--exit-threshold", "0.6", {"exit_threshold": 0.6})):
        want = dasspec.generate(ouro, TEXT, max_new_tokens=6, **target).text
        assert want != last, f"{flag} {value} reads the last step's tokens here: the test could not see it ignored"
        assert main(["generate", "--model", str(ouro_folder), "--prompt", TEXT, "--max-new-tokens", "6",
                     "--method", "self-spec", flag, value]) == 0
        assert capsys.readouterr().out == TEXT + want + "\n"
    assert main(["generate", "--model", str(ouro_folder), "--prompt", TEXT, "--exit-threshold", "1.5"]) == 2
    assert capsys.readouterr().err == ("dasspec: error: exit_threshold must be a number in [0, 1], got 1.5 "
                                       "(--exit-threshold / --exit-at-step)\n")
    assert main(["generate", "--model", str(ouro_folder), "--prompt", TEXT, "--exit-at-step", "4"]) == 2
    assert "exit_at_step=4 is beyond the 4 recurrence steps" in capsys.readouterr().err
    assert main(["generate", "--model", str(folder), "--prompt", TEXT, "--exit-at-step", "0"]) == 2
    assert capsys.readouterr().err.startswith("dasspec: error: exit_threshold / exit_at_step need a model with an "
                                              "early-exit gate (Ouro); a raven-llama model has none")


def test_chat_sends_one_user_turn_in_the_template_and_prints_the_reply(tmp_path, capsys):
    from reference_impl import write_ouro_checkpoint

    ouro_folder = write_ouro_checkpoint(tmp_path / "ouro", vocab_size=320, seed=3, tokenizer=write_tokenizer("ouro"))
    (ouro_folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    ouro = dasspec.load_model(ouro_folder, device="cpu")
    tok = ouro.tokenizer
    ids = tok.encode("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert ids[0] == tok.token_to_id("<|im_start|>")
    want = dasspec.generate(ouro, ids, max_new_tokens=6)
    assert main(["generate", "--model", str(ouro_folder), "--prompt", "Hi there", "--chat",
                 "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out == want.text + "\n"
