"""What the probes share: GSM8K prompts (dasspec.eval.tasks.gsm8k), the target's greedy trajectories, paired timed
runs against AR (dasspec.eval.pairing), the paper's summary statistics (S eq. 8, A eq. 9, G eq. 10 and the prompt
bootstrap, from dasspec.eval.bench.metrics) and table output (markdown + CSV)."""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from ..bench import metrics
from ..data import data_dir
from ..pairing import paired_runs
from ..tasks import gsm8k
from ...engine.api.generate import GenerationResult, generate
from ...model.looped import LoopedLM

# --------------------------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------------------------

def gsm8k_prompts(n: int, data: str | os.PathLike | None = None, offset: int = 0) -> list[str]:
    """The first ``n`` GSM8K test questions (file order, after ``offset``) as zero-shot "Question: ...\\nAnswer:"
    prompts.  The data folder is ``data``, else ``$DASSPEC_DATA``; an error says how to set one."""
    if n < 1:
        raise ValueError(f"--prompts must be >= 1, got {n}")
    if offset < 0:
        raise ValueError(f"--prompt-offset must be >= 0, got {offset}")
    rows = gsm8k.load(data_dir(data, required=True))[offset:offset + n]
    if len(rows) < n:
        raise ValueError(f"GSM8K test has only {len(rows)} questions after offset {offset}; asked for {n}")
    return [gsm8k.prompt(row["question"], shots=0) for row in rows]


def encode_prompts(model: LoopedLM, texts: Sequence[str]) -> list[list[int]]:
    if model.tokenizer is None:
        raise ValueError("the probes read text prompts, but this model folder has no tokenizer.json")
    return [model.tokenizer.encode(t) for t in texts]


# --------------------------------------------------------------------------------------------------------------
# The target's greedy trajectory (what the mechanism probes teacher-force on)
# --------------------------------------------------------------------------------------------------------------

@dataclass
class Trajectory:
    """A prompt followed by the full-depth target's greedy continuation."""

    tokens: Tensor      # [P + N] long
    prompt_len: int     # P

    @property
    def new_tokens(self) -> int:
        return len(self.tokens) - self.prompt_len


def greedy_trajectory(model: LoopedLM, prompt: Sequence[int], max_new_tokens: int, num_steps: int | None = None,
                      init_scale: float = 1.0, seed: int = 0) -> Trajectory:
    res = generate(model, list(prompt), method="ar", max_new_tokens=max_new_tokens, num_steps=num_steps,
                   init_scale=init_scale, seed=seed)
    toks = torch.tensor(list(prompt) + res.tokens, dtype=torch.long, device=model.device)
    return Trajectory(toks, len(prompt))


def greedy_trajectories(model: LoopedLM, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                        num_steps: int | None = None, init_scale: float = 1.0, seed: int = 0,
                        progress: bool = True) -> list[Trajectory]:
    return [greedy_trajectory(model, p, max_new_tokens, num_steps, init_scale, seed)
            for p in tqdm(prompts, desc="target AR trajectories", disable=not progress, leave=False)]


# --------------------------------------------------------------------------------------------------------------
# Paired timed runs (each arm against a full-depth AR reference on the same prompt, in the same process)
# --------------------------------------------------------------------------------------------------------------

WARMUP_TOKENS = 8


@dataclass(frozen=True)
class Arm:
    name: str
    method: str
    knobs: dict = field(default_factory=dict, hash=False, compare=False)


def run_paired(model: LoopedLM, prompts: Sequence[Sequence[int]], arms: Sequence[Arm], max_new_tokens: int,
               num_steps: int | None = None, init_scale: float = 1.0, seed: int = 0, progress: bool = True,
               warmup: bool = True) -> dict[str, list[GenerationResult]]:
    """The benchmark runner's schedule (dasspec.eval.pairing) for arms that share a method but differ in knobs: AR
    and every arm on every prompt, interleaved in an order that rotates from prompt to prompt.  Returns results by
    arm name, in prompt order, with full-depth AR under "ar"."""
    names = [a.name for a in arms]
    if "ar" in names or len(set(names)) != len(names):
        raise ValueError(f"arm names must be unique and not 'ar': {names}")
    all_arms = [Arm("ar", "ar")] + list(arms)

    def run_one(prompt: Sequence[int], arm: Arm, cap: int) -> GenerationResult:
        return generate(model, list(prompt), method=arm.method, max_new_tokens=cap, num_steps=num_steps,
                        init_scale=init_scale, seed=seed, **arm.knobs)

    warm = (lambda prompt, arm: run_one(prompt, arm, min(WARMUP_TOKENS, max_new_tokens))) if warmup else None
    runs = paired_runs(prompts, all_arms, lambda prompt, arm: run_one(prompt, arm, max_new_tokens), warmup=warm,
                       cuda=model.device.type == "cuda")
    out: dict[str, list[GenerationResult]] = {a.name: [] for a in all_arms}
    for run in tqdm(runs, total=len(prompts) * len(all_arms), desc="paired runs", disable=not progress, leave=False):
        out[run.arm.name].append(run.result)
    return out


# --------------------------------------------------------------------------------------------------------------
# Summary statistics (paper eq. 8-10) and the paired prompt bootstrap
# --------------------------------------------------------------------------------------------------------------

def speedup_ratios(arm: Sequence[GenerationResult], ar: Sequence[GenerationResult]) -> np.ndarray:
    """Per-prompt throughput ratios (n_a/t_a) / (n_AR/t_AR), prefill included; their mean is S of eq. (8)."""
    if len(arm) != len(ar):
        raise ValueError(f"paired runs differ in length: {len(arm)} vs {len(ar)} prompts")
    return metrics.throughput_ratios([r.stats.new_tokens for r in arm], [r.stats.wall_time for r in arm],
                                     [r.stats.new_tokens for r in ar], [r.stats.wall_time for r in ar])


def bootstrap_ci(values: np.ndarray, den: np.ndarray | None = None, seed: int = 0) -> tuple[float, float]:
    """95% prompt-bootstrap interval (bench.metrics' resampling): of the mean of per-prompt ``values``, or with
    ``den`` of the pooled ratio sum(values) / sum(den) (e.g. matches over positions).  NaNs under 2 prompts."""
    values = np.asarray(values, dtype=float)
    if len(values) < 2:
        return float("nan"), float("nan")
    if den is None:
        return metrics.bootstrap_ci(values, seed=seed)
    idx = metrics.bootstrap_indices(len(values), metrics.N_RESAMPLES, np.random.default_rng(seed))
    stats = values[idx].sum(1) / np.asarray(den, dtype=float)[idx].sum(1)
    lo, hi = np.quantile(stats, [0.025, 0.975])
    return float(lo), float(hi)


def _mean(per_prompt: list) -> float:
    m = metrics.mean_over_prompts(per_prompt)
    return float("nan") if m is None else float(m)


def mean_A(results: Sequence[GenerationResult]) -> float:
    """A = mean over prompts of A_p (eq. 9), prompts without verification events skipped."""
    return _mean([metrics.accepted_length(r.stats.accepted) for r in results])


def mean_G(results: Sequence[GenerationResult]) -> float:
    """G = mean over prompts of G_p (eq. 10)."""
    return _mean([metrics.committed_progress(r.stats.accepted, r.stats.target_tokens) for r in results])


def same_tokens(results: Sequence[GenerationResult], reference: Sequence[GenerationResult]) -> int:
    """How many prompts produced exactly the reference's tokens (greedy target preservation)."""
    return sum(a.tokens == b.tokens for a, b in zip(results, reference))


# --------------------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------------------

def _fmt(v) -> str:
    if isinstance(v, float):
        if v != v:
            return "-"
        return f"{v:.4f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def markdown_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_csv(path: Path, rows: Sequence[dict]) -> None:
    columns: list[str] = []
    for r in rows:
        columns += [c for c in r if c not in columns]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)


def write_report(out: str | os.PathLike, name: str, title: str, setup: dict, sections: Sequence[tuple[str, str]],
                 csv_rows: Sequence[dict]) -> Path:
    """``name``.md (title, setup, markdown sections) and ``name``.csv into ``out``; returns the folder."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    md = [f"# {title}", "", "Setup: " + "; ".join(f"{k} = {v}" for k, v in setup.items()), ""]
    for heading, body in sections:
        if heading:
            md += [f"## {heading}", ""]
        md += [body, ""]
    md.append(f"Plot: `{name}.png`; all rows: `{name}.csv`.")
    (folder / f"{name}.md").write_text("\n".join(md) + "\n")
    write_csv(folder / f"{name}.csv", csv_rows)
    return folder


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib                   # lazy: matplotlib is slow to import; only the plots need it
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt     # lazy: as above
    return plt


def model_setup(model: LoopedLM, num_steps: int | None, **extra) -> dict:
    cfg = model.config
    setup = {"model": model.source or "(in-memory)", "family": cfg.family,
             "R": model.depth(num_steps),
             "layers (prelude/core/coda)": f"{cfg.n_prelude}/{cfg.n_core}/{cfg.n_coda}",
             "device": str(model.device), "dtype": str(model.dtype).replace("torch.", "")}
    setup.update(extra)
    return setup
