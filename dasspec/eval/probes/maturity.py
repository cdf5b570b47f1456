"""Q/K/V maturity (paper sec. 3.1, Figure 2 top): how close each core layer's queries, keys and values at recurrence
depth r are to their final-depth (r = R) values.

For every prompt's greedy trajectory, one synchronous full-depth forward runs with forward hooks on the core layers'
attention, which record (q, k, v) at every recurrence step.  At each position the heads are flattened into
one vector and the cosine to the depth-R vector is taken; the table reports the mean over core layers, positions and
prompts (pooled), and the CSV also has each layer.

q and k are captured after RoPE.  RoPE rotates a position's q (or k) by the same angles at every depth, and a
rotation preserves inner products and norms, so these cosines equal the pre-RoPE ones (up to rounding).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ...model.looped import LoopedLM
from .common import Trajectory, markdown_table, pyplot, write_report

CHANNELS = ("q", "k", "v")


def cosine_to_final(xs: Sequence[Tensor]) -> Tensor:
    """xs: per depth r = 1..R a tensor [B, heads, T, hd] -> cosine of every depth's per-position vector (heads
    flattened) to the last depth's: [R, B*T]."""
    flat = torch.stack([x.transpose(1, 2).flatten(2).flatten(0, 1).float() for x in xs])   # [R, B*T, heads*hd]
    return torch.nn.functional.cosine_similarity(flat, flat[-1:], dim=-1)


def capture_qkv(model: LoopedLM, ids: Tensor, num_steps: int | None = None, init_scale: float = 1.0,
                seed: int = 0) -> list[list[tuple[Tensor, Tensor, Tensor]]]:
    """Run one synchronous forward; returns per core layer the list of (q, k, v) per recurrence step 1..R, read by
    forward hooks on the core layers' attention (which recompute the projections from the layer's input)."""
    captured: list[list] = [[] for _ in model.transformer.core_block]
    hooks = [blk.attn.register_forward_hook(lambda mod, args, out, sink=sink: sink.append(mod.qkv(args[0], args[1])))
             for blk, sink in zip(model.transformer.core_block, captured)]
    try:
        with torch.inference_mode():
            model(ids.reshape(1, -1), num_steps=num_steps, init_scale=init_scale, seed=seed)
        return captured
    finally:
        for h in hooks:
            h.remove()


def run(model: LoopedLM, trajectories: Sequence[Trajectory], num_steps: int | None = None, init_scale: float = 1.0,
        seed: int = 0, progress: bool = True) -> list[dict]:
    """Rows per depth r (layer = "mean") and per (layer, r): mean cosine of q, k and v to depth R."""
    R = model.depth(num_steps)
    L = model.config.n_core
    sums = torch.zeros(L, R, 3, dtype=torch.float64)
    count = 0
    for traj in tqdm(trajectories, desc="maturity", disable=not progress, leave=False):
        captured = capture_qkv(model, traj.tokens, R, init_scale, seed)
        for layer, steps in enumerate(captured):
            if len(steps) != R:
                raise RuntimeError(f"core layer {layer} recorded {len(steps)} calls, expected R={R}")
            for c in range(3):
                sums[layer, :, c] += cosine_to_final([s[c] for s in steps]).double().sum(-1).cpu()
        count += len(traj.tokens)
    if count == 0:
        raise ValueError("no positions to measure")
    means = sums / count                                       # [L, R, 3]
    rows = []
    for r in range(R):
        avg = means[:, r].mean(0)                              # every layer has the same positions: mean of means
        rows.append({"layer": "mean", "r": r + 1, **{f"cos_{ch}": float(avg[c]) for c, ch in enumerate(CHANNELS)},
                     "positions": count})
    for layer in range(L):
        for r in range(R):
            rows.append({"layer": layer, "r": r + 1,
                         **{f"cos_{ch}": float(means[layer, r, c]) for c, ch in enumerate(CHANNELS)},
                         "positions": count})
    return rows


def write(rows: list[dict], out, setup: dict) -> None:
    mean = [r for r in rows if r["layer"] == "mean"]
    R = len(mean)
    cols = ["r", "cos_q", "cos_k", "cos_v"]
    first = mean[0]
    order = sorted(CHANNELS, key=lambda ch: -first[f"cos_{ch}"])
    summary = (f"At r = 1 the mean cosine to depth R = {R} is q {first['cos_q']:.3f}, k {first['cos_k']:.3f}, "
               f"v {first['cos_v']:.3f} (most to least mature at r = 1: {' > '.join(order)}); "
               f"{first['positions']} positions x {sum(1 for r in rows if r['layer'] != 'mean') // R} core layers.")
    per_layer = [r for r in rows if r["layer"] != "mean" and r["r"] in (1, 2)]
    write_report(out, "maturity", "Q/K/V maturity: cosine similarity to the final recurrence", setup,
                 [("", summary), ("Mean over core layers, prompts and positions", markdown_table(mean, cols)),
                  ("Per core layer, r = 1 and 2", markdown_table(per_layer, ["layer"] + cols))], rows)
    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
    r = [row["r"] for row in mean]
    for ch, color in zip(CHANNELS, ("tab:blue", "tab:orange", "tab:green")):
        cos = [row[f"cos_{ch}"] for row in mean]
        ax.plot(r, cos, marker="o", ms=3, label=ch.upper(), color=color)
        gap = [max(1.0 - c, 1e-7) for c in cos[:-1]]                # depth R itself is 0 by definition
        ax2.plot(r[:-1], gap, marker="o", ms=3, label=ch.upper(), color=color)
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_xlabel("recurrence depth r")
        a.grid(alpha=0.3)
    ax.set_ylabel(f"cosine to r = R = {R}")
    ax.set_title("Q/K/V maturity (mean over core layers)", fontsize=10)
    ax2.set_yscale("log")
    ax2.set_ylabel("1 - cosine")
    ax2.set_title("distance from the final depth (log scale)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(f"{out}/maturity.png", dpi=130)
    plt.close(fig)
