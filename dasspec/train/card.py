"""What a finished run leaves next to its weights for readers: ``generation_config.json``, the ``train_loss.png``
plot and the model card ``README.md``, all written from ``train_summary.json`` - no number is typed in."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

from ..eval.probes.common import pyplot

CARD_DEPTHS = (1, 2, 4, 8, 16)
PAPER_HUGINN_AGREEMENT = {1: 0.4722, 2: 0.6362, 4: 0.7937, 8: 0.9127}   # paper Table 6, Huginn, Aligned


def write_generation_config(folder: Path, eos: int, previous: Path | None = None) -> None:
    """``generation_config.json`` in ``folder``.  Tuned decoder defaults (benchmarks/tune_wave.py) and their
    provenance survive a retrain: they are read from ``previous`` (the model folder this run replaces), else from
    ``folder`` itself."""
    path = Path(folder) / "generation_config.json"
    source = next((f / "generation_config.json" for f in (previous, Path(folder))
                   if f is not None and (f / "generation_config.json").exists()), None)
    old = json.loads(source.read_text()) if source is not None else {}
    keep = {k: old[k] for k in ("dasspec", "dasspec_tuning") if k in old}
    path.write_text(json.dumps({"eos_token_id": eos, "do_sample": False, "dasspec": {}, **keep}, indent=2) + "\n")


# --- the plot -------------------------------------------------------------------------------------------------

def plot_training(folder: Path, summary: dict) -> Path:
    """``train_loss.png``: left, the per-step loss of ``train_log.csv`` (and its 50-step mean) against tokens
    seen; right, how the held-out depth-d readout agrees with depth R, next to the paper's Huginn-0125."""
    with open(Path(folder) / "train_log.csv") as f:
        rows = list(csv.DictReader(f))
    tokens = np.array([float(r["tokens"]) for r in rows])
    loss = np.array([float(r["loss"]) for r in rows])
    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    ax.plot(tokens, loss, lw=0.5, alpha=0.35, color="tab:blue", label="one step")
    if len(loss) >= 50:
        ax.plot(tokens[49:], np.convolve(loss, np.ones(50) / 50, mode="valid"), color="tab:blue",
                label="50-step mean")
    R = summary["val"]["R"]
    val_loss = {int(d): x for d, x in summary["val"]["loss"].items()}       # int keys in memory, str from JSON
    ax.axhline(val_loss[R], color="tab:red", ls="--", lw=1, label=f"held-out, depth {R}")
    ax.set(xlabel="training tokens", ylabel="cross-entropy (nats)",
           title=f"training loss ({summary['train_s'] / 60:.0f} min, {summary['threads']} thread(s))")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    for name, v in summary["val_by_source"].items():
        agree = sorted((int(d), x) for d, x in v["agreement"].items() if int(d) < R)
        bx.plot([d for d, _ in agree], [x for _, x in agree], marker="o", lw=2 if name == "all" else 1,
                label={"all": "this model (pooled)"}.get(name, name))
    bx.plot(list(PAPER_HUGINN_AGREEMENT), list(PAPER_HUGINN_AGREEMENT.values()), marker="s", ls="--",
            color="gray", label="Huginn-0125 (paper)")
    bx.set_xscale("log", base=2)
    bx.set(xlabel="readout depth d", ylabel=f"agreement with depth {R}", ylim=(0, 1.02),
           title="held-out: depth-d vs depth-R argmax")
    bx.grid(alpha=0.3)
    bx.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path = Path(folder) / "train_loss.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --- the model card: one function per section -------------------------------------------------------------------

def write_model_card(folder: Path, summary: dict, samples: list[dict], pilots: dict[str, dict] | None = None
                     ) -> Path:
    """README.md in ``folder`` from what the run measured (train_summary.json) - no number is typed in.
    ``pilots``: name -> an earlier run's train_summary.json, tabulated as the runs that chose the recipe."""
    lines = (_intro() + _model_section(summary) + _corpus_section(summary) + _training_section(summary)
             + _depth_section(summary, Path(folder)) + _pilots_section(summary, pilots) + _samples_section(samples)
             + _files_section())
    path = Path(folder) / "README.md"
    path.write_text("\n".join(lines))
    return path


def _intro() -> list[str]:
    return [
        "# dasspec-tiny", "",
        "A small looped (recurrent-depth) language model in the Huginn-0125 layout, trained from scratch by "
        "`dasspec train` so that dasspec works with no download: `dasspec.load_model()` / "
        "`dasspec generate --prompt ...` use it when no `--model` is given. It is a test and demo model: "
        "it writes Python-looking code and GSM8K-looking text, but it is not good at either.", "",
    ]


def _model_section(s: dict) -> list[str]:
    m, R = s["model"], s["val"]["R"]
    return [
        "## Model", "",
        f"* Huginn layout through `dasspec.model.looped.LoopedLM` (`family=huginn`): embedding x sqrt(d), prelude "
        f"{m['n_prelude']} / shared core {m['n_core']} / coda {m['n_coda']} sandwich blocks, linear adapter on "
        "[state, prelude output], qk_bias, interleaved RoPE, ln_f after the loop and after the coda, tied head.",
        f"* d = {m['n_embd']}, {m['n_heads']} heads of {m['head_dim']}, gated-SiLU MLP {m['intermediate_size']}, "
        f"vocabulary {m['vocab_size']}, context {m['block_size']} positions (RoPE base {m['rope_theta']:g}).",
        f"* Inference depth R = {R} (`mean_recurrence`); like-init initial state std sqrt(2/(5d)) = "
        f"{m['init_std']:.4f} (x embed scale {m['embed_scale']:.1f}).",
        f"* {s['parameters']:,} parameters; weights {s['weights_bytes'] / 2 ** 20:.1f} MiB (fp32 safetensors).", "",
    ]


def _corpus_section(s: dict) -> list[str]:
    c = s["config"]
    lines = ["## Training corpus (offline)", "",
             "| source | documents | characters | train tokens | held-out tokens |", "|---|---|---|---|---|"]
    for src, st in s["corpus"].items():
        lines.append(f"| {src} | {st['documents']:,} | {st['chars']:,} | {s['train_tokens'].get(src, 0):,} | "
                     f"{s['val_tokens'].get(src, 0):,} |")
    return lines + [
        "",
        "* `stdlib`: the Python standard library `.py` files of the interpreter that ran the recipe (test suites "
        "excluded); `gsm8k`: GSM8K **train** as `Question: ...\\nAnswer: ...\\n#### N` (calculator annotations "
        "removed); `mbpp`: MBPP **train** (task_ids 601-974) as comment + tests + code.",
        "* No evaluation split is trained on: documents containing a GSM8K-test, MATH-500, HumanEval or MBPP 11-510 "
        "prompt are dropped (`dasspec.train.corpus.contamination`, word 13-gram probes; it removes the MBPP-train "
        "tasks whose text duplicates an MBPP-test task). `tests/test_corpus.py` re-checks the corpus.",
        f"* Held-out: {c['val_fraction']:.0%} of the documents of every source ({s['val_documents']} documents).",
        "* Tokenizer: byte-level BPE (HF `tokenizers`, digits split) trained on the training documents; special "
        "tokens `<|begin_text|>` (prepended by the post-processor), `<|end_text|>` (EOS, appended after every "
        "document), `<|pad|>`.", "",
    ]


def _training_section(s: dict) -> list[str]:
    c = s["config"]
    resumed = s.get("resumed_at") or []
    run = (f"* `dasspec train --out DIR` (preset `{c['preset']}`, seed {c['seed']}): {s['steps']:,} steps, "
           f"{s['tokens_seen']:,} tokens in {s['train_s'] / 60:.1f} min of training (+{s['setup_s'] / 60:.1f} min "
           f"corpus/tokenizer, +{s['eval_s'] / 60:.1f} min evaluation), {s['tokens_per_s']:.0f} tokens/s on "
           f"{c['device']} with {s['threads']} thread(s), torch {s['torch']}."
           + (f" Stopped and resumed at step{'s' * (len(resumed) > 1)} {', '.join(f'{x:,}' for x in resumed)}; "
              "weights, optimizer and random state were restored, so it is the same run." if resumed else ""))
    depth = (f"* Depth: every step draws r from Huginn's log-normal-Poisson scheme (mean {c['mean_recurrence']}, "
             f"sigma {c['depth_sigma']}, r in [{c['min_depth']}, {c['max_depth']}]), starts from a fresh like-init "
             f"random state (scale {c['init_scale']:g}), runs r - k core steps without gradient and back-propagates "
             f"through the last k = min({c['backprop_depth']}, r); loss on the depth-r readout only."
             + (f" Curriculum (the Raven retrofit code's `mean_recurrence_schedule`): the sampler's mean rises "
                f"linearly from {c['depth_warmup_start']} to {c['mean_recurrence']} over the first "
                f"{c['depth_warmup_frac']:.0%} of the steps." if c.get("depth_warmup_frac") else ""))
    optim = (f"* Sequences of {c['seq_len']} tokens x {c['batch_size']}, every {c['long_every']}th step "
             f"{c['long_seq_len']} tokens; AdamW (betas {tuple(c['betas'])}, weight decay {c['weight_decay']}), "
             f"peak lr {c['lr']:g}, {c['warmup_steps']} warmup steps then cosine to {c['min_lr_frac']:g}x over "
             + (f"{c['max_steps']:,} steps, grad clip {c['grad_clip']}. The schedules run on steps, so a faster or "
                "slower machine runs the same schedule (only the duration changes, and float rounding with the CPU)."
                if c["max_steps"] is not None else
                f"the wall-clock budget ({c['time_budget_s'] / 60:.0f} min), grad clip {c['grad_clip']}. The step "
                "count depends on the machine's speed and load; for a machine-independent run of the same length "
                f"use `--set max_steps={s['steps']}`."))
    stopped = c["max_steps"] is not None and s["steps"] < c["max_steps"]
    early = [f"* **Stopped early** by the {c['time_budget_s'] / 60:.0f}-minute safety budget at step {s['steps']} "
             f"of {c['max_steps']}."] if stopped else []
    return ["## Training", "", run, depth, optim, *early, ""]


def _depth_section(s: dict, folder: Path) -> list[str]:
    c, R = s["config"], s["val"]["R"]
    lines = [
        "## Depth: validation loss and agreement of the depth-d readout with depth R", "",
        f"Teacher-forced on held-out documents (up to {c['eval_tokens']:,} tokens of code and of GSM8K, windows "
        f"of {min(512, c['seq_len'])} tokens), initial state as in "
        f"training (init_scale {c['init_scale']:g}, seed 0; 1 = like-init, the decoding default); agreement = "
        f"fraction of positions whose depth-d argmax equals the depth-{R} argmax "
        "(`dasspec.train.depth_agreement`).", "",
    ]
    depths = sorted({*CARD_DEPTHS, R})
    lines += ["| held-out text | tokens | " + " | ".join(f"d={d}" for d in depths) + " |",
              "|---|---|" + "---|" * len(depths)]
    label = {"all": "pooled", "code": "code (stdlib + mbpp)", "gsm8k": "gsm8k"}
    for key, unit in (("agreement", ""), ("loss", " (nats)")):
        for name, v in s["val_by_source"].items():
            x = {int(k): y for k, y in v[key].items()}
            lines.append(f"| {label.get(name, name)}: {key}{unit} | {v['tokens']:,} | "
                         + " | ".join(f"{x[d]:.3f}" for d in depths) + " |")
    lines += ["", "For comparison, the paper reports an aligned depth-d draft of Huginn-0125 agreeing with its "
              "depth-32 target about 0.47 / 0.64 / 0.79 / 0.91 at d = 1 / 2 / 4 / 8.", ""]
    if (folder / "train_loss.png").exists():
        lines += ["![training loss](train_loss.png)", ""]
    return lines


def _pilot_row(summary: dict, name: str) -> str:
    c, v = summary["config"], summary["val"]
    a = {int(k): x for k, x in v["agreement"].items()}
    loss = {int(k): x for k, x in v["loss"].items()}
    ramp = c.get("depth_warmup_frac") or 0
    recipe = (f"d={c['n_embd']}, core {c['n_core']}, mean r {c['mean_recurrence']}"
              + (f" (ramp from {c['depth_warmup_start']} over {ramp:.0%})" if ramp else "")
              + f", k {c['backprop_depth']}, floor {c['min_depth']}, init {c['init_scale']:g}, "
              f"T {c['seq_len']}x{c['batch_size']}, lr {c['lr']:g}, "
              + (f"cosine over {c['max_steps']} steps" if c["max_steps"] else "cosine over wall-clock"))
    return (f"| {name} | {recipe} | {summary['train_s'] / 60:.1f} | {summary['tokens_seen']:,} | "
            + " | ".join(f"{a[d]:.3f}" if d in a else "-" for d in CARD_DEPTHS)
            + f" | {loss[summary['val']['R']]:.3f} |")


def _pilots_section(s: dict, pilots: dict[str, dict] | None) -> list[str]:
    if not pilots:
        return []
    return ["## Pilot runs (how the recipe was chosen)", "",
            "Each row is a run of the same script with the listed changes; agreement with depth R "
            "on the pooled held-out text.", "",
            "| run | recipe | train min | tokens | " + " | ".join(f"d={d}" for d in CARD_DEPTHS)
            + " | loss at R |", "|---|---|---|---|" + "---|" * (len(CARD_DEPTHS) + 1),
            *(_pilot_row(p, name) for name, p in pilots.items()),
            _pilot_row(s, "**this model**"), ""]


def _samples_section(samples: list[dict]) -> list[str]:
    lines = ["## Samples (greedy, depth R, `method=\"ar\"`)", ""]
    for smp in samples:
        lines += ["```text", smp["prompt"] + smp["text"], "```",
                  f"({smp['tokens_per_s']} tokens/s on this machine)", ""]
    return lines


def _files_section() -> list[str]:
    return ["## Files", "",
            "`config.json` (Huginn-style), `model.safetensors`, `tokenizer.json` + `tokenizer_config.json` + "
            "`special_tokens_map.json`, `generation_config.json` (EOS; the `dasspec` section holds tuned "
            "decoder defaults), `train_log.csv` (per-step loss), `train_loss.png` (its plot), `train_summary.json` "
            "(everything above).", ""]
