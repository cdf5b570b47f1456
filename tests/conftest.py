"""Test-session settings, the one place they are made.

* One intra-op thread for the whole session: the tests run tiny models where a second thread only adds
  synchronisation overhead, and on a shared 2-core machine two threads per process contend badly
  (docs/performance-journal.md, "Threads on a loaded shared CPU").
* OpenMP's waiting threads sleep (``OMP_WAIT_POLICY=PASSIVE``, unless set): the lossless suites also run at two
  threads, beside the other worker, and on a shared 2-core machine spinning threads made those tests ~25x slower
  (docs/performance-journal.md, "Lossless under stress").  The arithmetic does not depend on how threads wait.
* ``eval_data``: the evaluation data folder (``$DASSPEC_DATA``), or a skip that says why there is none.
* Method auto's calibration cache (``$DASSPEC_CACHE``) in a folder of the session's own, never the user's home: the
  servers the tests start (method auto by default) inherit it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")     # before torch loads OpenMP
import torch  # noqa: E402

torch.set_num_threads(1)            # at import, so module-level model building is single-threaded too
os.environ["DASSPEC_CACHE"] = tempfile.mkdtemp(prefix="dasspec-test-cache-")
atexit.register(shutil.rmtree, os.environ["DASSPEC_CACHE"], True)


@pytest.fixture(autouse=True)
def _one_thread():
    """Re-pin after every test: a CLI test may set --threads for its own run."""
    yield
    torch.set_num_threads(1)


@pytest.fixture
def eval_data() -> Callable[..., Path]:
    """``eval_data(*files)``: the data folder ``$DASSPEC_DATA`` holding ``files`` (relative paths); the test is
    skipped with the reason when the variable is unset, names a missing folder, or the folder lacks a file."""
    from dasspec.eval.data import DataError, data_dir     # here, so a broken package fails only these tests

    def require(*files: str) -> Path:
        try:
            root = data_dir()
        except DataError as err:
            pytest.skip(f"evaluation data: {err}")
        if root is None:
            pytest.skip("evaluation data: DASSPEC_DATA is not set")
        missing = [f for f in files if not (root / f).exists()]
        if missing:
            pytest.skip(f"evaluation data: {root} lacks {', '.join(missing)}")
        return root
    return require
