"""Lossless under stress (issue 51, "Measure"): does every request's output equal its own batch-1 AR decode at one
thread, whatever method drafted it, whatever shared its batch, at whatever thread count?

    python benchmarks/lossless_stress.py --out runs/lossless_stress --quick
    python benchmarks/lossless_stress.py --out runs/lossless_stress --prompts 8 --models ouro-mid

Cells: method (every method, ``auto``, ``mixed``: all of them as requests of one ``Engine``, and ``mixed-overlap``:
the same with ``Engine(overlap=True)``, each step planned while the one before runs) x batch size
(``generate_batch(..., max_batch=B)`` of all the prompts; ``mixed``: the Engine's ``max_batch``) x thread count
(``torch.set_num_threads``) x model x decoding (greedy; sampled: temperature 0.7, the prompt's index as its seed).
Models (``--models``):

* ``bundled``: the bundled model (float32, its default depth);
* ``ouro-mid``: Ouro-1.4B's config and tokenizer (``--ouro-src``) at width 512, 8 heads of 64, intermediate 1408, 8
  layers looped T = 4, the real 49,152-id vocabulary, HF's normal(0, 0.02) init, float32 - built once with
  ``dasspec.testing.build_real_checkpoint`` into ``--models-dir`` (the mid-size Ouro of docs/performance-journal.md);
* ``bf16-stack``: Ouro-1.4B's real layer widths (2048, 16 heads of 128, intermediate 5632, the 49,152-id
  vocabulary) with ``--bf16-layers`` layers, bfloat16, random weights (with dasspec's kernels bfloat16 rows on a
  CPU are batch-invariant as float32 ones are: this measures that it holds; before them it often did not);
* ``NAME=FOLDER``: any checkpoint folder, float32 (the mid-size Nanbeige and IQuest-Loop of the vLLM comparisons).

Prompts: GSM8K training questions and answers run together (``$DASSPEC_DATA`` or ../shared/data; random ids where
there is none) cut to a length drawn in [--min-len, --max-len], ``--new-tokens`` each, ``eos=False``.  The
reference of a prompt is ``dasspec.generate(model, prompt, "ar")`` at one thread (greedy, or sampled with the same
seed); a cell counts the requests whose tokens differ from their reference and the first position where each
differs.  Records are appended per cell to ``DIR/cells.jsonl`` (references with their tokens to ``DIR/refs.jsonl``),
so a killed run resumes where it stopped; ``DIR/summary.md`` and ``DIR/cells.csv`` are rewritten after every cell.
A benchmark, never a test: it measures and asserts nothing.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))           # the checkout this script belongs to, not another installed dasspec
MODELS = ("bundled", "ouro-mid", "bf16-stack")
MODES = ("greedy", "sampled")
SAMPLING = dict(do_sample=True, temperature=0.7)
QUICK = dict(prompts=2, new_tokens=32, batches="1,8", min_len=200, max_len=400)
QUICK_BF16_METHODS = "ar,das-wave,sam,auto"      # the bf16 stack's decode is slow here: a subset under --quick


# --- models -------------------------------------------------------------------------------------------------------

def build_ouro(src: Path, out: Path, *, width: int, heads: int, intermediate: int, layers: int, dtype: str) -> Path:
    """A random Ouro folder from ``src``'s config and tokenizer at these widths, full scale of that config."""
    from dasspec.testing import build_real_checkpoint
    if (out / "config.json").is_file():
        return out
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(hidden_size=width, num_hidden_layers=layers, intermediate_size=intermediate,
               num_attention_heads=heads, num_key_value_heads=heads, head_dim=width // heads,
               layer_types=["full_attention"] * layers, max_window_layers=layers, torch_dtype=dtype)
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        for f in src.iterdir():
            if f.is_file() and f.name != "config.json":
                shutil.copy(f, t / f.name)
        (t / "config.json").write_text(json.dumps(cfg, indent=1))
        print(f"building {out} (once)", file=sys.stderr, flush=True)
        return build_real_checkpoint(t, out, "full")


def near_tie(model, eta: float) -> None:
    """Replace the head by one shared row plus ``eta`` of the rows (an untied copy): the argmax is the same in exact
    arithmetic, but the logits' spread is at the level of float32 rounding, so a token depends on every bit of its
    row - a difference in a row's bits that the model's own margins would hide shows as changed tokens."""
    import torch
    with torch.no_grad():
        w = model.lm_head.weight.detach().clone()
        shared = w[0].clone()
        w.mul_(eta).add_(shared)
        model.lm_head.weight = torch.nn.Parameter(w, requires_grad=False)


def load(name: str, args: argparse.Namespace):
    model = load_plain(name, args)
    if args.near_tie:
        near_tie(model, args.near_tie)
    return model


def load_plain(name: str, args: argparse.Namespace):
    import torch
    import dasspec
    src, models = Path(args.ouro_src), Path(args.models_dir)
    if name in getattr(args, "folders", {}):
        return dasspec.load_model(args.folders[name], device="cpu", dtype=torch.float32)
    if name == "bundled":
        return dasspec.load_model(device="cpu", dtype=torch.float32)
    if name == "ouro-mid":
        folder = build_ouro(src, models / "ouro-mid", width=512, heads=8, intermediate=1408, layers=8,
                            dtype="float32")
        return dasspec.load_model(folder, device="cpu", dtype=torch.float32)
    if name == "bf16-stack":
        folder = build_ouro(src, models / f"ouro-1.4b-widths-{args.bf16_layers}l", width=2048, heads=16,
                            intermediate=5632, layers=args.bf16_layers, dtype="bfloat16")
        return dasspec.load_model(folder, device="cpu", dtype=torch.bfloat16)
    raise SystemExit(f"dasspec: error: unknown model {name!r} (choose from {', '.join(MODELS)})")


# --- prompts ------------------------------------------------------------------------------------------------------

def prompt_texts(data: Path | None) -> list[str]:
    path = data / "gsm8k" / "train.jsonl" if data else None
    if path is None or not path.is_file():
        return []
    with open(path) as f:
        rows = [json.loads(line) for _, line in zip(range(400), f)]
    return [f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in rows]


def make_prompts(model, texts: list[str], n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of lengths drawn in [lo, hi]: consecutive GSM8K examples from a different start each (random
    ids where there is no data)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        L = rng.randint(lo, hi)
        if texts and model.tokenizer is not None:
            ids: list[int] = []
            j = (i * 37) % len(texts)
            while len(ids) < L:
                ids += model.tokenizer.encode(texts[j % len(texts)])
                j += 1
            out.append(ids[:L])
        else:
            out.append([rng.randrange(3, model.config.vocab_size) for _ in range(L)])
    return out


# --- cells --------------------------------------------------------------------------------------------------------

def digest(ids: list[int]) -> str:
    return hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:12]


def first_diff(a: list[int], b: list[int]) -> int | None:
    """The first position where a and b differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def decode(model, prompts: list[list[int]], method: str, B: int, mode: str, new: int,
           methods: list[str]) -> list[tuple[int, str, list[int]]]:
    """(prompt index, method, tokens) of every request of one cell."""
    import torch
    import dasspec
    opts = dict(SAMPLING) if mode == "sampled" else {}
    if method not in ("mixed", "mixed-overlap"):
        outs = dasspec.generate_batch(model, prompts, method, max_new_tokens=new, eos=False, max_batch=B,
                                      seed=list(range(len(prompts))), **opts)
        return [(i, method, o.tokens) for i, o in enumerate(outs)]
    from dasspec.engine.core.blocks import BLOCK_SIZE
    count = max(len(prompts), len(methods))       # every method at least once, every prompt at least once
    plan = [(i % len(prompts), methods[i % len(methods)]) for i in range(count)]
    longest = max(len(p) for p in prompts)
    budget = B * (-(-(longest + new + 320) // BLOCK_SIZE) + 1) * BLOCK_SIZE
    engine = dasspec.Engine(model, "ar", max_batch=B, kv_budget=budget, overlap=method == "mixed-overlap")
    with torch.inference_mode():
        rids = [engine.add(prompts[j], method=m, max_new_tokens=new, eos=False, seed=j, **opts) for j, m in plan]
        while engine.has_work:
            engine.step()
    out = [(j, m, engine.result(r).tokens) for (j, m), r in zip(plan, rids)]
    engine.close()
    return out


def cpu_info() -> dict:
    """The CPU and build the figures were measured on."""
    import torch
    from dasspec.model import decode_kernel
    flags, name = "", platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    flags = line.split(":", 1)[1]
                    break
    except OSError:
        pass
    simd = sorted(f for f in flags.split() if f.startswith(("avx", "amx", "fma")))
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = ""
    return {"cpu": name, "simd": simd, "cores": os.cpu_count(), "torch": torch.__version__,
            "kernels_built": decode_kernel.available(), "isa": decode_kernel.isa(), "commit": commit}


# --- records, report ----------------------------------------------------------------------------------------------

def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:        # a line cut by a kill: that cell runs again
            pass
    return rows


def append(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


CELL_KEY = ("model", "mode", "method", "B", "threads")
COLUMNS = CELL_KEY + ("dtype", "requests", "mismatched", "first_diff", "differing", "seconds")


def report(out: Path, cells: list[dict], info: dict, args: argparse.Namespace) -> None:
    with open(out / "cells.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for c in cells:
            w.writerow([c[k] if k not in ("first_diff", "differing") else json.dumps(c[k]) for k in COLUMNS])
    lines = [f"# Lossless under stress ({time.strftime('%Y-%m-%d')})", "",
             f"CPU: {info['cpu']}, {info['cores']} cores, SIMD flags {' '.join(info['simd'])}; torch {info['torch']}; "
             f"CPU kernels built: {info['kernels_built']} (ISA path {info['isa']}); code {info['commit']}.", "",
             f"Prompts: {args.prompts} per model, {args.min_len}-{args.max_len} tokens, {args.new_tokens} new tokens "
             "each, eos off; reference: each prompt's own batch-1 AR (`dasspec.generate`) at one thread.  A cell: "
             "`generate_batch(..., max_batch=B)` of all the prompts (`mixed`: every method as requests of one "
             "Engine).  Entries: requests whose tokens differ from their reference / requests.", ""]
    models = sorted({(c["model"], c["dtype"], c["mode"]) for c in cells},
                    key=lambda x: (MODELS.index(x[0].split("@")[0]) if x[0].split("@")[0] in MODELS else len(MODELS),
                                   x[0], x[2]))
    cols = sorted({(c["threads"], c["B"]) for c in cells})
    lines += ["| model | dtype | decoding | method | " + " | ".join(f"{t} thr, B={b}" for t, b in cols) + " |",
              "|---|---|---|---|" + "---|" * len(cols)]
    for m, dt, mode in models:
        rows = [c for c in cells if (c["model"], c["dtype"], c["mode"]) == (m, dt, mode)]
        for method in dict.fromkeys(c["method"] for c in rows):
            by = {(c["threads"], c["B"]): c for c in rows if c["method"] == method}
            entries = []
            for k in cols:
                c = by.get(k)
                entries.append("" if c is None else f"{c['mismatched']}/{c['requests']}"
                               + (f" (@{min(c['first_diff'])})" if c["mismatched"] else ""))
            lines.append(f"| {m} | {dt} | {mode} | {method} | " + " | ".join(entries) + " |")
    total = sum(c["mismatched"] for c in cells)
    lines += ["", f"{total} of {sum(c['requests'] for c in cells)} requests differ in {len(cells)} cells "
              "(`(@p)`: the earliest first differing position in the cell).", ""]
    (out / "summary.md").write_text("\n".join(lines) + "\n")


# --- main ---------------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder of the records (resumed when it has some)")
    p.add_argument("--quick", action="store_true", help=f"a small run: {QUICK}, the bf16 stack on "
                   f"{QUICK_BF16_METHODS} (options given explicitly win)")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--methods", default=None, help="default: every method and auto, then mixed and mixed-overlap")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--batches", default=None, help="default 1,4,8")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--prompts", type=int, default=None, help="prompts per model (default 8)")
    p.add_argument("--min-len", type=int, default=None, help="default 200")
    p.add_argument("--max-len", type=int, default=None, help="default 1000")
    p.add_argument("--new-tokens", type=int, default=None, help="default 64")
    p.add_argument("--bf16-layers", type=int, default=4)
    p.add_argument("--near-tie", type=float, default=0.0, help="ETA > 0: the head made a near tie (`near_tie`), "
                   "so every bit of a row shows in its tokens; recorded as model@tieETA")
    p.add_argument("--ouro-src", default=str(ROOT.parent / "shared" / "checkpoints" / "ouro-1.4b"))
    p.add_argument("--models-dir", default="/tmp/dasspec-stress-models", help="where the random models are kept")
    p.add_argument("--data", default=os.environ.get("DASSPEC_DATA") or str(ROOT.parent / "shared" / "data"))
    args = p.parse_args(argv)
    defaults = dict(prompts=8, new_tokens=64, batches="1,4,8", min_len=200, max_len=1000)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, QUICK[k] if args.quick else v)
    if args.prompts < 1 or args.new_tokens < 1 or not 1 <= args.min_len <= args.max_len:
        p.error("--prompts and --new-tokens must be >= 1, and 1 <= --min-len <= --max-len")

    os.environ.setdefault("DASSPEC_CACHE", tempfile.mkdtemp(prefix="dasspec-stress-cache-"))  # auto's calibration
    import torch
    import dasspec
    from tqdm import tqdm

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = cpu_info()
    (out / "machine.json").write_text(json.dumps(info, indent=1) + "\n")
    all_methods = [m for m in dasspec.method_names() if m != "ar"]
    all_methods = ["ar"] + sorted(m for m in all_methods if m != "auto") + ["auto"]
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.folders = dict(m.split("=", 1) for m in models if "=" in m)        # NAME=FOLDER: a checkpoint of one's own
    models = [m.split("=", 1)[0] for m in models]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    batches = [int(b) for b in args.batches.split(",")]
    threads = [int(t) for t in args.threads.split(",")]

    def methods_of(model_name: str) -> list[str]:
        given = args.methods or (QUICK_BF16_METHODS if args.quick and model_name == "bf16-stack" else None)
        return [m.strip() for m in given.split(",")] if given else all_methods + ["mixed", "mixed-overlap"]

    tag = f"@tie{args.near_tie:g}" if args.near_tie else ""
    plan = [(m + tag, mode, method, B, t) for m in models for mode in modes for method in methods_of(m)
            for B in batches for t in threads]
    cells = read_jsonl(out / "cells.jsonl")
    done = {tuple(c[k] for k in CELL_KEY) for c in cells}
    refs = {(r["model"], r["mode"], r["digest"], r["new_tokens"]): r["tokens"] for r in read_jsonl(out / "refs.jsonl")}
    texts = prompt_texts(Path(args.data) if args.data else None)
    bar = tqdm(total=len(plan), initial=sum(1 for c in plan if c in done), unit="cell", file=sys.stderr)
    loaded: dict = {}
    for cell in plan:
        if cell in done:
            continue
        name, mode, method, B, t = cell
        if name not in loaded:
            loaded.clear()                              # one model in memory at a time
            torch.set_num_threads(1)
            model = load(name.split("@")[0], args)
            loaded[name] = (model, make_prompts(model, texts, args.prompts, args.min_len, args.max_len))
        model, prompts = loaded[name]
        bar.set_description(f"{name} {mode} {method} B={B} t={t}")
        want = [(name, mode, digest(pr), args.new_tokens) for pr in prompts]
        torch.set_num_threads(1)
        for i, (key, pr) in enumerate(zip(want, prompts)):
            if key not in refs:
                opts = dict(SAMPLING) if mode == "sampled" else {}
                refs[key] = dasspec.generate(model, pr, "ar", max_new_tokens=args.new_tokens, eos=False, seed=i,
                                             **opts).tokens
                append(out / "refs.jsonl", {"model": name, "mode": mode, "digest": key[2], "prompt_tokens": len(pr),
                                            "new_tokens": args.new_tokens, "tokens": refs[key]})
        torch.set_num_threads(t)
        t0 = time.perf_counter()
        try:
            mixed = [m for m in methods_of(name) if not m.startswith("mixed")] or all_methods
            got = decode(model, prompts, method, B, mode, args.new_tokens, mixed)
            error = None
        except Exception as e:                          # a crash is a finding too: recorded, the run goes on
            got, error = [], f"{type(e).__name__}: {e}"
        seconds = time.perf_counter() - t0
        torch.set_num_threads(1)
        diffs = [(i, m, first_diff(tokens, refs[want[i]])) for i, m, tokens in got]
        bad = [(i, m, d) for i, m, d in diffs if d is not None]
        row = dict(zip(CELL_KEY, cell), dtype=str(model.dtype).replace("torch.", ""),
                   requests=len(got) if error is None else len(prompts),
                   mismatched=len(bad) if error is None else len(prompts),
                   first_diff=[d for _, _, d in bad] or ([0] if error else []),
                   differing=[[i, m] for i, m, _ in bad], seconds=round(seconds, 2),
                   prompt_tokens=[len(pr) for pr in prompts], new_tokens=args.new_tokens, error=error)
        append(out / "cells.jsonl", row)
        cells.append(row)
        done.add(cell)
        report(out, cells, info, args)
        bar.update(1)
    bar.close()
    report(out, cells, info, args)
    print((out / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
