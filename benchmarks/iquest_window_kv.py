"""IQuest-Loop's windowed depths in the engine's pool (issue 53: "IQuest's loop-2 window: blocks past it freed for
that depth, and the memory this saves measured"): the depth cache a request holds with ``window_kv`` (a row holds one
depth; depth 2's rows in a ring of a few blocks per request) against the full layout (every depth of every row),
and what it costs in speed, side by side in one run.

    python benchmarks/iquest_window_kv.py --out runs/iquest-window-kv [--model /tmp/iquest-mid]

1. The published 40B-Loop shape (``iquest_real.PUBLISHED``: 80 layers x 2 loops, 8 key-value heads of 128, window
   64), bfloat16, from the pool's own arithmetic (``bytes_per_token``, ``ring_blocks``): K/V bytes one request holds
   at contexts of 1K-128K positions under the default method's widest call, full against windowed.
2. Measured on the mid-size random IQuest-Loop of ``iquest_vllm.py`` (width 512, 8 layers x 2 loops, window 64,
   vocabulary 76,800), float32: ``--prompts`` random prompts of ``--prompt-len`` ids and ``--max-new-tokens``
   greedy tokens (EOS ignored) at batch ``--batch``, method AR and the default (auto); per side the most pool bytes
   in use over the run (the blocks the requests held at once, rings included) and tok/s.  Rounds alternate the
   sides; ratios per round, median and range.  Tokens must be equal (asserted).
3. ``--shared-prefix N``: the prompts start with the same N ids (a system prompt), and a third side runs the windowed
   pool with prompt sharing kept off (each request its own ``state_seed``, which enters the block keys and not
   IQuest's computation: the pool as it was before windowed pools shared).  Per side also the prompt rows computed
   and taken from shared blocks, and the mean time to first token.

Writes results.json, results.md and memory.png to --out; asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def published_table(contexts: list[int]) -> list[dict]:
    import torch
    from dasspec.engine.core.blocks import BLOCK_SIZE, call_rows, ring_blocks
    from dasspec.model.cache import bytes_per_token
    from dasspec.model.families import get_family
    from iquest_real import PUBLISHED
    cfg = get_family("iquest-loop").read_config(dict(PUBLISHED))
    R, w, B = cfg.mean_recurrence, cfg.loop_window, BLOCK_SIZE
    full = bytes_per_token(cfg, R, torch.bfloat16)
    one = bytes_per_token(cfg, R, torch.bfloat16, w)
    rows = []
    for width in (17, 81):                       # DAS-Wave's (auto's widest arm) and Token Recycling's verifier
        ring = ring_blocks(w, R, B, call_rows(B, width)) * B
        for ctx in contexts:
            held = -(-ctx // B) * B
            rows.append(dict(context=ctx, width=width, full_bytes=held * full,
                             window_bytes=(held + ring) * one, ring_rows=ring))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="/tmp/iquest-mid")
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=384)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--methods", default="ar,auto")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shared-prefix", type=int, default=0, help="ids every prompt starts with (<= --prompt-len)")
    a = p.parse_args(argv)

    import torch
    torch.set_num_threads(a.threads)
    import dasspec
    from dasspec.engine.api.engine import Engine
    from iquest_vllm import MID, build

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    table = published_table([1024, 8192, 32768, 131072])

    folder = Path(a.model)
    if not (folder / "config.json").exists():
        build(folder)
    model = dasspec.load_model(folder, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    if not 0 <= a.shared_prefix <= a.prompt_len:
        p.error("--shared-prefix must be between 0 and --prompt-len")
    common = torch.randint(3, MID["vocab_size"], (a.shared_prefix,), generator=g).tolist()
    prompts = [common + torch.randint(3, MID["vocab_size"], (a.prompt_len - a.shared_prefix,), generator=g).tolist()
               for _ in range(a.prompts)]
    budget = a.batch * (a.prompt_len + a.max_new_tokens + 128)
    # side -> (window_kv, every request's blocks keyed apart: no sharing)
    SIDES = {"full layout": (False, False), "windowed": (True, False), "windowed, sharing off": (True, True)}

    def run(method: str, side: str) -> dict:
        window_kv, apart = SIDES[side]
        eng = Engine(model, method, max_batch=a.batch, kv_budget=budget, window_kv=window_kv)
        t = time.perf_counter()
        ids = [eng.add(q, max_new_tokens=a.max_new_tokens, eos=False, state_seed=i if apart else 0)
               for i, q in enumerate(prompts)]
        peak, first = 0, {}
        while eng.has_work:
            for ev in eng.step():
                if ev.tokens and ev.id not in first:
                    first[ev.id] = time.perf_counter() - t
            peak = max(peak, eng.pool.in_use)
        seconds = time.perf_counter() - t
        toks = [eng.result(i).tokens for i in ids]
        return dict(seconds=seconds, tokens=toks, peak_bytes=peak * eng.pool.bytes_per_block,
                    pool_bytes=eng.pool.num_blocks * eng.pool.bytes_per_block,
                    prefilled_rows=eng.scheduler.prefilled_rows, shared_rows=eng.scheduler.shared_rows,
                    ttft=statistics.mean(first.values()))

    methods = a.methods.split(",")
    kinds = list(SIDES) if a.shared_prefix else ["full layout", "windowed"]
    sides = [(m, w) for m in methods for w in kinds]
    for m in methods:                                       # warm-up
        run(m, "windowed")
    records = []
    for rnd in range(a.rounds):
        for m, w in (sides if rnd % 2 == 0 else sides[::-1]):
            r = run(m, w)
            r.update(method=m, side=w, round=rnd, tokens_per_second=a.prompts * a.max_new_tokens / r["seconds"])
            records.append(r)
            print(f"round {rnd} {m:5s} {w:21s} {r['tokens_per_second']:6.2f} tok/s  "
                  f"peak K/V {r['peak_bytes'] / 2**20:7.1f} MiB  prompt rows computed {r['prefilled_rows']} "
                  f"shared {r['shared_rows']}  mean TTFT {r['ttft']:.2f} s", flush=True)
    ref = next(r["tokens"] for r in records if r["method"] == "ar" and r["side"] == "full layout")
    assert all(r["tokens"] == ref for r in records), "windowed and full layouts emitted different tokens"

    summary = {}
    for m in methods:
        pairs = []
        for rnd in range(a.rounds):
            on, off = (next(r for r in records if r["method"] == m and r["side"] == side and r["round"] == rnd)
                       for side in ("windowed", "full layout"))
            pairs.append((on["tokens_per_second"] / off["tokens_per_second"], on["peak_bytes"] / off["peak_bytes"],
                          on["peak_bytes"], off["peak_bytes"]))
        sp = [x[0] for x in pairs]
        summary[m] = dict(speed_median=statistics.median(sp), speed_range=[min(sp), max(sp)],
                          peak_ratio=pairs[0][1], peak_window=pairs[0][2], peak_full=pairs[0][3])
        for w in kinds:
            rs = [r for r in records if r["method"] == m and r["side"] == w]
            summary[m][w] = dict(
                prefilled_rows=rs[0]["prefilled_rows"], shared_rows=rs[0]["shared_rows"],
                peak_bytes=rs[0]["peak_bytes"], ttft_median=statistics.median(r["ttft"] for r in rs),
                tokens_per_second_median=statistics.median(r["tokens_per_second"] for r in rs))

    lines = ["# IQuest-Loop's windowed depths in the pool (`window_kv`)", "",
             "## The published 40B-Loop shape, bfloat16 (the pool's arithmetic)", "",
             "| context | verifier width | full layout | windowed | saved | ring rows |", "|---|---|---|---|---|---|"]
    for t in table:
        lines.append(f"| {t['context']:,} | {t['width']} | {t['full_bytes'] / 2**30:.2f} GiB | "
                     f"{t['window_bytes'] / 2**30:.2f} GiB | {1 - t['window_bytes'] / t['full_bytes']:.1%} | "
                     f"{t['ring_rows']} |")
    lines += ["", f"## Measured: mid-size IQuest-Loop, float32, {a.prompts} prompts x {a.prompt_len} ids + "
              f"{a.max_new_tokens} tokens, batch {a.batch}, {a.threads} threads, {a.rounds} rounds", "",
              "| method | peak K/V full | peak K/V windowed | windowed / full | speed windowed / full (median [range]) |",
              "|---|---|---|---|---|"]
    for m, s in summary.items():
        lines.append(f"| {m} | {s['peak_full'] / 2**20:.1f} MiB | {s['peak_window'] / 2**20:.1f} MiB | "
                     f"{s['peak_ratio']:.3f} | {s['speed_median']:.3f} [{s['speed_range'][0]:.3f}, "
                     f"{s['speed_range'][1]:.3f}] |")
    if a.shared_prefix:
        lines += ["", f"## Sharing a {a.shared_prefix}-id prefix (each side's medians over rounds)", "",
                  "| method | side | prompt rows computed | shared | peak K/V | mean TTFT | tok/s |",
                  "|---|---|---|---|---|---|---|"]
        for m in methods:
            for w in kinds:
                x = summary[m][w]
                lines.append(f"| {m} | {w} | {x['prefilled_rows']:,} | {x['shared_rows']:,} | "
                             f"{x['peak_bytes'] / 2**20:.1f} MiB | {x['ttft_median']:.2f} s | "
                             f"{x['tokens_per_second_median']:.2f} |")
    lines += ["", "Tokens equal in every run (asserted)."]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps(dict(args=vars(a), published=table, summary=summary, records=[
        {k: v for k, v in r.items() if k != "tokens"} for r in records]), indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for width, style in ((17, "-"), (81, "--")):
            ts = [t for t in table if t["width"] == width]
            ax.plot([t["context"] for t in ts], [t["full_bytes"] / 2**30 for t in ts], "k" + style,
                    label="full layout (every depth of every row)" if width == 17 else None)
            ax.plot([t["context"] for t in ts], [t["window_bytes"] / 2**30 for t in ts], "C0" + style,
                    label=f"windowed, verifier width {width}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("context (positions)")
        ax.set_ylabel("K/V of one request (GiB)")
        ax.set_title("IQuest-Coder-V1-40B-Loop, bfloat16")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "memory.png", dpi=120)
    except ImportError:
        print("matplotlib is not installed: no memory.png")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
