"""Sequential proposal cost (paper Appendix E.2, Table 14): how much proposal time the sequential drafters spend
for their accepted length - depth-8 self-speculation with Aligned reads against depth-4 Mature-Spec with Deep K/V
reads (the paper finds similar A at about half the draft time).

Draft time is ``stats.draft_time``: proposal construction only, excluding prefill and target verification (CUDA
events on GPU, the wall clock on CPU).  Per request it is the mean over prompts; per output token the mean over
prompts of draft time / retained new tokens; per accepted token, total draft time / total accepted draft tokens.
Full-depth AR runs interleaved on the same prompts for the speedup column (eq. 8).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ...methods import resolve_knobs
from ...model.looped import LoopedLM
from .common import (Arm, bootstrap_ci, markdown_table, mean_A, pyplot, run_paired, same_tokens, speedup_ratios,
                     write_report)


def drafters(self_spec_depth: int, mature_depth: int, block: int | None, R: int) -> list[Arm]:
    for name, d in (("self-spec", self_spec_depth), ("mature-spec", mature_depth)):
        if not 1 <= d < R:
            raise ValueError(f"{name} draft depth {d} must lie in 1..R-1 (R={R})")
    b = {} if block is None else {"block": block}
    return [Arm(f"self-spec d={self_spec_depth}", "self-spec",
                {"draft_depth": self_spec_depth, "policy": "aligned", **b}),
            Arm(f"mature-spec d={mature_depth}", "mature-spec",
                {"draft_depth": mature_depth, "policy": "deep-kv", **b})]


def run(model: LoopedLM, prompts: Sequence[Sequence[int]], max_new_tokens: int, self_spec_depth: int = 8,
        mature_depth: int = 4, block: int | None = None, num_steps: int | None = None, init_scale: float = 1.0,
        seed: int = 0, progress: bool = True) -> list[dict]:
    R = model.depth(num_steps)
    arms = drafters(self_spec_depth, mature_depth, block, R)
    res = run_paired(model, prompts, arms, max_new_tokens, num_steps, init_scale, seed, progress)
    rows = []
    for arm in arms:
        rr = res[arm.name]
        draft = np.array([r.stats.draft_time for r in rr])
        new = np.array([r.stats.new_tokens for r in rr])
        accepted = sum(sum(r.stats.accepted) for r in rr)
        ratios = speedup_ratios(rr, res["ar"])
        lo, hi = bootstrap_ci(ratios)
        rows.append({"drafter": arm.method, "d": arm.knobs["draft_depth"], "policy": arm.knobs["policy"],
                     "block": resolve_knobs(model, arm.method, arm.knobs, R).block,
                     "A": mean_A(rr), "draft_ms_per_request": float(draft.mean() * 1e3),
                     "draft_ms_per_token": float((draft / np.maximum(new, 1)).mean() * 1e3),
                     "draft_ms_per_accepted_token": float(draft.sum() / accepted * 1e3) if accepted else float("nan"),
                     "draft_passes_per_request": float(np.mean([r.stats.draft_passes for r in rr])),
                     "speedup": float(ratios.mean()), "ci_low": lo, "ci_high": hi,
                     "same_tokens_as_ar": same_tokens(rr, res["ar"]), "new_tokens": float(new.mean()),
                     "prompts": len(prompts)})
    return rows


def write(rows: list[dict], out, setup: dict) -> None:
    cols = ["drafter", "d", "policy", "block", "A", "draft_ms_per_request", "draft_ms_per_token",
            "draft_ms_per_accepted_token", "speedup", "ci_low", "ci_high", "same_tokens_as_ar"]
    a, b = rows
    note = (f"{a['prompts']} prompts, {a['new_tokens']:.0f} new tokens per request on average.  "
            f"{b['drafter']} (d={b['d']}) spends {b['draft_ms_per_request'] / a['draft_ms_per_request']:.2f}x the "
            f"draft time per request of {a['drafter']} (d={a['d']}) at A = {b['A']:.2f} vs {a['A']:.2f}.  "
            "`block` is the draft block length b (the family default unless --block).")
    write_report(out, "cost", "Sequential proposal cost at similar accepted length", setup,
                 [("", note), ("Proposal cost (Table 14 layout)", markdown_table(rows, cols))], rows)
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(7.5, 3.2))
    names = [f"{r['drafter']}\nd={r['d']}" for r in rows]
    for ax, key, title in ((axes[0], "draft_ms_per_request", "draft ms / request"),
                           (axes[1], "draft_ms_per_token", "draft ms / output token")):
        bars = ax.bar(names, [r[key] for r in rows], color=["tab:gray", "tab:green"])
        for bar, r in zip(bars, rows):
            ax.annotate(f"A={r['A']:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_ylim(0, 1.15 * max(r[key] for r in rows))          # room for the A labels
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(f"{out}/cost.png", dpi=130)
    plt.close(fig)
