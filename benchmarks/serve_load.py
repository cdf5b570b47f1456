"""Serving benchmark (issues 21, 28): ``dasspec serve`` under concurrent streaming clients, one arm against another.

An arm is a method and server flags, and optionally another checkout of dasspec to run the server from (the
"before" of a change: ``--arm before=das-wave@../wt-old --max-batch 1``).  For each arm a server (a subprocess on a
free port) is started and loaded by C closed-loop clients (C = 1, 4, 16), each sending streamed completions back to
back until the level's requests are done.  Per (arm, C):

    requests/s | tokens/s | time to first token p50 / p99 | per-token latency p50 / p99 | equal to the first method

* time to first token: from sending the request to its first text event (queue wait and prefill included);
* per-token latency: per request, (time of the last event - time of the first) / (tokens - 1) - the decoding
  speed a reader of the stream sees once it has started (a batch-1 server decodes one request at a time, so
  under load the wait shows in the time to first token, not here);
* equal: the requests whose text equals the first method's for the same prompt (lossless, end to end).

    python benchmarks/serve_load.py --out runs/serve-load                       # bundled model, das-wave vs ar
    python benchmarks/serve_load.py --methods das-wave,ar --concurrency 1,4,16 --requests 8 --threads 2 --out DIR
    python benchmarks/serve_load.py --arm "serial=das-wave@/path/to/old/checkout" \
        --arm "batched=das-wave --max-batch 16" --arm "ar=ar --max-batch 16" --out DIR

Prompts: the first evaluation prompts of GSM8K (2-shot) and MBPP (the data folder: --data or $DASSPEC_DATA), with
their stop strings and a cap of --max-tokens.  Writes results.json and results.md into --out.  This is a
benchmark, never a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import os


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_arm(text: str) -> tuple[str, str, str | None, list[str]]:
    """``LABEL=METHOD[@CHECKOUT] [FLAGS...]`` (or just ``METHOD``) -> (label, method, checkout or None, flags)."""
    label, eq, rest = text.partition("=")
    if not eq:
        label, rest = text.split()[0], text
    head, *flags = rest.split()
    method, _, checkout = head.partition("@")
    return label.strip(), method, checkout or None, flags


def start_server(method: str, args: argparse.Namespace, log: Path, checkout: str | None = None,
                 flags: list[str] = ()) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = [sys.executable, "-m", "dasspec.cli", "serve", "--method", method, "--port", str(port),
           "--log-level", "warning", "--max-queue", "256", *flags]
    if args.model:
        cmd += ["--model", args.model]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.device:
        cmd += ["--device", args.device]
    out = open(log, "w")
    env = None
    if checkout:             # that checkout's dasspec package first on the path (this venv's dependencies)
        import os
        env = dict(os.environ, PYTHONPATH=str(Path(checkout).resolve()))
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                            cwd=str(Path(checkout).resolve()) if checkout else None)
    out.close()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the {method} server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc, port
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the {method} server did not come up:\n{log.read_text()[-3000:]}")


def stream_one(port: int, prompt: str, stop: list[str], max_tokens: int) -> dict:
    """One streamed completion, timed at each server-sent event."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    if stop:
        body["stop"] = stop
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    text, first, last, usage = [], None, None, None
    for line in r:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        now = time.perf_counter()
        if event.get("usage"):
            usage = event["usage"]
        for choice in event.get("choices", []):
            if choice.get("text"):
                text.append(choice["text"])
                first = first or now
            if choice.get("finish_reason"):
                last = now
    conn.close()
    tokens = usage["completion_tokens"] if usage else 0
    first = first or last
    return {"text": "".join(text), "tokens": tokens, "ttft": first - t0, "end": last - t0,
            "tpot": (last - first) / (tokens - 1) if tokens > 1 else None}


def run_level(port: int, prompts: list[tuple[str, list[str]]], concurrency: int, n_requests: int,
              max_tokens: int) -> tuple[list[dict], float]:
    """``n_requests`` requests by ``concurrency`` closed-loop clients; request i uses prompt i mod len(prompts)."""
    results: list[dict | None] = [None] * n_requests
    next_index = iter(range(n_requests))
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            prompt, stop = prompts[i % len(prompts)]
            results[i] = {**stream_one(port, prompt, stop, max_tokens), "prompt_index": i % len(prompts)}

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in results if r is not None], time.perf_counter() - t0


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def load_prompts(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    from dasspec.eval.tasks import get_task

    out = []
    for name in args.tasks.split(","):
        task = get_task(name.strip())
        if task.name == "gsm8k":
            task = task.with_shots(2)
        out += [(ex.prompt, list(task.stop)) for ex in task.examples(args.prompts, data=args.data)]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=None, help="checkpoint folder (default: the bundled model)")
    p.add_argument("--methods", default="das-wave,ar", help="comma-separated; the first is the reference for "
                                                           "'equal' (any lossless method gives AR's text)")
    p.add_argument("--arm", action="append", default=[], metavar="LABEL=METHOD[@CHECKOUT] [FLAGS]",
                   help="instead of --methods: a labelled server (repeatable; the first is the reference)")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--requests", type=int, default=8, help="requests per level (at least the concurrency)")
    p.add_argument("--tasks", default="gsm8k,mbpp")
    p.add_argument("--prompts", type=int, default=4, help="prompts per task")
    p.add_argument("--data", default=os.environ.get("DASSPEC_DATA") or str(Path(__file__).resolve().parents[2] / "shared" / "data"),
                   help="data folder (default $DASSPEC_DATA, else ../shared/data beside the repository)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2, help="the server's torch threads")
    p.add_argument("--device", default=None)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(args)
    levels = [int(c) for c in args.concurrency.split(",")]
    arms = [parse_arm(a) for a in args.arm] or [(m.strip(), m.strip(), None, []) for m in args.methods.split(",")]
    methods = [a[0] for a in arms]
    rows, texts = [], {}
    for method, served, checkout, flags in arms:
        proc, port = start_server(served, args, out / f"server-{method}.log", checkout, flags)
        try:
            for prompt, stop in prompts[:2]:                       # warm-up, untimed
                stream_one(port, prompt, stop, 8)
            for c in levels:
                results, wall = run_level(port, prompts, c, max(args.requests, c), args.max_tokens)
                for r in results:
                    texts.setdefault((method, r["prompt_index"]), r["text"])
                ref = methods[0]
                equal = sum(texts.get((ref, r["prompt_index"])) == r["text"] for r in results)
                tpot = [r["tpot"] for r in results if r["tpot"] is not None]
                row = {"method": method, "concurrency": c, "requests": len(results), "wall_s": wall,
                       "requests_per_s": len(results) / wall, "tokens_per_s": sum(r["tokens"] for r in results) / wall,
                       "mean_tokens": float(np.mean([r["tokens"] for r in results])),
                       "ttft_p50_ms": 1e3 * pct([r["ttft"] for r in results], 50),
                       "ttft_p99_ms": 1e3 * pct([r["ttft"] for r in results], 99),
                       "tpot_p50_ms": 1e3 * pct(tpot, 50), "tpot_p99_ms": 1e3 * pct(tpot, 99),
                       "equal_to_" + ref: f"{equal}/{len(results)}"}
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    ref = methods[0]
    lines = [f"| arm | C | requests | req/s | tok/s | mean tokens | TTFT p50 / p99 (ms) | per-token p50 / p99 (ms) "
             f"| = {ref} |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['concurrency']} | {r['requests']} | {r['requests_per_s']:.2f} | "
                     f"{r['tokens_per_s']:.1f} | {r['mean_tokens']:.1f} | {r['ttft_p50_ms']:.0f} / "
                     f"{r['ttft_p99_ms']:.0f} | {r['tpot_p50_ms']:.1f} / {r['tpot_p99_ms']:.1f} | "
                     f"{r['equal_to_' + ref]} |")
    lines += ["", "Arms: " + "; ".join(f"{label} = {m}{'@' + c if c else ''} {' '.join(f)}".strip()
                                       for label, m, c, f in arms)]
    base = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["method"] == ref}
    lines += ["", f"| arm | C | tok/s x {ref} at the same C | tok/s x its own C = 1 |", "|---|---|---|---|"]
    for r in rows:
        own1 = next((x["tokens_per_s"] for x in rows if x["method"] == r["method"] and x["concurrency"] == levels[0]),
                    float("nan"))
        lines.append(f"| {r['method']} | {r['concurrency']} | {r['tokens_per_s'] / base.get(r['concurrency'], float('nan')):.2f} "
                     f"| {r['tokens_per_s'] / own1:.2f} |")
    table = "\n".join(lines)
    (out / "results.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
