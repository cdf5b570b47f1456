"""Where a checkpoint's files are, and its JSON files read: ``resolve_source`` (a folder, a Hugging Face repo id in
the local cache, or None for the bundled model) and ``read_json`` (regular files inside the folder only).

Both the loader (``checkpoint``) and ``tokenizer`` find their files through this module.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from .fields import json_type
from .safetensors_io import CheckpointError, open_regular

BUNDLED_DIR = Path(__file__).parents[1] / "assets" / "dasspec-tiny"


def resolve_source(source: str | os.PathLike | None) -> Path:
    """Folder path for ``source``: None -> bundled model; a directory; or an HF repo id in the local HF cache."""
    if source is None:
        if not (BUNDLED_DIR / "config.json").exists():
            raise CheckpointError(f"the bundled model is missing from {BUNDLED_DIR}; run `dasspec train --out DIR` "
                                  "or reinstall the package")
        return BUNDLED_DIR
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    text = str(source)
    if path.exists():
        raise CheckpointError(f"{text} is a file; pass the checkpoint folder (config.json + safetensors)")
    if path.is_symlink():
        raise CheckpointError(f"checkpoint folder {text!r} is a dangling symlink or a symlink loop")
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        cached = _hf_cache_snapshot(text)
        if cached is not None:
            return cached
        raise CheckpointError(f"{text!r} is neither a local folder nor in the local Hugging Face cache "
                              f"({_hf_cache_root()}); download it on a connected machine "
                              "(huggingface-cli download) and copy the folder here")
    raise CheckpointError(f"checkpoint folder {text!r} does not exist")


def _hf_cache_root() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    return home / "hub"


# What huggingface_hub writes into refs/<branch>: a commit hash, so a ref can only name a folder of snapshots/.
_COMMIT = re.compile(r"[0-9a-f]{40}")


def _hf_cache_snapshot(repo_id: str, revision: str = "main") -> Path | None:
    repo_dir = _hf_cache_root() / ("models--" + repo_id.replace("/", "--"))
    if not repo_dir.is_dir():
        return None
    snapshots = repo_dir / "snapshots"
    ref = repo_dir / "refs" / revision
    if os.path.lexists(ref):
        # confined to the repository's cache folder; its content is quoted only once it is known to be a hash
        with open_regular(ref, "Hugging Face cache ref", within=repo_dir) as f:
            raw = f.read(256)
        commit = raw.decode("ascii", "replace").strip()
        if not _COMMIT.fullmatch(commit):
            raise CheckpointError(f"{ref} does not hold a commit hash ({len(raw)} bytes that are not 40 hex "
                                  f"digits), so it names no snapshot of {snapshots}; the cache is damaged - "
                                  "download the repository again")
        snap = snapshots / commit
        if not snap.is_dir():
            # never another snapshot in its place: the ref says which revision the user asked for
            raise CheckpointError(f"{ref} names commit {commit}, but {snap} does not exist; the cache is "
                                  "incomplete - download the repository again")
        if not snap.resolve().is_relative_to(snapshots.resolve()):
            raise CheckpointError(f"snapshot {snap} (from {ref}) resolves outside {snapshots}")
        return snap
    snaps = sorted((p for p in snapshots.glob("*") if p.is_dir() and not p.is_symlink()),
                   key=lambda p: p.stat().st_mtime)
    return snaps[-1] if snaps else None


def read_json(path: Path, expect: type = dict, within: Path | None = None) -> Any:
    """A checkpoint's JSON file, refused by name when it is not a regular file (inside ``within`` after symlinks),
    not JSON, or not of type ``expect`` (an object unless told otherwise)."""
    with open_regular(path, path.name, within) as f:
        raw = f.read()
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(value, expect):
        raise CheckpointError(f"{path} must hold a JSON {json_type(expect())}, got a JSON {json_type(value)}")
    return value
