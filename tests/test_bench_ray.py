"""``dasspec bench --ray`` on a real local Ray instance with 2 CPU workers (one per core of the test machine), a
small random checkpoint and a small data folder: a sharded run records what a one-process run records (all but
timings); an interrupted driver resumes, a worker killed mid-run loses and duplicates nothing, and the folder is
interchangeable with a one-process run's.  One Ray instance serves the whole module (starting one takes seconds,
and so does starting workers: the fault scenarios share their runs)."""

import json
import os
import signal

import pytest

ray = pytest.importorskip("ray")

import dasspec  # noqa: E402
from dasspec.cli import main  # noqa: E402
from dasspec.eval.bench.ray_runner import ModelSource, run_bench_ray  # noqa: E402
from dasspec.eval.bench.records import read_records  # noqa: E402
from dasspec.eval.bench.runner import run_bench  # noqa: E402
from dasspec.eval.bench.setup import BenchPlan, resolve_tasks  # noqa: E402
from test_bench_runner import char_checkpoint  # noqa: E402

CAP = 8
TASKS = ("gsm8k", "mbpp")
PROMPTS = 3
RUNS = len(TASKS) * PROMPTS * 3                    # cells x (AR, DAS-Wave, SAM)
# what differs between two runs of the same records: the clock, and who ran them when
UNREPEATABLE = {"wall_time", "prefill_time", "draft_time", "verify_time", "tokens_per_second", "peak_memory",
                "session", "worker"}


@pytest.fixture(scope="module", autouse=True)
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False,
             configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return char_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """GSM8K and MBPP in the shared data layout, with short rows (the real ones would only be slower)."""
    root = tmp_path_factory.mktemp("data")
    (root / "gsm8k").mkdir()
    (root / "gsm8k" / "test.jsonl").write_text("".join(
        json.dumps({"question": f"What is {i} plus {i}?", "answer": f"It is {2 * i}.\n#### {2 * i}"}) + "\n"
        for i in range(8)))
    (root / "mbpp").mkdir()
    (root / "mbpp" / "mbpp.jsonl").write_text("".join(
        json.dumps({"task_id": t, "text": f"Write f{t}.", "test_list": [f"assert f{t}() == {t}"],
                    "code": f"def f{t}(): return {t}"}) + "\n" for t in range(11, 511)))
    return root


def plan(data) -> BenchPlan:
    return BenchPlan(tasks=resolve_tasks(TASKS, {"*": CAP}, {"gsm8k": 0}), methods=["das-wave", "sam"],
                     knobs={"das-wave": {"gamma": 4, "rounds": 2}}, prompts=PROMPTS, data=str(data))


def records(folder):
    """Finished records by (task, prompt, method); read_records refuses a folder holding any run twice."""
    got = read_records(folder / "records.jsonl")
    assert not got.failed and got.torn_tail is None
    return {(r["task"], r["prompt_id"], r["method"]): r for r in got.ok}


def test_a_sharded_run_records_what_a_one_process_run_records(ckpt, data, tmp_path):
    argv = ["bench", "--model", str(ckpt), "--tasks", ",".join(TASKS), "--shots", "gsm8k=0", "--data", str(data),
            "--methods", "das-wave,sam", "--gamma", "4", "--rounds", "2", "--prompts", str(PROMPTS),
            "--max-new-tokens", str(CAP), "--threads", "1", "--bootstrap", "100", "--quiet"]
    assert main(argv + ["--out", str(tmp_path / "ray"), "--ray", "--workers", "2"]) == 0
    assert main(argv + ["--out", str(tmp_path / "local")]) == 0
    sharded, local = records(tmp_path / "ray"), records(tmp_path / "local")
    assert len(sharded) == RUNS and sharded.keys() == local.keys()
    for key, r in sharded.items():
        assert list(r) == list(local[key])                                # one schema, field for field
        assert {k: v for k, v in r.items() if k not in UNREPEATABLE} == \
            {k: v for k, v in local[key].items() if k not in UNREPEATABLE}, key   # tokens, order, device, ...
    assert len({r["worker"] for r in sharded.values()}) == 2               # both workers ran cells
    for task, pid, _ in sharded:                                           # a cell stays on one worker
        assert len({sharded[(task, pid, m)]["worker"] for m in ("ar", "das-wave", "sam")}) == 1
    sharded_info, local_info = (json.loads((tmp_path / f / "run.json").read_text()) for f in ("ray", "local"))
    assert len(sharded_info.pop("sessions")[-1]["ray"]["workers"]) == 2
    local_info.pop("sessions")
    assert sharded_info == local_info                                      # the same pinned setup
    report = (tmp_path / "ray" / "report.md").read_text()
    assert "None: all 18 paired outputs equal AR's tokens" in report
    assert all((tmp_path / "ray" / f).stat().st_size for f in ("summary.csv", "prompts.jsonl", "speedup.png"))


def test_an_interrupted_driver_and_a_killed_worker_lose_and_duplicate_nothing(ckpt, data, tmp_path):
    """Ctrl-C on the driver after two cells; the same run again, with a worker SIGKILLed after its first cell:
    the run resumes, retries the dead worker's next cell elsewhere, and every run is recorded once; a one-process
    run then takes the folder as done."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)      # Ctrl-C raises, whoever runs us
    seen = []

    def ctrl_c_after_two_cells(cell_records):
        seen.append(cell_records)
        if len(seen) == 2:
            os.kill(os.getpid(), signal.SIGINT)

    try:
        with pytest.raises(KeyboardInterrupt):
            run_bench_ray(ModelSource(str(ckpt)), plan(data), tmp_path, workers=2, progress=False,
                          on_cell=ctrl_c_after_two_cells)
    finally:
        signal.signal(signal.SIGINT, previous)
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    assert [json.loads(x)["method"] for x in lines]                          # every line whole
    assert len(records(tmp_path)) == len(lines) == 3 * len(seen) == 6        # the two finished cells, whole

    killed = []

    def kill_its_worker(cell_records):
        if not killed:                                  # after its first cell: SIGKILL the process that ran it
            killed.append(int(cell_records[0]["worker"].rsplit(":", 1)[1]))
            os.kill(killed[0], signal.SIGKILL)

    run = run_bench_ray(ModelSource(str(ckpt)), plan(data), tmp_path, workers=2, progress=False,
                        on_cell=kill_its_worker)
    assert (run.kept, run.ran, run.failed) == (6, RUNS - 6, 0)
    assert run.retried >= 1 and run.workers == 3                 # its next cell ran elsewhere; it was replaced
    got = records(tmp_path)                                       # nothing twice, nothing missing
    assert len(got) == RUNS
    assert sum(r["worker"].endswith(f":{killed[0]}") for r in got.values()) == 3   # only its one finished cell
    local = run_bench(dasspec.load_model(str(ckpt)), plan(data), tmp_path, progress=False)
    assert (local.kept, local.ran) == (RUNS, 0)                              # a local run takes the folder as done
