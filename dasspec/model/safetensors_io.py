"""The safetensors format read and written without mapping whole files.

The loader needs three things from a weight file: its header (names, dtypes, shapes - for the checks, before any
weight is read), a few rows of one tensor (the tied-head check) and each tensor converted into the load's dtype and
layout.  ``safetensors.safe_open`` maps the whole file, and the pages a load touches stay resident until the file is
closed, so a 4 GB shard read tensor by tensor costs its 4 GB on top of the converted copies.  Here every tensor is
read with plain file reads in bounded chunks straight into its destination, so a load's peak memory is the loaded
model plus one chunk.

Files are opened only when they are regular files: a FIFO named in a checkpoint would block ``open`` forever, a
directory or device is not a weight file.  Every malformed header is a ``CheckpointError`` naming the file.
"""

from __future__ import annotations

import json
import math
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterable

import torch

# safetensors dtype codes -> torch dtypes (those torch can hold; others are refused by name)
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
FLOAT_CODES = frozenset({"F64", "F32", "F16", "BF16"})
CODE_OF = {v: k for k, v in DTYPES.items()}
# The reference implementation refuses larger headers too; a bigger one is damage, not a model.
MAX_HEADER_BYTES = 100_000_000
CHUNK_BYTES = 64 << 20          # one read's buffer: the only transient memory a load adds to the model's


class CheckpointError(ValueError):
    """The checkpoint folder is missing files, or its files are unreadable or do not match its config."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: where its bytes lie (absolute file offsets) and what they hold."""
    name: str
    code: str                     # safetensors dtype code, e.g. "F32"
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.code]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def checkpoint_root(folder: Path) -> Path:
    """The folder a checkpoint's files must lie in after symlinks: the folder itself, or for a Hugging Face cache
    snapshot (``models--org--name/snapshots/<commit>``, whose files link into ``../../blobs``) the repository's
    cache folder."""
    folder = Path(folder)
    real = Path(os.path.realpath(folder))
    repo = real.parent.parent
    if real.parent.name == "snapshots" and repo.name.startswith(("models--", "datasets--")) and \
            (repo / "blobs").is_dir():
        return repo
    return real


def confine(path: Path, root: Path, what: str = "file") -> Path:
    """``path`` if it lies inside ``root`` after every symlink is followed, else a ``CheckpointError``: a link in a
    downloaded folder must not make the loader read (and quote, or serve) a file elsewhere on the machine."""
    real = Path(os.path.realpath(path))
    if not real.is_relative_to(os.path.realpath(root)):
        raise CheckpointError(f"{what} {path} is a symlink that leads outside {root}; only files inside the "
                              "checkpoint are read")
    return path


def open_regular(path: Path, what: str = "file", within: Path | None = None) -> BinaryIO:
    """Open ``path`` for reading only if it is a regular file (after symlinks) - and, given ``within``, only if it
    lies inside that folder after symlinks (``confine``).  O_NONBLOCK keeps ``open`` from waiting for a writer when
    the path is a FIFO; the type is then checked on the open descriptor."""
    if within is not None:
        confine(path, within, what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CheckpointError(f"missing {what} {path}") from None
    except OSError as err:      # ELOOP (a symlink loop), EACCES, ...
        raise CheckpointError(f"cannot open {what} {path}: {err.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
            raise CheckpointError(f"{what} {path} is {kind}; only regular files are read from a checkpoint")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def check_regular(path: Path, what: str = "file", within: Path | None = None) -> None:
    """Raise unless ``path`` is a readable regular file (inside ``within``; opens and closes it; never blocks)."""
    open_regular(path, what, within).close()


def read_header(path: Path, within: Path | None = None) -> dict[str, TensorEntry]:
    """Every tensor entry of a safetensors file, validated against the file's size: a damaged or truncated file is
    refused here, by name, before anything is allocated for it."""
    with open_regular(path, "weight file", within) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"cannot read {path}: shorter than a safetensors header ({size} bytes)")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(f"cannot read {path}: header length {n} does not fit the file ({size} bytes); "
                                  "the file is damaged or not safetensors")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"cannot read {path}: the header is not valid JSON ({err})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"cannot read {path}: the header is a JSON {type(header).__name__}, not an object")
    data_start, data_size = 8 + n, size - 8 - n
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entries[name] = _entry(path, name, info, data_start, data_size)
    return entries


def _entry(path: Path, name: str, info: object, data_start: int, data_size: int) -> TensorEntry:
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"cannot read {path}: tensor {name} {why}")

    if not isinstance(info, dict):
        raise bad(f"has a header entry of type {type(info).__name__}")
    code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if code not in DTYPES:
        raise bad(f"has dtype {code!r}, which dasspec cannot read (known: {', '.join(DTYPES)})")
    if not (isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape)):
        raise bad(f"has an invalid shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_size):
        raise bad(f"has data_offsets {offsets!r} outside the file's {data_size} data bytes (truncated?)")
    entry = TensorEntry(name, code, tuple(shape), data_start + offsets[0], data_start + offsets[1])
    if entry.numel * entry.dtype.itemsize != entry.end - entry.begin:
        raise bad(f"of shape {list(shape)} ({code}) needs {entry.numel * entry.dtype.itemsize} bytes, the header "
                  f"gives it {entry.end - entry.begin}")
    return entry


def _readinto(f: BinaryIO, buf: torch.Tensor, path: Path, name: str) -> None:
    view = memoryview(buf.reshape(-1).view(torch.uint8).numpy())
    got = 0
    while got < len(view):
        k = f.readinto(view[got:])
        if not k:
            raise CheckpointError(f"cannot read {path}: the file ended inside tensor {name}")
        got += k


def _check_finite(chunk: torch.Tensor, first_row: int, entry: TensorEntry, path: Path) -> None:
    # One reduction per chunk: NaN and inf propagate into the sum.  A sum can also overflow on finite values, so a
    # non-finite sum is confirmed element-wise before the tensor is refused.
    if chunk.is_floating_point() and not torch.isfinite(chunk.sum()) and not torch.isfinite(chunk).all():
        bad = (~torch.isfinite(chunk)).nonzero()[0].tolist()
        bad[0] += first_row
        value = chunk[tuple(bad[0] - first_row if i == 0 else j for i, j in enumerate(bad))].item()
        raise CheckpointError(f"tensor {entry.name} in {path} holds a non-finite value ({value} at index {bad}); "
                              "the checkpoint is damaged")


def read_into(path: Path, entry: TensorEntry, out: torch.Tensor, chunk_bytes: int | None = None,
              within: Path | None = None) -> None:
    """Fill ``out`` (the entry's shape, any float dtype, any strides, on any device) with the tensor's values,
    converting chunk by chunk (``chunk_bytes``, default ``CHUNK_BYTES``) along the first dimension, and refuse
    non-finite values by name."""
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    if tuple(out.shape) != entry.shape:
        raise ValueError(f"{entry.name}: destination shape {list(out.shape)} != stored {list(entry.shape)}")
    if sys.byteorder != "little":
        raise CheckpointError("safetensors files are little-endian; this machine is not")
    flat = out.reshape(1) if out.dim() == 0 else out
    rows = flat.shape[0]
    if rows == 0 or entry.numel == 0:
        return
    row_elems = entry.numel // rows
    step = max(1, chunk_bytes // max(1, row_elems * entry.dtype.itemsize))
    direct = out.device.type == "cpu" and out.dtype == entry.dtype and out.is_contiguous()
    buf = None if direct else torch.empty(min(step, rows) * row_elems, dtype=entry.dtype)
    with open_regular(path, "weight file", within) as f:
        f.seek(entry.begin)
        for a in range(0, rows, step):
            b = min(rows, a + step)
            dst = flat[a:b]
            if direct:
                _readinto(f, dst, path, entry.name)
            else:
                src = buf[: (b - a) * row_elems]
                _readinto(f, src, path, entry.name)
                dst.copy_(src.view(dst.shape))
            _check_finite(dst, a, entry, path)


def read_rows(path: Path, entry: TensorEntry, rows: Iterable[int], within: Path | None = None) -> torch.Tensor:
    """Rows of a tensor along its first dimension, in its stored dtype (for spot checks that must not read it all)."""
    rows = list(rows)
    row_elems = entry.numel // entry.shape[0]
    nbytes = row_elems * entry.dtype.itemsize
    out = torch.empty(len(rows), row_elems, dtype=entry.dtype)
    with open_regular(path, "weight file", within) as f:
        for i, r in enumerate(rows):
            f.seek(entry.begin + r * nbytes)
            _readinto(f, out[i], path, entry.name)
    return out


def write_streamed(path: Path, specs: list[tuple[str, tuple[int, ...], torch.dtype]],
                   produce: Callable[[str], torch.Tensor]) -> int:
    """Write a safetensors file whose tensors are produced one at a time (``produce(name)``, called in ``specs``
    order), so a file larger than memory can be written; returns the data bytes written."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in specs:
        n = 1
        for s in shape:
            n *= s
        header[name] = {"dtype": CODE_OF[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + n * dtype.itemsize]}
        offset += n * dtype.itemsize
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)                       # the format aligns the data section to 8 bytes
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, shape, dtype in specs:
            t = produce(name)
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise ValueError(f"{name}: produced {t.dtype} {list(t.shape)}, declared {dtype} {list(shape)}")
            f.write(memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
            del t
    return offset
