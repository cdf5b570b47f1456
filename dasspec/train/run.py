"""``train()``: one run from corpus to model card - prepare the data, build the model, train (resuming when
``DIR.partial`` holds a resume state), then save the checkpoint, evaluate, write the card and rename
``DIR.partial`` to DIR.

The result is a folder ``dasspec.load_model(DIR)`` loads exactly like a real checkpoint (``save_checkpoint``); until
the run is complete no folder named DIR is written (``resume.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from ..model.checkpoint import save_checkpoint
from ..model.looped import LoopedLM
from .card import plot_training, write_generation_config, write_model_card
from .config import TrainConfig
from .corpus import Document, corpus_stats
from .evaluate import held_out_metrics, sample_generations
from .loop import train_loop
from .objective import build_model, make_optimizer
from .prepare import Prepared, fingerprint, prepare
from .resume import (FINISHED_FILE, STATE_FILE, Progress, check_destination, discard, finished,
                     open_state, publish, restore)


def train(cfg: TrainConfig, out: str | os.PathLike, data_dir: str | os.PathLike | None = None,
          docs: list[Document] | None = None, progress: bool = True, pilots: dict[str, dict] | None = None,
          fresh: bool = False, force: bool = False) -> dict:
    """Train into ``out``: the checkpoint (config.json, model.safetensors, tokenizer files, generation_config.json),
    ``train_log.csv``, ``train_summary.json`` and the model card ``README.md`` (which tabulates ``pilots``: name ->
    an earlier run's train_summary.json).  The corpus is built from ``data_dir`` (else ``$DASSPEC_DATA``) unless
    ``docs`` are given.  The run works in ``out.partial`` and renames it to ``out`` when complete; a resume state
    there is continued, ``fresh`` discards it; an existing ``out`` is refused unless ``force``, which replaces it
    at the end (``resume.py``).  Returns the summary."""
    cfg.validate()
    out = Path(out)
    work = check_destination(out, force)
    if finished(work) and not fresh:
        print(f"{work} holds a finished run; moving it to {out}", flush=True)
        publish(work, out)
        return json.loads((out / FINISHED_FILE).read_text())
    state = open_state(work, cfg, fresh)
    created = not work.exists()
    work.mkdir(parents=True, exist_ok=True)
    try:
        model, data, p, setup_s = _train(cfg, out, work, state, data_dir, docs, progress)
    except BaseException:
        if created and not (work / STATE_FILE).exists():
            shutil.rmtree(work, ignore_errors=True)     # nothing to resume from: leave no trace of the attempt
        raise
    summary = finish(cfg, work, model, data, p, setup_s, pilots, out)
    discard(work)                   # train_summary.json now marks the run finished
    publish(work, out)
    return summary


def _train(cfg: TrainConfig, out: Path, work: Path, state: dict | None, data_dir, docs, progress: bool
           ) -> tuple[LoopedLM, Prepared, Progress, float]:
    """Data, model and optimizer (restored from ``state`` when resuming), then the training loop in ``work``.
    Returns the model, the data, the final counters and the setup seconds."""
    t_start = time.time()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    data = prepare(cfg, work, data_dir, docs, reuse_tokenizer=state is not None)
    model = build_model(cfg, data)
    opt = make_optimizer(cfg, model)
    stream_id = fingerprint(data.train_ids)
    p = Progress()
    if state is not None:
        p = restore(state, model, opt, rng, stream_id)
        print(f"resuming {out} from step {p.step}" + (f" of {cfg.max_steps}" if cfg.max_steps else "")
              + f" ({work / STATE_FILE}, {p.elapsed / 60:.1f} min trained)", flush=True)
    setup_s = time.time() - t_start
    p = train_loop(cfg, work, model, opt, data.train_ids, rng, p, stream_id, progress)
    return model, data, p, setup_s


def finish(cfg: TrainConfig, out: Path, model: LoopedLM, data: Prepared, p: Progress, setup_s: float,
           pilots: dict[str, dict] | None = None, previous: Path | None = None) -> dict:
    """Save the checkpoint into ``out`` (the training folder), evaluate it, write train_summary.json, the plot and
    the card.  ``previous``: the folder this run will replace, whose tuned decoder defaults are kept."""
    model.eval()
    save_checkpoint(model, out)
    write_generation_config(out, data.special_ids()[1], previous)
    t_eval = time.time()
    val = held_out_metrics(model, data.tokenizer, data.val_docs, cfg)
    summary = {
        "config": cfg.to_dict(), "model": model.config.to_dict(), "parameters": model.num_parameters(),
        "weights_bytes": (out / "model.safetensors").stat().st_size,
        "corpus": corpus_stats(data.docs), "train_documents": len(data.train_docs),
        "val_documents": len(data.val_docs), "train_tokens": data.train_counts, "val_tokens": data.val_counts,
        "steps": p.step, "tokens_seen": p.tokens, "setup_s": round(setup_s, 1), "train_s": round(p.elapsed, 1),
        "eval_s": round(time.time() - t_eval, 1), "tokens_per_s": round(p.tokens / max(p.elapsed, 1e-9), 1),
        "val": val["all"], "val_by_source": val, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "resumed_at": p.resumed_at,
    }
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_training(out, summary)
    write_model_card(out, summary, sample_generations(out, max_new_tokens=cfg.sample_tokens), pilots)
    return summary
