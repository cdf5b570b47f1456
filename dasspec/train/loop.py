"""The training loop, in nanoGPT's shape: every step draws a batch and a depth, makes one truncated-BPTT update and
logs a row of ``train_log.csv``.

It is resumable: every ``checkpoint_every`` steps, when the run ends, and after Ctrl-C (SIGINT) or SIGTERM it saves
the resume state (``resume.py``) at a step boundary, in the run's training folder (``DIR.partial``).  Ctrl-C does
not interrupt a step half-way (the update and the counters would disagree): it finishes the step, saves and raises
``Interrupted``.  A second Ctrl-C, or a KeyboardInterrupt that does not come through the signal handler (training
off the main thread), stops at once, and the last periodic state stands.  A resumed run replays exactly what the
uninterrupted run would have done (bit for bit on the same machine and thread count: ``tests/test_train.py``
checks it).
"""

from __future__ import annotations

import csv
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from ..host import fair_threads
from ..model.looped import LoopedLM
from .config import TrainConfig
from .objective import looped_loss
from .resume import STATE_FILE, Progress, save_state
from .schedule import lr_at, mean_depth_at, run_fraction, sample_depth

LOG_FILE = "train_log.csv"
LOG_FIELDS = ["step", "elapsed_s", "lr", "depth", "backprop", "seq_len", "loss", "tokens", "tokens_per_s", "threads"]


class Interrupted(KeyboardInterrupt):
    """Training stopped by a signal after saving the resume state; running the same command resumes it."""


class StopRequest:
    """While active, SIGINT / SIGTERM only set ``requested``; the loop stops at the next step boundary.  The
    previous handlers come back at the first signal, so a second Ctrl-C interrupts at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():      # Python delivers signals there only
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._request)
        return self

    def _request(self, signum, frame) -> None:
        self.requested = True
        self._restore()
        print(f"\n{signal.Signals(signum).name}: stopping after this step to save the resume state "
              "(Ctrl-C again stops at once)", file=sys.stderr)

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __exit__(self, *exc) -> None:
        self._restore()


def get_batch(stream: np.ndarray, rng: np.random.Generator, batch: int, T: int, device) -> tuple[Tensor, Tensor]:
    """``batch`` random windows of T + 1 tokens: inputs and next-token targets."""
    starts = rng.integers(0, len(stream) - T - 1, size=batch)
    x = np.stack([stream[s: s + T + 1] for s in starts]).astype(np.int64)
    x = torch.from_numpy(x).to(device)
    return x[:, :-1], x[:, 1:]


def batch_shape(cfg: TrainConfig, step: int) -> tuple[int, int]:
    """(T, B): every ``long_every``-th step trains long positions with the same tokens per step."""
    if cfg.long_every and step % cfg.long_every == cfg.long_every - 1:
        return cfg.long_seq_len, max(1, cfg.batch_size * cfg.seq_len // cfg.long_seq_len)
    return cfg.seq_len, cfg.batch_size


def train_step(cfg: TrainConfig, model: LoopedLM, opt: torch.optim.Optimizer, stream: np.ndarray,
               rng: np.random.Generator, p: Progress, elapsed: float) -> dict:
    """One update at step ``p.step`` (``elapsed`` training seconds in); advances ``p``.  Returns the log row
    without its time columns."""
    device = model.device
    lr = lr_at(cfg, p.step, elapsed)
    if cfg.threads > 1 and cfg.share_cpu and device.type == "cpu" and p.step % 10 == 0:
        torch.set_num_threads(fair_threads(cfg.threads, own_threads=torch.get_num_threads()))
    for g in opt.param_groups:
        g["lr"] = lr
    T, B = batch_shape(cfg, p.step)
    x, y = get_batch(stream, rng, B, T, device)
    mean_r = mean_depth_at(cfg, run_fraction(cfg, p.step, elapsed))
    n, k = sample_depth(rng, mean_r, cfg.depth_sigma, cfg.backprop_depth, cfg.min_depth, cfg.max_depth)
    seed = int(rng.integers(0, 2 ** 31))
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.autocast_bf16):
        loss = looped_loss(model, x, y, n, k, cfg.init_scale, seed)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if cfg.grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    lv = loss.detach().item()
    if not math.isfinite(lv):
        raise RuntimeError(f"training diverged at step {p.step + 1} (loss {lv})")
    p.step += 1
    p.tokens += B * T
    p.ema = lv if p.ema is None else 0.95 * p.ema + 0.05 * lv
    return dict(step=p.step, lr=f"{lr:.3e}", depth=n + k, backprop=k, seq_len=T, loss=round(lv, 4), tokens=p.tokens,
                threads=torch.get_num_threads())


def open_log(path: Path, step: int):
    """``train_log.csv`` ready for the rows after ``step``: a new file at step 0; on resume, the rows a killed
    session wrote after its last saved state are dropped first, so no step appears twice."""
    if step == 0 or not path.exists():
        f = open(path, "w", newline="")
        csv.DictWriter(f, LOG_FIELDS).writeheader()
        return f, csv.DictWriter(f, LOG_FIELDS)
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if int(r["step"]) <= step]
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, LOG_FIELDS)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, path)
    f = open(path, "a", newline="")
    return f, csv.DictWriter(f, LOG_FIELDS)


def _progress_bar(cfg: TrainConfig, p: Progress, show: bool):
    by_steps = cfg.max_steps is not None
    return tqdm(total=cfg.max_steps if by_steps else int(cfg.time_budget_s), unit="step" if by_steps else "s",
                initial=p.step if by_steps else min(p.elapsed, cfg.time_budget_s), desc="train", disable=not show,
                bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} {unit} [{elapsed}<{remaining}{postfix}]")


def _done(cfg: TrainConfig, step: int, elapsed: float) -> bool:
    return elapsed >= cfg.time_budget_s or (cfg.max_steps is not None and step >= cfg.max_steps)


def train_loop(cfg: TrainConfig, out: Path, model: LoopedLM, opt: torch.optim.Optimizer, stream: np.ndarray,
               rng: np.random.Generator, p: Progress, stream_id: str, show: bool = True) -> Progress:
    """Train from ``p`` until max_steps or the time budget, logging every step and saving the resume state as
    described above.  Returns the final counters (``p``, advanced)."""
    t0 = time.time() - p.elapsed                   # training time counts across resumes
    log_f, log = open_log(out / LOG_FILE, p.step)
    bar = _progress_bar(cfg, p, show)

    def save() -> None:
        log_f.flush()                              # the log holds every step the state holds
        save_state(out, cfg, model, opt, rng, p, stream_id)

    with log_f, StopRequest() as stop:
        while not _done(cfg, p.step, elapsed := time.time() - t0):
            row = train_step(cfg, model, opt, stream, rng, p, elapsed)
            p.elapsed = now = time.time() - t0
            log.writerow(row | dict(elapsed_s=round(now, 2), tokens_per_s=round(p.tokens / max(now, 1e-9), 1)))
            if p.step % cfg.log_every == 0:
                log_f.flush()
            bar.set_postfix_str(f"step {p.step} loss {p.ema:.3f} r={row['depth']} "
                                f"{p.tokens / max(now, 1e-9):.0f} tok/s")
            bar.update(1 if cfg.max_steps is not None else min(now, cfg.time_budget_s) - bar.n)
            if stop.requested:
                break
            if cfg.checkpoint_every and p.step % cfg.checkpoint_every == 0:
                save()
        else:
            p.elapsed = elapsed                    # the time that ended the run: a resume ends there too
        save()
    bar.close()
    if stop.requested:
        raise Interrupted(f"stopped at step {p.step}; the resume state is in {out / STATE_FILE} - run the same "
                          "command again to resume")
    return p
