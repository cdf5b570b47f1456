"""Where evaluation and training data come from: one resolver for tasks, probes, the training corpus and scripts.

A folder given explicitly (``--data DIR``), else ``$DASSPEC_DATA``.  The installed package never guesses a folder
of its own; the repository's scripts set ``DASSPEC_DATA`` (default ``../shared/data``).  The layout is
``gsm8k/{test,train}.jsonl``, ``math500/test.jsonl``, ``mbpp/mbpp.jsonl``, ``humaneval/HumanEval.jsonl.gz``.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Iterable
from pathlib import Path

DATA_ENV = "DASSPEC_DATA"


class DataError(FileNotFoundError):
    """Data cannot be found (no data folder, a file missing in it, no offline copy, no `datasets`)."""


class DataFormatError(ValueError):
    """A data file is there but cannot be read: truncated or corrupt gzip, a line that is not a JSON object, a
    missing field.  The message names the file and the line."""


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


def read_jsonl(path: Path, required: Iterable[str] = ()) -> list[dict]:
    """The JSON objects of a ``.jsonl`` (or ``.jsonl.gz``) file, one per non-blank line, each holding the fields
    in ``required``.  A file that cannot be read raises ``DataFormatError`` naming the file and the line."""
    required = tuple(required)
    rows: list[dict] = []
    line_no = 0
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:            # bytes, decoded line by line: errors name the right line
            for line_no, raw in enumerate(f, 1):
                if raw.strip():
                    rows.append(_row(path, line_no, raw, required))
    except gzip.BadGzipFile as err:
        raise DataFormatError(f"{path}: not gzip data ({err}); fetch the file again") from None
    except (EOFError, zlib.error) as err:
        raise DataFormatError(f"{path}: truncated or corrupt gzip data after line {line_no} ({err}); fetch the "
                              "file again") from None
    return rows


def _row(path: Path, line_no: int, raw: bytes, required: tuple[str, ...]) -> dict:
    try:
        row = json.loads(raw.decode("utf-8").rstrip())
    except UnicodeDecodeError as err:
        raise DataFormatError(f"{path}, line {line_no}: not UTF-8 text (byte {raw[err.start]:#04x} at column "
                              f"{err.start + 1})") from None
    except json.JSONDecodeError as err:
        raise DataFormatError(f"{path}, line {line_no}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(row, dict):
        raise DataFormatError(f"{path}, line {line_no}: expected a JSON object, got {type(row).__name__}")
    missing = [k for k in required if k not in row]
    if missing:
        raise DataFormatError(f"{path}, line {line_no}: no {', '.join(map(repr, missing))} field")
    return row
