"""From records.jsonl to the paper's tables: pair every method with AR per prompt, compute S / A / G with
bootstrap CIs, check token agreement with AR, and write report.md (Table 1 style), summary.csv, prompts.jsonl
(per-prompt derived records, ``match`` included) and two PNG plots (speedup with CI bars; A per method)."""

from __future__ import annotations

import csv
import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from . import metrics
from .folder import RUN_INFO, OutDirError, usable_folder
from .records import RECORDS, Records, read_records

METHOD_LABELS = {"ar": "AR", "lookahead": "Lookahead", "pld": "PLD", "token-recycling": "Token Recycling",
                 "sam": "SAM-Decoding", "self-spec": "Self-speculative", "mature-spec": "Mature-Spec",
                 "das-wave": "DAS-Wave", "auto": "auto (DAS-Wave / SAM / PLD / AR per step)"}
TASK_LABELS = {"gsm8k": "GSM8K", "math500": "MATH-500", "humaneval": "HumanEval", "mbpp": "MBPP"}
METHOD_ORDER = list(METHOD_LABELS)
TASK_ORDER = list(TASK_LABELS)
# Every method runs the same full-depth prefill, so on a prompt where AR spends t_prefill of t_AR there, no decoder
# can beat AR by more than t_AR / t_prefill (Amdahl).  The report notes a task where the mean of that bound over
# prompts - S's own averaging - is below this (e.g. HumanEval prompts whose output hits a stop string at once).
PREFILL_BOUND_NOTE = 2.0


def method_label(name: str) -> str:
    return METHOD_LABELS.get(name, name)


def task_label(name: str) -> str:
    return TASK_LABELS.get(name, name)


def _sorted(names, order) -> list[str]:
    return sorted(set(names), key=lambda n: (order.index(n) if n in order else len(order), n))


@dataclass
class Summary:
    rows: list[dict]                      # per (task, prompt, method), paired with AR
    cells: dict[tuple[str, str], dict]    # (task, method) -> S, CI, A, G, ...
    tasks: list[str]
    methods: list[str]
    unpaired: list[dict] = field(default_factory=list)    # records whose prompt has no AR record yet
    failed: list[dict] = field(default_factory=list)      # failure records (a Ray cell that failed twice)
    torn_tail: bool = False                               # records.jsonl ends in an unfinished line

    @property
    def mismatches(self) -> list[dict]:
        return [r for r in self.rows if not r["match"]]


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def decode_ratios(r: dict, ar: dict) -> tuple[float | None, float | None]:
    """The throughput and pass-count ratios of the decode phase alone: the tokens after the first (which every
    method takes from the same full-depth prefill) over the wall time and the sequential passes after the prefill.
    (None, None) where a side decoded nothing (a request that stopped at its first token) or records lack the
    prefill split."""
    sides = []
    for x in (r, ar):
        if x.get("prefill_time") is None or x.get("prefill_passes") is None:
            return None, None
        n, t, p = x["new_tokens"] - 1, x["wall_time"] - x["prefill_time"], x["sequential_passes"] - x["prefill_passes"]
        if n <= 0 or t <= 0 or p <= 0:
            return None, None
        sides.append((n, t, p))
    (n, t, p), (n_ar, t_ar, p_ar) = sides
    return (n / t) / (n_ar / t_ar), (n / p) / (n_ar / p_ar)


def pair_with_ar(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """One row per (task, prompt, method) that has an AR record for the same prompt: the eq. (8) ratio, the
    pass-count ratio, A_p, G_p and whether the tokens equal AR's."""
    by_prompt: dict[tuple[str, str], dict[str, dict]] = defaultdict(dict)
    for r in records:
        by_prompt[(r["task"], r["prompt_id"])][r["method"]] = r
    rows, unpaired = [], []
    for (task, pid), per_method in by_prompt.items():
        ar = per_method.get("ar")
        if ar is None:
            unpaired.extend(per_method.values())
            continue
        for method, r in per_method.items():
            ratio = float(metrics.throughput_ratios([r["new_tokens"]], [r["wall_time"]],
                                                    [ar["new_tokens"]], [ar["wall_time"]])[0])
            pass_ratio = float(metrics.throughput_ratios([r["new_tokens"]], [r["sequential_passes"]],
                                                         [ar["new_tokens"]], [ar["sequential_passes"]])[0])
            diff = first_difference(r["tokens"], ar["tokens"])
            decode, decode_pass = decode_ratios(r, ar)
            rows.append({
                "task": task, "prompt_id": pid, "prompt_index": r["prompt_index"], "method": method,
                "ratio": ratio, "pass_ratio": pass_ratio, "decode_ratio": decode, "decode_pass_ratio": decode_pass,
                "A_p": metrics.accepted_length(r["accepted"]),
                "G_p": metrics.committed_progress(r["accepted"], r["target_tokens"]),
                "match": diff is None, "first_mismatch": diff,
                "new_tokens": r["new_tokens"], "ar_new_tokens": ar["new_tokens"],
                "wall_time": r["wall_time"], "ar_wall_time": ar["wall_time"],
                "ar_prefill_time": ar.get("prefill_time"),
                "prompt_tokens": ar.get("prompt_tokens"), "cached_tokens": ar.get("cached_tokens", 0),
                "tokens_per_second": r["new_tokens"] / r["wall_time"],
                "sequential_passes": r["sequential_passes"], "ar_sequential_passes": ar["sequential_passes"],
                "stop_reason": r["stop_reason"], "stateful": bool(r.get("stateful", False)),
                "same_session": r.get("session") == ar.get("session"),
                "device": r.get("device"), "stream": (r.get("session"), r.get("worker")),
            })
    rows.sort(key=lambda x: (x["task"], x["prompt_index"], x["method"]))
    return rows, unpaired


def prefill_share_and_bound(rows: list[dict]) -> tuple[float | None, float | None]:
    """Over paired rows: the mean share of AR's time spent in the prefill, and the prefill bound - the mean over
    prompts of t_AR / t_prefill, the S a decoder that took no time after the prefill would reach (every method runs
    AR's prefill).  (None, None) where a record lacks the prefill time."""
    if not rows or any(not r["ar_prefill_time"] for r in rows):
        return None, None
    shares = [r["ar_prefill_time"] / r["ar_wall_time"] for r in rows]
    return sum(shares) / len(shares), sum(1 / f for f in shares) / len(shares)


def summarize(records: list[dict] | Records, n_resamples: int = metrics.N_RESAMPLES, seed: int = 0) -> Summary:
    """``records``: finished records (a list), or a ``Records`` read from a folder (its failures and an unfinished
    last line are then noted too)."""
    failed, torn = [], False
    if isinstance(records, Records):
        failed, torn, records = records.failed, records.torn_tail is not None, records.ok
    rows, unpaired = pair_with_ar(records)
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for row in rows:
        groups[(row["task"], row["method"])].append(row)
    cells = {}
    for (task, method), g in groups.items():
        g.sort(key=lambda x: x["prompt_index"])            # request order, for the moving-block bootstrap
        stateful = any(x["stateful"] for x in g)
        cell = metrics.summarize_speedup([x["ratio"] for x in g], stateful, n_resamples, seed)
        cell.update({
            "A": metrics.mean_over_prompts([x["A_p"] for x in g]),
            "G": metrics.mean_over_prompts([x["G_p"] for x in g]),
            "pass_speedup": metrics.speedup([x["pass_ratio"] for x in g]),
            "matches": sum(x["match"] for x in g),
            "tokens_per_second": sum(x["tokens_per_second"] for x in g) / len(g),
            "mean_new_tokens": sum(x["new_tokens"] for x in g) / len(g),
            "cross_session": sum(not x["same_session"] for x in g),
        })
        cell["ar_prefill_share"], cell["prefill_bound"] = prefill_share_and_bound(g)
        cell["mean_prompt_tokens"] = sum(x["prompt_tokens"] or 0 for x in g) / len(g)
        cells[(task, method)] = cell
    tasks = _sorted([t for t, _ in cells], TASK_ORDER)
    methods = _sorted([m for _, m in cells], METHOD_ORDER)
    return Summary(rows, cells, tasks, methods, unpaired, failed, torn)


def _fmt(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def speedup_table(s: Summary) -> str:
    """Rows = methods, columns = tasks; cells 'S× [lo, hi]' and A (paper Table 1 with Table 13's CIs)."""
    head = "| Method | " + " | ".join(f"{task_label(t)} speedup [95% CI] | A" for t in s.tasks) + " |"
    rule = "|---|" + "---|---|" * len(s.tasks)
    lines = [head, rule]
    for m in s.methods:
        cells = []
        for t in s.tasks:
            c = s.cells.get((t, m))
            if c is None:
                cells += ["–", "–"]
            elif m == "ar":
                cells += [f"1.00× ({c['tokens_per_second']:.1f} tok/s)", "–"]
            else:
                cells += [f"{c['S']:.2f}× [{c['lo']:.2f}, {c['hi']:.2f}]", _fmt(c["A"])]
        lines.append(f"| {method_label(m)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def detail_table(s: Summary) -> str:
    lines = ["| Task | Method | N | Speedup S | Pass-count speedup | A | G | Matches AR | tok/s | new tokens | "
             "bootstrap |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in s.tasks:
        for m in s.methods:
            c = s.cells.get((t, m))
            if c is None:
                continue
            lines.append(f"| {task_label(t)} | {method_label(m)} | {c['n']} | {c['S']:.2f}× | "
                         f"{c['pass_speedup']:.2f}× | {_fmt(c['A'])} | {_fmt(c['G'])} | {c['matches']}/{c['n']} | "
                         f"{c['tokens_per_second']:.1f} | {c['mean_new_tokens']:.1f} | {c['bootstrap']} |")
    return "\n".join(lines)


def prefill_notes(s: Summary) -> list[str]:
    """One line per task where AR's prefill alone caps every method's S below PREFILL_BOUND_NOTE."""
    notes = []
    for t in s.tasks:
        c = s.cells.get((t, "ar"))
        if c is None or c["prefill_bound"] is None or c["prefill_bound"] >= PREFILL_BOUND_NOTE:
            continue
        notes.append(f"{task_label(t)}: AR spends {100 * c['ar_prefill_share']:.0f}% of its time in the prefill "
                     f"(outputs of {c['mean_new_tokens']:.1f} tokens on average after prompts of "
                     f"{c['mean_prompt_tokens']:.0f}), which every method runs alike, so even a decoder that took "
                     f"no time after it would reach only about {c['prefill_bound']:.2f}x here; "
                     "`benchmarks/speed.py` also reports the decode phase alone.")
    return notes


def markdown(s: Summary, info: dict, skipped: list[dict] | None = None) -> str:
    sessions = info.get("sessions", [])
    env = sessions[-1] if sessions else {}
    threads = env.get("threads", "?")
    where = env.get("gpu") or f"CPU ({env.get('machine', '?')}, {threads} thread{'' if threads == 1 else 's'})"
    out = [
        "# dasspec benchmark",
        "",
        f"Model `{info.get('model', '?')}` ({info.get('family', '?')}, {info.get('parameters', 0) / 1e6:.2f}M "
        f"parameters, context {info.get('context', '?')}), R = {info.get('num_steps')}"
        f"{exit_label(info.get('exit'))}, {info.get('dtype')} on {where}, torch {env.get('torch', '?')}; "
        f"{len(sessions)} session(s). Prompts: {info.get('split')} split, "
        f"selection seed {info.get('select_seed')}; "
        + ", ".join(f"{task_label(t)} N = {s.cells[(t, 'ar')]['n']}" for t in s.tasks if (t, "ar") in s.cells)
        + ".",
        "",
        f"Decoding: {decoding_label(info.get('sampling'))}"
        + (f", seed {info.get('gen_seed')}; \"Matches AR\" compares with AR sampling at the same seed (every "
           "method must emit exactly its tokens)." if info.get("sampling") else "."),
        "",
        "## Speedup over paired full-depth AR",
        "",
        speedup_table(s),
        "",
        "Speedup S: eq. (8), the mean over prompts of the per-prompt throughput ratio (tokens / elapsed time, "
        "prefill included) against full-depth AR on the same prompt in the same session. 95% CIs: "
        "10,000 paired bootstrap resamples over prompts; moving blocks of 5 requests for methods whose state "
        "persists across requests. A: eq. (9), mean accepted draft tokens per verification.",
        "",
        "## Pass counts, committed progress and agreement with AR",
        "",
        detail_table(s),
        "",
        "Pass-count speedup: eq. (8) with sequential core passes in place of time (AR passes / method passes, "
        "per token). G: eq. (10), committed tokens per verification. New tokens: mean output length per prompt.",
        "",
    ]
    tasks_info = info.get("tasks", {})
    out += ["## Tasks", ""]
    for t in s.tasks or list(tasks_info):
        ti = tasks_info.get(t, {})
        out.append(f"- {task_label(t)}: cap {ti.get('cap')}, {ti.get('shots')} demonstrations, stop "
                   f"{json.dumps(ti.get('stop', []))}")
    out += ["", "## Method knobs", ""]
    for m, mi in sorted(info.get("methods", {}).items(), key=lambda kv: _sorted(info["methods"], METHOD_ORDER)
                        .index(kv[0])):
        out.append(f"- {method_label(m)} (`{m}`{', stateful' if mi.get('stateful') else ''}): "
                   f"`{json.dumps(mi.get('knobs', {}))}`")
    out += ["", "## Outputs that differ from AR", ""]
    if s.mismatches:
        failing = info.get("dtype") == "float32"
        if failing:
            out.append("**FAILURE: in float32 every method must reproduce AR's tokens.**")
            out.append("")
        for r in s.mismatches:
            out.append(f"- {task_label(r['task'])} `{r['prompt_id']}` {method_label(r['method'])}: first "
                       f"difference at token {r['first_mismatch']} ({r['new_tokens']} vs AR {r['ar_new_tokens']} "
                       "tokens)")
    else:
        out.append(f"None: all {len(s.rows)} paired outputs equal AR's tokens.")
    devices = device_kinds(s)
    if len(devices) > 1:
        out += ["", "## Tokens/s per device kind", "", device_table(s, devices)]
    cross = sum(c["cross_session"] for c in s.cells.values())
    thin = any(c["bootstrap"].startswith("moving-block") and c["n"] <= metrics.STATEFUL_BLOCK
               for c in s.cells.values())
    short = prefill_notes(s)
    notes = device_notes(devices) + stream_notes(s) + failure_notes(s)
    if cross or s.unpaired or skipped or thin or short or notes:
        out += ["", "## Notes", ""]
    out += [f"- {note}" for note in notes]
    if cross:
        out.append(f"- {cross} method runs are paired with an AR run from another session (the folder was "
                   "resumed); pairs within one session are the paper's protocol.")
    for (t, m), c in sorted(s.cells.items()):
        if c["bootstrap"].startswith("moving-block") and c["n"] <= metrics.STATEFUL_BLOCK:
            out.append(f"- {method_label(m)} on {task_label(t)}: {c['n']} requests <= one block of "
                       f"{metrics.STATEFUL_BLOCK}, so its moving-block interval is the point estimate (not "
                       "informative; use more prompts).")
    out += [f"- {note}" for note in short]
    if s.unpaired:
        out.append(f"- {len(s.unpaired)} records have no AR record for their prompt yet and are not counted.")
    for sk in skipped or []:
        out.append(f"- skipped {task_label(sk['task'])} `{sk['prompt_id']}`: {sk['reason']}")
    return "\n".join(out) + "\n"


def device_kinds(s: Summary) -> list[str]:
    """The device kinds paired rows ran on (records from before the field existed name none)."""
    return sorted({r["device"] for r in s.rows if r["device"]})


def device_notes(devices: list[str]) -> list[str]:
    if len(devices) < 2:
        return []
    return [f"Cells ran on {len(devices)} device kinds ({'; '.join(devices)}). Every speedup is still paired per "
            "prompt (AR and each method on the same prompt ran back to back on one device), but absolute tokens/s "
            "are not comparable across kinds: see the tokens/s per device kind."]


def device_table(s: Summary, devices: list[str]) -> str:
    """Mean tokens/s (prompts) per (task, method) and device kind."""
    lines = ["| Task | Method | " + " | ".join(devices) + " |", "|---|---|" + "---|" * len(devices)]
    for t in s.tasks:
        for m in s.methods:
            cells = []
            for d in devices:
                tps = [r["tokens_per_second"] for r in s.rows if (r["task"], r["method"], r["device"]) == (t, m, d)]
                cells.append(f"{sum(tps) / len(tps):.1f} ({len(tps)})" if tps else "–")
            if any(c != "–" for c in cells):
                lines.append(f"| {task_label(t)} | {method_label(m)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def stream_notes(s: Summary) -> list[str]:
    """One line per stateful method whose requests were split over more request streams than sessions (a
    sharded run: every worker keeps its own state), since the paper's hot start follows one stream."""
    notes = []
    for m in s.methods:
        rows = [r for r in s.rows if r["method"] == m and r["stateful"]]
        streams = {r["stream"] for r in rows}
        sessions = {st[0] for st in streams}
        if len(streams) > len(sessions):
            notes.append(f"{method_label(m)} keeps state across requests, which the paper's protocol (and a "
                         f"one-process run) builds over one request stream; here its {len(rows)} requests were "
                         f"split over {len(streams)} streams, one per worker process and session (a sharded run "
                         f"gives every worker its own), {len(rows) / len(streams):.1f} requests each on average, so "
                         "its state was built from fewer requests than in a one-process run.")
    return notes


def failure_notes(s: Summary) -> list[str]:
    notes = [f"{len(s.failed)} runs failed and are not counted (run the same command again to retry them):"
             ] if s.failed else []
    for r in s.failed:
        notes.append(f"failed: {task_label(r['task'])} `{r['prompt_id']}` {method_label(r['method'])}: "
                     f"{r['error']}")
    if s.torn_tail:
        notes.append("records.jsonl ends in an unfinished line (a run is writing it, or stopped while writing it); "
                     "it is not counted.")
    return notes


CSV_FIELDS = ["task", "method", "n", "S", "S_lo", "S_hi", "bootstrap", "A", "G", "pass_speedup", "matches",
              "mismatches", "tokens_per_second", "mean_new_tokens", "ar_prefill_share", "prefill_bound",
              "cross_session", "decoding", "temperature", "top_k", "top_p", "min_p"]
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p")


def exit_label(exit: dict | None) -> str:
    """The target's early exit, when the run set one (" (target: exit_threshold 0.9)")."""
    return f" (target: {', '.join(f'{k} {v}' for k, v in exit.items())})" if exit else ""


def decoding_label(sampling: dict | None) -> str:
    """"greedy", or the sampling settings ("sampled: temperature 0.7, top_p 0.95")."""
    if not sampling:
        return "greedy"
    return "sampled: " + ", ".join(f"{k} {sampling[k]}" for k in SAMPLING_FIELDS if sampling.get(k) is not None)


def write_csv(s: Summary, path: Path, sampling: dict | None = None) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for t in s.tasks:
            for m in s.methods:
                c = s.cells.get((t, m))
                if c is None:
                    continue
                w.writerow([t, m, c["n"], f"{c['S']:.4f}", f"{c['lo']:.4f}", f"{c['hi']:.4f}", c["bootstrap"],
                            "" if c["A"] is None else f"{c['A']:.4f}", "" if c["G"] is None else f"{c['G']:.4f}",
                            f"{c['pass_speedup']:.4f}", c["matches"], c["n"] - c["matches"],
                            f"{c['tokens_per_second']:.3f}", f"{c['mean_new_tokens']:.1f}",
                            "" if c["ar_prefill_share"] is None else f"{c['ar_prefill_share']:.3f}",
                            "" if c["prefill_bound"] is None else f"{c['prefill_bound']:.3f}",
                            c["cross_session"], "sampled" if sampling else "greedy",
                            *("" if not sampling or sampling.get(k) is None else sampling[k]
                              for k in SAMPLING_FIELDS)])


def plot(s: Summary, out: Path) -> list[Path]:
    """speedup.png (S with 95% CI bars, grouped by task) and accept.png (A per method, grouped by task)."""
    import matplotlib                   # lazy: matplotlib is slow to import; only the plots need it
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt     # lazy: as above
    import numpy as np                  # lazy: with matplotlib

    methods = [m for m in s.methods if m != "ar"]
    if not methods or not s.tasks:
        return []
    x = np.arange(len(s.tasks))
    width = 0.8 / len(methods)
    paths = []
    for name, key, ylabel, title in (
            ("speedup.png", "S", "speedup over AR (×)", "Throughput speedup over paired AR, 95% CI"),
            ("accept.png", "A", "accepted draft tokens per verification (A)", "Accepted length A")):
        fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(s.tasks) * max(1, len(methods) / 3)), 4.6))
        for i, m in enumerate(methods):
            vals, err = [], [[], []]
            for t in s.tasks:
                c = s.cells.get((t, m))
                v = None if c is None else c[key]
                vals.append(np.nan if v is None else v)
                lo = hi = 0.0
                if key == "S" and c is not None:
                    lo, hi = c["S"] - c["lo"], c["hi"] - c["S"]
                err[0].append(lo)
                err[1].append(hi)
            ax.bar(x - 0.4 + width * (i + 0.5), vals, width, label=method_label(m),
                   yerr=err if key == "S" else None, capsize=3)
        if key == "S":
            ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(x, [task_label(t) for t in s.tasks])
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=8, ncols=min(4, len(methods)), loc="upper center", bbox_to_anchor=(0.5, -0.1),
                  frameon=False)
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def write_report(out: str | Path, skipped: list[dict] | None = None, n_resamples: int = metrics.N_RESAMPLES,
                 seed: int = 0, repair: bool = False) -> tuple[Summary, str]:
    """Summarise every record in ``out/records.jsonl`` and write report.md, summary.csv, prompts.jsonl and the
    PNGs; returns the summary and the markdown text.  Reads records.jsonl only (a run may be appending to it);
    ``repair``: set lines that are not records aside (records.rejected.jsonl) instead of stopping."""
    if n_resamples < 1:
        raise ValueError(f"--bootstrap must be >= 1, got {n_resamples}")
    out = usable_folder(out, create=False)
    if not os.access(out, os.W_OK):
        raise OutDirError(f"--out {out} is not writable: the report cannot be written there")
    records = read_records(out / RECORDS, set_aside=repair)
    if not records.ok:
        raise ValueError(f"no records in {out / RECORDS}; run `dasspec bench --out {out}` first")
    info = json.loads((out / RUN_INFO).read_text()) if (out / RUN_INFO).exists() else {}
    s = summarize(records, n_resamples, seed)
    text = markdown(s, info, info.get("skipped", []) if skipped is None else skipped)
    (out / "report.md").write_text(text)
    write_csv(s, out / "summary.csv", info.get("sampling"))
    with open(out / "prompts.jsonl", "w") as f:
        for row in s.rows:
            f.write(json.dumps(row) + "\n")
    plot(s, out)
    return s, text
