"""Prefix sharing through ``dasspec serve`` (issue 34): few-shot requests from concurrent clients, old server
against new, side by side in one run, with the real ``openai`` client.

    python benchmarks/serve_prefix.py --old ../wt-old --out DIR            # 16 GSM8K 8-shot requests at C = 8

For each arm a server is started (the old one from ``--old``, a checkout of the code before the change), loaded by
C clients sending streamed completions back to back, and measured: prompt rows prefilled (prompt tokens minus the
rows taken from shared blocks, ``dasspec.cached_tokens``; the old server shares nothing), completion tokens per
second over the whole load, time to first token p50 / p99, and whether every answer equals full-depth AR (computed
here, alone, by ``dasspec.generate``).  Writes results.json and results.md into --out.  A benchmark, never a
test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import start_server  # noqa: E402


def one(client, prompt: str, stop: list[str], max_tokens: int, method: str) -> dict:
    t0 = time.perf_counter()
    stream = client.completions.create(model="dasspec-tiny", prompt=prompt, max_tokens=max_tokens, stop=stop,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"dasspec": {"method": method}})
    text, first, stats, usage = [], None, {}, None
    for chunk in stream:
        for c in chunk.choices:
            if c.text:
                first = first or time.perf_counter()
                text.append(c.text)
        extra = getattr(chunk, "model_extra", None) or {}
        stats = extra.get("dasspec") or stats
        usage = chunk.usage or usage
    end = time.perf_counter()
    return {"text": "".join(text), "ttft": (first or end) - t0, "end": end - t0,
            "prompt_tokens": usage.prompt_tokens if usage else 0,
            "completion_tokens": usage.completion_tokens if usage else 0,
            "cached_tokens": stats.get("cached_tokens", 0)}


def load(port: int, prompts, concurrency: int, max_tokens: int, method: str) -> tuple[list[dict], float]:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=1800)
    results: list = [None] * len(prompts)
    it = iter(range(len(prompts)))
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                i = next(it, None)
            if i is None:
                return
            results[i] = one(client, prompts[i][0], prompts[i][1], max_tokens, method)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--old", default=None, help="a checkout of the old code")
    p.add_argument("--model", default=None)
    p.add_argument("--method", default="das-wave")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--shots", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default=None)
    p.add_argument("--flags", default="--max-batch 8", help="server flags of both arms")
    p.add_argument("--data", default=os.environ.get("DASSPEC_DATA")
                   or str(Path(__file__).resolve().parents[2] / "shared" / "data"))
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import dasspec
    from dasspec.eval.tasks import get_task

    task = get_task("gsm8k").with_shots(args.shots)
    prompts = [(ex.prompt, list(task.stop)) for ex in task.examples(args.requests, data=args.data)]
    model = dasspec.load_model(args.model)
    print(f"{len(prompts)} GSM8K {args.shots}-shot prompts, {len(model.tokenizer.encode(prompts[0][0]))} tokens "
          "in the first; AR references...", flush=True)
    refs = [dasspec.generate(model, text, "ar", max_new_tokens=args.max_tokens, stop=stop).text
            for text, stop in prompts]
    arms = ([("old", args.old)] if args.old else []) + [("new", None)]
    rows = {}
    for label, checkout in arms:
        proc, port = start_server(args.method, args, out / f"server-{label}.log", checkout, args.flags.split())
        try:
            load(port, prompts[:1], 1, 4, args.method)                    # warm-up (kernels, allocator)
            res, wall = load(port, prompts, args.concurrency, args.max_tokens, args.method)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        prompt_rows = sum(r["prompt_tokens"] for r in res)
        prefilled = sum(r["prompt_tokens"] - r["cached_tokens"] for r in res)
        rows[label] = {
            "prompt_rows": prompt_rows, "prefilled_rows": prefilled,
            "tokens_per_second": sum(r["completion_tokens"] for r in res) / wall, "wall": wall,
            "ttft_p50": float(np.percentile([r["ttft"] for r in res], 50)),
            "ttft_p99": float(np.percentile([r["ttft"] for r in res], 99)),
            "equal_ar": sum(r["text"] == ref for r, ref in zip(res, refs)), "requests": len(res)}
        print(label, json.dumps(rows[label]), flush=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "arms": rows}, indent=1))
    lines = ["# Prefix sharing through dasspec serve", "", f"`{' '.join(sys.argv)}`", "",
             "| arm | prompt rows | rows prefilled | tokens/s | TTFT p50 (s) | TTFT p99 (s) | answers = AR |",
             "|---|---|---|---|---|---|---|"]
    for label, r in rows.items():
        lines.append(f"| {label} | {r['prompt_rows']} | {r['prefilled_rows']} | {r['tokens_per_second']:.1f} | "
                     f"{r['ttft_p50']:.2f} | {r['ttft_p99']:.2f} | {r['equal_ar']}/{r['requests']} |")
    if "old" in rows:
        o, n = rows["old"], rows["new"]
        lines += ["", f"new / old: rows prefilled {o['prefilled_rows'] / max(n['prefilled_rows'], 1):.1f}x fewer, "
                      f"throughput {n['tokens_per_second'] / o['tokens_per_second']:.2f}x, "
                      f"TTFT p50 {o['ttft_p50'] / n['ttft_p50']:.2f}x lower"]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
