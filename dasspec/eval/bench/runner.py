"""The timing protocol of paper Appendix A.3 in one process, into an output folder one record at a time.

* The model is loaded once; every method runs in the same process, stack and session as its paired full-depth AR
  (the schedule and the records are ``work.Bench``'s, the same a Ray worker uses: ``ray_runner.py``).
* One JSONL record per (task, prompt, method) is appended to ``records.jsonl`` and pushed to disk as soon as it
  exists, by the one process that holds the folder (``folder.py``).  Re-running the same command resumes:
  finished records are skipped; an interrupt keeps everything finished.
* ``run.json`` pins what must not change between resumed sessions (model, dtype, device, R, caps, prompt
  templates, knobs); adding tasks, methods or prompts to an existing folder is fine.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from tqdm.auto import tqdm

from ...model.looped import LoopedLM
from .folder import RESULT_FILES, RUN_INFO, RunFolder, clear_results  # noqa: F401  (re-exported)
from .records import RECORDS, load_records, record_key  # noqa: F401  (re-exported)
from .setup import (BenchPlan, Prompt, begin_session, canonical_methods, dev_prompts,  # noqa: F401
                    environment, parse_knobs, resolve_tasks)
from .work import Bench


@dataclass
class BenchRun:
    out: Path
    ran: int                      # records written in this session
    kept: int                     # records found from earlier sessions
    skipped: list[dict]           # prompts that cannot run, with the reason
    methods: list[str]
    workers: int = 1              # processes that ran cells (Ray: every worker started, replacements included)
    retried: int = 0              # Ray: cells run again after a failure (a worker died, or the cell raised)
    failed: int = 0               # Ray: cells recorded as failed (failed twice)


@contextmanager
def held(out: str | os.PathLike | RunFolder) -> Iterator[RunFolder]:
    """``out`` as a locked folder: a ``RunFolder`` the caller already holds (kept open), or a path opened here."""
    if isinstance(out, RunFolder):
        yield out
        return
    with RunFolder(out) as folder:
        yield folder


def run_bench(model: LoopedLM, plan: BenchPlan, out: str | os.PathLike | RunFolder, tokenizer=None,
              model_name: str = "", progress: bool = True, repair: bool = False) -> BenchRun:
    """Run ``plan`` into ``out`` (records.jsonl + run.json), resuming whatever is already there.  ``repair``: set
    lines of records.jsonl that are not records aside (records.rejected.jsonl) instead of stopping."""
    bench = Bench(model, plan, tokenizer, model_name)        # every setting checked before the folder is touched
    with held(out) as folder:
        session = time.strftime("%Y-%m-%dT%H:%M:%S")
        begin_session(folder, bench.info, bench.skipped,
                      {"started": session, **environment(), "worker": bench.worker, "device_kind": bench.device})
        done = folder.read(repair).done
        cells = [(p.task.name, p.example.id, m) for p in bench.prompts for m in bench.methods]
        pending = sum(key not in done for key in cells)
        kept = len(cells) - pending

        bar = tqdm(total=pending, desc="bench", unit="gen", disable=not progress or pending == 0,
                   dynamic_ncols=True)
        ran = 0
        try:
            for rec in bench.run(bench.prompts, lambda p, m: (p.task.name, p.example.id, m) not in done, session,
                                 plan.warmup, on_start=lambda p, m: bar.set_postfix_str(
                                     f"{p.task.name} #{p.index} {m}", refresh=False)):
                folder.append(rec)
                done.add(record_key(rec))
                ran += 1
                bar.update(1)
        except Exception:
            if bench.current is not None:
                p, m = bench.current
                bar.write(f"bench: {m} failed on {p.task.name} {p.example.id}; {ran} new records kept in "
                          f"{folder.records_path}", file=sys.stderr)
            raise
        finally:
            bar.close()
    return BenchRun(folder.path, ran, kept, bench.skipped, bench.methods)
