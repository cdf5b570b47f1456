"""One process's share of a benchmark: the loaded model, its resolved setup and its request stream, turning
prompts into finished records.  The one-process runner (``runner.py``) hands it every prompt; a Ray worker
(``ray_runner.py``) hands it one (task, prompt) cell at a time.  Both go through ``Bench.run``, so a record is
made the same way, with the same fields, wherever it ran.

* The schedule is ``dasspec.eval.pairing``'s: warm-up first (one short generation per method, not recorded); on
  each prompt AR and every method run back to back in an order rotated by the prompt's place in its task's
  selection.
* Each run is timed by ``dasspec.generate`` itself (``stats.wall_time``: prefill included, CUDA synchronised at
  the end); nothing is recomputed inside the timed region.
* One drafter per method for the life of a ``Bench``: state a method keeps across requests (Token Recycling's
  successor table) follows this process's request stream, warm-up included, as in the paper.  A record names its
  ``worker`` (host:pid), so a report can tell how many streams a stateful method's requests were split over.
"""

from __future__ import annotations

import os
import platform
import socket
from typing import Callable, Iterator

import torch

from ...engine.api.generate import GenerationResult, generate
from ...engine.api.prefix_cache import PrefixCache, common_prefix
from ...methods import build_drafter, get_method
from ...model.looped import LoopedLM
from ..pairing import PairedRun, paired_runs
from .setup import BenchPlan, Prompt, canonical_methods, prepare_prompts, resolved_knobs, run_info

WARMUP_TOKENS = 16


def device_kind(model: LoopedLM) -> str:
    """What a record ran on, as far as its absolute speed goes: the GPU's name, or the CPU and its thread count."""
    if model.device.type == "cuda":
        return torch.cuda.get_device_name(model.device)
    threads = torch.get_num_threads()
    return f"CPU {platform.machine()}, {threads} thread{'s' if threads != 1 else ''}"


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class Bench:
    """``Bench(model, plan)`` resolves and validates everything (methods, knobs, prompts, drafters) before
    anything is timed; ``run(prompts, pending, session)`` then yields one record per finished run."""

    def __init__(self, model: LoopedLM, plan: BenchPlan, tokenizer=None, model_name: str = ""):
        self.model, self.plan = model, plan
        self.tokenizer = tokenizer or model.tokenizer
        if self.tokenizer is None:
            raise ValueError("the benchmark encodes text prompts and needs a tokenizer (tokenizer.json next to the "
                             "weights, or tokenizer=)")
        self.methods = canonical_methods(plan.methods)
        self.R = model.depth(plan.num_steps)
        model.exit_rule(num_steps=self.R, **(plan.exit or {}))     # refused here (no exit gate) before any timing
        self.knobs = resolved_knobs(model, self.methods, plan.knobs, self.R, sampled=bool(plan.sampling))
        self.prompts, self.skipped = prepare_prompts(plan, self.tokenizer, model.config.block_size)
        self.info = run_info(model, model_name, plan, self.R, self.knobs)
        self.device = device_kind(model)
        self.worker = worker_name()
        self.drafters = {m: build_drafter(model, m, plan.knobs.get(m, {}), self.R, sampled=bool(plan.sampling))
                         for m in self.methods}
        self.prefixes: dict[str, PrefixCache] | None = None
        self.current: tuple[Prompt, str] | None = None     # the run in progress, for error messages

    def generate(self, p: Prompt, method: str, cap: int) -> GenerationResult:
        plan = self.plan
        return generate(self.model, p.ids, max_new_tokens=cap, num_steps=self.R, init_scale=plan.init_scale,
                        stop=list(p.task.stop), seed=plan.gen_seed, state_seed=plan.gen_seed, tokenizer=self.tokenizer,
                        prefix_cache=(self.prefixes or {}).get(p.task.name), drafter=self.drafters[method],
                        runtime=plan.runtime, **(plan.exit or {}),
                        **({"do_sample": True, **plan.sampling} if plan.sampling else {}))

    def run(self, prompts: list[Prompt], pending: Callable[[Prompt, str], bool], session: str, warmup: bool,
            on_start: Callable[[Prompt, str], None] | None = None) -> Iterator[dict]:
        """Every pending (prompt, method) of ``prompts`` in the paired schedule, each yielded as its record as soon
        as it exists.  ``warmup``: first one short untimed run per method on ``prompts[0]`` (when anything is
        pending).  ``on_start(prompt, method)`` is told before each timed run."""
        if self.plan.prefix_cache and self.prefixes is None and any(pending(p, m) for p in prompts
                                                                    for m in self.methods):
            # from every selected prompt, not only ``prompts``: each worker of a sharded run caches the same prefix
            self.prefixes = task_prefix_caches(self.model, self.prompts, self.R, self.plan)

        def timed(p: Prompt, method: str):
            self.current = (p, method)
            if on_start is not None:
                on_start(p, method)
            return self.generate(p, method, p.task.cap)

        runs = paired_runs(prompts, self.methods, timed, cuda=self.model.device.type == "cuda",
                           shift=lambda p: p.index, pending=pending,
                           warmup=(lambda p, m: self.generate(p, m, min(WARMUP_TOKENS, p.task.cap))) if warmup
                           else None)
        for run in runs:
            yield self.record(run, session)
        self.current = None

    def record(self, run: PairedRun, session: str) -> dict:
        """One finished generation as a ``records.jsonl`` line: where it ran in the schedule and on what, how it
        decoded (greedy: ``sampling`` None), its stats and output."""
        p, method, res = run.prompt, run.arm, run.result
        rec = {"task": p.task.name, "prompt_id": p.example.id, "prompt_index": p.index,
               "method": method, "order": run.slot, "session": session, "cap": p.task.cap,
               "stateful": get_method(method).stateful, "sampling": self.plan.sampling, "status": "ok",
               "device": self.device, "worker": self.worker, **res.stats.to_dict(),
               "tokens": res.tokens, "text": res.text}
        rec["method"] = method            # the canonical name, whatever stats call it
        return rec


def task_prefix_caches(model: LoopedLM, prompts: list[Prompt], R: int, plan: BenchPlan,
                       min_tokens: int = 16) -> dict[str, PrefixCache]:
    """One ``PrefixCache`` per task whose prompts share at least ``min_tokens`` leading tokens (the few-shot
    exemplars), built before any timing and then read, never extended, by every method alike."""
    out = {}
    for task in dict.fromkeys(p.task.name for p in prompts):
        ids = [p.ids for p in prompts if p.task.name == task]
        m = common_prefix(ids) if len(ids) > 1 else 0
        if m >= min_tokens:
            out[task] = PrefixCache(model, ids[0][:m], R, plan.init_scale, plan.gen_seed, runtime=plan.runtime)
    return out
