"""A benchmark's ``--out`` folder, opened for writing: checked, locked (one writer), its records file made whole
(``records.py``), cleared for ``--fresh`` once the run starts; then read, appended to and its ``run.json`` replaced,
by the one holder.

Opening it is cheap and comes before any model work, so a folder that cannot be written, or that another run
holds, fails in a second with a message instead of after the benchmark.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .lock import RunLock
from .records import REJECTED, RECORDS, Records, RecordsWriter, read_records, terminate_torn_tail

RUN_INFO = "run.json"
RESULT_FILES = (RECORDS, REJECTED, RUN_INFO, "prompts.jsonl", "report.md", "summary.csv", "speedup.png",
                "accept.png")


class OutDirError(ValueError):
    """--out cannot be used as a benchmark folder."""


def usable_folder(out: str | os.PathLike, create: bool = True) -> Path:
    """``out`` as a folder (created when ``create``), or an ``OutDirError`` saying why it cannot be one."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise OutDirError(f"--out {out} is a file, not a folder")
    if not create:
        if not path.is_dir():
            raise OutDirError(f"--out {out}: no such folder")
        return path
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutDirError(f"--out {out}: cannot create the folder ({err.strerror or err})") from None
    return path


class RunFolder:
    """``with RunFolder(out, fresh=...) as folder:`` - the folder locked for this process.  ``fresh`` clears the
    earlier results only when the run starts (``start``, after the model loaded and every setting was checked),
    so a ``--fresh`` run that fails to start loses nothing."""

    def __init__(self, out: str | os.PathLike, fresh: bool = False, create: bool = True):
        self.path = usable_folder(out, create)
        self.fresh = fresh
        self.lock = RunLock(self.path)
        try:
            self.lock.acquire()
        except PermissionError as err:
            raise OutDirError(f"--out {out} is not writable ({err.strerror})") from None
        except OSError as err:                      # (FolderBusy, a ValueError, passes through)
            raise OutDirError(f"--out {out}: cannot write there ({err.strerror or err})") from None
        try:
            if not os.access(self.path, os.W_OK):
                raise OutDirError(f"--out {out} is not writable")
            self.torn = False if fresh else terminate_torn_tail(self.records_path)
            self.writer = RecordsWriter(self.records_path)
        except BaseException:
            self.lock.release()
            raise

    def start(self) -> None:
        """The run starts: a fresh one deletes the earlier results now (once)."""
        if self.fresh:
            for name in RESULT_FILES:
                (self.path / name).unlink(missing_ok=True)
            self.fresh = False

    @property
    def records_path(self) -> Path:
        return self.path / RECORDS

    @property
    def info_path(self) -> Path:
        return self.path / RUN_INFO

    def read(self, set_aside: bool = False) -> Records:
        return read_records(self.records_path, set_aside)

    def append(self, rec: dict) -> None:
        self.writer.append(rec)

    def write_info(self, info: dict) -> None:
        """Replace run.json whole (a reader never sees half of it)."""
        tmp = self.info_path.with_name(RUN_INFO + ".tmp")
        tmp.write_text(json.dumps(info, indent=2))
        os.replace(tmp, self.info_path)

    def close(self) -> None:
        self.lock.release()

    def __enter__(self) -> "RunFolder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def clear_results(out: str | os.PathLike) -> None:
    """Delete the files a benchmark writes in ``out`` (nothing else), for a fresh start; refused while another
    run holds the folder."""
    with RunFolder(out, fresh=True) as folder:
        folder.start()
