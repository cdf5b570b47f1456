"""What each method earns on a T = 2 checkpoint (Nanbeige4.2, IQuest-Loop): every method at batch 1 on the same
prompts, each prompt decoded by AR and by every method in turn (the order rotated per prompt), ``--rounds`` times,
float32, greedy.  Per method: tokens/s, the ratio to AR's tokens/s per prompt (median [range]), A (accepted tokens
per verification), sequential core passes per token against AR's 2 (the pass-count speedup: what the method would
gain if a pass cost the same at every width), and whether its tokens equal AR's (they must).

    python benchmarks/nanbeige_methods.py --model /tmp/dasspec-big/nanbeige-mid --out benchmarks/records/performance/nanbeige-methods
    python benchmarks/nanbeige_methods.py --model /tmp/iquest-mid --out runs/iquest-methods

Random weights accept little (a depth draft agrees with the target by chance); the prompts include a repetitive one
so the lookup drafters have text to copy.  A checkpoint without tokenizer files (the IQuest-Loop of
``iquest_vllm.py``) gets as many prompts of 40-120 random ids instead, the first a run of 12 ids repeated.  A benchmark, not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

METHODS = ("ar", "self-spec", "mature-spec", "das-wave", "pld", "lookahead", "token-recycling", "sam", "auto")
PROMPTS = ("The cat sat on the mat. The dog sat on the log. The cat sat on the mat. The dog sat on the",
           "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
           "Question: Tom has 3 apples and buys 5 more. How many apples does Tom have?\nAnswer:",
           "The looped transformer reads the same layers twice, so")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--out", default="runs/nanbeige-methods")
    p.add_argument("--rounds", type=int, default=1, help="passes over the prompts (ratios per prompt and round)")
    args = p.parse_args()

    import torch
    import dasspec

    torch.set_num_threads(args.threads)
    model = dasspec.load_model(args.model, device="cpu", dtype=torch.float32)
    methods = args.methods.split(",")
    drafters = {m: dasspec.build_drafter(model, m) for m in methods if m != "ar"}    # kept across prompts
    if model.tokenizer is not None:
        prompts = [model.tokenizer.encode(t) for t in PROMPTS]
    else:                                        # random ids; the first prompt repeats itself
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from iquest_vllm import random_prompts
        prompts = random_prompts(len(PROMPTS), model.config.vocab_size)
        prompts[0] = (prompts[0][:12] * 10)[: len(prompts[0])]
    rows: dict[str, list[dict]] = {m: [] for m in methods}
    for i, ids in enumerate(prompts * args.rounds):
        order = methods[i % len(methods):] + methods[: i % len(methods)]
        for m in order:
            out = dasspec.generate(model, ids, m, drafter=drafters.get(m), max_new_tokens=args.tokens, eos=False)
            s = out.stats
            rows[m].append({"tokens": out.tokens, "tps": s.tokens_per_second, "A": s.A,
                            "passes": s.sequential_passes, "seconds": s.wall_time})
            print(f"prompt {i} {m}: {s.tokens_per_second:.2f} tok/s, A {s.A:.2f}, {s.sequential_passes} passes",
                  file=sys.stderr, flush=True)
    ar = rows["ar"]
    lines = [f"# Every method on {args.model} (T = {model.R}), float32, batch 1, {args.threads} threads, "
             f"{len(prompts)} prompts x {args.tokens} greedy tokens, {args.rounds} round(s)", "",
             "| method | tok/s (mean) | x AR per prompt: median [range] | A | passes per token | pass-count speedup "
             "| tokens = AR's |", "|---|---|---|---|---|---|---|"]
    for m in methods:
        r = rows[m]
        x = [a["tps"] / b["tps"] for a, b in zip(r, ar)]
        passes = sum(a["passes"] for a in r) / sum(len(a["tokens"]) for a in r)
        ar_passes = sum(a["passes"] for a in ar) / sum(len(a["tokens"]) for a in ar)
        lines.append(f"| {m} | {statistics.mean(a['tps'] for a in r):.2f} | {statistics.median(x):.2f} "
                     f"[{min(x):.2f}, {max(x):.2f}] | {statistics.mean(a['A'] for a in r):.2f} | {passes:.2f} | "
                     f"{ar_passes / passes:.2f} | {all(a['tokens'] == b['tokens'] for a, b in zip(r, ar))} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"rows": rows, "threads": args.threads, "tokens": args.tokens,
                                                  "rounds": args.rounds, "prompts": prompts, "model": args.model,
                                                  "torch": torch.__version__}, indent=1))
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
