"""The timing protocol of paper Appendix A.3, run into an output folder one record at a time.

* The model is loaded once; every method runs in the same process, stack and session as its paired full-depth AR.
* The schedule is ``dasspec.eval.pairing``'s: warm-up first (one short generation per method, not recorded);
  for each prompt, AR and every method run in an order that rotates by one per prompt (by the prompt's place in
  its task's selection), so slow drift (thermal, other load) hits every method alike.
* Each run is timed by ``dasspec.generate`` itself (``stats.wall_time``: prefill included, CUDA synchronised at
  the end); nothing is recomputed inside the timed region.
* One JSONL record per (task, prompt, method) is appended to ``records.jsonl`` and flushed as soon as it exists.
  Re-running the same command resumes: finished records are skipped; an interrupt keeps everything finished.
* ``run.json`` pins what must not change between resumed sessions (model, dtype, device, R, caps, prompt
  templates, knobs); adding tasks, methods or prompts to an existing folder is fine.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from ...engine.generate import generate
from ...engine.runtime import Runtime
from ...methods import build_drafter, get_method, resolve_knobs
from ...model.looped import LoopedLM
from ...engine.prefix_cache import PrefixCache, common_prefix
from ..pairing import PairedRun, paired_runs
from ..tasks import Example, Task, get_task

RECORDS = "records.jsonl"
RUN_INFO = "run.json"
WARMUP_TOKENS = 16


@dataclass
class BenchPlan:
    """What to run.  ``methods`` may omit "ar": it is always added, since every arm is paired with it."""
    tasks: list[Task]
    methods: list[str]
    knobs: dict[str, dict] = field(default_factory=dict)   # method -> user knobs
    prompts: int = 40
    split: str = "eval"
    seed: int = 0                 # prompt selection
    data: str | None = None
    num_steps: int | None = None  # target depth R (default: the model's)
    init_scale: float = 1.0
    gen_seed: int = 0             # seed of the per-position initial states (shared by every method)
    warmup: bool = True
    prefix_cache: bool = False    # reuse each task's shared prompt prefix (few-shot exemplars) across requests
    runtime: Runtime = field(default_factory=lambda: Runtime(track_memory=True))   # execution options
    sampling: dict | None = None  # generate()'s sampling options (temperature, top_k, top_p, min_p); None: greedy


@dataclass
class Prompt:
    task: Task
    index: int                    # position in the seeded selection = request order
    example: Example
    ids: list[int]


@dataclass
class BenchRun:
    out: Path
    ran: int                      # records written in this session
    kept: int                     # records found from earlier sessions
    skipped: list[dict]           # prompts that cannot run, with the reason
    methods: list[str]


def canonical_methods(names: Iterable[str]) -> list[str]:
    """Registered method names (aliases resolved, duplicates dropped), AR first; unknown names fail here."""
    out = ["ar"]
    for name in names:
        spec = get_method(name.strip())          # ValueError naming the unknown method and the available ones
        if spec.name not in out:
            out.append(spec.name)
    return out


def jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    text = getattr(value, "name", None) or str(value)
    if len(text) > 80:      # a structure (e.g. a draft tree): a short stable digest keeps run.json readable
        text = f"{type(value).__name__}<sha1:{hashlib.sha1(text.encode()).hexdigest()[:12]}>"
    return text


def resolved_knobs(model: LoopedLM, methods: list[str], user: dict[str, dict], R: int) -> dict[str, dict]:
    """Every method's effective knobs (family defaults <- model folder <- user), validated before any timing."""
    unknown = sorted(set(user) - set(methods))
    if unknown:
        raise ValueError(f"--knobs names method(s) {', '.join(unknown)} that are not being benchmarked "
                         f"(methods: {', '.join(methods)})")
    out = {}
    for name in methods:
        try:
            out[name] = jsonable(resolve_knobs(model, name, user.get(name, {}), R).as_dict())
        except ValueError as err:
            raise ValueError(f"method {name}: {err} (set its knobs with --knobs {name}:NAME=VALUE)") from None
    return out


def load_records(path: Path) -> list[dict]:
    """Finished records; a torn last line (killed mid-write) is dropped and the file rewritten without it."""
    if not path.exists():
        return []
    records, good_lines, torn = [], [], False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                torn = True
                continue
            try:
                records.append(json.loads(line))
                good_lines.append(line)
            except json.JSONDecodeError:
                torn = True
    if torn:
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(good_lines), encoding="utf-8")
        os.replace(tmp, path)
    return records


RESULT_FILES = (RECORDS, RUN_INFO, "prompts.jsonl", "report.md", "summary.csv", "speedup.png", "accept.png")


def clear_results(out: str | os.PathLike) -> None:
    """Delete the files a benchmark writes in ``out`` (nothing else), for a fresh start."""
    for name in RESULT_FILES:
        (Path(out) / name).unlink(missing_ok=True)


def record_key(r: dict) -> tuple[str, str, str]:
    return r["task"], r["prompt_id"], r["method"]


def prepare_prompts(plan: BenchPlan, tokenizer, block_size: int) -> tuple[list[Prompt], list[dict]]:
    """Seeded examples of every task, encoded; prompts whose length + cap exceed the context are skipped with a
    stated reason (never silently)."""
    prompts, skipped = [], []
    for task in plan.tasks:
        for i, ex in enumerate(task.examples(plan.prompts, plan.split, plan.seed, plan.data)):
            ids = tokenizer.encode(ex.prompt)
            if len(ids) + task.cap > block_size:
                skipped.append({"task": task.name, "prompt_id": ex.id, "prompt_index": i,
                                "reason": f"prompt {len(ids)} tokens + cap {task.cap} > context {block_size}"})
                continue
            prompts.append(Prompt(task, i, ex, ids))
    return prompts, skipped


def dev_prompts(model: LoopedLM, task_names: str, prompts: int, max_new_tokens: int, shots: Iterable[str] = (),
                data: str | None = None) -> list[Prompt]:
    """The *development* prompts the tuning and diagnostic scripts use (never the evaluation ones): ``prompts``
    per task of the comma-separated ``task_names``, every task capped at ``max_new_tokens``, ``shots`` as
    ``TASK=N`` items."""
    n_shots = {k: int(v) for k, v in (s.split("=", 1) for s in shots)}
    tasks = resolve_tasks(task_names.split(","), {"*": max_new_tokens}, n_shots)
    plan = BenchPlan(tasks=tasks, methods=["ar"], prompts=prompts, split="dev", data=data)
    return prepare_prompts(plan, model.tokenizer, model.config.block_size)[0]


def weights_fingerprint(model: LoopedLM) -> str:
    """A short digest of the weights (float64 sums per tensor), so a retrained model is not resumed into old
    records under the same name."""
    with torch.no_grad():
        sums = [f"{float(p.sum(dtype=torch.float64)):.6e}" for p in model.parameters()]
    return hashlib.sha1(",".join(sums).encode()).hexdigest()[:16]


def run_info(model: LoopedLM, model_name: str, plan: BenchPlan, R: int, knobs: dict[str, dict]) -> dict:
    return {
        "model": model_name, "family": model.config.family,
        "parameters": sum(p.numel() for p in model.parameters()), "weights": weights_fingerprint(model),
        "context": model.config.block_size,
        "device": model.device.type, "dtype": str(model.dtype).replace("torch.", ""), "num_steps": R,
        "init_scale": plan.init_scale, "gen_seed": plan.gen_seed, "split": plan.split, "select_seed": plan.seed,
        "prefix_cache": plan.prefix_cache, "sampling": plan.sampling,
        "tasks": {t.name: {"cap": t.cap, "shots": t.shots, "stop": list(t.stop)} for t in plan.tasks},
        "methods": {m: {"knobs": knobs[m], "stateful": get_method(m).stateful} for m in knobs},
    }


PINNED = ("model", "parameters", "weights", "device", "dtype", "num_steps", "init_scale", "gen_seed", "split",
          "select_seed", "prefix_cache", "sampling")


def merge_run_info(path: Path, new: dict) -> dict:
    """Check a resumed folder was made with the same setup; add this session's tasks and methods to it."""
    if not path.exists():
        return new
    old = json.loads(path.read_text())
    old.setdefault("prefix_cache", False)             # folders from before the options existed
    old.setdefault("sampling", None)
    diffs = [f"{k}: {old.get(k)!r} there, {new[k]!r} now" for k in PINNED if old.get(k) != new[k]]
    for kind in ("tasks", "methods"):
        for name, spec in new[kind].items():
            if name in old.get(kind, {}) and old[kind][name] != spec:
                diffs.append(f"{kind[:-1]} {name}: {old[kind][name]} there, {spec} now")
    if diffs:
        raise ValueError(f"{path.parent} holds records of a different setup ({'; '.join(diffs)}); resume with "
                         "the same settings or use a new --out folder")
    merged = dict(old)
    for kind in ("tasks", "methods"):
        merged[kind] = {**old.get(kind, {}), **new[kind]}
    return merged


def environment() -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
           "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def run_bench(model: LoopedLM, plan: BenchPlan, out: str | os.PathLike, tokenizer=None, model_name: str = "",
              progress: bool = True) -> BenchRun:
    """Run ``plan`` into ``out`` (records.jsonl + run.json), resuming whatever is already there."""
    tok = tokenizer or model.tokenizer
    if tok is None:
        raise ValueError("the benchmark encodes text prompts and needs a tokenizer (tokenizer.json next to the "
                         "weights, or tokenizer=)")
    methods = canonical_methods(plan.methods)
    R = model.depth(plan.num_steps)
    knobs = resolved_knobs(model, methods, plan.knobs, R)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    info = merge_run_info(out / RUN_INFO, run_info(model, model_name, plan, R, knobs))
    prompts, skipped = prepare_prompts(plan, tok, model.config.block_size)
    session = time.strftime("%Y-%m-%dT%H:%M:%S")
    info.setdefault("sessions", []).append({"started": session, **environment()})
    info["skipped"] = skipped                 # of the latest session, so --report-only can list them too
    (out / RUN_INFO).write_text(json.dumps(info, indent=2))

    records_path = out / RECORDS
    done = {record_key(r) for r in load_records(records_path)}
    pending = sum((p.task.name, p.example.id, m) not in done for p in prompts for m in methods)
    kept = sum((p.task.name, p.example.id, m) in done for p in prompts for m in methods)
    prefixes = task_prefix_caches(model, prompts, R, plan) if plan.prefix_cache and pending else {}

    # One drafter per method for the whole run: state a method keeps across requests (Token Recycling's table)
    # follows the request stream, warm-up included, as in the paper.
    drafters = {m: build_drafter(model, m, plan.knobs.get(m, {}), R) for m in methods}

    def run_one(p: Prompt, method: str, cap: int):
        return generate(model, p.ids, max_new_tokens=cap, num_steps=R, init_scale=plan.init_scale,
                        stop=list(p.task.stop), seed=plan.gen_seed, tokenizer=tok,
                        prefix_cache=prefixes.get(p.task.name), drafter=drafters[method], runtime=plan.runtime,
                        **({"do_sample": True, **plan.sampling} if plan.sampling else {}))

    from tqdm.auto import tqdm
    bar = tqdm(total=pending, desc="bench", unit="gen", disable=not progress or pending == 0, dynamic_ncols=True)
    ran = 0

    def timed(p: Prompt, method: str):
        bar.set_postfix_str(f"{p.task.name} #{p.index} {method}", refresh=False)
        try:
            return run_one(p, method, p.task.cap)
        except Exception:
            bar.write(f"bench: {method} failed on {p.task.name} {p.example.id}; "
                      f"{ran} new records kept in {records_path}")
            raise

    runs = paired_runs(prompts, methods, timed, cuda=model.device.type == "cuda", shift=lambda p: p.index,
                       pending=lambda p, m: (p.task.name, p.example.id, m) not in done,
                       warmup=(lambda p, m: run_one(p, m, min(WARMUP_TOKENS, p.task.cap))) if plan.warmup else None)
    try:
        with open(records_path, "a", encoding="utf-8") as sink:
            for run in runs:
                append_record(sink, bench_record(run, session, plan.sampling))
                done.add((run.prompt.task.name, run.prompt.example.id, run.arm))
                ran += 1
                bar.update(1)
    finally:
        bar.close()
    return BenchRun(out, ran, kept, skipped, methods)


def bench_record(run: PairedRun, session: str, sampling: dict | None = None) -> dict:
    """One finished generation as a ``records.jsonl`` line: where it ran in the schedule, how it decoded (greedy:
    ``sampling`` None), its stats and output."""
    p, method, res = run.prompt, run.arm, run.result
    rec = {"task": p.task.name, "prompt_id": p.example.id, "prompt_index": p.index,
           "method": method, "order": run.slot, "session": session, "cap": p.task.cap,
           "stateful": get_method(method).stateful, "sampling": sampling, **res.stats.to_dict(),
           "tokens": res.tokens, "text": res.text}
    rec["method"] = method            # the canonical name, whatever stats call it
    return rec


def append_record(sink, rec: dict) -> None:
    """Write one record and push it to disk, so an interrupt keeps everything finished."""
    sink.write(json.dumps(rec) + "\n")
    sink.flush()
    os.fsync(sink.fileno())


def task_prefix_caches(model: LoopedLM, prompts: list[Prompt], R: int, plan: BenchPlan,
                       min_tokens: int = 16) -> dict[str, PrefixCache]:
    """One ``PrefixCache`` per task whose prompts share at least ``min_tokens`` leading tokens (the few-shot
    exemplars), built before any timing and then read, never extended, by every method alike."""
    out = {}
    for task in dict.fromkeys(p.task.name for p in prompts):
        ids = [p.ids for p in prompts if p.task.name == task]
        m = common_prefix(ids) if len(ids) > 1 else 0
        if m >= min_tokens:
            out[task] = PrefixCache(model, ids[0][:m], R, plan.init_scale, plan.gen_seed)
    return out


def parse_knobs(items: Iterable[str]) -> dict[str, dict]:
    """``METHOD:NAME=VALUE[,NAME=VALUE...]`` (repeatable) -> {method: {name: value}}, each value parsed by the
    knob's declared type (``Knobs.parse``).  A value that itself contains "=" (an explicit read policy such as
    k=4,v=32) takes the following comma-separated item with it."""
    out: dict[str, dict] = {}
    for item in items:
        method, sep, body = item.partition(":")
        if not sep or not method.strip() or not body.strip():
            raise ValueError(f"--knobs expects METHOD:NAME=VALUE[,NAME=VALUE...], got {item!r}")
        method = get_method(method.strip()).name
        pairs: list[list[str]] = []
        for part in body.split(","):
            if pairs and "=" in pairs[-1][1] and "," not in pairs[-1][1] and "=" in part:
                pairs[-1][1] += "," + part            # policy=k=4,v=32
                continue
            name, eq, value = part.partition("=")
            if not eq or not name.strip():
                raise ValueError(f"--knobs {item!r}: {part!r} is not NAME=VALUE")
            pairs.append([name.strip(), value.strip()])
        knobs = get_method(method).knobs
        for name, value in pairs:
            if name not in knobs.names():
                raise ValueError(f"--knobs {item!r}: method {method!r} does not take {name}; its knobs: "
                                 f"{', '.join(knobs.names()) or 'none'}")
            out.setdefault(method, {})[name] = knobs.parse(name, value)
    return out


def resolve_tasks(names: Iterable[str], caps: dict[str, int] | None = None,
                  shots: dict[str, int] | None = None) -> list[Task]:
    tasks, seen = [], set()
    for name in names:
        task = get_task(name)
        if task.name in seen:
            continue
        seen.add(task.name)
        tasks.append(task.with_cap((caps or {}).get(task.name, (caps or {}).get("*")))
                     .with_shots((shots or {}).get(task.name)))
    return tasks
