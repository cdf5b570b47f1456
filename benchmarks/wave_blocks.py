"""What DAS-Wave does to its seed, block by block (the diagnostic behind ``seed_branch`` and ``copy_run``).

Runs DAS-Wave without a seed branch or copy runs on development prompts and, for every block, compares the wave's
proposals (as sent to the verifier, i.e. after ``trim``) and the window's seed with full-depth AR's continuation at
that position: how far each would have been accepted.  A seed that full depth accepts further than the wave's chain
is a block where the shallow rounds drifted off correct copied text.

    python benchmarks/wave_blocks.py --out runs/blocks --tasks gsm8k,mbpp --prompts 4 --shots gsm8k=2

Writes ``blocks.csv`` (one row per block) and ``blocks.md`` (counts per task, and how often a block whose seed
was accepted whole is followed by another: the case for ``copy_run``).  Each block is judged on its own
(the counterfactual "what if the seed had been verified" would change the later blocks, so no totals of tokens).
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path


def matched(proposal: list[int], truth: list[int]) -> int:
    """Length of the common prefix: how many proposals greedy verification would accept."""
    a = 0
    while a < min(len(proposal), len(truth)) and proposal[a] == truth[a]:
        a += 1
    return a


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--tasks", default="gsm8k,mbpp")
    p.add_argument("--prompts", type=int, default=4, help="development prompts per task")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--shots", action="append", default=[], metavar="TASK=N")
    p.add_argument("--knobs", default="",
                   help="DAS-Wave knobs as name=value,... (seed_branch=0 and copy_run=false are forced)")
    p.add_argument("--data", default=None)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)

    import torch
    from tqdm.auto import tqdm

    import dasspec
    from dasspec.eval.bench.runner import dev_prompts, parse_knobs

    if args.threads:
        torch.set_num_threads(args.threads)
    model = dasspec.load_model(args.model)
    knobs = parse_knobs([f"das-wave:{args.knobs}"])["das-wave"] if args.knobs else {}
    knobs.update(seed_branch=0, copy_run=False)         # every block runs its rounds and verifies the chain alone
    prompts = dev_prompts(model, args.tasks, args.prompts, args.max_new_tokens, args.shots, args.data)

    rows = []
    for pr in tqdm(prompts, desc="blocks", unit="prompt"):
        stop = list(pr.task.stop)
        ref = dasspec.generate(model, pr.ids, "ar", max_new_tokens=pr.task.cap, stop=stop)
        out = dasspec.generate(model, pr.ids, "das-wave", max_new_tokens=pr.task.cap, stop=stop, trace=True,
                               **knobs)
        if out.tokens != ref.tokens:
            raise AssertionError(f"{pr.example.id}: DAS-Wave differs from AR")
        text = list(pr.ids) + ref.tokens
        n = len(pr.ids)                                   # the anchor's position: the prefill's token
        for i, (draft, verdict) in enumerate(out.trace):
            seed = [] if draft.notes["seed"] is None else draft.notes["seed"].tolist()
            truth = text[n + 1:]
            a_wave, a_seed = matched(draft.tokens, truth), matched(seed, truth)
            rows.append({"task": pr.task.name, "prompt": pr.example.id, "block": i, "position": n,
                         "seed_len": len(seed), "wave_len": len(draft.tokens), "wave_accepted": a_wave,
                         "seed_accepted": a_seed, "common_prefix": matched(draft.tokens, seed)})
            n += verdict.kept

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "blocks.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    lines = ["| task | blocks | no seed | seed accepted further | of which the whole seed | wave's chain further | "
             "tie | mean wave accepted when the seed won | whole seed -> next block's seed whole too |",
             "|---|---|---|---|---|---|---|---|---|"]
    for task in dict.fromkeys(r["task"] for r in rows):
        g = [r for r in rows if r["task"] == task]
        seeded = [r for r in g if r["seed_len"]]
        won = [r for r in seeded if r["seed_accepted"] > r["wave_accepted"]]
        whole = [r for r in won if r["seed_accepted"] == r["seed_len"]]
        lost = [r for r in seeded if r["seed_accepted"] < r["wave_accepted"]]
        mean_wave = sum(r["wave_accepted"] for r in won) / len(won) if won else float("nan")
        is_whole = [bool(r["seed_len"]) and r["seed_accepted"] == r["seed_len"] for r in g]
        after = [is_whole[i + 1] for i in range(len(g) - 1) if is_whole[i] and g[i + 1]["prompt"] == g[i]["prompt"]]
        lines.append(f"| {task} | {len(g)} | {len(g) - len(seeded)} | {len(won)} | {len(whole)} | {len(lost)} | "
                     f"{len(seeded) - len(won) - len(lost)} | {mean_wave:.1f} | {sum(after)} of {len(after)} |")
    text = (f"DAS-Wave blocks without a seed branch or copy runs, knobs {knobs} (others: the model's defaults), "
            f"{len(prompts)} development prompts, cap {args.max_new_tokens}\n\n" + "\n".join(lines))
    (out_dir / "blocks.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
