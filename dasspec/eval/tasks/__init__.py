"""Benchmark workloads (paper Appendix A.1, Table 4): one module per task holding its prompt template, stop
strings and generation cap; this registry maps names to them.

    task = get_task("gsm8k")
    examples = task.examples(40, split="eval", seed=0, data="../shared/data")   # fixed, seeded
    dev = task.examples(40, split="dev")                                           # disjoint tuning set
"""

from __future__ import annotations

from .base import DATA_ENV, DataError, Example, Task, data_dir, select
from . import gsm8k, humaneval, math500, mbpp

TASKS: dict[str, Task] = {}


def register(task: Task) -> Task:
    for name in (task.name, *task.aliases):
        TASKS[name] = task
    return task


for _module in (gsm8k, math500, humaneval, mbpp):
    register(_module.TASK)


def task_names() -> list[str]:
    """Canonical task names in the paper's column order."""
    seen: list[str] = []
    for task in TASKS.values():
        if task.name not in seen:
            seen.append(task.name)
    return seen


def get_task(name: str) -> Task:
    key = name.strip().lower()
    if key not in TASKS:
        raise ValueError(f"unknown task {name!r}; available: {', '.join(task_names())}")
    return TASKS[key]


__all__ = ["Task", "Example", "DataError", "DATA_ENV", "TASKS", "register", "get_task", "task_names", "select",
           "data_dir"]
