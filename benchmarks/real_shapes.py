"""Huginn-0125 (or Ouro-1.4B: ``--layout ouro``; Nanbeige4.2-3B: ``--layout nanbeige``) at its real size on this machine's CPU, with random weights of the
real layout.

From the real repository's files without the weights (config.json, model.safetensors.index.json when there is one,
tokenizer) a checkpoint of the real shapes is built once (``dasspec.testing.build_real_checkpoint``: Huginn-0125,
four float32 shards, 15.6 GB; Ouro-1.4B, one bfloat16 model.safetensors, 2.9 GB), then loaded and decoded as a
user with the real folder would (``load_model(folder, dtype=...)``):

* load time and peak resident memory, in float32 and bfloat16, each in a fresh process;
* tokens/s of AR and the speculative methods (Huginn: Mature-Spec and DAS-Wave at R = 32; Ouro: SAM-Decoding and
  DAS-Wave at its T = 4; a few tokens each, the family's default knobs) in bfloat16 and float32, and whether each
  speculative method's tokens equal AR's (in float32 they must);
* the depth cache's bytes per token at R = 32 in bfloat16, computed and allocated, against the README's 2.7 MB.

Random weights decide nothing about acceptance (a speculative method accepts almost nothing on them, so its
tokens/s here is a floor, not a forecast); what they do measure is the cost of the passes, the memory and the
losslessness.

    python benchmarks/real_shapes.py --huginn-files ../shared/checkpoints/huginn-0125 \\
        --ckpt /tmp/dasspec-big/huginn-0125-random --out runs/real_shapes --tokens 4 --threads 2

    python benchmarks/real_shapes.py --layout ouro --out runs/real_shapes_ouro      # build, load, bf16 decode

Heavy: the float32 load holds 15.6 GB; run it on a quiet machine.  ``--scale small`` runs everything on the
scaled-down layout in seconds (a dry run of the script).  ``--phases`` picks a subset (build, load, bf16, fp32,
batch: AR through the batched engine at ``--batches`` in bfloat16, the wide-bfloat16 shortcut on and off);
``--methods`` the decoded methods.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "The recurrent-depth model reads the question twice and then answers:"
README_BYTES_PER_TOKEN = 2.7e6          # Huginn-0125's depth cache per token in the README
# --layout: the repository files, where the checkpoint goes, the default phases and depth, the report's title
LAYOUTS = {
    "huginn": dict(files="../shared/checkpoints/huginn-0125", ckpt="/tmp/dasspec-big/huginn-0125-random",
                   phases="build,load,bf16,fp32", R=32, methods="ar,mature-spec,das-wave", title="Huginn-0125"),
    "ouro": dict(files="../shared/checkpoints/ouro-1.4b", ckpt="/tmp/dasspec-big/ouro-1.4b-random",
                 phases="build,load,bf16", R=4, methods="ar,sam,das-wave", title="Ouro-1.4B"),
    # files: ``python benchmarks/nanbeige_files.py --out /tmp/dasspec-big/nanbeige-files [--layers N]``
    "nanbeige": dict(files="/tmp/dasspec-big/nanbeige-files", ckpt="/tmp/dasspec-big/nanbeige-random",
                     phases="build,load,bf16", R=2, methods="ar,self-spec,das-wave,pld", title="Nanbeige4.2-3B"),
}


def _peak_rss() -> int:
    from dasspec.model.memory import _proc_bytes
    return _proc_bytes("/proc/self/status", "VmHWM") or 0


def child_load(ckpt: str, dtype: str) -> dict:
    """Load once in this (fresh) process: seconds, peak resident memory, the model's bytes."""
    import torch
    import dasspec
    import dasspec.model.checkpoint, dasspec.model.tokenizer    # noqa: F401  (imported before the baseline)
    from dasspec.model.memory import _proc_bytes

    base = _proc_bytes("/proc/self/status", "VmRSS") or 0
    t = time.perf_counter()
    model = dasspec.load_model(ckpt, device="cpu", dtype=getattr(torch, dtype))
    seconds = time.perf_counter() - t
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"dtype": dtype, "seconds": seconds, "peak_rss": _peak_rss(), "rss_before": base, "model_bytes": size,
            "peak_over_model": (_peak_rss() - base) / size}


def child_decode(ckpt: str, dtype: str, tokens: int, R: int, methods: tuple[str, ...], rounds: int = 1) -> dict:
    """``methods`` (AR first) on one prompt, ``rounds`` times (the order reversed every other round): tokens,
    tokens/s (the fastest round), A, each round's tokens/s; plus the depth cache's bytes per token.  ``auto``'s
    calibration (once per model and machine, then cached) is made and timed before the first round."""
    import torch
    import dasspec
    from dasspec.model.cache import DepthCache, bytes_per_token

    model = dasspec.load_model(ckpt, device="cpu", dtype=getattr(torch, dtype))
    ids = model.tokenizer.encode(PROMPT)
    runs: dict = {}
    calibration = None
    if "auto" in methods:
        t = time.perf_counter()
        dasspec.build_drafter(model, "auto", num_steps=R)
        calibration = time.perf_counter() - t
    for r in range(rounds):
        for method in (methods if r % 2 == 0 else methods[::-1]):
            out = dasspec.generate(model, ids, method, max_new_tokens=tokens, num_steps=R)
            s = out.stats
            decode = s.wall_time - s.prefill_time
            row = {"tokens": out.tokens, "seconds": s.wall_time, "tokens_per_second": s.tokens_per_second,
                   "prefill_seconds": s.prefill_time, "decode_tokens_per_second": len(out.tokens) / decode,
                   "A": s.A, "sequential_passes": s.sequential_passes, "choices": dict(s.choices)}
            seen = runs.get(method, {}).get("rounds_tokens_per_second", []) + [s.tokens_per_second]
            if method not in runs or s.tokens_per_second > runs[method]["tokens_per_second"]:
                runs[method] = row
            runs[method]["rounds_tokens_per_second"] = seen
            print(f"  {dtype} round {r} {method}: {len(out.tokens)} tokens in {s.wall_time:.1f} s "
                  f"({s.tokens_per_second:.3f} tok/s, prefill {s.prefill_time:.1f} s) {dict(s.choices) or ''}",
                  file=sys.stderr, flush=True)
    for method in methods[1:]:
        runs[method]["equals_ar"] = runs[method]["tokens"] == runs["ar"]["tokens"]
    capacity = 64
    cache = DepthCache(model.config, R, capacity, "cpu", getattr(torch, dtype))
    held = sum(t.numel() * t.element_size() for t in (cache.core_k, cache.core_v, cache.pre_k, cache.pre_v,
                                                      cache.coda_k, cache.coda_v))
    return {"dtype": dtype, "R": R, "prompt_tokens": len(ids), "runs": runs, "peak_rss": _peak_rss(),
            "rounds": rounds, "calibration_seconds": calibration,
            "cache_bytes_per_token": bytes_per_token(model.config, R, getattr(torch, dtype)),
            "cache_allocated_per_token": held / capacity}


BATCH_PROMPTS = ("The answer is", "Once upon a time", "def main():", "Question: why", "In 1905,", "The loop",
                 "Dear reader,", "x = 3; y =")


def child_batch(ckpt: str, dtype: str, tokens: int, R: int, batches: tuple[int, ...]) -> dict:
    """AR through the batched engine at each batch size B (B short prompts, ``tokens`` new tokens each), with the
    wide-bfloat16 shortcut (``dasspec.model.linear``) on and off: seconds of the prefill step and of each decode
    step, tokens/s after the prefill (B tokens per decode step), and whether each request's tokens equal its batch-1
    decode with the shortcut on (in bfloat16 a wider product may round differently: this measures how often)."""
    import torch
    import dasspec
    from dasspec.model import linear as lin

    model = dasspec.load_model(ckpt, device="cpu", dtype=getattr(torch, dtype))
    tok = model.tokenizer
    has_units = lin.cpu_has_bf16_units()
    runs, alone = [], {}
    for shortcut in (True, False):
        lin.cpu_has_bf16_units = (lambda: has_units) if shortcut else (lambda: True)
        for B in batches:
            engine = dasspec.Engine(model, "ar", num_steps=R, max_batch=B)
            ids = [engine.add(tok.encode(p), max_new_tokens=tokens) for p in BATCH_PROMPTS[:B]]
            seconds = []
            while engine.has_work:
                t = time.perf_counter()
                engine.step()
                seconds.append(time.perf_counter() - t)
            outs = [engine.result(i).tokens for i in ids]
            if B == 1 and shortcut:
                alone[BATCH_PROMPTS[0]] = outs[0]
            decode = seconds[1:]
            run = {"B": B, "shortcut": shortcut, "prefill_step_seconds": seconds[0], "decode_step_seconds": decode,
                   "decode_tokens_per_second": B * len(decode) / sum(decode) if decode else None,
                   "tokens_per_second": B * tokens / sum(seconds), "tokens": outs}
            runs.append(run)
            print(f"  {dtype} B={B} shortcut={shortcut}: prefill step {seconds[0]:.1f} s, decode steps "
                  f"{', '.join(f'{d:.1f}' for d in decode)} s", file=sys.stderr, flush=True)
    lin.cpu_has_bf16_units = lambda: has_units
    return {"dtype": dtype, "R": R, "tokens": tokens, "cpu_has_bf16_units": has_units, "runs": runs,
            "prompt_tokens": [len(tok.encode(p)) for p in BATCH_PROMPTS[:max(batches)]]}


def batch_report(b: dict) -> list[str]:
    base = {r["shortcut"]: r["decode_tokens_per_second"] for r in b["runs"] if r["B"] == 1}
    first = {r["shortcut"]: r["tokens"][0] for r in b["runs"] if r["B"] == min(x["B"] for x in b["runs"])}
    lines = [f"Batched AR through the engine, {b['dtype']}, R = {b['R']}, {b['tokens']} new tokens per request, "
             f"prompts of {min(b['prompt_tokens'])}-{max(b['prompt_tokens'])} tokens (CPU bfloat16 units: "
             f"{b['cpu_has_bf16_units']}):", "",
             "| wide-bf16 shortcut | B | prefill step s | decode step s | tok/s after prefill | x B = 1 | "
             "request 1 = its B = 1 tokens |", "|---|---|---|---|---|---|---|"]
    for r in b["runs"]:
        d = r["decode_step_seconds"]
        rate = r["decode_tokens_per_second"]
        lines.append(f"| {'on' if r['shortcut'] else 'off'} | {r['B']} | {r['prefill_step_seconds']:.1f} | "
                     f"{sum(d) / len(d):.1f} | {rate:.3f} | {rate / base[r['shortcut']]:.2f} | "
                     f"{r['tokens'][0] == first[True]} |")
    return lines + [""]


def run_child(args: argparse.Namespace, *child_args: str) -> dict:
    cmd = [sys.executable, __file__, "--threads", str(args.threads), "--child", *child_args]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with status {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(results: dict) -> str:
    gib = 2 ** 30
    title = LAYOUTS[results.get("layout", "huginn")]["title"]
    lines = [f"# {title} layout at scale {results['scale']}, random weights, CPU, {results['threads']} threads", ""]
    if "build" in results:
        build = results["build"]
        peak = f", peak RSS {build['peak_rss'] / gib:.2f} GiB" if build.get("peak_rss") else ""
        lines += [f"Built in {build['seconds']:.0f} s{peak}.", ""]
    if "load" in results:
        lines += ["| dtype | load s | model | peak RSS | peak added / model |", "|---|---|---|---|---|"]
        for r in results["load"]:
            lines.append(f"| {r['dtype']} | {r['seconds']:.1f} | {r['model_bytes'] / gib:.2f} GiB | "
                         f"{r['peak_rss'] / gib:.2f} GiB | {r['peak_over_model']:.2f} |")
        lines.append("")
    for key in ("bfloat16", "float32"):
        d = results.get("decode", {}).get(key)
        if not d:
            continue
        rounds = d.get("rounds", 1)
        cal = d.get("calibration_seconds")
        lines += [f"{key}, R = {d['R']}, prompt {d['prompt_tokens']} tokens, peak RSS {d['peak_rss'] / gib:.2f} GiB, "
                  f"{rounds} round(s), the fastest shown" + (f"; auto's calibration {cal:.1f} s (once)" if cal else "")
                  + ":", "", "| method | tokens | seconds | tok/s | prefill s | tok/s after prefill | A | equals AR | "
                  "x AR per round: median [range] |", "|---|---|---|---|---|---|---|---|---|"]
        ar_rounds = d["runs"].get("ar", {}).get("rounds_tokens_per_second", [])
        for m, r in d["runs"].items():
            per = [a / b for a, b in zip(r.get("rounds_tokens_per_second", []), ar_rounds)]
            ratio = f"{statistics.median(per):.2f} [{min(per):.2f}, {max(per):.2f}]" if per and m != "ar" else "-"
            lines.append(f"| {m} | {len(r['tokens'])} | {r['seconds']:.1f} | {r['tokens_per_second']:.3f} | "
                         f"{r['prefill_seconds']:.1f} | {r['decode_tokens_per_second']:.3f} | {r['A']:.2f} | "
                         f"{r.get('equals_ar', '-')} | {ratio} |")
        readme = (f" (README: {README_BYTES_PER_TOKEN / 1e6:.1f} MB in bfloat16)"
                  if results.get("layout", "huginn") == "huginn" else "")
        lines += ["", f"Depth cache at R = {d['R']} in {key}: {d['cache_bytes_per_token'] / 1e6:.2f} MB per token "
                      f"computed, {d['cache_allocated_per_token'] / 1e6:.2f} MB allocated{readme}.", ""]
    if "batch" in results:
        lines += batch_report(results["batch"])
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layout", choices=tuple(LAYOUTS), default="huginn")
    p.add_argument("--files", "--huginn-files", dest="files", default=None,
                   help="the real repository's files without weights (default: the layout's, in ../shared)")
    p.add_argument("--ckpt", default=None, help="where the random checkpoint is (built there when it lacks "
                   "config.json; default: under /tmp/dasspec-big)")
    p.add_argument("--scale", choices=("full", "small"), default="full")
    p.add_argument("--out", default="runs/real_shapes")
    p.add_argument("--tokens", type=int, default=4, help="new tokens per method")
    p.add_argument("--R", type=int, default=None, help="recurrence depth (default: the layout's)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--phases", default=None, help="build, load, bf16, fp32 (default: the layout's)")
    p.add_argument("--methods", default=None, help="decoded methods, AR first (default: the layout's)")
    p.add_argument("--batches", default="1,4,8", help="batch sizes of the batch phase")
    p.add_argument("--rounds", type=int, default=1, help="decode phases: each method this many times, alternating "
                   "(tok/s: the fastest; x AR: per round, median and range)")
    p.add_argument("--load-dtypes", default="float32,bfloat16", help="the load phase's dtypes")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()

    import torch
    torch.set_num_threads(args.threads)
    if args.child:
        kind, ckpt, dtype, *rest = args.child
        out = (child_load(ckpt, dtype) if kind == "load"
               else child_batch(ckpt, dtype, int(rest[0]), int(rest[1]), tuple(map(int, rest[2].split(","))))
               if kind == "batch"
               else child_decode(ckpt, dtype, int(rest[0]), int(rest[1]), tuple(rest[2].split(",")), int(rest[3])))
        print(json.dumps(out))
        return

    layout = LAYOUTS[args.layout]
    phases = set((args.phases or layout["phases"]).split(","))
    R = args.R or layout["R"]
    ckpt = Path(args.ckpt or layout["ckpt"])
    results: dict = {"layout": args.layout, "scale": args.scale, "threads": args.threads, "ckpt": str(ckpt),
                     "torch": torch.__version__}
    if "build" in phases and not (ckpt / "config.json").exists():
        from dasspec.testing import build_real_checkpoint
        t = time.perf_counter()
        build_real_checkpoint(args.files or layout["files"], ckpt, scale=args.scale)
        results["build"] = {"seconds": time.perf_counter() - t, "peak_rss": _peak_rss()}
        print(f"built {ckpt} in {results['build']['seconds']:.0f} s", file=sys.stderr, flush=True)
    if "load" in phases:
        results["load"] = [run_child(args, "load", str(ckpt), d) for d in args.load_dtypes.split(",")]
    results["decode"] = {}
    for phase, dtype in (("bf16", "bfloat16"), ("fp32", "float32")):
        if phase in phases:
            results["decode"][dtype] = run_child(args, "decode", str(ckpt), dtype, str(args.tokens), str(R),
                                                 args.methods or layout["methods"], str(args.rounds))
    if "batch" in phases:
        results["batch"] = run_child(args, "batch", str(ckpt), "bfloat16", str(args.tokens), str(R), args.batches)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    text = report(results)
    (out / "report.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
