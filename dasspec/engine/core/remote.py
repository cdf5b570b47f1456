"""The executor in a process of its own, fed by plans: ``Engine(..., executor="process")``.

The engine keeps the scheduler (on an accounting-only pool: the books of the blocks, no tensors) and the output
processor; a child process holds the model, the depth cache and the drafters and answers every ``StepPlan`` with a
``StepOutput`` over a pipe.  Only plain data crosses (``base/contract.py``), so what crosses here is what would cross to
a GPU runner or to the ranks of a tensor-parallel group.  The child builds its drafters from their registry keys,
so a drafter object handed to ``add`` and a ``PrefixCache`` (rows held in the engine's process) are refused.

The model reaches the child once, at start, through ``torch.multiprocessing`` (CUDA tensors shared; CPU tensors
arrive in shared memory and the child copies them into its own, so a CPU model's weights are held twice).  A failure in the child comes back as a ``RemoteExecutorError`` naming what it raised; the child ends with
``close`` (or with the engine's process).
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
import torch.multiprocessing as mp

from ...model.looped import LoopedLM
from ..base.contract import StepOutput, StepPlan
from ..base.runtime import Runtime
from .blocks import BlockPool
from .drafters import DrafterCache
from .executor import Executor


class RemoteExecutorError(RuntimeError):
    """The executor's process failed a step (its traceback is the message) or is gone."""


def _serve(conn, model: LoopedLM, R: int, kv_budget: int, block_size: int, runtime: Runtime, threads: int,
           window: int | None = None) -> None:
    torch.set_num_threads(threads)
    with torch.no_grad():        # CPU weights into this process's own memory: read from the shared segment they
        for t in list(model.parameters()) + list(model.buffers()):   # arrived in, steps ran slower (docs/performance.md)
            if t.device.type == "cpu":
                t.data = t.data.clone()
    try:
        pool = BlockPool(model, R, kv_budget, block_size, window)
        runtime.prepare_cache(pool.tensors())
        executor = Executor(model, R, pool, runtime, DrafterCache.of_registry(model, R))
    except BaseException:                        # noqa: BLE001 - reported to the engine, which raises it
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            plan = conn.recv()
        except EOFError:                         # the engine's process is gone
            return
        if plan is None:
            return
        try:
            conn.send(("ok", executor.execute(plan)))
        except BaseException:                    # noqa: BLE001 - the step failed: the engine decides what ends
            conn.send(("error", traceback.format_exc()))


class RemoteExecutor:
    """``execute(plan) -> StepOutput`` in a child process (the in-process ``Executor``'s interface)."""

    def __init__(self, model: LoopedLM, R: int, kv_budget: int, block_size: int, runtime: Runtime,
                 window: int | None = None):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, model, R, kv_budget, block_size, runtime,
                                                       torch.get_num_threads(), window), daemon=True)
        main = sys.modules.get("__main__")
        path = getattr(main, "__file__", None)
        hidden = path is not None and not os.path.isfile(path)
        if hidden:                       # a script read from stdin (or a REPL): the child would re-run a file that
            del main.__file__            # does not exist and die before reading its start-up data, and the write
        try:                             # of that data would then block for good
            self._proc.start()
        finally:
            if hidden:
                main.__file__ = path
        child.close()
        self._answer()                                   # raises if the child could not set up

    def execute(self, plan: StepPlan) -> StepOutput:
        try:
            self._conn.send(plan)
        except (BrokenPipeError, OSError) as err:
            raise RemoteExecutorError(f"the executor's process is gone ({err})") from None
        return self._answer()

    def cancel(self, rid: int) -> None:
        """Nothing to do between steps: the scheduler ends a cancelled request before the next plan."""

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.kill()
        self._conn.close()

    def _answer(self):
        try:
            while not self._conn.poll(1.0):              # returns as soon as the answer is there
                if not self._proc.is_alive():            # (a child dead before it took its end of the pipe
                    raise EOFError                       # leaves that end open: no EOF would come)
            kind, value = self._conn.recv()
        except (EOFError, OSError):
            raise RemoteExecutorError(f"the executor's process ended (exit code {self._proc.exitcode})") from None
        if kind == "error":
            raise RemoteExecutorError(f"the executor's process failed:\n{value}")
        return value

    def __del__(self):
        try:
            self.close()
        except Exception:                                # noqa: BLE001 - interpreter shutdown
            pass
