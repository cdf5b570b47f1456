"""``records.jsonl``: one JSON record per finished (task, prompt, method) run, append-only.

The file is never rewritten, by anyone: a writer (holding the folder's lock, ``lock.py``) only appends whole lines,
each pushed to disk before the next run starts, and a reader only reads.  What goes wrong is named, never dropped:

* an unterminated last line (a run stopped mid-write) is ignored by readers; the next writer sets it aside and
  terminates it with a newline (appending, so nothing another process wrote after it can be lost);
* a line that is not a record (not JSON, ``{}``, missing fields, or a second record of a run already recorded)
  stops the run with its line number, the file left as it was; ``set_aside=True`` (``--repair-records``) lists
  such lines in ``records.rejected.jsonl`` instead, and readers skip the lines listed there.

A record is finished (``status`` "ok", or no status: folders from before it existed) or failed (``status``
"failed" with ``error``: a Ray cell that failed twice); only finished ones count as done, so a resume runs a failed
one again.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

RECORDS = "records.jsonl"
REJECTED = "records.rejected.jsonl"
# What the report reads from every finished record, and from a failed one.
NEEDED = ("task", "prompt_id", "prompt_index", "method", "new_tokens", "wall_time", "sequential_passes", "tokens",
          "accepted", "target_tokens", "stop_reason")
NEEDED_FAILED = ("task", "prompt_id", "prompt_index", "method", "error")
SHOWN_BAD_LINES = 5


class RecordsError(ValueError):
    """records.jsonl holds lines that are not records; the message names them."""


def record_key(r: dict) -> tuple[str, str, str]:
    return r["task"], r["prompt_id"], r["method"]


def is_failed(r: dict) -> bool:
    return r.get("status") == "failed"


@dataclass
class Records:
    ok: list[dict] = field(default_factory=list)       # finished records, one per (task, prompt, method), file order
    failed: list[dict] = field(default_factory=list)   # failure records of runs that have no finished record
    set_aside: int = 0                                  # lines skipped because records.rejected.jsonl lists them
    torn_tail: str | None = None                        # an unterminated last line (a writer stopped, or writing)

    @property
    def done(self) -> set[tuple[str, str, str]]:
        return {record_key(r) for r in self.ok}


def problem(rec) -> str | None:
    """Why a parsed line is not a record (None: it is one)."""
    if not isinstance(rec, dict):
        return f"a JSON {type(rec).__name__}, not an object"
    missing = [k for k in (NEEDED_FAILED if is_failed(rec) else NEEDED) if k not in rec]
    if missing:
        return f"missing {', '.join(missing)}"
    bad = [k for k in ("task", "prompt_id", "method") if not isinstance(rec[k], str)]
    return f"{', '.join(bad)} not text" if bad else None


def rejected_lines(path: Path) -> set[tuple[int, str]]:
    """(line number, text) of the lines set aside in the side file next to ``path``.  A side entry that is itself
    unreadable lists nothing (its line is then reported again)."""
    side = path.with_name(REJECTED)
    out = set()
    if side.exists():
        for line in side.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                entry = json.loads(line)
                out.add((int(entry["line"]), str(entry["text"])))
            except (ValueError, KeyError, TypeError):
                continue
    return out


def read_records(path: str | os.PathLike, set_aside: bool = False) -> Records:
    """The records in ``path`` (none if it does not exist).  Raises ``RecordsError`` naming every line that is not
    a record, unless ``set_aside``: then those lines are listed in records.rejected.jsonl and skipped."""
    path = Path(path)
    out = Records()
    if not path.exists():
        return out
    listed = rejected_lines(path)
    lines = path.read_bytes().split(b"\n")
    tail = lines.pop()                                  # b"" when the file ends with a newline
    if tail:
        out.torn_tail = tail.decode("utf-8", "replace")
    first_ok: dict[tuple, int] = {}
    failed: dict[tuple, dict] = {}
    bad: list[tuple[int, str, str]] = []
    for number, raw in enumerate(lines, 1):
        text = raw.decode("utf-8", "replace")
        if (number, text) in listed:
            out.set_aside += 1
            continue
        try:
            rec = json.loads(text)
        except json.JSONDecodeError as err:
            bad.append((number, text, f"not JSON: {err.msg}"))
            continue
        why = problem(rec)
        if why is None and not is_failed(rec) and record_key(rec) in first_ok:
            why = f"a second record of {'/'.join(record_key(rec))} (first on line {first_ok[record_key(rec)]})"
        if why is not None:
            bad.append((number, text, why))
        elif is_failed(rec):
            failed[record_key(rec)] = rec
        else:
            first_ok[record_key(rec)] = number
            out.ok.append(rec)
    if bad and not set_aside:
        shown = "; ".join(f"line {n} ({why}): {text[:60]!r}" for n, text, why in bad[:SHOWN_BAD_LINES])
        more = f"; and {len(bad) - SHOWN_BAD_LINES} more" if len(bad) > SHOWN_BAD_LINES else ""
        raise RecordsError(f"{path} has {len(bad)} line(s) that are not benchmark records: {shown}{more}. The file "
                           f"is left as it was: fix or delete those lines, or pass --repair-records to set them "
                           f"aside in {REJECTED} (records.jsonl itself is never rewritten)")
    if bad:
        append_lines(path.with_name(REJECTED), [rejected_entry(n, text, why) for n, text, why in bad])
        out.set_aside += len(bad)
    out.failed = [r for k, r in failed.items() if k not in first_ok]
    return out


def load_records(path: str | os.PathLike) -> list[dict]:
    """The finished records in ``path`` (``read_records(path).ok``)."""
    return read_records(path).ok


def rejected_entry(line: int, text: str, why: str) -> dict:
    return {"line": line, "reason": why, "text": text, "set_aside": time.strftime("%Y-%m-%dT%H:%M:%S")}


def terminate_torn_tail(path: str | os.PathLike) -> str | None:
    """For the folder's writer only (it holds the lock): if ``path`` ends in an unterminated line, list it in
    records.rejected.jsonl and append a newline, so the next record starts on a line of its own (a whole record
    that only lacks its newline is kept: just the newline).  Returns the fragment set aside (None if none)."""
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return None
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return None
    fragment = data[data.rfind(b"\n") + 1:].decode("utf-8", "replace")
    line = data.count(b"\n") + 1
    try:
        whole = problem(json.loads(fragment)) is None
    except json.JSONDecodeError:
        whole = False
    if whole:                           # a finished record that only lacks its newline: keep it
        append_bytes(path, b"\n")
        return None
    # the side entry first: killed between the two writes, the next writer finds the same fragment and lists it
    # again (a harmless repeat); the other order could leave a terminated line that nothing lists
    append_lines(path.with_name(REJECTED),
                  [rejected_entry(line, fragment, "unterminated last line: a run stopped while writing it")])
    append_bytes(path, b"\n")
    return fragment


def append_lines(path: Path, records: list[dict]) -> None:
    append_bytes(path, "".join(json.dumps(r) + "\n" for r in records).encode("utf-8"))


def append_bytes(path: Path, data: bytes) -> None:
    """Append ``data`` whole and push it to disk; Ctrl-C waits until it is written (a half-written line would be
    a torn record)."""
    with interrupts_deferred():
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)


class RecordsWriter:
    """Appends records to one file, each as one line pushed to disk at once (the caller holds the lock)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def append(self, rec: dict) -> None:
        append_bytes(self.path, (json.dumps(rec) + "\n").encode("utf-8"))


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """SIGINT (Ctrl-C) is held while the block runs and delivered right after it (main thread only: signal
    handlers can only be set there; elsewhere the block runs as is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[tuple] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append((signum, frame)))
    try:
        yield
    finally:
        # None: a handler not set from Python, which cannot be put back; the default is the nearest
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)
        if caught:
            if callable(previous):
                previous(*caught[0])                    # default_int_handler: KeyboardInterrupt, now
            elif previous == signal.SIG_DFL:
                os.kill(os.getpid(), signal.SIGINT)
