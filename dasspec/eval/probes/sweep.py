"""Refinement-budget sweeps (paper sec. 4.4, Appendix D, Tables 11-12, Figure 3): DAS-Wave speedup over paired
full-depth AR and accepted length A against the updates per round k, the verifier capacity gamma and the initial
active width W_init, one knob at a time around a base schedule (the family defaults of Table 5 unless overridden).

Speedup is S of eq. (8): the mean over prompts of the throughput ratio to the AR run on the same prompt, in the same
process, interleaved with the other arms (common.run_paired); intervals are 95% prompt bootstraps.  Every arm's
tokens are compared with AR's (greedy target preservation).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ...model.looped import LoopedLM
from .common import (Arm, bootstrap_ci, markdown_table, mean_A, mean_G, pyplot, run_paired, same_tokens,
                     speedup_ratios, write_report)

KNOBS = ("k", "gamma", "w_init")
SYMBOL = {"k": "k", "gamma": "gamma", "w_init": "W_init"}


def arm_name(knobs: dict) -> str:
    name = f"gamma={knobs['gamma']},J={knobs['rounds']},W_init={knobs['w_init']},k={knobs['k']}"
    name += f",guesses={knobs['guesses']}" if knobs.get("guesses", "anchor") != "anchor" else ""
    name += ",trim" if knobs.get("trim") else ""
    name += f",seed_branch={knobs['seed_branch']}" if knobs.get("seed_branch") else ""
    name += ",copy_run" if knobs.get("copy_run") else ""
    return name + (",early_stop" if knobs.get("early_stop") else "")


def plan(base: dict, values: dict[str, Sequence[int]]) -> list[tuple[str, int, dict]]:
    """(swept knob, value, full knobs) for each one-knob variation of ``base``; W_init must not exceed gamma."""
    out = []
    for knob in KNOBS:
        for v in values.get(knob, ()):
            knobs = {**base, knob: int(v)}
            if knobs["w_init"] > knobs["gamma"]:
                raise ValueError(f"sweep point {SYMBOL[knob]}={v}: W_init ({knobs['w_init']}) exceeds gamma "
                                 f"({knobs['gamma']})")
            out.append((knob, int(v), knobs))
    if not out:
        raise ValueError("nothing to sweep")
    return out


def run(model: LoopedLM, prompts: Sequence[Sequence[int]], max_new_tokens: int, base: dict,
        values: dict[str, Sequence[int]], num_steps: int | None = None, init_scale: float = 1.0, seed: int = 0,
        progress: bool = True) -> list[dict]:
    """One row per sweep point (the base schedule appears once per swept knob, from the same runs)."""
    points = plan(base, values)
    arms = {arm_name(kn): Arm(arm_name(kn), "das-wave", kn) for _, _, kn in points}
    res = run_paired(model, prompts, list(arms.values()), max_new_tokens, num_steps, init_scale, seed, progress)
    ar = res["ar"]
    ar_tps = float(np.mean([r.stats.tokens_per_second for r in ar]))
    rows = []
    for knob, v, kn in points:
        name = arm_name(kn)
        ratios = speedup_ratios(res[name], ar)
        lo, hi = bootstrap_ci(ratios)
        rows.append({"sweep": SYMBOL[knob], "value": v, "speedup": float(ratios.mean()), "ci_low": lo, "ci_high": hi,
                     "A": mean_A(res[name]), "G": mean_G(res[name]),
                     "tokens_per_s": float(np.mean([r.stats.tokens_per_second for r in res[name]])),
                     "ar_tokens_per_s": ar_tps, "same_tokens_as_ar": same_tokens(res[name], ar),
                     "prompts": len(prompts), **kn})
    return rows


def write(rows: list[dict], out, setup: dict) -> None:
    cols = ["value", "speedup", "ci_low", "ci_high", "A", "G", "tokens_per_s", "same_tokens_as_ar"]
    sweeps = list(dict.fromkeys(r["sweep"] for r in rows))
    sections = []
    for s in sweeps:
        rr = [r for r in rows if r["sweep"] == s]
        fixed = ", ".join(f"{SYMBOL.get(k, k)}={rr[0][k]}" for k in ("gamma", "rounds", "w_init", "k")
                          if SYMBOL.get(k, k) != s)
        sections.append((f"{s} (fixed: {fixed})", markdown_table(rr, cols)))
    lossless = all(r["same_tokens_as_ar"] == r["prompts"] for r in rows)
    note = (f"{rows[0]['prompts']} prompts; full-depth AR at {rows[0]['ar_tokens_per_s']:.1f} tokens/s.  Every arm's "
            + ("tokens equal AR's on every prompt." if lossless else
               "tokens differ from AR's on some prompts (see same_tokens_as_ar) - a numerical near-tie or a bug."))
    write_report(out, "sweep", "DAS-Wave refinement-budget sweeps: speedup and accepted length", setup,
                 [("", note)] + sections, rows)
    plt = pyplot()
    fig, axes = plt.subplots(2, len(sweeps), figsize=(3.4 * len(sweeps), 5.2), squeeze=False)
    for j, s in enumerate(sweeps):
        rr = [r for r in rows if r["sweep"] == s]
        x = [r["value"] for r in rr]
        err = np.nan_to_num(np.array([[r["speedup"] - r["ci_low"] for r in rr],
                                      [r["ci_high"] - r["speedup"] for r in rr]]))
        axes[0, j].errorbar(x, [r["speedup"] for r in rr], yerr=err, marker="o", capsize=3)
        axes[0, j].axhline(1.0, color="gray", lw=0.8, ls="--")          # AR
        axes[1, j].plot(x, [r["A"] for r in rr], marker="s", color="tab:orange")
        for ax in axes[:, j]:
            ax.set_xscale("log", base=2)
            ax.set_xticks(x, [str(v) for v in x])
            ax.grid(alpha=0.3)
        axes[1, j].set_xlabel(s)
    axes[0, 0].set_ylabel("speedup over AR")
    axes[1, 0].set_ylabel("accepted length A")
    fig.suptitle("DAS-Wave refinement cost vs acceptance", fontsize=10)
    fig.tight_layout()
    fig.savefig(f"{out}/sweep.png", dpi=130)
    plt.close(fig)
