"""Paired, interleaved timing (paper Appendix A.3): the one schedule the benchmark runner and the probes share.

* Warm-up first: one untimed run per arm on the first prompt, and only when something is left to time (first calls
  pay for allocator growth, lazy initialisation and kernel selection, which belong to no arm).
* On each prompt every arm runs once, in an order that rotates by one per prompt, so slow drift of a shared machine
  (thermal, other load) hits every arm alike.
* Before every run, outside the timed region: garbage collection and, on CUDA, a device synchronisation, so that
  neither lands inside a measurement.  The timing itself is the caller's (``generate`` times its own runs).

The caller decides how an arm runs (``run_one(prompt, arm)``), which runs are still to do (``pending``) and what
to keep of each result.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterator, Sequence, TypeVar

import torch

P = TypeVar("P")
A = TypeVar("A")


@dataclass(frozen=True)
class PairedRun(Generic[P, A]):
    prompt: P
    arm: A
    slot: int       # the arm's place in this prompt's order (0 = ran first)
    result: Any


def rotated(arms: Sequence[A], shift: int) -> list[A]:
    """``arms`` rotated left by ``shift`` (modulo their number): the order they run in on prompt ``shift``."""
    k = shift % len(arms)
    return list(arms[k:]) + list(arms[:k])


def settle(cuda: bool) -> None:
    """Collect garbage and drain the device: work that must not land inside the next timed run."""
    gc.collect()
    if cuda:
        torch.cuda.synchronize()


def paired_runs(prompts: Sequence[P], arms: Sequence[A], run_one: Callable[[P, A], Any], *,
                warmup: Callable[[P, A], Any] | None = None, pending: Callable[[P, A], bool] | None = None,
                shift: Callable[[P], int] | None = None, cuda: bool = False) -> Iterator[PairedRun[P, A]]:
    """Run every (prompt, arm) that is ``pending`` (default: all) and yield each result as soon as it exists.

    ``warmup(prompt, arm)``: one untimed run of each arm on the first prompt, before any timed run; skipped when
    nothing is pending.  ``shift(prompt)``: the prompt's rotation (default: its position in ``prompts``).  ``cuda``:
    synchronise the device before every run."""
    if not arms:
        raise ValueError("paired runs need at least one arm")
    todo = pending or (lambda prompt, arm: True)
    if warmup is not None and any(todo(p, a) for p in prompts for a in arms):
        for arm in arms:
            settle(cuda)
            warmup(prompts[0], arm)
    for i, prompt in enumerate(prompts):
        for slot, arm in enumerate(rotated(arms, i if shift is None else shift(prompt))):
            if todo(prompt, arm):
                settle(cuda)
                yield PairedRun(prompt, arm, slot, run_one(prompt, arm))
