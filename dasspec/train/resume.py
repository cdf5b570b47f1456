"""Where a run lives until it is complete, and the resume state that lets a killed run continue as if it had
never stopped.

``dasspec train --out DIR`` trains in ``DIR.partial`` and renames it to DIR only when the checkpoint, tokenizer,
evaluation and model card are all written, so a folder named DIR is always a complete model: a run that is stopped
or killed leaves DIR as it was (absent, or the previous model) and its work in ``DIR.partial``.

``DIR.partial/resume.pt`` (``torch.save``; written to a temporary file that then replaces the old one, so a kill
during the write leaves the previous state) holds the model weights, the optimizer state, the loop's counters
(step, tokens seen, training seconds, EMA loss), numpy's Generator state and torch's RNG state, the config the run
was started with, and a fingerprint of the training token stream.  The tokenizer and the token streams are not in
it: the tokenizer is already in ``DIR.partial`` (``tokenizer.json``, reused on resume) and the streams are rebuilt
from the corpus, which is deterministic; the fingerprint proves the rebuilt stream is the one the run was trained
on.

What a run finds decides what it does:

* DIR exists and is not empty (a finished run, another model): refuse, unless ``force`` - then the new run replaces
  it when it completes, and until then DIR is left untouched;
* ``DIR.partial/resume.pt``: resume from it, if it was made with the same config (else refuse and name the fields
  that differ);
* ``DIR.partial`` holding ``train_summary.json`` but no ``resume.pt``: the run finished but was stopped before its
  rename - the rename is all that is left to do;
* neither: a fresh run.

``--fresh`` (``fresh=True``) empties ``DIR.partial`` and starts over.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..host import unwritable_reason
from .config import TrainConfig

STATE_FILE = "resume.pt"
FINISHED_FILE = "train_summary.json"
PARTIAL_SUFFIX = ".partial"
VERSION = 1
# Settings a resumed run may change: they set how often files are written, never what is computed.
MAY_CHANGE = frozenset({"log_every", "checkpoint_every"})


class ResumeError(ValueError):
    """The output folder holds a run this command must not continue."""


@dataclass
class Progress:
    """The loop's counters; with the weights, the optimizer and the RNG states they are all a resume needs."""
    step: int = 0
    tokens: int = 0
    elapsed: float = 0.0                # training seconds over every session: time_budget_s counts these
    ema: float | None = None            # smoothed loss for the progress bar
    resumed_at: list[int] = field(default_factory=list)


def save_state(out: Path, cfg: TrainConfig, model: torch.nn.Module, opt: torch.optim.Optimizer,
               rng: np.random.Generator, progress: Progress, stream_id: str) -> Path:
    """Write ``out/resume.pt`` atomically (temporary file, fsync, ``os.replace``)."""
    cuda = next(model.parameters()).device.type == "cuda"
    state = {"version": VERSION, "config": cfg.to_dict(), "progress": asdict(progress), "stream": stream_id,
             "model": model.state_dict(), "optimizer": opt.state_dict(), "numpy_rng": rng.bit_generator.state,
             "torch_rng": torch.get_rng_state(), "cuda_rng": torch.cuda.get_rng_state_all() if cuda else None}
    path = out / STATE_FILE
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def partial_dir(out: Path) -> Path:
    """The folder a run for ``out`` trains in: ``DIR.partial`` beside it."""
    out = Path(os.path.abspath(out))
    return out.with_name(out.name + PARTIAL_SUFFIX)


def check_destination(out: Path, force: bool = False) -> Path:
    """Refuse an ``out`` this run may not (yet) become, before any work: a file, a folder that cannot be created,
    or - without ``force`` - a folder that already holds something.  Returns the folder to train in
    (``partial_dir``); creates nothing."""
    work = partial_dir(out)
    if out.exists() and not out.is_dir():
        raise ResumeError(f"cannot train into {out}: it is a file, not a folder")
    if work.exists() and not work.is_dir():
        raise ResumeError(f"cannot train into {out}: {work} (where the run trains until it is complete) is a file")
    problem = unwritable_reason(work.parent)
    if problem:
        raise ResumeError(f"cannot train into {out}: {problem}")
    if out.is_dir() and any(out.iterdir()) and not force:
        if (out / FINISHED_FILE).exists():
            what = f"the run in {out} already finished ({FINISHED_FILE} is there)"
        elif (out / STATE_FILE).exists():
            what = (f"{out} holds the resume state of a run that trained in place (an earlier dasspec); rename "
                    f"it to {work.name} to resume it")
        else:
            what = f"{out} already exists and is not empty"
        raise ResumeError(f"{what}; pass --force to replace it once the new run completes, or choose another --out")
    return work


def finished(work: Path) -> bool:
    """Whether ``work`` holds a complete run that was stopped before its rename into place."""
    return (work / FINISHED_FILE).exists() and not (work / STATE_FILE).exists()


def open_state(work: Path, cfg: TrainConfig, fresh: bool = False) -> dict | None:
    """The state in the training folder ``work`` to resume from, or None for a fresh run (see the module
    docstring); ``fresh`` empties ``work`` first.  Raises ``ResumeError`` for a state made with another config."""
    path = work / STATE_FILE
    if fresh:
        shutil.rmtree(work, ignore_errors=True)
        return None
    if not path.exists():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("version") != VERSION:
        raise ResumeError(f"{path} was written by another version of dasspec train; pass --fresh to start "
                          "over, or choose another --out")
    changed = config_changes(state["config"], cfg.to_dict())
    if changed:
        raise ResumeError(f"{path} was saved by a run with other settings: {'; '.join(changed)}. Pass --fresh "
                          "to start over with these settings, or choose another --out")
    return state


def config_changes(saved: dict, now: dict) -> list[str]:
    """``name (saved X, now Y)`` for every setting that differs, except those in ``MAY_CHANGE``."""
    missing = "(unset)"
    names = [k for k in dict.fromkeys([*saved, *now]) if k not in MAY_CHANGE]
    return [f"{k} (saved {saved.get(k, missing)!r}, now {now.get(k, missing)!r})" for k in names
            if saved.get(k, missing) != now.get(k, missing)]


def restore(state: dict, model: torch.nn.Module, opt: torch.optim.Optimizer, rng: np.random.Generator,
            stream_id: str) -> Progress:
    """Load ``state`` into a freshly built model, optimizer and Generator; the counters to continue from."""
    if state["stream"] != stream_id:
        raise ResumeError("the training token stream differs from the one the saved run was trained on (the "
                          "corpus or tokenizer.json changed); pass --fresh to start over")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    rng.bit_generator.state = state["numpy_rng"]
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] is not None:
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    progress = Progress(**state["progress"])
    progress.resumed_at.append(progress.step)
    return progress


def discard(work: Path) -> None:
    """Delete the resume state (the run is complete; ``train_summary.json`` now marks it finished)."""
    for name in (STATE_FILE, STATE_FILE + ".tmp"):
        (work / name).unlink(missing_ok=True)


def publish(work: Path, out: Path) -> None:
    """Move the complete run in ``work`` to ``out``.  An existing ``out`` (an empty folder, or one ``force``
    allowed) is first moved aside into a hidden temporary folder beside it and deleted once the new one is in
    place: at every moment ``out`` is the old model or the new one, never a mix (a kill between the two renames
    leaves no ``out`` and the finished ``work``, which the next run moves into place)."""
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if not out.exists():
        os.rename(work, out)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.replaced-", dir=out.parent))
    os.rename(out, aside / out.name)
    os.rename(work, out)
    shutil.rmtree(aside)
