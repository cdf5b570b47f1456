"""Hostile and broken inputs across the commands (docs/reliability.md): each case builds its bad input and checks
the one-line message (the field, file or line it names), the exit code, and that nothing was written, lost or left
half-done.  ``dasspec generate``'s own cases are in test_cli_generate.py, the API's in test_generate_api.py."""

from __future__ import annotations

import gzip
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import dasspec
from dasspec.cli import build_parser, main
from dasspec.eval.data import DataFormatError, read_jsonl
from dasspec.train.corpus import Document
from reference_impl import write_checkpoint, write_tokenizer
from test_train import TEXTS


def one_error_line(err: str, message: str) -> None:
    assert err.startswith(f"dasspec: error: {message}"), err
    assert err.count("\n") == 1 and "Traceback" not in err, err


def listing(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` with its bytes: what "nothing changed" compares."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --- the command line itself ---------------------------------------------------------------------------------------

def test_top_level_help_does_not_import_torch():
    """``dasspec --help`` lists the commands without importing any of them (torch takes seconds to import)."""
    code = ("import sys\nfrom dasspec.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'numpy', 'dasspec.methods') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "generate" in proc.stdout and "serve" in proc.stdout
    assert proc.stdout.splitlines()[-1] == "[]"


def test_top_level_help_lists_what_the_command_modules_declare():
    """The light listing (no command module imported) and the full parser say the same."""
    assert build_parser([]).format_help() == build_parser().format_help()


@pytest.mark.parametrize("argv,message", [
    (["generate", "--prompt", "x", "--threads", "0"], "--threads must be >= 1, got 0"),
    (["bench", "--out", "{tmp}/b", "--bootstrap", "0"], "--bootstrap must be >= 1, got 0"),
    (["probe", "maturity", "--out", "{tmp}/file.txt"], "--out {tmp}/file.txt: is a file, not a folder"),
    (["train", "--out", "{tmp}/t", "--set", "betas=5"], "--set betas=5: betas takes 2 numbers as a JSON list"),
    (["serve", "--max-queue", "-1"], "--max-queue must be >= 0, got -1"),
    (["generate", "--method", "nope"], "argument --method: invalid choice: 'nope'"),     # argparse's own errors too
    (["bench", "--out", "{tmp}/b", "--bootstrap", "x"], "argument --bootstrap: invalid int value: 'x'"),
])
def test_every_command_answers_a_bad_input_with_exit_2_and_one_line(tmp_path, capsys, argv, message):
    if argv[0] == "serve":
        pytest.importorskip("uvicorn")
    (tmp_path / "file.txt").write_text("x")
    before = listing(tmp_path)
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    one_error_line(capsys.readouterr().err, message.replace("{tmp}", str(tmp_path)))
    assert listing(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]


def test_a_command_that_exits_with_a_message_gets_the_same_line(capsys, monkeypatch):
    monkeypatch.setattr("dasspec.train.cli.cmd_train", lambda args: sys.exit("no GPU here"))
    assert main(["train", "--out", "x"]) == 2
    one_error_line(capsys.readouterr().err, "no GPU here")


# --- data files: the file and the line ------------------------------------------------------------------------------

ROWS = [{"question": f"q{i}", "answer": f"a{i} " * 30} for i in range(300)]
GOOD = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
TWO_LINES = b"".join(GOOD.splitlines(keepends=True)[:2])


@pytest.mark.parametrize("name,data,message", [
    ("t.jsonl.gz", gzip.compress(GOOD)[:1500], r"t.jsonl.gz: truncated or corrupt gzip data after line \d+"),
    ("t.jsonl.gz", GOOD, r"t.jsonl.gz: not gzip data"),
    ("t.jsonl", TWO_LINES + b"{oops\n" + GOOD, r"t.jsonl, line 3: not valid JSON \(.* at column 2\)"),
    ("t.jsonl", b'{"question": 1, "answer": 2}\n\n[1, 2]\n', r"t.jsonl, line 3: expected a JSON object, got list"),
    ("t.jsonl", b'{"question": 1, "answer": 2}\n{"question": "caf\xe9"}\n', r"t.jsonl, line 2: not UTF-8 text"),
    ("t.jsonl", b'{"question": 1, "answer": 2}\n{"question": 3}\n', r"t.jsonl, line 2: no 'answer' field"),
])
def test_broken_data_files_name_the_file_and_line(tmp_path, name, data, message):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(DataFormatError, match=message):
        read_jsonl(path, required=("question", "answer"))


def test_a_broken_data_file_stops_a_probe_before_any_output(tmp_path, capsys):
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_bytes(TWO_LINES + b'{"question": "cut off\n')
    out = tmp_path / "results"
    assert main(["probe", "maturity", "--data", str(tmp_path), "--prompts", "2", "--out", str(out)]) == 2
    one_error_line(capsys.readouterr().err, f"{tmp_path / 'gsm8k' / 'test.jsonl'}, line 3: not valid JSON")
    assert not out.exists()


def test_probe_out_that_cannot_be_written_fails_before_the_model_loads(tmp_path, capsys, monkeypatch):
    from dasspec import host

    monkeypatch.setattr(dasspec, "load_model", lambda *a, **k: pytest.fail("the model was loaded first"))
    monkeypatch.setattr(host, "writable", lambda path: path != tmp_path)          # a read-only folder
    assert main(["probe", "cost", "--out", str(tmp_path / "results")]) == 2
    one_error_line(capsys.readouterr().err, f"--out {tmp_path / 'results'}: {tmp_path} is not writable")
    assert list(tmp_path.iterdir()) == []


# --- train: refuse before any work; never a folder that looks like a model until it is one ------------------------

@pytest.mark.parametrize("argv,message", [
    (["--minutes", "-1"], "--minutes must be a positive number of minutes, got -1"),
    (["--minutes", "0"], "--minutes must be a positive number of minutes, got 0"),
    (["--set", "time_budget_s=-60"], "time_budget_s must be a positive number of seconds, got -60"),
    (["--set", "betas=5"], "--set betas=5: betas takes 2 numbers as a JSON list, e.g. --set betas=[0.9,0.95]"),
    (["--set", "max_steps=many"], "--set max_steps=many: max_steps takes an integer or null"),
    (["--set", "share_cpu=2"], "--set share_cpu=2: share_cpu takes true or false"),
    (["--set", "lr"], "--set expects NAME=VALUE, got 'lr'"),
    (["--pilots", "{tmp}"], "--pilots {tmp}: no train_summary.json there"),
])
def test_train_refuses_bad_settings_before_any_work(tmp_path, capsys, argv, message):
    out = tmp_path / "model"
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["train", "--out", str(out), "--preset", "micro"] + argv) == 2
    one_error_line(capsys.readouterr().err, message.replace("{tmp}", str(tmp_path)))
    assert list(tmp_path.iterdir()) == []


def test_train_out_that_cannot_be_written(tmp_path, capsys, monkeypatch):
    from dasspec import host

    (tmp_path / "file").write_text("x")
    assert main(["train", "--out", str(tmp_path / "file"), "--preset", "micro"]) == 2
    one_error_line(capsys.readouterr().err, f"cannot train into {tmp_path / 'file'}: it is a file, not a folder")
    monkeypatch.setattr(host, "writable", lambda path: path != tmp_path)          # a read-only folder
    assert main(["train", "--out", str(tmp_path / "model"), "--preset", "micro"]) == 2
    one_error_line(capsys.readouterr().err, f"cannot train into {tmp_path / 'model'}: {tmp_path} is not writable")
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


def test_a_run_that_fails_before_saving_leaves_no_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("DASSPEC_DATA", raising=False)
    assert main(["train", "--out", str(tmp_path / "model"), "--preset", "micro"]) == 2
    one_error_line(capsys.readouterr().err, "no data folder: pass --data DIR or set DASSPEC_DATA")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def old_model(tmp_path) -> Path:
    """A model folder someone cares about, with tuned decoder defaults in its generation_config.json."""
    folder = write_checkpoint(tmp_path / "model", "huginn", vocab_size=320, mean_recurrence=3,
                              tokenizer=write_tokenizer("huginn"))
    (folder / "generation_config.json").write_text(json.dumps({"dasspec": {"das-wave": {"gamma": 8}}}))
    return folder


def test_train_does_not_overwrite_a_model_folder_without_force(old_model, capsys):
    before = listing(old_model)
    assert main(["train", "--out", str(old_model), "--preset", "micro"]) == 2
    one_error_line(capsys.readouterr().err, f"{old_model} already exists and is not empty; pass --force to replace "
                                            "it once the new run completes")
    assert listing(old_model) == before and sorted(p.name for p in old_model.parent.iterdir()) == ["model"]


def test_train_killed_over_a_model_folder_leaves_it_whole_then_replaces_it(old_model, capsys, monkeypatch):
    """Ctrl-C part-way through a --force run: exit 130 with the resume hint, the old folder byte for byte as it
    was (no new tokenizer beside old weights), the resume state in DIR.partial.  The same command then resumes and
    replaces the folder whole, keeping its tuned decoder defaults, leaving nothing else behind."""
    from dasspec.train import corpus
    from dasspec.train.schedule import sample_depth

    docs = [Document("stdlib", f"d{i}.py", t) for i, t in enumerate(TEXTS * 4)]
    monkeypatch.setattr(corpus, "build_corpus", lambda *a, **k: docs)
    calls = []

    def ctrl_c_at_step_3(*args):
        calls.append(1)
        if len(calls) == 3:
            signal.raise_signal(signal.SIGINT)
        return sample_depth(*args)
    monkeypatch.setattr("dasspec.train.loop.sample_depth", ctrl_c_at_step_3)
    before = listing(old_model)
    argv = ["train", "--out", str(old_model), "--preset", "micro", "--force", "--set", "val_fraction=0.1"]
    assert main(argv) == 130
    err = capsys.readouterr().err
    partial = old_model.with_name("model.partial")
    assert err.splitlines()[-1] == (f"dasspec: interrupted: stopped at step 3; the resume state is in "
                                    f"{partial / 'resume.pt'} - run the same command again to resume")
    assert "Traceback" not in err
    assert listing(old_model) == before and (partial / "resume.pt").exists()
    before_resume = listing(partial)

    monkeypatch.setattr("dasspec.train.loop.sample_depth", sample_depth)
    assert main(argv) == 0
    assert sorted(p.name for p in old_model.parent.iterdir()) == ["model"]          # no .partial, nothing aside
    summary = json.loads((old_model / "train_summary.json").read_text())
    assert summary["steps"] == 6 and summary["resumed_at"] == [3] and not (old_model / "resume.pt").exists()
    assert json.loads((old_model / "generation_config.json").read_text())["dasspec"] == {"das-wave": {"gamma": 8}}
    new_tokenizer = before_resume["tokenizer.json"]          # trained by the stopped run, reused by the resume
    assert (old_model / "tokenizer.json").read_bytes() == new_tokenizer != before["tokenizer.json"]
    model = dasspec.load_model(old_model, device="cpu")      # the new weights, with the tokenizer they match
    assert model.config.vocab_size == model.tokenizer.backend.get_vocab_size() != 320
