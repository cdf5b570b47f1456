"""Paired old-vs-new run of a closed batch under method auto (issue 37, 2026-12-04): two worker processes, one
importing dasspec from OLD_ROOT (e.g. a `git worktree` of the previous commit), one from NEW_ROOT, each decoding the
bundled model (or MODEL, a folder) on 8 GSM8K questions with generate_batch(max_batch=8, 64 tokens, eos on),
alternated round by round; every round's tokens must be equal; prints each round's tok/s, the drafters chosen
(steps per drafter, summed over the requests) and the median new/old ratio with its range.

    python docs/performance/auto/closed_ab.py OLD_ROOT NEW_ROOT greedy|sampled ROUNDS [METHOD [MAX_BATCH [MODEL [N]]]]

(MAX_BATCH 1: the requests one at a time, as at batch 1.  N questions, default 8: with more than MAX_BATCH some
wait for a slot, and the batch is open - as a server's - until none does.)
"""
import json
import statistics
import subprocess
import sys

WORKER = r'''
import sys, json, time
sys.path.insert(0, sys.argv[1])
import torch; torch.set_num_threads(1)
import dasspec
src = sys.argv[3] or None
model = dasspec.load_model(src, dtype=torch.float32); tok = dasspec.load_tokenizer(src)
qs = [json.loads(l)["question"] for l in open(sys.argv[2])][:int(sys.argv[4])]
prompts = [tok.encode(f"Question: {q}\nAnswer:") for q in qs]
print("ready", flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    opts = dict(do_sample=True, temperature=0.7, top_p=0.95) if cmd["sampled"] else {}
    t = time.perf_counter()
    outs = dasspec.generate_batch(model, prompts, cmd["method"], max_new_tokens=64, max_batch=cmd["max_batch"],
                                  seed=list(range(len(prompts))), **opts)
    dt = time.perf_counter() - t
    choices = {}
    for o in outs:
        for k, v in (o.stats.choices or {}).items():
            choices[k] = choices.get(k, 0) + v
    print(json.dumps({"tps": sum(len(o.tokens) for o in outs) / dt, "toks": [o.tokens for o in outs],
                      "choices": choices}), flush=True)
'''

if __name__ == "__main__":
    old, new, mode, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    method = sys.argv[5] if len(sys.argv) > 5 else "auto"
    max_batch = int(sys.argv[6]) if len(sys.argv) > 6 else 8
    model = sys.argv[7] if len(sys.argv) > 7 else ""
    n = sys.argv[8] if len(sys.argv) > 8 else "8"
    data = "../shared/data/gsm8k/test.jsonl"
    ws = {k: subprocess.Popen([sys.executable, "-c", WORKER, root, data, model, n], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for k, root in (("old", old), ("new", new))}
    for w in ws.values():
        while (line := w.stdout.readline()) and line.strip() != "ready":
            pass
        assert line, "a worker died"
    ratios = []
    for r in range(rounds):
        res = {}
        for k in (("old", "new") if r % 2 == 0 else ("new", "old")):
            ws[k].stdin.write(json.dumps({"sampled": mode == "sampled", "method": method, "max_batch": max_batch})
                              + "\n")
            ws[k].stdin.flush()
            res[k] = json.loads(ws[k].stdout.readline())
        assert res["old"]["toks"] == res["new"]["toks"]
        ratios.append(res["new"]["tps"] / res["old"]["tps"])
        print(r, f"old {res['old']['tps']:.1f} new {res['new']['tps']:.1f} tok/s, new/old {ratios[-1]:.3f}",
              res["old"]["choices"], res["new"]["choices"], flush=True)
    print(f"median new/old {statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]")
