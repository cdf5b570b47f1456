"""Prefix read-depth grid (paper Appendix C.1, Figure 4): draft-target agreement at a fixed draft depth r over the
verified prefix's key depth d_K x value depth d_V.

Axis entries are read depths: an integer reads the prefix at that depth at every draft step; "r" reads at the draft
step's own depth (step j reads depth j: Aligned's channel); "R" is full depth.  So the corners ("r"|"R") x ("r"|"R")
are exactly Aligned, Deep V, Deep K and Deep K/V of eq. (4), and the probe follows the same teacher-forced protocol
as the channel probe (channels.py).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ...model.looped import LoopedLM
from .channels import agreement_counts
from .common import Trajectory, markdown_table, pyplot, write_report


def default_axis(R: int) -> list:
    """"r", then 1, 2, 4, ... up to R, then R."""
    ax: list = ["r"]
    d = 1
    while d < R:
        ax.append(d)
        d *= 2
    return ax + ["R"]


def parse_axis(spec: str | Sequence, R: int) -> list:
    items = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else list(spec)
    out: list = []
    for it in items:
        if it in ("r", "R"):
            out.append(it)
            continue
        try:
            d = int(it)
        except (TypeError, ValueError):
            raise ValueError(f"grid depth {it!r}: expected r, R or an integer") from None
        if not 1 <= d <= R:
            raise ValueError(f"grid depth {d} outside 1..R={R}")
        out.append(d)
    if not out:
        raise ValueError("empty grid axis")
    return out


def label(spec, R: int) -> str:
    return "r (step)" if spec == "r" else f"R={R}" if spec == "R" else str(spec)


def run(model: LoopedLM, trajectories: Sequence[Trajectory], draft_depth: int = 2, k_axis: Sequence | None = None,
        v_axis: Sequence | None = None, num_steps: int | None = None, init_scale: float = 1.0, seed: int = 0,
        coda: str = "target", progress: bool = True) -> list[dict]:
    """One row per (d_K, d_V) cell: agreement of the depth-``draft_depth`` draft with the full-depth target."""
    R = model.depth(num_steps)
    if not 1 <= draft_depth <= R:
        raise ValueError(f"draft depth {draft_depth} outside 1..R={R}")
    k_axis = parse_axis(default_axis(R) if k_axis is None else k_axis, R)
    v_axis = parse_axis(default_axis(R) if v_axis is None else v_axis, R)
    cells = [(draft_depth, (k, v)) for k in k_axis for v in v_axis]
    hits, total, mismatch = agreement_counts(model, trajectories, cells, R, init_scale, seed, coda, progress, "grid")
    n = int(total[0].sum())
    if n == 0:
        raise ValueError("no positions to score: every trajectory has fewer than 2 new tokens")
    return [{"draft_depth": draft_depth, "d_K": str(k), "d_V": str(v), "agreement": float(hits[c].sum() / n),
             "matches": int(hits[c].sum()), "positions": n, "prompts": len(trajectories), "coda": coda,
             "forced_vs_ar_mismatch": mismatch}
            for c, (_, (k, v)) in enumerate(cells)]


def matrix(rows: list[dict]) -> tuple[list[str], list[str], np.ndarray]:
    ks = list(dict.fromkeys(r["d_K"] for r in rows))
    vs = list(dict.fromkeys(r["d_V"] for r in rows))
    m = np.full((len(ks), len(vs)), np.nan)
    for r in rows:
        m[ks.index(r["d_K"]), vs.index(r["d_V"])] = r["agreement"]
    return ks, vs, m


def write(rows: list[dict], out, setup: dict) -> None:
    R = int(setup["R"])
    ks, vs, m = matrix(rows)
    table = [{"d_K \\ d_V": label(k, R), **{label(v, R): m[i, j] for j, v in enumerate(vs)}} for i, k in enumerate(ks)]
    r0 = rows[0]
    note = (f"Draft depth r = {r0['draft_depth']}; {r0['positions']} positions from {r0['prompts']} prompts.  "
            "'r (step)' reads the prefix at the draft step's own depth (Aligned's channel), an integer reads that "
            f"depth at every step, R={R} is full depth.  Row = key depth d_K, column = value depth d_V.  Range of "
            f"the V axis at aligned K: {np.nanmin(m[0]):.4f}..{np.nanmax(m[0]):.4f}; range of the K axis at aligned "
            f"V: {np.nanmin(m[:, 0]):.4f}..{np.nanmax(m[:, 0]):.4f}.")
    write_report(out, "grid", "Prefix read-depth grid: agreement over K depth x V depth", setup,
                 [("", note), ("Agreement", markdown_table(table, ["d_K \\ d_V"] + [label(v, R) for v in vs]))], rows)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(1.0 + 0.75 * len(vs), 1.0 + 0.6 * len(ks)))
    im = ax.imshow(m, cmap="viridis", aspect="auto")
    for i in range(len(ks)):
        for j in range(len(vs)):
            ax.text(j, i, f"{m[i, j]:.3f}", ha="center", va="center", fontsize=7,
                    color="white" if m[i, j] < np.nanmean(m) else "black")
    ax.set_xticks(range(len(vs)), [label(v, R) for v in vs], fontsize=8)
    ax.set_yticks(range(len(ks)), [label(k, R) for k in ks], fontsize=8)
    ax.set_xlabel("prefix V depth d_V")
    ax.set_ylabel("prefix K depth d_K")
    ax.set_title(f"Agreement at draft depth r = {r0['draft_depth']}", fontsize=9)
    fig.colorbar(im, ax=ax, shrink=0.8)
    fig.tight_layout()
    fig.savefig(f"{out}/grid.png", dpi=130)
    plt.close(fig)
