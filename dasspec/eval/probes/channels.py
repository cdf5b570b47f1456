"""Depth-dependent channel replacement (paper sec. 3.1, Appendix C.1, Table 6, Figure 2 bottom).

Along the full-depth target's own greedy trajectory (teacher-forced), a depth-d draft at every anchor position
predicts the next token while reading the verified prefix under one of the four policies of eq. (4):

    Aligned (r, r)   Deep V (r, R)   Deep K (R, r)   Deep K/V (R, R)

Agreement is the fraction of positions where the draft's argmax equals the full-depth target's.  Positions are the
anchors of the generated continuation (N-1 per prompt of N new tokens; see teacher.scored_rows).  Intervals are
95% prompt-bootstrap intervals; "gain" is the paired difference to Aligned at the same depth.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from tqdm.auto import tqdm

from ...model.looped import LoopedLM
from .common import Trajectory, bootstrap_ci, markdown_table, pyplot, write_report
from .teacher import TeacherForced, scored_rows

POLICIES = ("aligned", "deep-v", "deep-k", "deep-kv")
LABELS = {"aligned": "Aligned", "deep-v": "Deep V", "deep-k": "Deep K", "deep-kv": "Deep K/V"}
DEFAULT_DEPTHS = (1, 2, 4, 8)


def default_depths(R: int) -> list[int]:
    return [d for d in DEFAULT_DEPTHS if d <= R]


def check_depths(depths: Sequence[int], R: int) -> list[int]:
    depths = [int(d) for d in depths]
    bad = [d for d in depths if not 1 <= d <= R]
    if bad or not depths:
        raise ValueError(f"draft depths must lie in 1..R={R}, got {depths}")
    return depths


def agreement_counts(model: LoopedLM, trajectories: Sequence[Trajectory], cells: Sequence[tuple[int, object]],
                     num_steps: int | None = None, init_scale: float = 1.0, seed: int = 0, coda: str = "target",
                     progress: bool = True, desc: str = "drafts") -> tuple[np.ndarray, np.ndarray, int]:
    """For each (draft depth, read policy) cell: matches and positions per trajectory, arrays [cells, prompts];
    plus how many scored positions' teacher-forced target argmax differs from the greedy AR token (0 unless the
    parallel and incremental passes round differently at a near-tie)."""
    hits = np.zeros((len(cells), len(trajectories)), dtype=np.int64)
    total = np.zeros_like(hits)
    forced_mismatch = 0
    for p, traj in enumerate(tqdm(trajectories, desc=desc, disable=not progress, leave=False)):
        tf = TeacherForced(model, traj.tokens[:-1], num_steps, init_scale, seed)
        rows = scored_rows(traj.prompt_len, len(traj.tokens))
        forced_mismatch += int((tf.target[rows.start: rows.stop] != traj.tokens[rows.start + 1:]).sum())
        for c, (d, policy) in enumerate(cells):
            hits[c, p], total[c, p] = tf.agreement(d, policy, rows, coda)
    return hits, total, forced_mismatch


def run(model: LoopedLM, trajectories: Sequence[Trajectory], depths: Sequence[int] | None = None,
        policies: Sequence[str] = POLICIES, num_steps: int | None = None, init_scale: float = 1.0, seed: int = 0,
        coda: str = "target", progress: bool = True) -> list[dict]:
    """One row per (policy, draft depth): agreement with prompt-bootstrap interval, and the paired gain over
    Aligned at the same depth."""
    R = model.depth(num_steps)
    depths = check_depths(default_depths(R) if depths is None else depths, R)
    cells = [(d, pol) for pol in policies for d in depths]
    hits, total, mismatch = agreement_counts(model, trajectories, cells, R, init_scale, seed, coda, progress,
                                             "channels")
    n = int(total[0].sum())
    if n == 0:
        raise ValueError("no positions to score: every trajectory has fewer than 2 new tokens")
    rows = []
    for c, (d, pol) in enumerate(cells):
        lo, hi = bootstrap_ci(hits[c], total[c])
        row = {"policy": pol, "d": d, "agreement": float(hits[c].sum() / n), "ci_low": lo, "ci_high": hi,
               "matches": int(hits[c].sum()), "positions": n, "prompts": len(trajectories), "coda": coda,
               "forced_vs_ar_mismatch": mismatch}
        if "aligned" in policies and pol != "aligned":
            a = cells.index((d, "aligned"))
            row["gain_vs_aligned"] = float((hits[c].sum() - hits[a].sum()) / n)
            row["gain_ci_low"], row["gain_ci_high"] = bootstrap_ci(hits[c] - hits[a], total[c])
        rows.append(row)
    return rows


def pivot(rows: list[dict], value: str = "agreement") -> list[dict]:
    """Policies as rows, depths as columns (the paper's Table 6 layout)."""
    out = []
    for pol in dict.fromkeys(r["policy"] for r in rows):
        out.append({"policy": LABELS.get(pol, pol),
                    **{f"d={r['d']}": r[value] for r in rows if r["policy"] == pol}})
    return out


def write(rows: list[dict], out, setup: dict) -> None:
    depths = list(dict.fromkeys(r["d"] for r in rows))
    table = markdown_table(pivot(rows), ["policy"] + [f"d={d}" for d in depths])
    detail = markdown_table(rows, ["policy", "d", "agreement", "ci_low", "ci_high", "gain_vs_aligned",
                                   "gain_ci_low", "gain_ci_high", "matches", "positions"])
    n, p = rows[0]["positions"], rows[0]["prompts"]
    note = (f"{n} next-token positions from {p} prompts (anchors of the greedy continuation; teacher-forced target "
            f"differs from the AR token at {rows[0]['forced_vs_ar_mismatch']} of them).  Prefix coda K/V: "
            + ("full-depth target's (as in the decoders)." if rows[0]["coda"] == "target"
               else "from the prefix's synchronous depth-d states (Aligned = plain depth-d forward)."))
    write_report(out, "channels", "Draft-target agreement under prefix-channel replacement", setup,
                 [("", note), ("Agreement (Table 6 layout)", table),
                  ("With 95% prompt-bootstrap intervals and paired gains over Aligned", detail)], rows)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    pols = list(dict.fromkeys(r["policy"] for r in rows))
    for i, pol in enumerate(pols):
        rr = [r for r in rows if r["policy"] == pol]
        x = [r["d"] * 2 ** (0.06 * (i - (len(pols) - 1) / 2)) for r in rr]     # side by side, not on top
        y = [r["agreement"] for r in rr]
        err = [[r["agreement"] - r["ci_low"] for r in rr], [r["ci_high"] - r["agreement"] for r in rr]]
        ax.errorbar(x, y, yerr=np.nan_to_num(np.array(err)), marker="o", ms=4, capsize=3, label=LABELS.get(pol, pol))
    ax.set_xscale("log", base=2)
    ax.set_xticks(depths, [str(d) for d in depths])
    ax.set_xlabel("draft depth d")
    ax.set_ylabel("draft-target agreement")
    ax.set_title(f"Prefix-channel replacement ({n} positions)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(f"{out}/channels.png", dpi=130)
    plt.close(fig)
