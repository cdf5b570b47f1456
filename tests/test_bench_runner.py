"""The benchmark protocol on a tiny random model: paired records, rotation, AR agreement, resume after an
interrupt, skipped prompts, stop strings, stateful bootstrap, knob parsing and the report files."""

import json
from argparse import Namespace

import pytest

from dasspec.eval.bench import runner
from dasspec.eval.bench.cli import cmd_bench
from dasspec.eval.bench.report import write_report
from dasspec.eval.bench.runner import BenchPlan, load_records, parse_knobs, run_bench
from dasspec.engine.draft import Drafter
from dasspec.methods import METHODS, Method
from dasspec.methods.ar import ARKnobs
from dasspec.eval.tasks import Example, Task, select
from dasspec.testing import random_model

CAP = 6
FAST = {"mature-spec": {"draft_depth": 2, "block": 3}, "das-wave": {"gamma": 4, "rounds": 2}}


class CharTokenizer:
    chars = "\n" + "".join(chr(c) for c in range(32, 127))
    eos_ids = [1]
    bos_id = 0

    def encode(self, text):
        return [0] + [2 + self.chars.index(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.chars[i - 2] for i in ids if 2 <= i < 2 + len(self.chars))


def toy_task(n=10, cap=CAP, stop=("\n\n\n",), long_ids=()):
    rows = [{"id": f"p{i}", "text": ("long " * 80 if i in long_ids else f"prompt {i}: say something")}
            for i in range(n)]
    return Task("toy", cap, tuple(stop), lambda root: rows, lambda r, s: Example("toy", r["id"], r["text"]))


@pytest.fixture(scope="module")
def model():
    return random_model("huginn")


class Broken(Drafter):
    """AR, with its last token changed after the stop: output that differs from AR's."""

    name = "test-broken"

    def observe(self, req, verdict):
        if req.done:
            req.generated[-1] = (req.generated[-1] + 1) % req.model.config.vocab_size


@pytest.fixture
def extra_methods(monkeypatch):
    """Test-only methods: one that breaks AR's output, one that declares cross-request state."""
    from dasspec import methods
    methods.method_names()                                       # the built-in methods first
    monkeypatch.setitem(METHODS, "test-broken", Method("test-broken", ARKnobs, lambda k: Broken()))
    monkeypatch.setitem(METHODS, "test-stateful", Method("test-stateful", ARKnobs, lambda k: Drafter(),
                                                          stateful=True))


def plan(methods, prompts=3, **kw):
    knobs = kw.pop("knobs", {m: k for m, k in FAST.items() if m in methods})
    return BenchPlan(tasks=[kw.pop("task", toy_task())], methods=methods, knobs=knobs,
                     prompts=prompts, warmup=kw.pop("warmup", False), **kw)


def bench(model, out, p):
    return run_bench(model, p, out, tokenizer=CharTokenizer(), model_name="random", progress=False)


def test_records_are_paired_rotated_and_match_ar(model, tmp_path):
    run = bench(model, tmp_path, plan(["mature-spec", "das-wave"], warmup=True))
    assert run.methods == ["ar", "mature-spec", "das-wave"] and run.ran == 9 and run.kept == 0
    recs = load_records(tmp_path / "records.jsonl")
    assert len(recs) == 9 and len({(r["task"], r["prompt_id"], r["method"]) for r in recs}) == 9
    for r in recs:
        assert r["new_tokens"] == len(r["tokens"]) <= CAP and r["wall_time"] > 0
        assert r["sequential_passes"] > 0 and r["cap"] == CAP and r["session"]
        # the order rotates by one per prompt
        assert r["order"] == (run.methods.index(r["method"]) - r["prompt_index"]) % 3
    s, text = write_report(tmp_path, n_resamples=200)
    assert not s.mismatches and len(s.rows) == 9
    assert all(r["match"] for r in map(json.loads, (tmp_path / "prompts.jsonl").read_text().splitlines()))
    assert "None: all 9 paired outputs equal AR's tokens" in text
    assert "| Mature-Spec |" in text and "| DAS-Wave |" in text
    for name in ("report.md", "summary.csv", "prompts.jsonl", "speedup.png", "accept.png", "run.json"):
        assert (tmp_path / name).stat().st_size > 0
    csv = (tmp_path / "summary.csv").read_text().splitlines()
    assert csv[0].startswith("task,method,n,S,S_lo,S_hi") and len(csv) == 4


def test_resume_after_interrupt_runs_only_what_is_missing(model, tmp_path, monkeypatch):
    real = runner.generate
    calls = []

    def interrupted(*a, **k):
        if len(calls) == 4:
            raise KeyboardInterrupt
        calls.append(k["drafter"].name)
        return real(*a, **k)

    monkeypatch.setattr(runner, "generate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bench(model, tmp_path, plan(["mature-spec"]))
    assert len(load_records(tmp_path / "records.jsonl")) == 4       # everything finished is kept

    def counting(*a, **k):
        calls.append(k["drafter"].name)
        return real(*a, **k)

    monkeypatch.setattr(runner, "generate", counting)
    calls.clear()
    run = bench(model, tmp_path, plan(["mature-spec"]))
    assert run.ran == 2 and run.kept == 4 and len(calls) == 2
    recs = load_records(tmp_path / "records.jsonl")
    assert len({(r["prompt_id"], r["method"]) for r in recs}) == len(recs) == 6
    calls.clear()
    run = bench(model, tmp_path, plan(["mature-spec"], warmup=True))   # all done: no warm-up, no runs
    assert run.ran == 0 and calls == []
    # more prompts extend the same folder
    run = bench(model, tmp_path, plan(["mature-spec"], prompts=4))
    assert run.ran == 2 and len(load_records(tmp_path / "records.jsonl")) == 8


def test_schedule_warms_up_rotates_and_keeps_slots_of_skipped_runs(monkeypatch):
    """The shared schedule (dasspec.eval.pairing): warm-up of every arm on the first prompt before any timed run,
    an order rotating by one per prompt, garbage collected before every run, done runs skipped in place."""
    from dasspec.eval import pairing

    calls = []
    monkeypatch.setattr(pairing.gc, "collect", lambda: calls.append("gc"))
    arms = ["ar", "x", "y"]
    runs = pairing.paired_runs(["p0", "p1", "p2", "p3"], arms, lambda p, a: calls.append((p, a)) or f"{p}/{a}",
                               warmup=lambda p, a: calls.append(("warm", p, a)),
                               pending=lambda p, a: (p, a) != ("p2", "y"))
    got = [(r.prompt, r.arm, r.slot, r.result) for r in runs]
    assert calls[:6] == ["gc", ("warm", "p0", "ar"), "gc", ("warm", "p0", "x"), "gc", ("warm", "p0", "y")]
    timed = calls[6:]
    assert timed[::2] == ["gc"] * 11 and [c[:2] for c in timed[1::2]] == [(p, a) for p, a, _, _ in got]
    assert [(p, a, slot) for p, a, slot, _ in got] == [
        ("p0", "ar", 0), ("p0", "x", 1), ("p0", "y", 2),
        ("p1", "x", 0), ("p1", "y", 1), ("p1", "ar", 2),
        ("p2", "ar", 1), ("p2", "x", 2),                       # ("p2", "y") was done: its slot 0 stays empty
        ("p3", "ar", 0), ("p3", "x", 1), ("p3", "y", 2)]
    assert all(result == f"{p}/{a}" for p, a, _, result in got)
    calls.clear()
    shifted = pairing.paired_runs(["q", "r"], arms, lambda p, a: None, warmup=lambda p, a: calls.append(p),
                                  pending=lambda p, a: p == "r", shift=lambda p: 5)
    assert [(r.arm, r.slot) for r in shifted] == [("y", 0), ("ar", 1), ("x", 2)]   # rotation from shift(prompt)
    assert [c for c in calls if c != "gc"] == ["q", "q", "q"]  # warm-up on the first prompt, done or not
    calls.clear()
    assert list(pairing.paired_runs(["q"], arms, lambda p, a: None, warmup=lambda p, a: calls.append(p),
                                    pending=lambda p, a: False)) == []
    assert calls == []                                         # nothing to time: no warm-up either


def test_warm_up_runs_every_method_once_on_the_first_prompt_with_a_short_cap(model, tmp_path, monkeypatch):
    real = runner.generate
    calls = []

    def counting(*a, **k):
        calls.append((k["drafter"].name, k["max_new_tokens"]))
        return real(*a, **k)

    monkeypatch.setattr(runner, "generate", counting)
    monkeypatch.setattr(runner, "WARMUP_TOKENS", 2)
    bench(model, tmp_path, plan(["mature-spec"], prompts=2, warmup=True))
    assert calls == [("ar", 2), ("mature-spec", 2), ("ar", CAP), ("mature-spec", CAP), ("mature-spec", CAP),
                     ("ar", CAP)]
    assert [(r["method"], r["order"]) for r in load_records(tmp_path / "records.jsonl")] == [
        ("ar", 0), ("mature-spec", 1), ("mature-spec", 0), ("ar", 1)]


def test_target_depth_is_validated(model, tmp_path):
    with pytest.raises(ValueError, match="num_steps must be a whole number"):
        bench(model, tmp_path, plan(["ar"], num_steps=2.5))
    with pytest.raises(ValueError, match="num_steps must be >= 1"):
        bench(model, tmp_path, plan(["ar"], num_steps=0))


def test_a_torn_last_line_is_dropped(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text('{"task": "t", "prompt_id": "a", "method": "ar"}\n{"task": "t", "prom')
    assert [r["prompt_id"] for r in load_records(path)] == ["a"]
    assert path.read_text().endswith("}\n")


def test_resuming_with_a_different_setup_is_refused(model, tmp_path):
    bench(model, tmp_path, plan(["mature-spec"], prompts=1))
    with pytest.raises(ValueError, match="different setup.*cap"):
        bench(model, tmp_path, plan(["mature-spec"], prompts=1, task=toy_task(cap=CAP + 1)))
    with pytest.raises(ValueError, match="different setup.*mature-spec"):
        bench(model, tmp_path, plan(["mature-spec"], prompts=1, knobs={"mature-spec": {"draft_depth": 3}}))
    with pytest.raises(ValueError, match="different setup.*weights"):     # same name and size, other weights
        bench(random_model("huginn", seed=1), tmp_path, plan(["mature-spec"], prompts=1))


def test_unknown_methods_and_bad_knobs_fail_before_any_run(model, tmp_path):
    with pytest.raises(ValueError, match="unknown method 'nope'.*available"):
        bench(model, tmp_path, plan(["mature-spec", "nope"]))
    with pytest.raises(ValueError, match="method self-spec: draft_depth must be < R.*--knobs self-spec:"):
        bench(model, tmp_path, plan(["self-spec"], knobs={"self-spec": {"draft_depth": 8}}))
    with pytest.raises(ValueError, match="does not take gama"):
        bench(model, tmp_path, plan(["das-wave"], knobs={"das-wave": {"gama": 4}}))
    with pytest.raises(ValueError, match="not being benchmarked"):
        bench(model, tmp_path, plan(["ar"], knobs={"das-wave": {"gamma": 4}}))
    assert not (tmp_path / "records.jsonl").exists() or not load_records(tmp_path / "records.jsonl")


def test_prompts_that_do_not_fit_the_context_are_skipped_with_a_reason(model, tmp_path):
    first = select(10, 3)[0]                                       # the first selected prompt is too long
    run = bench(model, tmp_path, plan(["ar", "pld"], task=toy_task(long_ids=(first,))))
    assert [sk["prompt_id"] for sk in run.skipped] == [f"p{first}"]
    assert "> context 256" in run.skipped[0]["reason"]
    _, text = write_report(tmp_path, run.skipped, n_resamples=100)
    assert f"skipped toy `p{first}`: prompt 401 tokens + cap 6 > context 256" in text
    recs = load_records(tmp_path / "records.jsonl")
    assert len(recs) == 4
    # the rotation follows each prompt's place in the selection, skipped prompts included
    assert all(r["order"] == (run.methods.index(r["method"]) - r["prompt_index"]) % 2 for r in recs)
    assert {r["prompt_index"] for r in recs} == {1, 2}


def test_task_stop_strings_reach_generate(model, tmp_path):
    # find the text AR produces, then make its third character a stop string
    tok = CharTokenizer()
    bench(model, tmp_path / "a", plan(["ar"], prompts=1, task=toy_task(cap=8)))
    first = load_records(tmp_path / "a" / "records.jsonl")[0]
    text = tok.decode(first["tokens"])
    stop = text[2]
    cut = text.index(stop) + 1
    bench(model, tmp_path / "b", plan(["ar", "mature-spec"], prompts=1, task=toy_task(cap=8, stop=(stop,))))
    for r in load_records(tmp_path / "b" / "records.jsonl"):
        assert r["stop_reason"] == "stop_string" and r["new_tokens"] == cut
        assert r["text"] == text[:cut - 1]


def test_mismatches_are_reported_and_fail_in_float32(model, tmp_path, extra_methods, capsys):
    bench(model, tmp_path, plan(["test-broken"], prompts=2))
    s, text = write_report(tmp_path, n_resamples=100)
    assert {(m["method"], m["prompt_index"]) for m in s.mismatches} == {("test-broken", 0), ("test-broken", 1)}
    assert "FAILURE" in text and "test-broken" in text
    args = Namespace(out=str(tmp_path), report_only=True, bootstrap=100, quiet=True)
    assert cmd_bench(args) == 3
    assert "differ from AR" in capsys.readouterr().err


def test_stateful_methods_get_the_moving_block_bootstrap(model, tmp_path, extra_methods):
    bench(model, tmp_path, plan(["test-stateful", "mature-spec"], prompts=2))
    s, _ = write_report(tmp_path, n_resamples=100)
    assert s.cells[("toy", "test-stateful")]["bootstrap"] == "moving-block(1)"   # 2 requests: block shrunk to n // 2
    assert s.cells[("toy", "mature-spec")]["bootstrap"] == "paired"
    assert json.loads((tmp_path / "run.json").read_text())["methods"]["test-stateful"]["stateful"] is True


def test_parse_knobs_syntax():
    assert parse_knobs(["das-wave:gamma=16,rounds=8", "mature-spec:policy=deep-v,block=4"]) == {
        "das-wave": {"gamma": 16, "rounds": 8}, "mature-spec": {"policy": "deep-v", "block": 4}}
    assert parse_knobs(["wave:carry=false"]) == {"das-wave": {"carry": False}}          # alias, JSON value
    assert parse_knobs(["mature-spec:policy=k=4,v=32,block=8"]) == {
        "mature-spec": {"policy": "k=4,v=32", "block": 8}}
    for bad in ("das-wave", "das-wave:", "das-wave:gamma", ":gamma=1"):
        with pytest.raises(ValueError, match="--knobs"):
            parse_knobs([bad])
    with pytest.raises(ValueError, match="unknown method"):
        parse_knobs(["nope:gamma=1"])


def char_checkpoint(folder):
    """A random model saved as a checkpoint folder with a one-character-per-token tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models

    from dasspec import save_checkpoint

    chars = CharTokenizer.chars[:95]
    vocab = {"<s>": 0, "<|endoftext|>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|endoftext|>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<s>", "<|endoftext|>"])
    save_checkpoint(random_model("huginn", block_size=2048), folder)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_cli_bench_writes_the_table_and_resumes(tmp_path, capsys, monkeypatch):
    from dasspec.cli import main

    monkeypatch.delenv("DASSPEC_DATA", raising=False)             # HumanEval from the package: no data needed

    ckpt = char_checkpoint(tmp_path / "ckpt")
    argv = ["bench", "--model", str(ckpt), "--tasks", "humaneval", "--methods", "mature-spec", "--prompts", "1",
            "--max-new-tokens", "4", "--knobs", "mature-spec:draft_depth=2,block=2", "--bootstrap", "100",
            "--out", str(tmp_path / "out"), "--no-warmup"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| Method | HumanEval speedup [95% CI] | A |" in out and "| Mature-Spec |" in out
    recs = load_records(tmp_path / "out" / "records.jsonl")
    assert len(recs) == 2 and {r["cap"] for r in recs} == {4}
    assert main(argv + ["--quiet"]) == 0                          # resumed: nothing left to run
    assert len(load_records(tmp_path / "out" / "records.jsonl")) == 2
    capsys.readouterr()
    assert main(argv + ["--quiet", "--prefix-cache"]) == 2       # the folder was made without a prefix cache
    assert "prefix_cache: False there, True now" in capsys.readouterr().err
    assert main(["bench", "--out", str(tmp_path / "out"), "--report-only", "--quiet"]) == 0
    assert main(argv[:-3] + ["--methods", "nope", "--out", str(tmp_path / "x")]) == 2
    assert "unknown method 'nope'" in capsys.readouterr().err
    for bad in (["--prompts", "0"], ["--preset", "quick", "--prompts", "0"]):   # refused, not run with a default
        assert main(["bench", "--model", str(ckpt), "--tasks", "humaneval", "--methods", "ar", "--out",
                     str(tmp_path / "z"), "--quiet", "--no-warmup"] + bad) == 2
        assert "--prompts must be >= 1, got 0" in capsys.readouterr().err


def test_quick_preset_fills_only_unset_flags_and_drops_tasks_without_data(monkeypatch, tmp_path, capsys):
    from dasspec.eval.bench.cli import QUICK, _apply_preset, _available
    from dasspec.eval.bench.runner import resolve_tasks

    args = Namespace(preset="quick", tasks=None, prompts=None, max_new_tokens=None, shots=[], threads=None)
    _apply_preset(args)
    assert (args.tasks, args.prompts, args.max_new_tokens, args.shots, args.threads) == (
        QUICK["tasks"], 3, 64, ["gsm8k=2"], 1)
    args = Namespace(preset="quick", tasks="mbpp", prompts=5, max_new_tokens=8, shots=["gsm8k=1"], threads=2)
    _apply_preset(args)
    assert (args.tasks, args.prompts, args.max_new_tokens, args.shots, args.threads) == ("mbpp", 5, 8,
                                                                                      ["gsm8k=1"], 2)
    args = Namespace(preset="quick", tasks=None, prompts=0, max_new_tokens=0, shots=[], threads=None)
    _apply_preset(args)                      # 0 is a value (refused later), not "unset"
    assert (args.prompts, args.max_new_tokens) == (0, 0)
    monkeypatch.delenv("DASSPEC_DATA", raising=False)
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)
    tasks = resolve_tasks(["humaneval", "gsm8k"], {"*": 64}, {"gsm8k": 2})
    assert [(t.name, t.cap) for t in tasks] == [("humaneval", 64), ("gsm8k", 64)] and tasks[1].shots == 2
    assert [t.name for t in _available(tasks, None, preset=True)] == ["humaneval"]
    assert "leaving out gsm8k" in capsys.readouterr().err
    assert _available(tasks, None, preset=False) == tasks          # outside the preset the run itself fails


def test_prefix_cache_serves_every_method_alike_and_is_pinned(model, tmp_path):
    header = "Answer in one word.\nQ: what is red? A: a rose.\n"
    rows = [{"id": f"p{i}", "text": header + f"Q: item {i}?"} for i in range(8)]
    task = Task("toy", CAP, ("\n\n\n",), lambda root: rows, lambda r, s: Example("toy", r["id"], r["text"]))
    bench(model, tmp_path, plan(["das-wave", "pld"], prompts=4, task=task, prefix_cache=True))
    recs = load_records(tmp_path / "records.jsonl")
    shared = 1 + len(header) + len("Q: item ")           # BOS + the characters every prompt starts with
    assert len(recs) == 12 and {r["cached_tokens"] for r in recs} == {shared}
    s, _ = write_report(tmp_path, n_resamples=100)
    assert not s.mismatches
    assert json.loads((tmp_path / "run.json").read_text())["prefix_cache"] is True
    with pytest.raises(ValueError, match="prefix_cache"):       # resuming without it would mix two setups
        bench(model, tmp_path, plan(["das-wave", "pld"], prompts=4, task=task))


def test_a_stateful_drafter_follows_the_whole_request_stream(model, tmp_path, monkeypatch):
    """The paper's protocol for Token Recycling: one successor table for the whole stream of requests (warm-up
    included), so the benchmark keeps one drafter per method for the run."""
    real = runner.build_drafter
    built = {}

    def keep(model, method, *a, **k):
        built[method] = real(model, method, *a, **k)
        return built[method]

    monkeypatch.setattr(runner, "build_drafter", keep)
    bench(model, tmp_path, plan(["token-recycling"], prompts=3, warmup=True))
    assert built["token-recycling"].table.requests == 1 + 3


def test_sampled_benchmark_records_its_settings_and_pairs_with_ar_sampling(model, tmp_path):
    """--temperature: every arm, AR included, samples with the same seed, so every output must equal AR's; the
    settings are in every record, run.json (pinned for resumes), report.md and summary.csv."""
    sampling = {"temperature": 1.3, "top_p": 0.9}
    bench(model, tmp_path, plan(["mature-spec", "das-wave"], sampling=sampling))
    recs = load_records(tmp_path / "records.jsonl")
    assert all(r["sampling"] == sampling for r in recs)
    greedy = tmp_path / "greedy"
    bench(model, greedy, plan(["mature-spec"]))
    greedy_ar = {r["prompt_id"]: r["tokens"] for r in load_records(greedy / "records.jsonl") if r["method"] == "ar"}
    sampled_ar = {r["prompt_id"]: r["tokens"] for r in recs if r["method"] == "ar"}
    assert sampled_ar != greedy_ar                                     # the AR arm samples too
    s, text = write_report(tmp_path)
    assert not s.mismatches and "Decoding: sampled: temperature 1.3, top_p 0.9" in text
    rows = (tmp_path / "summary.csv").read_text().splitlines()
    assert rows[0].endswith("decoding,temperature,top_k,top_p,min_p") and rows[1].endswith("sampled,1.3,,0.9,")
    with pytest.raises(ValueError, match="sampling"):                 # resuming with other settings is refused
        bench(model, tmp_path, plan(["mature-spec"], sampling={"temperature": 0.5}))
