"""The resume state: what ``dasspec train --out DIR`` keeps in DIR so that a killed run continues as if it had
never stopped.

``DIR/resume.pt`` (``torch.save``; written to a temporary file that then replaces the old one, so a kill during the
write leaves the previous state) holds the model weights, the optimizer state, the loop's counters (step, tokens
seen, training seconds, EMA loss), numpy's Generator state and torch's RNG state, the config the run was started
with, and a fingerprint of the training token stream.  The tokenizer and the token streams are not in it: the
tokenizer is already in DIR (``tokenizer.json``, reused on resume) and the streams are rebuilt from the corpus,
which is deterministic; the fingerprint proves the rebuilt stream is the one the run was trained on.

What a run finds in DIR decides what it does:

* ``resume.pt``: resume from it, if it was made with the same config (else refuse and name the fields that differ);
* no ``resume.pt`` but ``train_summary.json``: that run finished - refuse rather than silently retrain;
* neither: a fresh run.

``--fresh`` (``fresh=True``) deletes both and starts over.  A finished run deletes ``resume.pt`` once its model card
is written, so ``train_summary.json`` is the mark of a finished run.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from .config import TrainConfig

STATE_FILE = "resume.pt"
FINISHED_FILE = "train_summary.json"
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


def open_state(out: Path, cfg: TrainConfig, fresh: bool = False) -> dict | None:
    """The state to resume from, or None for a fresh run (see the module docstring).  Raises ``ResumeError`` for
    a finished run or a state made with another config."""
    path = out / STATE_FILE
    if fresh:
        discard(out, finished=True)
        return None
    if path.exists():
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state.get("version") != VERSION:
            raise ResumeError(f"{path} was written by another version of dasspec train; pass --fresh to start "
                              "over, or choose another --out")
        changed = config_changes(state["config"], cfg.to_dict())
        if changed:
            raise ResumeError(f"{path} was saved by a run with other settings: {'; '.join(changed)}. Pass --fresh "
                              "to start over with these settings, or choose another --out")
        return state
    if (out / FINISHED_FILE).exists():
        raise ResumeError(f"the run in {out} already finished ({FINISHED_FILE} is there); pass --fresh to train "
                          "again into it, or choose another --out")
    return None


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


def discard(out: Path, finished: bool = False) -> None:
    """Delete the resume state (and, ``finished``, the mark of a finished run)."""
    names = [STATE_FILE, STATE_FILE + ".tmp"] + ([FINISHED_FILE] if finished else [])
    for name in names:
        (out / name).unlink(missing_ok=True)
