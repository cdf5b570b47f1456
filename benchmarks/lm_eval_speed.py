"""lm-eval's wall time on a generate_until task, DAS-Wave against full-depth AR, in one run side by side.

    python benchmarks/lm_eval_speed.py --limit 20 --out runs/lm_eval_speed     # GSM8K CoT, the bundled model

Each configuration is one ``lm_eval.simple_evaluate`` call on the in-process dasspec model (``DasspecLM``), timed
from the call to its return (model loading excluded: the model is loaded once and shared); the methods alternate
(``--repeats``), so a load spike on the shared machine hits both.  The script checks that every method's per-sample
outputs and scores equal AR's and writes ``results.json`` (times, speedups, scores) and ``samples_<method>.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder or HF-cache repo id (default: the bundled model)")
    p.add_argument("--task", default="dasspec_gsm8k_cot")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--methods", default="ar,das-wave")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--prefix-cache", action="store_true", help="prefill the prompts' shared few-shot prefix once")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    import lm_eval

    import dasspec
    from dasspec.eval.lm_eval_model import DasspecLM, task_manager

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = dasspec.load_model(args.model)
    methods = args.methods.split(",")
    tm = task_manager()
    times: dict[str, list[float]] = {m: [] for m in methods}
    samples, scores = {}, {}
    for rep in range(args.repeats):
        for method in methods:
            lm = DasspecLM(model=model, method=method, batch_size=args.batch_size, prefix_cache=args.prefix_cache)
            t = time.perf_counter()
            res = lm_eval.simple_evaluate(model=lm, tasks=[args.task], task_manager=tm, limit=args.limit,
                                          log_samples=True, bootstrap_iters=0)
            wall = time.perf_counter() - t
            times[method].append(wall)
            got = [(s["doc_id"], s["resps"], s["filtered_resps"]) for s in res["samples"][args.task]]
            samples.setdefault(method, got)
            scores[method] = {k: v for k, v in res["results"][args.task].items() if isinstance(v, (int, float))}
            print(f"[{rep}] {method}: {wall:.1f} s  {scores[method]}", flush=True)
            if rep == 0:
                with open(out / f"samples_{method}.jsonl", "w") as f:
                    for s in res["samples"][args.task]:
                        f.write(json.dumps({"doc_id": s["doc_id"], "resps": s["resps"],
                                            "filtered_resps": s["filtered_resps"]}, default=str) + "\n")
    ref = methods[0]
    same = {m: samples[m] == samples[ref] and scores[m] == scores[ref] for m in methods}
    best = {m: min(v) for m, v in times.items()}
    result = {
        "task": args.task, "limit": args.limit, "batch_size": args.batch_size, "prefix_cache": args.prefix_cache,
        "threads": args.threads, "model": args.model or "bundled dasspec-tiny", "repeats": args.repeats,
        "wall_s": times, "best_s": best, "speedup_vs_" + ref: {m: best[ref] / best[m] for m in methods},
        "same_outputs_and_scores_as_" + ref: same, "scores": scores,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
        "torch": torch.__version__, "lm_eval": lm_eval.__version__,
    }
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("best_s", "speedup_vs_" + ref, "same_outputs_and_scores_as_" + ref)}))
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
