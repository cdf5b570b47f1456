"""Issue 29 outside the server: every method knob has a ceiling that follows from the model and the call, held for
the API, the CLI and a checkpoint's generation_config.json alike; a checkpoint names no file outside itself; every
positive temperature samples validly (tiny ones give the greedy text, equal across methods); and the command
line refuses what names nothing or cannot work before any model loads.  (The server's side: test_serve_hostile.py.)"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dasspec
from dasspec.cli import main
from dasspec.methods import all_knobs, get_method
from dasspec.methods.knobs import Scope
from dasspec.testing import random_model

DOCS = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"
PROMPT = [5, 17, 3, 90, 42, 8, 61, 7, 23, 11, 5, 17, 3]


@pytest.fixture(scope="module")
def model():
    return random_model("huginn", mean_recurrence=6, block_size=96)


def one_error_line(err: str, message: str) -> None:
    assert err.startswith(f"dasspec: error: {message}"), err
    assert err.count("\n") == 1 and "Traceback" not in err, err


# --- knob ceilings -------------------------------------------------------------------------------------------------

def numeric(cls) -> list[str]:
    return [f.name for f in cls.specs() if cls.kind(f.name) in (int, float)]


def test_every_number_knob_has_a_ceiling_in_its_help_and_in_the_docs():
    """A knob without a ceiling could again hold the worker for hours: each one's help says its ceiling, and
    docs/reliability.md lists it."""
    docs = DOCS.read_text()
    for cls in all_knobs():
        if not cls.__module__.startswith("dasspec.methods."):     # (a test's own method)
            continue
        ceilings = cls.ceilings()
        for name in numeric(cls):
            assert name in ceilings, f"{cls.method}: knob {name} has no ceiling"
        for f in cls.specs():
            if f.name in ceilings:
                assert f"(at most {ceilings[f.name].text})" in f.metadata["help"], f.name
                assert f"`{f.name}`" in docs and ceilings[f.name].text in docs, (cls.method, f.name)


# (method, knobs above a ceiling, the knob named) - every one refused by its ceiling on the module's model
ABOVE = [("das-wave", {"rounds": 10**6}, "rounds"), ("das-wave", {"gamma": 96}, "gamma"),
         ("das-wave", {"gamma": 4, "w_init": 5}, "w_init"), ("das-wave", {"k": 7}, "k"),
         ("das-wave", {"guesses": "copy", "seed_branch": 90}, "seed_branch"), ("das-wave", {"max_ngram": 97}, "max_ngram"),
         ("self-spec", {"block": 96}, "block"), ("mature-spec", {"draft_depth": 6}, "draft_depth"),
         ("pld", {"num_pred": 96}, "num_pred"), ("lookahead", {"window": 30}, "window"),
         ("lookahead", {"ngram": 20}, "ngram"), ("lookahead", {"guess_set": 12}, "guess_set"),
         ("token-recycling", {"topk": 33}, "topk"), ("sam", {"n_predicts": 97}, "n_predicts"),
         ("sam", {"alpha": math.inf}, "alpha"), ("sam", {"len_threshold": 97}, "len_threshold"),
         ("sam", {"len_bias": 10**9}, "len_bias")]


@pytest.mark.parametrize("method, knobs, name", ABOVE, ids=[f"{m}-{n}" for m, _, n in ABOVE])
def test_a_knob_above_its_ceiling_is_refused_by_the_api(model, method, knobs, name):
    with pytest.raises(ValueError, match=rf"({name} .*must be <|{name}=\S+ is above its ceiling of \S+ on this model)"):
        dasspec.build_drafter(model, method, knobs)    # what generate(method=..., **knobs) builds first


def test_ceilings_hold_for_the_cli_and_generation_config_and_defaults_are_lowered(model, tmp_path, capsys):
    from dasspec.model.checkpoint import save_checkpoint

    # the command line: one line, exit 2, before anything decodes
    assert main(["generate", "--prompt", "x", "--method", "das-wave", "--rounds", "1000000", "--max-new-tokens", "1"]) \
        == 2
    one_error_line(capsys.readouterr().err, "rounds=1000000 is above its ceiling of 40")
    # a checkpoint's generation_config.json: the file is named
    folder = save_checkpoint(model, tmp_path / "m")
    (folder / "generation_config.json").write_text(json.dumps({"dasspec": {"das-wave": {"rounds": 10**6}}}))
    loaded = dasspec.load_model(folder, device="cpu")
    with pytest.raises(ValueError, match=r"generation_config.json: \"dasspec\" -> \"das-wave\": rounds=1000000 is "
                                         r"above its ceiling"):
        dasspec.build_drafter(loaded, "das-wave")
    # a kept drafter is held to a shallower call's ceilings too
    drafter = dasspec.build_drafter(model, "das-wave", {"gamma": 8, "rounds": 12, "k": 1})
    with pytest.raises(ValueError, match="rounds=12 is above its ceiling of 10"):
        dasspec.generate(model, PROMPT, max_new_tokens=2, num_steps=2, drafter=drafter)
    # a defaulted knob above its ceiling is lowered (rounds: 24 -> gamma + ceil(R / k) = 4 + 3), still lossless
    kn = dasspec.build_drafter(model, "das-wave", {"gamma": 4}).knobs
    assert (kn.rounds, kn.k) == (7, 2) and kn.rounds == kn.ceilings()["rounds"].of(kn, Scope.of(model, 6))
    ar = dasspec.generate(model, PROMPT, "ar", max_new_tokens=12, eos=False).tokens
    assert dasspec.generate(model, PROMPT, "das-wave", max_new_tokens=12, eos=False, gamma=4).tokens == ar


def test_a_generation_config_section_that_names_no_method_is_named(model, monkeypatch):
    monkeypatch.setattr(model, "generation_defaults", {"dasspec": {"das-wav": {"gamma": 4}, "pld:sampled": {}}})
    with pytest.warns(UserWarning, match=r"\"dasspec\" has sections 'das-wav', which name no method"):
        dasspec.build_drafter(model, "pld")


def test_a_checkpoint_names_no_file_outside_itself(model, tmp_path):
    """generation_config.json may set SAM's static corpus only to a file inside the checkpoint (a client is refused
    the knob altogether; the API user's own paths stay theirs)."""
    from dasspec.model.checkpoint import save_checkpoint

    folder = save_checkpoint(model, tmp_path / "m")
    outside = tmp_path / "private.txt"
    outside.write_text("secret words")
    (folder / "corpus.txt").write_text("5 17 3")
    (folder / "linked.txt").symlink_to(outside)
    cases = {"/etc/passwd": "may only name files inside its folder", "../private.txt": "may only name files inside",
             "linked.txt": "symlink that leads outside", "corpus.txt": None}
    for path, message in cases.items():
        (folder / "generation_config.json").write_text(json.dumps({"dasspec": {"sam": {"static_corpus": path}}}))
        loaded = dasspec.load_model(folder, device="cpu")
        if message is None:
            kn = dasspec.build_drafter(loaded, "sam").knobs
            assert kn.static_corpus == str(folder / "corpus.txt")
            continue
        with pytest.raises(ValueError, match=f"static_corpus.*{message}") as err:
            dasspec.build_drafter(loaded, "sam")
        assert "secret" not in str(err.value)
    assert dasspec.build_drafter(model, "sam", {"static_corpus": str(outside)}).knobs.static_corpus == str(outside)


# --- numbers -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sharp():
    """Logits past float32's max x 1e-38 (about 3.4), as a trained model's are."""
    m = random_model("huginn", mean_recurrence=6, block_size=96, seed=1)
    m.lm_head.weight.mul_(8)
    return m


@pytest.mark.parametrize("temperature", [1e-38, 1e-40, 1e-45, 5e-324])
def test_a_tiny_temperature_samples_the_greedy_text_with_every_method(sharp, temperature):
    """logits / T overflowed in float32 (inf - inf = NaN) and emitted garbage; the limit T -> 0 is greedy, and
    every method still equals AR sampling at that temperature."""
    model = sharp
    assert model(__import__("torch").tensor([PROMPT]), num_steps=6).abs().max() > 3.5
    greedy = dasspec.generate(model, PROMPT, "ar", max_new_tokens=10, eos=False, seed=3).tokens   # (the same states)
    for method, knobs in (("ar", {}), ("das-wave", {"gamma": 6, "rounds": 3}), ("pld", {}), ("mature-spec", {})):
        out = dasspec.generate(model, PROMPT, method, max_new_tokens=10, eos=False, do_sample=True,
                               temperature=temperature, top_p=0.9, seed=3, **knobs)
        assert out.tokens == greedy, (method, temperature)


def test_an_empty_stop_string_is_refused_as_the_server_refuses_it(model, capsys):
    with pytest.raises(ValueError, match="stop strings must not be empty"):
        dasspec.generate(model, PROMPT, max_new_tokens=2, stop=["x", ""])
    assert main(["generate", "--prompt", "x", "--stop", ""]) == 2
    one_error_line(capsys.readouterr().err, "stop strings must not be empty")


# --- the command line: names that name nothing, flags that cannot work, checked before any model loads -------------

@pytest.fixture
def no_model(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the flags were checked")
    monkeypatch.setattr(dasspec, "load_model", refuse)


def _taken_port() -> tuple[object, int]:
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s, s.getsockname()[1]


@pytest.mark.parametrize("argv, message", [
    (["serve", "--port", "99999"], "--port must be a TCP port, 1..65535, got 99999"),
    (["serve", "--port", "-5"], "--port must be a TCP port, 1..65535, got -5"),
    (["serve", "--port", "{taken}"], "cannot listen on 127.0.0.1:{taken}: Address already in use"),
    (["serve", "--host", "192.0.2.1"], "cannot listen on 192.0.2.1:8000: Cannot assign requested address"),
    (["serve", "--threads", "100000"], "--threads 100000 is more than the"),
    (["serve", "--max-body", "0"], "--max-body must be a number > 0, got 0"),
    (["serve", "--template-timeout", "nan"], "--template-timeout must be a number > 0, got nan"),
    (["serve", "--set", "gamma=6"], "--set gamma: method 'auto' has no knob 'gamma'; knobs: arms, calibrate, explore, "
                                    "recall; gamma is a knob of das-wave (name that method)"),
    (["serve", "--method", "pld", "--set", "nope=1"], "--set nope: method 'pld' has no knob 'nope'; knobs:"),
    (["generate", "--prompt", "x", "--threads", "5000"], "--threads 5000 is more than the"),
    (["train", "--out", "{tmp}/t", "--set", "threads=-3"], "threads must be >= 0"),
    (["train", "--out", "{tmp}/t", "--set", "lr=Infinity"], "lr must be > 0 and finite, got inf"),
    (["train", "--out", "{tmp}/t", "--set", "grad_clip=NaN"], "grad_clip must be a finite number >= 0 (0: no clipping), got nan"),
    (["bench", "--out", "{tmp}/b", "--cap", "humaneva=5"], "--cap humaneva=5: unknown task 'humaneva'"),
    (["bench", "--out", "{tmp}/b", "--shots", "nosuch=3"], "--shots nosuch=3: unknown task 'nosuch'"),
    (["bench", "--out", "{tmp}/b", "--tasks", "gsm8k", "--shots", "mbpp=3"],
     "--shots mbpp=3: mbpp is not among the tasks of this run (gsm8k)"),
    (["bench", "--out", "{tmp}/b", "--methods", "pld", "--knobs", "sam:alpha=2"],
     "--knobs names method sam that is not being benchmarked"),
    (["probe", "maturity", "--out", "/proc/dasspec-probe"], "--out /proc/dasspec-probe: /proc is not writable"),
])
def test_bad_flags_are_refused_before_the_model_loads(tmp_path, capsys, no_model, argv, message):
    held, port = _taken_port()
    try:
        fill = lambda a: a.replace("{tmp}", str(tmp_path)).replace("{taken}", str(port))     # noqa: E731
        assert main([fill(a) for a in argv]) == 2
        one_error_line(capsys.readouterr().err, fill(message))
    finally:
        held.close()
    assert list(tmp_path.iterdir()) == []


def test_a_closed_stdout_is_one_line_not_a_traceback():
    proc = subprocess.run(f"{sys.executable} -m dasspec.cli generate --prompt x >&-", shell=True,
                          capture_output=False, stderr=subprocess.PIPE, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 2
    one_error_line(proc.stderr, "stdout is closed")
