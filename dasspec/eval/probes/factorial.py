"""Carry / Deep K / Deep V factorial (paper Appendix C.4, Table 9, eq. 10-11).

DAS-Wave runs on the same prompts at one fixed drafting budget (gamma, J, W_init, k) for all eight combinations
of latent carry c, mature prefix keys d_K and mature prefix values d_V (read policies Aligned, Deep V, Deep K,
Deep K/V; under DAS-Wave the "draft depth" of a depth-relative read is the wave clock, see decoders/wave.py).
Y_{c,dK,dV} is the committed progress G (eq. 10: mean committed tokens per verification, per prompt, then averaged
over prompts), and

    E_cKV = 1/4 [ (Y111 - Y110 - Y101 + Y100) - (Y011 - Y010 - Y001 + Y000) ]          (eq. 11)

is positive when carry strengthens the complementarity of mature K and V.  Its interval is a prompt bootstrap of
the per-prompt contrast (E is linear in the per-prompt G values).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from tqdm.auto import tqdm

from ...engine.api.generate import generate
from ...model.looped import LoopedLM
from .common import bootstrap_ci, markdown_table, pyplot, write_report

POLICY = {(0, 0): "aligned", (0, 1): "deep-v", (1, 0): "deep-k", (1, 1): "deep-kv"}
COMBOS = [(c, k, v) for c in (0, 1) for k in (0, 1) for v in (0, 1)]


def interaction(Y: dict[tuple[int, int, int], float | np.ndarray]) -> float | np.ndarray:
    """E_cKV of eq. (11) from the eight cell values Y[(c, dK, dV)] (scalars or per-prompt arrays)."""
    return 0.25 * ((Y[1, 1, 1] - Y[1, 1, 0] - Y[1, 0, 1] + Y[1, 0, 0])
                   - (Y[0, 1, 1] - Y[0, 1, 0] - Y[0, 0, 1] + Y[0, 0, 0]))


def run(model: LoopedLM, prompts: Sequence[Sequence[int]], max_new_tokens: int, gamma: int, rounds: int,
        w_init: int, k: int, guesses: str = "anchor", trim: bool = False, seed_branch: int = 0,
        copy_run: bool = False, early_stop: bool = False, num_steps: int | None = None,
        init_scale: float = 1.0, seed: int = 0, progress: bool = True) -> tuple[list[dict], dict]:
    """Rows per (carry, dK, dV) with G, A and per-prompt G values; and a summary with E_cKV and its interval."""
    budget = dict(gamma=gamma, rounds=rounds, w_init=w_init, k=k, guesses=guesses, trim=trim, seed_branch=seed_branch,
                  copy_run=copy_run, early_stop=early_stop)
    G = np.zeros((len(COMBOS), len(prompts)))
    A = np.zeros_like(G)
    tokens = np.zeros_like(G)
    bar = tqdm(total=len(COMBOS) * len(prompts), desc="factorial", disable=not progress, leave=False)
    for p, prompt in enumerate(prompts):
        for i, (c, dk, dv) in enumerate(COMBOS):
            res = generate(model, list(prompt), method="das-wave", max_new_tokens=max_new_tokens,
                           num_steps=num_steps, init_scale=init_scale, seed=seed, carry=bool(c),
                           policy=POLICY[dk, dv], **budget)
            if not res.stats.verify_events:
                raise ValueError(f"prompt {p} stopped at prefill (no verification); G is undefined - raise "
                                 "--max-new-tokens or use other prompts")
            G[i, p], A[i, p], tokens[i, p] = res.stats.G, res.stats.A, res.stats.new_tokens
            bar.update()
    bar.close()
    rows = [{"carry": c, "deep_k": dk, "deep_v": dv, "policy": POLICY[dk, dv], "G": float(G[i].mean()),
             "A": float(A[i].mean()), "new_tokens": float(tokens[i].mean()), "prompts": len(prompts),
             **budget, "G_per_prompt": " ".join(f"{g:.3f}" for g in G[i])}
            for i, (c, dk, dv) in enumerate(COMBOS)]
    per_prompt = interaction({cell: G[i] for i, cell in enumerate(COMBOS)})
    lo, hi = bootstrap_ci(per_prompt)
    summary = {"E_cKV": float(per_prompt.mean()), "E_ci_low": lo, "E_ci_high": hi,
               "E_positive_prompts": int((per_prompt > 0).sum()), "prompts": len(prompts)}
    return rows, summary


def write(rows: list[dict], summary: dict, out, setup: dict) -> None:
    cols = ["carry", "deep_k", "deep_v", "policy", "G", "A", "new_tokens"]
    E = summary
    note = (f"E_cKV = {E['E_cKV']:.3f} tokens (95% prompt bootstrap [{E['E_ci_low']:.3f}, {E['E_ci_high']:.3f}]; "
            f"positive on {E['E_positive_prompts']} of {E['prompts']} prompts).  Budget: gamma = {rows[0]['gamma']}, "
            f"J = {rows[0]['rounds']}, W_init = {rows[0]['w_init']}, k = {rows[0]['k']}, "
            f"guesses = {rows[0]['guesses']}, trim = {rows[0]['trim']}.")
    csv_rows = rows + [{"carry": "E_cKV", "G": E["E_cKV"], "A": float("nan"),
                        "G_per_prompt": f"[{E['E_ci_low']:.4f}, {E['E_ci_high']:.4f}]"}]
    write_report(out, "factorial", "Carry x Deep K x Deep V factorial: committed progress G", setup,
                 [("", note), ("G per cell (Table 9 layout)", markdown_table(rows, cols))], csv_rows)
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(7.5, 3.4), sharey=True)
    Y = {(r["carry"], r["deep_k"], r["deep_v"]): r["G"] for r in rows}
    for ax, c in zip(axes, (0, 1)):
        for dv, style in ((0, "o--"), (1, "s-")):
            ax.plot([0, 1], [Y[c, 0, dv], Y[c, 1, dv]], style, label=f"Deep V = {dv}")
        ax.set_xticks([0, 1], ["K aligned", "Deep K"])
        ax.set_title("carry on" if c else "no carry")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("committed progress G (tokens / verification)")
    axes[1].legend()
    fig.suptitle(f"Carry x K x V factorial, E_cKV = {E['E_cKV']:.2f}", fontsize=10)
    fig.tight_layout()
    fig.savefig(f"{out}/factorial.png", dpi=130)
    plt.close(fig)
