"""``dasspec bench --ray [ADDRESS]``: the same benchmark with its (task, prompt) cells sharded over Ray workers.

* A cell is AR and every requested method on one prompt, run back to back on one worker in the rotated order of
  ``work.Bench`` (the same code a local run uses), so each method is still paired with AR on the same prompt, the
  same device and within seconds (eq. 8).
* A worker is a Ray actor holding one loaded model (``num_gpus=1`` each when the cluster has GPUs; otherwise CPU
  workers of ``threads`` threads) and its own drafters for the whole run: a method's cross-request state (Token
  Recycling's table) follows that worker's request stream, one stream per worker instead of the local run's one;
  records name their worker and the report says how many streams there were.
* Each worker prepares the setup itself (knobs, prompts, weights fingerprint, run.json's pinned fields); the
  driver refuses workers that disagree, then alone appends the records it gets back to records.jsonl (one writer,
  whole lines), with one progress bar over the cells.
* Faults: a cell whose worker died (killed, out of memory) or that raised is run again on another worker (a
  dead worker is replaced, up to as many times as there are workers); a cell that fails twice is recorded as
  failed, with its errors, and the run goes on.  Ctrl-C leaves records.jsonl whole; the same command resumes, with
  or without ``--ray``.

Ray is optional (``pip install 'dasspec[ray]'``); this module imports it only when a run starts.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable

import torch
from tqdm.auto import tqdm

import dasspec

from ...engine.base.runtime import Runtime
from .runner import BenchRun, RunFolder, held
from .setup import PINNED, BenchPlan, begin_session, environment
from .work import Bench

RAY_HINT = "--ray needs Ray: pip install 'dasspec[ray]' (or pip install 'ray>=2.9')"
ATTEMPTS = 2                      # a cell that fails this many times is recorded as failed
LOCAL_OBJECT_STORE = 256 * 2**20  # a local instance's object store: records are small, and RAM is the models'
WAIT_S = 1.0


class WorkersLost(RuntimeError):
    """Every worker died and no more may be started; what finished is recorded."""


@dataclass(frozen=True)
class ModelSource:
    """Where each worker loads its model from (``dasspec.load_model`` arguments)."""
    name: str | None = None       # checkpoint folder or HF-cache repo id; None: the bundled model
    device: str | None = None     # None: the worker's GPU if it has one, else CPU
    dtype: str | None = None


def import_ray():
    try:
        import ray                  # optional: the [ray] extra; only --ray runs need it
    except ImportError:
        raise ValueError(RAY_HINT) from None
    return ray


def shippable(plan: BenchPlan) -> tuple[BenchPlan, dict]:
    """The plan without its Runtime (which keeps compiled graphs per model and does not travel), and the
    Runtime's options, from which a worker builds its own."""
    options = {f.name: getattr(plan.runtime, f.name) for f in dataclasses.fields(plan.runtime)
               if f.init and not f.name.startswith("_")}
    return dataclasses.replace(plan, runtime=None), options


class BenchWorker:
    """The Ray actor (wrapped by ``ray.remote`` when a run starts, so this module imports without Ray)."""

    def __init__(self, source: ModelSource, plan: BenchPlan, runtime: dict, model_name: str,
                 threads: int | None):
        self.plan = dataclasses.replace(plan, runtime=Runtime(**runtime))
        self.source, self.model_name, self.threads = source, model_name, threads
        self.bench = None
        self.warmed = False

    def start(self) -> dict:
        """Load the model and resolve the setup, exactly as a local run does; say what this worker is."""
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        model = dasspec.load_model(self.source.name, device=self.source.device, dtype=self.source.dtype)
        self.bench = Bench(model, self.plan, model_name=self.model_name)
        self.by_cell = {p.cell: p for p in self.bench.prompts}
        return {"info": self.bench.info, "methods": self.bench.methods, "skipped": self.bench.skipped,
                "cells": [[*p.cell, p.index] for p in self.bench.prompts], "device": self.bench.device,
                "worker": self.bench.worker, "env": environment()}

    def run_cell(self, cell: tuple[str, str], methods: list[str], session: str) -> list[dict]:
        """AR and ``methods`` (the cell's runs not yet recorded) on one prompt, back to back; their records."""
        warm = self.plan.warmup and not self.warmed     # this worker's first cell warms its stack up, unrecorded
        self.warmed = True
        todo = set(methods)
        try:
            return list(self.bench.run([self.by_cell[cell]], lambda p, m: m in todo, session, warm))
        except Exception as err:
            where = f" ({self.bench.current[1]})" if self.bench.current else ""
            raise CellError(f"{type(err).__name__}{where}: {err}") from None


class CellError(Exception):
    """A cell raised; the message names the method and the error (a plain exception travels well through Ray)."""


@dataclass
class Worker:
    handle: object
    name: str = ""                # host:pid, once started
    device: str = ""


def cluster_plan(ray, source: ModelSource, workers: int | None, threads: int) -> tuple[int, dict]:
    """How many workers, and each one's Ray resources: one GPU each when the cluster has GPUs (and the device
    allows them), else ``threads`` CPUs each; refused when the cluster cannot hold them (they would wait forever)."""
    res = ray.cluster_resources()
    gpus, cpus = int(res.get("GPU", 0)), int(res.get("CPU", 0))
    device = (source.device or "").lower()
    if device.startswith("cuda:"):
        raise ValueError(f"--device {source.device} with --ray: Ray gives each worker its own GPU; use --device "
                         "cuda or leave it unset")
    use_gpu = gpus > 0 and device != "cpu"
    if device == "cuda" and not gpus:
        raise ValueError("--device cuda with --ray, but the Ray cluster has no GPU")
    if workers is not None and workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    if use_gpu:
        count = workers or gpus
        if count > gpus:
            raise ValueError(f"--workers {count}: the Ray cluster has {gpus} GPU(s), one per worker")
        return count, {"num_gpus": 1, "num_cpus": 1}
    count = workers or max(1, cpus // threads)
    if count * threads > cpus:
        raise ValueError(f"--workers {count} x {threads} thread(s) need {count * threads} CPUs; the Ray cluster "
                         f"has {cpus}")
    return count, {"num_cpus": threads}


def connect(ray, address: str | None) -> bool:
    """Use this process's Ray connection, or join ``address`` ("auto": the running cluster), or start a local
    instance (None / "local").  True when this call connected (and so should disconnect)."""
    if ray.is_initialized():
        return False
    quiet = {"include_dashboard": False, "log_to_driver": True, "configure_logging": False}
    if address in (None, "", "local"):
        ray.init(object_store_memory=LOCAL_OBJECT_STORE, **quiet)
    else:
        ray.init(address=address, **quiet)
    return True


def run_bench_ray(source: ModelSource, plan: BenchPlan, out: str | os.PathLike | RunFolder, *,
                  address: str | None = None, workers: int | None = None, threads: int | None = None,
                  model_name: str = "", progress: bool = True, repair: bool = False,
                  on_cell: Callable[[list[dict]], None] | None = None) -> BenchRun:
    """Run ``plan`` into ``out`` over Ray workers, resuming whatever is there (local records count as done).
    ``threads``: torch threads per worker (CPU workers default to 1).  ``on_cell(records)`` is called after each
    cell's records are written (progress hooks; the tests kill a worker from it)."""
    ray = import_ray()
    with held(out) as folder:                       # the folder first: a busy or unwritable one fails at once
        connected = connect(ray, address)
        pool = Pool(ray, source, plan, model_name, threads)
        try:
            return Driver(ray, pool, folder, plan, workers, repair, progress, on_cell).run()
        finally:
            pool.stop()
            if connected:
                ray.shutdown()


class Pool:
    """The workers: started together, replaced when one dies (at most as many replacements as workers)."""

    def __init__(self, ray, source: ModelSource, plan: BenchPlan, model_name: str, threads: int | None):
        self.ray, self.source, self.model_name, self.threads = ray, source, model_name, threads
        self.plan, self.runtime = shippable(plan)
        self.workers: list[Worker] = []
        self.started = 0
        self.actor = None

    def configure(self, count: int, resources: dict) -> None:
        self.count = count
        # CPU workers get the threads Ray reserved for them; GPU workers keep torch's default unless told
        self.worker_threads = self.threads or (None if "num_gpus" in resources else resources["num_cpus"])
        self.actor = self.ray.remote(**resources, max_restarts=0, max_task_retries=0)(BenchWorker)

    def spawn(self) -> tuple[Worker, object]:
        """A new worker and the reference its ``start`` answers on."""
        handle = self.actor.remote(self.source, self.plan, self.runtime, self.model_name, self.worker_threads)
        self.started += 1
        worker = Worker(handle)
        self.workers.append(worker)
        return worker, handle.start.remote()

    def can_replace(self) -> bool:
        return self.started < 2 * self.count

    def kill(self, worker: Worker) -> None:
        """Make sure a worker that failed is gone (its resources then go to a replacement)."""
        try:
            self.ray.kill(worker.handle)
        except Exception:               # already dead
            pass

    def stop(self) -> None:
        for w in self.workers:
            self.kill(w)


class Driver:
    def __init__(self, ray, pool: Pool, folder: RunFolder, plan: BenchPlan, workers: int | None, repair: bool,
                 progress: bool, on_cell: Callable[[list[dict]], None] | None):
        self.ray, self.pool, self.folder, self.plan = ray, pool, folder, plan
        self.requested, self.repair, self.progress, self.on_cell = workers, repair, progress, on_cell
        self.failures: Counter = Counter()
        self.errors: dict[tuple, list[str]] = {}
        self.failed_on: dict[tuple, set[str]] = {}
        self.retried = self.failed = self.ran = 0

    def run(self) -> BenchRun:
        ray, pool = self.ray, self.pool
        count, resources = cluster_plan(ray, pool.source, self.requested, pool.threads or 1)
        pool.configure(count, resources)
        spawned = [pool.spawn() for _ in range(count)]
        setups = [self.started(w, ref) for w, ref in spawned]
        setup = setups[0]
        for other in setups[1:]:
            self.check_agrees(setup, other)
        self.session = time.strftime("%Y-%m-%dT%H:%M:%S")
        begin_session(self.folder, setup["info"], setup["skipped"], {
            "started": self.session, **setup["env"], "device_kind": setup["device"],
            "ray": {"address": ray.get_runtime_context().gcs_address,
                    "workers": [{"worker": s["worker"], "device": s["device"]} for s in setups]}})
        self.setup = setup
        self.index = {(task, pid): i for task, pid, i in setup["cells"]}
        done = self.folder.read(self.repair).done
        methods = setup["methods"]
        todo = deque()
        kept = 0
        for task, pid, _ in setup["cells"]:
            missing = [m for m in methods if (task, pid, m) not in done]
            kept += len(methods) - len(missing)
            if missing:
                todo.append(((task, pid), missing))
        self.loop(todo, [w for w, _ in spawned])
        return BenchRun(self.folder.path, self.ran, kept, setup["skipped"], methods, workers=pool.started,
                        retried=self.retried, failed=self.failed)

    def started(self, worker: Worker, ref) -> dict:
        """A worker's setup; a worker that cannot start (bad checkpoint path, bad knob) stops the run with its
        own error."""
        try:
            setup = self.ray.get(ref)
        except self.ray.exceptions.RayTaskError as err:
            cause = getattr(err, "cause", None)
            raise (cause if isinstance(cause, Exception) else RuntimeError(str(err))) from None
        worker.name, worker.device = setup["worker"], setup["device"]
        return setup

    @staticmethod
    def check_agrees(a: dict, b: dict) -> None:
        diffs = [k for k in (*PINNED, "tasks", "methods") if a["info"].get(k) != b["info"].get(k)]
        if [list(c) for c in a["cells"]] != [list(c) for c in b["cells"]]:
            diffs.append("prompts")
        if diffs:
            raise ValueError(f"Ray workers {a['worker']} and {b['worker']} load different setups ({', '.join(diffs)}"
                             "): every worker must see the same checkpoint, data and settings")

    def loop(self, todo: deque, idle: list[Worker]) -> None:
        ray, pool = self.ray, self.pool
        running: dict = {}                  # ref -> ("cell", worker, (cell, methods)) | ("start", worker, None)
        bar = tqdm(total=len(todo), desc=f"bench ({len(idle)} Ray workers)", unit="cell",
                   disable=not self.progress or not todo, dynamic_ncols=True)
        try:
            while todo or any(kind == "cell" for kind, _, _ in running.values()):
                while idle and todo:
                    worker = self.pick(idle, todo[0][0])
                    item = todo.popleft()
                    running[worker.handle.run_cell.remote(item[0], item[1], self.session)] = ("cell", worker, item)
                if not running:
                    raise WorkersLost(f"every Ray worker died ({pool.started} started); {len(todo)} cells are not "
                                      f"run - what finished is in {self.folder.records_path}; run the same "
                                      "command again to resume")
                ready: list = []
                while not ready:                # short waits: Ctrl-C is seen between them, never lost in Ray
                    ready, _ = ray.wait(list(running), num_returns=1, timeout=WAIT_S)
                ref = ready[0]
                kind, worker, item = running.pop(ref)
                if kind == "start":
                    try:
                        self.check_agrees(self.setup, self.started(worker, ref))
                        idle.append(worker)
                    except Exception as err:
                        bar.write(f"bench: a replacement Ray worker did not start: {first_line(err)}",
                                  file=sys.stderr)
                        pool.kill(worker)
                        self.replace(running)
                    continue
                try:
                    records = ray.get(ref)
                except ray.exceptions.RayTaskError as err:      # the cell raised; the worker lives on
                    idle.append(worker)
                    self.fail(item, worker, f"on worker {worker.name}: {first_line(err.cause or err)}", todo, bar)
                    continue
                except ray.exceptions.RayError as err:          # the worker died (killed, out of memory, lost)
                    more = "; starting another" if pool.can_replace() else ""
                    bar.write(f"bench: Ray worker {worker.name} died running {'/'.join(item[0])}{more}",
                              file=sys.stderr)
                    pool.kill(worker)
                    self.fail(item, worker, f"worker {worker.name} died: {first_line(err)}", todo, bar)
                    self.replace(running)
                    continue
                idle.append(worker)
                for rec in records:
                    self.folder.append(rec)
                self.ran += len(records)
                bar.update(1)
                if self.on_cell is not None:
                    self.on_cell(records)
        finally:
            bar.close()

    def pick(self, idle: list[Worker], cell: tuple) -> Worker:
        """An idle worker, preferring one that has not failed ``cell`` already (a retry goes elsewhere)."""
        tried = self.failed_on.get(cell, set())
        for i, w in enumerate(idle):
            if w.name not in tried:
                return idle.pop(i)
        return idle.pop(0)

    def replace(self, running: dict) -> None:
        if self.pool.can_replace():
            worker, ref = self.pool.spawn()
            running[ref] = ("start", worker, None)

    def fail(self, item: tuple, worker: Worker, error: str, todo: deque, bar) -> None:
        cell, methods = item
        self.failures[cell] += 1
        self.errors.setdefault(cell, []).append(error)
        self.failed_on.setdefault(cell, set()).add(worker.name)
        if self.failures[cell] < ATTEMPTS:
            self.retried += 1
            todo.appendleft(item)           # next, on another worker
            return
        self.failed += 1
        for method in methods:
            self.folder.append({"task": cell[0], "prompt_id": cell[1], "prompt_index": self.index[cell],
                                "method": method,
                                "session": self.session, "status": "failed", "error": " | ".join(self.errors[cell]),
                                "attempts": self.failures[cell]})
        bar.write(f"bench: {'/'.join(cell)} failed {ATTEMPTS} times, recorded as failed: {self.errors[cell][-1]}",
                  file=sys.stderr)
        bar.update(1)


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]
