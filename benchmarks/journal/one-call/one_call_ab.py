"""A family's one-call paths against the calls they stand in for, paired in one process (issue 53): the same
decode with the loops' call (``Family.recur_rows``), the layers' (``NormedBlock.rows``) or IQuest's mixed attention
(``LoopCoderBlock.mixed_rows``) switched off and on, alternating, tokens checked equal; prints each path's speed
against ``--base`` (median and range over the pairs).  8 prompts of random ids x ``--tokens`` greedy tokens,
``generate_batch`` at ``--batch``, 2 threads.

    python benchmarks/journal/one-call/one_call_ab.py --model /tmp/iquest-mid --pairs 8 [--batch 8] [--method ar]
        [--paths calls,mix,loops] [--base calls]

Paths: ``calls`` (every one-call path off: the sublayers' kernels), ``mix`` (IQuest's mixed attention in one call),
``layers`` (whole layers in one call), ``loops`` (today's default: every path on)."""
import argparse, random, statistics, time
import torch
import dasspec
from dasspec.model.families import iquest
from dasspec.model.layers import NormedBlock

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--pairs", type=int, default=8)
p.add_argument("--batch", type=int, default=8)
p.add_argument("--method", default="ar")
p.add_argument("--tokens", type=int, default=32)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--paths", default="calls,mix,layers,loops")
p.add_argument("--base", default="calls")
a = p.parse_args()
torch.set_num_threads(a.threads)
model = dasspec.load_model(a.model, dtype=torch.float32)
rng = random.Random(0)
prompts = [[rng.randrange(3, model.config.vocab_size) for _ in range(rng.randrange(40, 121))] for _ in range(8)]
family = type(model.family)
OWN = {"recur": family.recur_rows, "rows": NormedBlock.rows, "mixed": iquest.LoopCoderBlock.mixed_rows}
ON = {"calls": (), "mix": ("mixed",), "layers": ("mixed", "rows"), "loops": ("mixed", "rows", "recur")}
off = lambda *args: None


def use(path):
    family.recur_rows = OWN["recur"] if "recur" in ON[path] else off
    NormedBlock.rows = OWN["rows"] if "rows" in ON[path] else off
    iquest.LoopCoderBlock.mixed_rows = OWN["mixed"] if "mixed" in ON[path] else off


def run(path):
    use(path)
    t = time.perf_counter()
    out = dasspec.generate_batch(model, prompts, method=a.method, max_new_tokens=a.tokens, eos=False,
                                 max_batch=a.batch)
    return time.perf_counter() - t, [o.tokens for o in out]


paths = a.paths.split(",")
assert a.base in paths and all(q in ON for q in paths), f"paths among {', '.join(ON)}, --base one of them"
for q in paths:                                                  # warm-up
    run(q)
ratios = {q: [] for q in paths}
for i in range(a.pairs):
    order = paths if i % 2 == 0 else paths[::-1]
    res = {q: run(q) for q in order}
    assert all(res[q][1] == res[a.base][1] for q in paths), "tokens differ"
    for q in paths:
        ratios[q].append(res[a.base][0] / res[q][0])
for q in paths:
    r = ratios[q]
    print(f"{a.model} {a.method} B={a.batch} {q}: speed / {a.base} median {statistics.median(r):.3f} "
          f"[{min(r):.3f}, {max(r):.3f}] n={len(r)}")
