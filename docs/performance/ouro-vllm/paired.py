"""Whole generate_batch runs of two arms alternating in one process, the A/B scripts' shared loop (layer_ab.py,
recur_ab.py, panels_ab.py): 8 GSM8K prompts of /tmp/vs/prompts.json (the first B) on /tmp/ouro-mid, 32 greedy
tokens, max_batch 8; ``set_arm(model, on)`` switches the arm before each run (outside the timing); tokens are
checked equal; prints the per-pair median time ratio (on / off) with its quartiles."""
import json, statistics, time

import torch

import dasspec


def paired(set_arm, threads: int, B: int, pairs: int, label: str) -> None:
    torch.set_num_threads(threads)
    m = dasspec.load_model('/tmp/ouro-mid', dtype=torch.float32)
    ids = json.load(open('/tmp/vs/prompts.json'))[:B]

    def run(on):
        set_arm(m, on)
        t = time.perf_counter()
        r = dasspec.generate_batch(m, ids, 'ar', max_new_tokens=32, eos=False, max_batch=8)
        return time.perf_counter() - t, [x.tokens for x in r]

    run(True); run(False)
    ratios = []
    for i in range(pairs):
        order = (True, False) if i % 2 == 0 else (False, True)
        res = {f: run(f) for f in order}
        assert res[True][1] == res[False][1]
        ratios.append(res[True][0] / res[False][0])
    q = statistics.quantiles(ratios, n=4)
    print(f"B={B} threads={threads} {label}, time: median {statistics.median(ratios):.3f} "
          f"quartiles {q[0]:.3f} {q[2]:.3f} (n={pairs})")
