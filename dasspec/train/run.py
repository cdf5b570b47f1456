"""``train()``: one run from corpus to model card - prepare the data, build the model, train (resuming when the
output folder holds a resume state), then save the checkpoint, evaluate and write the card.

The result is a folder ``dasspec.load_model(DIR)`` loads exactly like a real checkpoint (``save_checkpoint``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from ..model.looped import LoopedLM
from .card import plot_training, write_generation_config, write_model_card
from .config import TrainConfig
from .corpus import Document, corpus_stats
from .evaluate import held_out_metrics, sample_generations
from .loop import train_loop
from .objective import build_model, make_optimizer
from .prepare import Prepared, fingerprint, prepare
from .resume import STATE_FILE, Progress, discard, open_state, restore


def train(cfg: TrainConfig, out: str | os.PathLike, data_dir: str | os.PathLike | None = None,
          docs: list[Document] | None = None, progress: bool = True, pilots: dict[str, dict] | None = None,
          fresh: bool = False) -> dict:
    """Train into ``out``: the checkpoint (config.json, model.safetensors, tokenizer files, generation_config.json),
    ``train_log.csv``, ``train_summary.json`` and the model card ``README.md`` (which tabulates ``pilots``: name ->
    an earlier run's train_summary.json).  The corpus is built from ``data_dir`` (else ``$DASSPEC_DATA``) unless
    ``docs`` are given.  A resume state in ``out`` is continued; ``fresh`` discards it (``resume.py``).
    Returns the summary."""
    cfg.validate()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = open_state(out, cfg, fresh)
    t_start = time.time()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    data = prepare(cfg, out, data_dir, docs, reuse_tokenizer=state is not None)
    model = build_model(cfg, data)
    opt = make_optimizer(cfg, model)
    stream_id = fingerprint(data.train_ids)
    p = Progress()
    if state is not None:
        p = restore(state, model, opt, rng, stream_id)
        print(f"resuming {out} from step {p.step}" + (f" of {cfg.max_steps}" if cfg.max_steps else "")
              + f" ({out / STATE_FILE}, {p.elapsed / 60:.1f} min trained)", flush=True)
    setup_s = time.time() - t_start
    p = train_loop(cfg, out, model, opt, data.train_ids, rng, p, stream_id, progress)
    return finish(cfg, out, model, data, p, setup_s, pilots)


def finish(cfg: TrainConfig, out: Path, model: LoopedLM, data: Prepared, p: Progress, setup_s: float,
           pilots: dict[str, dict] | None = None) -> dict:
    """Save the checkpoint, evaluate it, write train_summary.json, the plot and the card; then drop the resume
    state (the summary now marks the run finished)."""
    from ..model.checkpoint import save_checkpoint

    model.eval()
    save_checkpoint(model, out)
    write_generation_config(out, data.special_ids()[1])
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
    discard(out)
    return summary
