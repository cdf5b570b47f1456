"""What a benchmark runs and what must not change between its sessions: the plan, the selected and encoded
prompts, every method's resolved knobs, and ``run.json`` (the pinned setup, checked on every resume).

Everything here is decided before anything is timed, and it is the same code wherever the model is loaded: in the
one process of a local run, and in every Ray worker (``ray_runner.py``), whose setups must agree.
"""

from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from ...engine.base.runtime import Runtime
from ...methods import get_method, resolve_knobs
from ...model.looped import LoopedLM
from ..tasks import Example, Task, get_task


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
    gen_seed: int = 0             # seed of the per-position initial states and of sampling (every method)
    warmup: bool = True
    prefix_cache: bool = False    # reuse each task's shared prompt prefix (few-shot exemplars) across requests
    runtime: Runtime = field(default_factory=lambda: Runtime(track_memory=True))   # execution options
    sampling: dict | None = None  # generate()'s sampling options (temperature, top_k, top_p, min_p); None: greedy
    exit: dict | None = None      # the target's early exit (exit_threshold or exit_at_step: Ouro); None: last step


@dataclass
class Prompt:
    task: Task
    index: int                    # position in the seeded selection = request order
    example: Example
    ids: list[int]

    @property
    def cell(self) -> tuple[str, str]:
        """The unit of work of a sharded run: AR and every method on this prompt."""
        return self.task.name, self.example.id


def canonical_methods(names: Iterable[str]) -> list[str]:
    """Registered method names (aliases resolved, duplicates dropped), AR first; unknown names fail here."""
    out = ["ar"]
    for name in names:
        spec = get_method(name.strip())          # ValueError naming the unknown method and the available ones
        if spec.name not in out:
            out.append(spec.name)
    return out


def resolved_knobs(model: LoopedLM, methods: list[str], user: dict[str, dict], R: int,
                   sampled: bool = False) -> dict[str, dict]:
    """Every method's effective knobs (family defaults <- model folder <- user), validated before any timing."""
    unknown = sorted(set(user) - set(methods))
    if unknown:
        raise ValueError(f"--knobs names method(s) {', '.join(unknown)} that are not being benchmarked "
                         f"(methods: {', '.join(methods)})")
    out = {}
    for name in methods:
        try:
            out[name] = resolve_knobs(model, name, user.get(name, {}), R, sampled).as_json()
        except ValueError as err:
            raise ValueError(f"method {name}: {err} (set its knobs with --knobs {name}:NAME=VALUE)") from None
    return out


def knobs_for_methods(methods: Iterable[str], shared: dict[str, Any], per_method: dict[str, dict]
                      ) -> dict[str, dict]:
    """Each benchmarked method's user knobs: ``shared`` (the derived ``--gamma``-style flags) applied to every
    method that declares the knob, then ``per_method`` (``--knobs METHOD:NAME=VALUE``), which wins for its method.
    A shared knob that no benchmarked method takes is refused, as a per-method one for an absent method is."""
    methods = canonical_methods(methods)
    out: dict[str, dict] = {}
    for name, value in shared.items():
        takers = [m for m in methods if name in get_method(m).knobs.names()]
        if not takers:
            flag = f"-{name}" if len(name) == 1 else f"--{name.replace('_', '-')}"
            raise ValueError(f"{flag}: none of the benchmarked methods ({', '.join(methods)}) "
                             f"takes {name}")
        for m in takers:
            out.setdefault(m, {})[name] = value
    for method, knobs in per_method.items():
        if method not in methods:          # refused here, before the model loads, as in resolved_knobs
            raise ValueError(f"--knobs names method {method} that is not being benchmarked (methods: "
                             f"{', '.join(methods)})")
        out.setdefault(method, {}).update(knobs)
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
                  shots: dict[str, int] | None = None, flags: tuple[str, str] = ("--cap", "--shots")) -> list[Task]:
    """The tasks ``names`` names, each with its cap and shots; a cap or shots entry for a task that is not among
    them (a typo: ``humaneva=5``) is an error naming its ``flags`` entry, never ignored."""
    picked = {}
    for name in names:
        task = get_task(name)
        picked.setdefault(task.name, task)
    per_task = []
    for flag, table in zip(flags, (caps or {}, shots or {})):
        by_task = {}
        for key, value in table.items():
            if key == "*":
                continue
            try:
                task = get_task(key)
            except ValueError as err:
                raise ValueError(f"{flag} {key}={value}: {err}") from None
            if task.name not in picked:
                raise ValueError(f"{flag} {key}={value}: {task.name} is not among the tasks of this run "
                                 f"({', '.join(picked)})")
            by_task[task.name] = value
        per_task.append(by_task)
    cap_of, shots_of = per_task
    return [task.with_cap(cap_of.get(name, (caps or {}).get("*"))).with_shots(shots_of.get(name))
            for name, task in picked.items()]


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
    tasks = resolve_tasks(task_names.split(","), {"*": max_new_tokens}, n_shots, flags=("cap", "--shots"))
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
        "prefix_cache": plan.prefix_cache, "sampling": plan.sampling, "exit": plan.exit,
        "tasks": {t.name: {"cap": t.cap, "shots": t.shots, "stop": list(t.stop)} for t in plan.tasks},
        "methods": {m: {"knobs": knobs[m], "stateful": get_method(m).stateful} for m in knobs},
    }


PINNED = ("model", "parameters", "weights", "device", "dtype", "num_steps", "init_scale", "gen_seed", "split",
          "select_seed", "prefix_cache", "sampling", "exit")


def merge_run_info(path: Path, new: dict) -> dict:
    """Check a resumed folder was made with the same setup; add this session's tasks and methods to it."""
    if not path.exists():
        return new
    old = json.loads(path.read_text())
    old.setdefault("prefix_cache", False)             # folders from before the options existed
    old.setdefault("sampling", None)
    old.setdefault("exit", None)
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


def begin_session(folder, info: dict, skipped: list[dict], session: dict) -> dict:
    """Merge this session's setup into the folder's run.json (refusing a different setup), note the session and
    the skipped prompts, and write it; returns the merged info.  A ``--fresh`` folder is cleared here, when the
    run has everything it needs to start."""
    folder.start()
    merged = merge_run_info(folder.info_path, info)
    merged.setdefault("sessions", []).append(session)
    merged["skipped"] = skipped               # of the latest session, so --report-only can list them too
    folder.write_info(merged)
    return merged


def environment() -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
           "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env
