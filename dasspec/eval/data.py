"""Where evaluation and training data come from: one resolver for tasks, probes, the training corpus and scripts.

A folder given explicitly (``--data DIR``), else ``$DASSPEC_DATA``.  The installed package never guesses a folder
of its own; the repository's scripts set ``DASSPEC_DATA`` (default ``../shared/data``).  The layout is
``gsm8k/{test,train}.jsonl``, ``math500/test.jsonl``, ``mbpp/mbpp.jsonl``, ``humaneval/HumanEval.jsonl.gz``.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

DATA_ENV = "DASSPEC_DATA"


class DataError(FileNotFoundError):
    """Data cannot be found (no data folder, a file missing in it, no offline copy, no `datasets`)."""


def data_dir(data: str | os.PathLike | None = None, required: bool = False) -> Path | None:
    """``data`` if given, else ``$DASSPEC_DATA``; None when neither is set (unless ``required``, then an error
    that says how to set it).  A folder that is named but missing is always an error."""
    value = data if data is not None else os.environ.get(DATA_ENV) or None
    if value is None:
        if required:
            raise DataError(f"no data folder: pass --data DIR or set {DATA_ENV} (the repository's scripts use "
                            "../shared/data)")
        return None
    path = Path(value).expanduser()
    if not path.is_dir():
        raise DataError(f"data folder {str(path)!r} does not exist (from {'--data' if data else DATA_ENV})")
    return path


def data_file(root: Path | None, relative: str) -> Path | None:
    """``root/relative`` if a data folder is set (an error when the file is missing there), else None."""
    if root is None:
        return None
    path = root / relative
    if not path.exists():
        raise DataError(f"{path} is missing; the data folder must hold {relative}")
    return path


def read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
