"""``dasspec serve --ray`` (issue 36) measured on a local Ray instance (127.0.0.1), the bundled model, one torch
thread per replica: one run, ratios side by side.

1. Throughput: the same closed-loop client load (``--clients`` threads, non-streamed greedy DAS-Wave completions
   of a fixed prompt list, ``--requests`` in all) against 1 replica and against 2; tokens/s and requests/s of each,
   their ratio, and whether every answer equals AR's.
2. Failover: with 2 replicas, ``--streams`` long streamed answers (AR and DAS-Wave, greedy and sampled); once each
   has text, the replica running the most of them is killed (SIGKILL); for each stream that was on it, the time
   from the kill to its next token, and whether every client's text equals its AR decode.
3. Prefix locality on a few-shot workload (``--shots`` exemplar blocks x ``--questions`` questions, shuffled,
   4 clients): prefix-aware routing against random routing (and the wall time of each).  If the replicas report a prefix-hit metric
   (``dasspec_prompt_tokens_cached_total``: prompt tokens taken from shared blocks), its rate; otherwise the routing's own locality - of the requests whose prefix an
   earlier request had, the fraction that landed on the replica that had that prefix's previous request - and
   the report says which.

    python benchmarks/serve_ray.py --out runs/serve-ray

Writes results.json and results.md into --out.  A benchmark, never a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "Q: What is 3 + 4?\nA:", "for i in range(",
           "def add(a, b):", "x = [", "The answer is", "def is_prime(n):", "Q: Tom has 5 apples.", "return ",
           "# sort the list\n"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def metric(url: str, series: str) -> float:
    for line in get(url + "/metrics").splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def deploy(serve, port: int, **args) -> str:
    from dasspec.serve.ray_app import build_app

    # DAS-Wave by name: the server's default became auto, and the recorded figures are DAS-Wave's
    serve.run(build_app({"num_cpus": 1, "threads": 1, "max_batch": 8, "max_queue": 32, "method": "das-wave", **args}),
              name="dasspec", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        h = json.loads(get(url + "/health"))
        if sum(r["status"] == "ok" for r in h["replicas"]) >= args.get("replicas", 1):
            return url
        if time.monotonic() > deadline:
            raise RuntimeError(f"replicas did not come up: {h}")
        time.sleep(0.5)


def throughput(client, refs: dict, clients: int, requests: int, max_tokens: int) -> dict:
    jobs = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
    lock, out = threading.Lock(), []

    def worker():
        while True:
            with lock:
                if not jobs:
                    return
                prompt = jobs.pop()
            r = client.completions.create(model="dasspec-tiny", prompt=prompt, max_tokens=max_tokens)
            with lock:
                out.append((prompt, r.choices[0].text, r.usage.completion_tokens))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"requests": len(out), "tokens": sum(n for *_, n in out), "wall_s": wall,
            "tokens_per_s": sum(n for *_, n in out) / wall, "requests_per_s": len(out) / wall,
            "equal_to_ar": sum(text == refs[p] for p, text, _ in out)}


def failover(client, model, url: str, streams: int, max_tokens: int) -> dict:
    import dasspec
    cases = [(("ar", "das-wave")[i % 2], i % 3 == 2, PROMPTS[i % len(PROMPTS)]) for i in range(streams)]
    results, started = {}, [threading.Event() for _ in cases]

    def run(i):
        method, sampled, prompt = cases[i]
        extra = {"extra_body": {"dasspec": {"method": method}}, **({"temperature": 0.8} if sampled else {})}
        text, times, stats = [], [], None
        for c in client.completions.create(model="dasspec-tiny", prompt=prompt, max_tokens=max_tokens, stream=True,
                                           **extra):
            if c.choices and c.choices[0].text:
                text.append(c.choices[0].text)
                times.append(time.monotonic())
                started[i].set()
            stats = getattr(c, "dasspec", None) or stats
        results[i] = ("".join(text), times, stats)
        started[i].set()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for e in started:
        e.wait(120)
    h = json.loads(get(url + "/health"))
    busy = max((r for r in h["replicas"] if r["status"] == "ok"), key=lambda r: r["running"])
    killed = time.monotonic()
    os.kill(busy["pid"], signal.SIGKILL)
    for t in threads:
        t.join()
    gaps, equal = [], 0
    for i, (method, sampled, prompt) in enumerate(cases):
        text, times, stats = results[i]
        ref = dasspec.generate(model, model.tokenizer.encode(prompt), method="ar", max_new_tokens=max_tokens,
                               seed=stats["seed"], **({"do_sample": True, "temperature": 0.8} if sampled else {}))
        equal += text == ref.text
        if stats["failovers"]:
            after = [t for t in times if t > killed]
            gaps.append(round(after[0] - killed, 3) if after else None)
    return {"streams": len(cases), "killed_running": busy["running"], "resumed": len(gaps),
            "death_to_next_token_s": gaps, "equal_to_ar": equal}


def fewshot_prompts(shots: int, questions: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    blocks = []
    for s in range(shots):
        lines = [f"Q: What is {a} + {b}?\nA: {a} + {b} = {a + b}.\n" for a, b in
                 ((rng.randrange(10, 99), rng.randrange(10, 99)) for _ in range(4))]
        blocks.append(f"# Example set {s}\n" + "".join(lines))
    prompts = [blocks[s] + f"Q: What is {q} + {s}?\nA:" for s in range(shots) for q in range(questions)]
    rng.shuffle(prompts)
    return prompts


def locality(client, url: str, prompts: list[str], max_tokens: int) -> dict:
    keyed0 = metric(url, "dasspec_route_prefix_requests_total")
    local0 = metric(url, "dasspec_route_prefix_local_total")
    text = get(url + "/metrics")
    hit_metric = next((line.split("{")[0].split(" ")[0] for line in text.splitlines()
                       if "dasspec_prompt_tokens_cached_total" in line and not line.startswith("#")), None)
    hits0 = metric(url, hit_metric) if hit_metric else 0.0
    prompt0 = metric(url, "dasspec_prompt_tokens_total")
    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda p: client.completions.create(model="dasspec-tiny", prompt=p, max_tokens=max_tokens),
                      prompts))
    wall = time.perf_counter() - t0
    keyed = metric(url, "dasspec_route_prefix_requests_total") - keyed0
    local = metric(url, "dasspec_route_prefix_local_total") - local0
    out = {"requests": len(prompts), "wall_s": wall, "keyed": keyed, "local": local,
           "locality": local / keyed if keyed else None, "hit_metric": hit_metric}
    if hit_metric:
        out["prefix_hit_rate"] = (metric(url, hit_metric) - hits0) / max(1.0, metric(url, "dasspec_prompt_tokens_total")
                                                                      - prompt0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=6)
    ap.add_argument("--shots", type=int, default=4)
    ap.add_argument("--questions", type=int, default=8)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import openai
    import ray
    import torch
    from ray import serve

    import dasspec
    from dasspec.serve.ray_app import local_ray_env, start_serve

    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = dasspec.load_model()
    refs = {p: dasspec.generate(model, model.tokenizer.encode(p), method="ar", max_new_tokens=args.max_tokens).text
            for p in PROMPTS}                    # greedy AR, before any replica runs
    port = free_port()
    ray.init(num_cpus=3, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False,
             configure_logging=False, runtime_env=local_ray_env(), _node_ip_address="127.0.0.1")
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
                     "args": vars(args)}
    try:
        start_serve(serve, {"host": "127.0.0.1", "port": port})
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=600)
        for n in (1, 2):
            url = deploy(serve, port, replicas=n, routing="least-loaded")
            results[f"throughput_{n}"] = throughput(client, refs, args.clients, args.requests, args.max_tokens)
            print(f"{n} replica(s): {results[f'throughput_{n}']}", flush=True)
        results["throughput_ratio"] = results["throughput_2"]["tokens_per_s"] / results["throughput_1"]["tokens_per_s"]
        results["failover"] = failover(client, model, url, args.streams, 96)
        print(f"failover: {results['failover']}", flush=True)
        prompts = fewshot_prompts(args.shots, args.questions)
        for policy in ("prefix", "random"):
            url = deploy(serve, port, replicas=2, routing=policy)
            results[f"locality_{policy}"] = locality(client, url, prompts, 8)
            print(f"{policy}: {results[f'locality_{policy}']}", flush=True)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    (out / "results.json").write_text(json.dumps(results, indent=1))
    t1, t2 = results["throughput_1"], results["throughput_2"]
    f = results["failover"]
    lp, lr = results["locality_prefix"], results["locality_random"]
    what = "prefix hit rate" if lp.get("hit_metric") else "routing locality (no prefix-hit metric on the replicas)"
    md = [f"# dasspec serve --ray ({results['date']}, {results['cpus']} CPUs, bundled model, 1 thread per replica)",
          "", "| | 1 replica | 2 replicas | ratio |", "|---|---|---|---|",
          f"| tokens/s | {t1['tokens_per_s']:.1f} | {t2['tokens_per_s']:.1f} | {results['throughput_ratio']:.2f}x |",
          f"| requests/s | {t1['requests_per_s']:.2f} | {t2['requests_per_s']:.2f} | "
          f"{t2['requests_per_s'] / t1['requests_per_s']:.2f}x |",
          f"| equal to AR | {t1['equal_to_ar']}/{t1['requests']} | {t2['equal_to_ar']}/{t2['requests']} | |", "",
          f"Failover: {f['resumed']} of {f['streams']} streams were on the killed replica; death -> next token: "
          f"{', '.join(f'{g} s' for g in f['death_to_next_token_s'])}; {f['equal_to_ar']}/{f['streams']} texts equal AR.",
          "", f"Few-shot workload ({len(prompts)} requests, {args.shots} prefixes), {what}: prefix-aware "
          f"{(lp.get('prefix_hit_rate') or lp['locality'] or 0):.2f} vs random "
          f"{(lr.get('prefix_hit_rate') or lr['locality'] or 0):.2f} (of the requests whose prefix an earlier "
          f"request had); wall time {lp['wall_s']:.1f} s vs {lr['wall_s']:.1f} s."]
    (out / "results.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
