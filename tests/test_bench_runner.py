"""The benchmark protocol on a tiny random model: paired records, rotation, AR agreement, resume after an
interrupt, skipped prompts, stop strings, stateful bootstrap, knob parsing and the report files."""

import json
from argparse import Namespace
from pathlib import Path

import pytest

from dasspec.eval.bench import work
from dasspec.eval.bench.report import write_report
from dasspec.eval.bench.folder import RunFolder, clear_results
from dasspec.eval.bench.lock import FolderBusy
from dasspec.eval.bench.records import REJECTED, RecordsError, read_records
from dasspec.eval.bench.runner import BenchPlan, load_records, parse_knobs, run_bench
from dasspec.engine.drafting.draft import Drafter, Session
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


class BrokenSession(Session):
    def observe(self, verdict):
        # a drafter cannot change what is committed (its context is read-only): this one corrupts the verdict it
        # is handed, in its last block, to stand for a broken engine
        ctx = self.ctx
        if ctx.budget <= len(verdict.tokens):
            verdict.tokens[-1] = (verdict.tokens[-1] + 1) % ctx.config.vocab_size


class Broken(Drafter):
    """AR, with its last token changed after the stop: output that differs from AR's."""

    name = "test-broken"
    session = BrokenSession


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
    real = work.generate
    calls = []

    def interrupted(*a, **k):
        if len(calls) == 4:
            raise KeyboardInterrupt
        calls.append(k["drafter"].name)
        return real(*a, **k)

    monkeypatch.setattr(work, "generate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bench(model, tmp_path, plan(["mature-spec"]))
    assert len(load_records(tmp_path / "records.jsonl")) == 4       # everything finished is kept

    def counting(*a, **k):
        calls.append(k["drafter"].name)
        return real(*a, **k)

    monkeypatch.setattr(work, "generate", counting)
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
    real = work.generate
    calls = []

    def counting(*a, **k):
        calls.append((k["drafter"].name, k["max_new_tokens"]))
        return real(*a, **k)

    monkeypatch.setattr(work, "generate", counting)
    monkeypatch.setattr(work, "WARMUP_TOKENS", 2)
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


def rec(pid, method="ar", **kw):
    """A minimal finished record (the fields the report reads)."""
    return {"task": "toy", "prompt_id": pid, "prompt_index": int(pid[1:]), "method": method, "new_tokens": 4,
            "wall_time": 0.5, "sequential_passes": 8, "tokens": [5, 6, 7, 8], "accepted": [], "target_tokens": [],
            "stop_reason": "max_new_tokens", "session": "s", **kw}


def line(r):
    return json.dumps(r) + "\n"


def test_lines_that_are_not_records_stop_with_their_number_and_the_file_is_kept(tmp_path):
    path = tmp_path / "records.jsonl"
    body = (line(rec("p0")) + "{}\n" + "garbage\n" + line(rec("p0")) + '[1, 2]\n' + line(rec("p1"))
            + '{"task": "toy", "prom')                               # a writer stopped (or still writing) mid-line
    path.write_text(body)
    with pytest.raises(RecordsError) as err:
        read_records(path)
    msg = str(err.value)
    assert "5 line(s)" not in msg and "4 line(s)" in msg
    assert "line 2 (missing task" in msg and "line 3 (not JSON" in msg and "line 5 (a JSON list" in msg
    assert "line 4 (a second record of toy/p0/ar (first on line 1))" in msg and "--repair-records" in msg
    assert path.read_text() == body and not (tmp_path / REJECTED).exists()       # left exactly as it was
    got = read_records(path, set_aside=True)                                      # --repair-records
    assert [r["prompt_id"] for r in got.ok] == ["p0", "p1"] and got.set_aside == 4
    assert got.torn_tail == '{"task": "toy", "prom'
    assert path.read_text() == body                                               # still never rewritten
    side = [json.loads(x) for x in (tmp_path / REJECTED).read_text().splitlines()]
    assert [(e["line"], e["text"]) for e in side] == [(2, "{}"), (3, "garbage"), (4, line(rec("p0"))[:-1]),
                                                      (5, "[1, 2]")]
    again = read_records(path)                                     # the listed lines are skipped from now on
    assert len(again.ok) == 2 and again.set_aside == 4


def test_the_writer_sets_a_torn_last_line_aside_by_appending(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text(line(rec("p0")) + '{"task": "toy", "prom')
    inode = path.stat().st_ino
    with RunFolder(tmp_path) as folder:
        assert folder.torn == '{"task": "toy", "prom'
        assert path.read_text() == line(rec("p0")) + '{"task": "toy", "prom\n'   # appended to, not rewritten
        folder.append(rec("p1"))
    assert path.stat().st_ino == inode
    side = [json.loads(x) for x in (tmp_path / REJECTED).read_text().splitlines()]
    assert [(e["line"], e["text"]) for e in side] == [(2, '{"task": "toy", "prom')]
    got = read_records(path)
    assert [r["prompt_id"] for r in got.ok] == ["p0", "p1"] and got.set_aside == 1 and got.torn_tail is None
    whole = tmp_path / "whole"
    whole.mkdir()
    (whole / "records.jsonl").write_text(line(rec("p0")) + line(rec("p1"))[:-1])   # stopped before the newline
    with RunFolder(whole) as folder:
        assert folder.torn is None                                   # a finished record: kept, not set aside
    assert len(read_records(whole / "records.jsonl").ok) == 2 and not (whole / REJECTED).exists()


def test_a_report_never_rewrites_records_that_a_running_bench_appends_to(tmp_path):
    """The race of issue 23: --report-only (or a resumed bench) used to rewrite records.jsonl while another process
    was halfway through a line; that process's later lines then went to an unlinked file."""
    import subprocess
    import sys
    import time

    path = tmp_path / "records.jsonl"
    path.write_text(line(rec("p0")) + line(rec("p0", "pld")))
    later = [line(rec(f"p{i}", m)) for i in (1, 2, 3) for m in ("ar", "pld")]
    writer = subprocess.Popen([sys.executable, "-c", f"""
import os, sys, time
lines, path, go = {later!r}, {str(path)!r}, {str(tmp_path / "go")!r}
fd = os.open(path, os.O_WRONLY | os.O_APPEND)
os.write(fd, lines[0][:20].encode())                  # halfway through a line ...
while not os.path.exists(go):
    time.sleep(0.01)
os.write(fd, lines[0][20:].encode())                  # ... then the rest, and more lines
for x in lines[1:]:
    os.write(fd, x.encode())
"""])
    try:
        deadline = time.time() + 30
        while path.stat().st_size == len(line(rec("p0")) + line(rec("p0", "pld"))) and time.time() < deadline:
            time.sleep(0.01)
        s, _ = write_report(tmp_path, n_resamples=10)                 # what --report-only does, mid-line
        assert len(s.rows) == 2 and s.torn_tail
        (tmp_path / "go").touch()
        assert writer.wait(30) == 0
    finally:
        writer.kill()
    assert path.read_text() == line(rec("p0")) + line(rec("p0", "pld")) + "".join(later)   # nothing lost
    assert len(read_records(path).ok) == 8


def test_one_writer_per_folder_and_the_lock_dies_with_its_holder(tmp_path, capsys):
    """A second bench on a folder that a running one holds (here a real process holding the lock) is refused at
    once, before any model work (its --model does not exist), saying who holds it; a killed holder frees it."""
    import subprocess
    import sys

    from dasspec.cli import main

    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", f"""
import sys
from dasspec.eval.bench.lock import RunLock
lock = RunLock({str(out)!r}).acquire()
print("held", flush=True)
sys.stdin.read()
"""], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(FolderBusy, match=f"another run holds {out} \\(pid {holder.pid} on "):
            RunFolder(out)
        with pytest.raises(FolderBusy):
            clear_results(out)                                     # --fresh of another run is refused too
        assert main(["bench", "--model", str(tmp_path / "no-model"), "--tasks", "humaneval", "--methods", "ar",
                     "--out", str(out), "--quiet"]) == 2
        assert f"another run holds {out} (pid {holder.pid}" in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()
    with RunFolder(out):                                           # the kernel dropped the lock with its holder
        pass


def test_fresh_clears_earlier_results_only_once_the_run_starts(tmp_path, capsys):
    """--fresh with a mistyped --model keeps the folder's records (they are deleted only when the run starts)."""
    from dasspec.cli import main

    out = tmp_path / "out"
    out.mkdir()
    (out / "records.jsonl").write_text('{"earlier": 1}\n')
    assert main(["bench", "--fresh", "--model", str(tmp_path / "no-model"), "--tasks", "humaneval", "--methods",
                 "ar", "--out", str(out), "--quiet"]) == 2
    assert (out / "records.jsonl").read_text() == '{"earlier": 1}\n'
    with RunFolder(out, fresh=True) as folder:
        assert (out / "records.jsonl").exists()                   # opening the folder deletes nothing
        folder.start()
        assert not (out / "records.jsonl").exists()


def test_settings_that_would_fail_late_are_refused_before_any_work(tmp_path, capsys):
    from dasspec.cli import main

    afile = tmp_path / "afile"
    afile.write_text("x")
    base = ["bench", "--model", str(tmp_path / "no-model"), "--tasks", "humaneval", "--methods", "ar", "--quiet"]
    cases = [(["--out", str(tmp_path / "o"), "--bootstrap", "0"], "--bootstrap must be >= 1, got 0"),
             (["--out", str(afile)], f"--out {afile} is a file, not a folder"),
             (["--out", str(afile / "sub")], f"--out {afile / 'sub'}: cannot create the folder"),
             (["--out", str(afile), "--report-only"], f"--out {afile} is a file, not a folder"),
             (["--out", str(tmp_path / "o"), "--workers", "2"], "--workers is for --ray runs")]
    if Path("/sys").is_dir():                                      # read-only even for root
        cases.append((["--out", "/sys/dasspec-bench-test"], "--out /sys/dasspec-bench-test: cannot create"))
    for extra, message in cases:
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err
        assert message in err and "no-model" not in err, (extra, err)   # nothing was loaded
    assert not (tmp_path / "o").exists()


def test_ctrl_c_waits_for_the_line_being_written():
    import os
    import signal

    from dasspec.eval.bench.records import interrupts_deferred

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        done = []
        with pytest.raises(KeyboardInterrupt):
            with interrupts_deferred():
                os.kill(os.getpid(), signal.SIGINT)                     # Ctrl-C in the middle of an append ...
                done.append("the rest of the line")                     # ... which still finishes
        assert done == ["the rest of the line"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_ray_is_optional_and_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    from dasspec.cli import main

    monkeypatch.setitem(__import__("sys").modules, "ray", None)          # as if not installed
    assert main(["bench", "--model", str(tmp_path / "no-model"), "--tasks", "humaneval", "--methods", "ar",
                 "--out", str(tmp_path / "o"), "--quiet", "--ray"]) == 2
    assert "pip install 'dasspec[ray]'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_knob_flags_apply_to_every_benchmarked_method_that_takes_them():
    from dasspec.cli import build_parser
    from dasspec.eval.bench.cli import bench_knobs

    def knobs(*argv, methods="self-spec,mature-spec,das-wave,pld"):
        args = build_parser().parse_args(["bench", "--out", "x", *argv])
        return bench_knobs(args, methods.split(","))

    assert knobs("--policy", "deep-v", "--no-trim", "-k", "1", "--knobs", "mature-spec:policy=aligned,block=4") == {
        "self-spec": {"policy": "deep-v"}, "mature-spec": {"policy": "aligned", "block": 4},   # --knobs wins
        "das-wave": {"policy": "deep-v", "trim": False, "k": 1}}
    assert knobs("--set", "max_ngram=2", "--num-pred", "5") == {"das-wave": {"max_ngram": 2},   # both take it
                                                               "pld": {"max_ngram": 2, "num_pred": 5}}
    with pytest.raises(ValueError, match="--gamma: none of the benchmarked methods \\(ar, pld\\) takes gamma"):
        knobs("--gamma", "8", methods="pld")


def test_failed_runs_are_reported_not_counted_and_rerun(tmp_path):
    path = tmp_path / "records.jsonl"
    failed = {"task": "toy", "prompt_id": "p1", "prompt_index": 1, "method": "pld", "status": "failed",
              "error": "worker w died: ActorDiedError", "session": "s"}
    path.write_text(line(rec("p0")) + line(rec("p0", "pld")) + line(rec("p1")) + line(failed))
    got = read_records(path)
    assert ("toy", "p1", "pld") not in got.done and [r["method"] for r in got.failed] == ["pld"]
    s, text = write_report(tmp_path, n_resamples=10)
    assert len(s.rows) == 3 and "1 runs failed and are not counted" in text
    assert "failed: toy `p1` PLD: worker w died: ActorDiedError" in text
    with open(path, "a") as f:                                    # the rerun's record supersedes the failure
        f.write(line(rec("p1", "pld")))
    assert read_records(path).failed == []


def test_the_report_names_device_kinds_and_request_streams(model, tmp_path, extra_methods):
    bench(model, tmp_path, plan(["test-stateful"], prompts=4))
    recs = load_records(tmp_path / "records.jsonl")
    assert {r["device"] for r in recs} == {"CPU " + __import__("platform").machine() + ", 1 thread"}
    _, text = write_report(tmp_path, n_resamples=10)
    assert "device kinds" not in text and "streams" not in text           # one device, one stream: nothing to say
    for i, r in enumerate(recs):                                          # as a sharded run on two kinds would
        if r["prompt_index"] % 2:
            r.update(device="GPU X", worker="h:2")
    (tmp_path / "records.jsonl").write_text("".join(map(line, recs)))
    _, text = write_report(tmp_path, n_resamples=10)
    assert "Cells ran on 2 device kinds" in text and "| toy | AR | " in text and "## Tokens/s per device kind" in text
    assert "test-stateful keeps state across requests" in text and "split over 2 streams" in text


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
    from dasspec.cli import main
    assert main(["bench", "--out", str(tmp_path), "--report-only", "--bootstrap", "100", "--quiet"]) == 3
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
            "--max-new-tokens", "4", "--draft-depth", "2", "--knobs", "mature-spec:block=2", "--bootstrap", "100",
            "--out", str(tmp_path / "out"), "--no-warmup"]
    assert main(argv) == 0
    knobs = json.loads((tmp_path / "out" / "run.json").read_text())["methods"]["mature-spec"]["knobs"]
    assert (knobs["draft_depth"], knobs["block"]) == (2, 2)       # a derived flag and --knobs, both applied
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
    assert len(recs) == 12 and {r["cached_tokens"] for r in recs} == {shared // 16 * 16}   # its full blocks
    s, _ = write_report(tmp_path, n_resamples=100)
    assert not s.mismatches
    assert json.loads((tmp_path / "run.json").read_text())["prefix_cache"] is True
    with pytest.raises(ValueError, match="prefix_cache"):       # resuming without it would mix two setups
        bench(model, tmp_path, plan(["das-wave", "pld"], prompts=4, task=task))


def test_a_stateful_drafter_follows_the_whole_request_stream(model, tmp_path, monkeypatch):
    """The paper's protocol for Token Recycling: one successor table for the whole stream of requests (warm-up
    included), so the benchmark keeps one drafter per method for the run."""
    real = work.build_drafter
    built = {}

    def keep(model, method, *a, **k):
        built[method] = real(model, method, *a, **k)
        return built[method]

    monkeypatch.setattr(work, "build_drafter", keep)
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


def test_a_sampled_benchmark_uses_the_models_sampled_defaults(model, tmp_path, monkeypatch):
    """The model folder's "das-wave:sampled" section applies to a sampled run (recorded in run.json), not a greedy
    one; the drafter that runs is built with it."""
    monkeypatch.setattr(model, "generation_defaults", {"dasspec": {"das-wave:sampled": {"w_init": 3}}})
    built = {}
    keep = work.build_drafter
    monkeypatch.setattr(work, "build_drafter", lambda *a, **k: built.setdefault(len(built), keep(*a, **k)))
    bench(model, tmp_path / "s", plan(["das-wave"], prompts=1, sampling={"temperature": 1.0}))
    bench(model, tmp_path / "g", plan(["das-wave"], prompts=1))
    sampled, greedy = (json.loads((tmp_path / f / "run.json").read_text())["methods"]["das-wave"]["knobs"]
                       for f in ("s", "g"))
    assert sampled["w_init"] == 3 and greedy["w_init"] != 3
    assert [d.knobs.w_init for d in built.values() if hasattr(d, "knobs") and hasattr(d.knobs, "w_init")] == \
        [3, greedy["w_init"]]


def test_an_exit_target_reaches_every_arm_and_is_pinned(tmp_path):
    """--exit-threshold / --exit-at-step (Ouro): every arm, AR included, decodes the early-exit target, so every
    output equals AR's at that target; the target is in run.json (a resume with another is refused) and the report;
    a model without an exit gate is refused before any run."""
    import dasspec

    ouro = random_model("ouro", seed=3)
    target = {"exit_at_step": 1}
    bench(ouro, tmp_path, plan(["self-spec", "das-wave"], knobs={}, exit=target))
    recs = load_records(tmp_path / "records.jsonl")
    s, text = write_report(tmp_path)
    assert not s.mismatches and "R = 4 (target: exit_at_step 1)" in text
    task, tok = toy_task(), CharTokenizer()
    by_id = {ex.id: ex for ex in task.examples(3, "eval", 0, None)}
    moved = 0
    for r in (r for r in recs if r["method"] == "ar"):
        ids = tok.encode(by_id[r["prompt_id"]].prompt)
        opts = dict(max_new_tokens=CAP, stop=list(task.stop), tokenizer=tok)
        assert r["tokens"] == dasspec.generate(ouro, ids, **opts, **target).tokens
        moved += r["tokens"] != dasspec.generate(ouro, ids, **opts).tokens
    assert moved, "the target changes no AR output here, so nothing shows that it was applied"
    with pytest.raises(ValueError, match="exit"):
        bench(ouro, tmp_path, plan(["self-spec"], knobs={}, exit={"exit_threshold": 0.5}))
    with pytest.raises(ValueError, match=r"need a model with an early-exit gate \(Ouro\); a huginn model has none"):
        bench(random_model("huginn"), tmp_path / "h", plan(["ar"], exit=target))
    assert not (tmp_path / "h" / "records.jsonl").exists()
