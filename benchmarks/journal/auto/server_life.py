"""A server's life in one process (issue 37): one long-lived Engine per method (max_batch 8, as ``dasspec serve``),
each loaded by C closed-loop clients (a request added as one finishes) for 16 requests per level C, the engines
taking turns level by level (order rotated round by round, so a burst of host load lands on each in turn); every
request's tokens checked equal across the methods; tok/s per engine and level, and the median ratio to the first
method with its range.  Prompts: the first GSM8K (2-shot; 0-shot for a folder) and MBPP prompts, 4 each, cap TOKENS.
    python benchmarks/journal/auto/server_life.py ROUNDS LEVELS METHODS [greedy|sampled [MODEL [TOKENS]]]
    e.g. ... server_life.py 10 4,16 das-wave,auto"""
import os, statistics, sys, time, torch
torch.set_num_threads(2)
import dasspec
from dasspec.eval.bench.setup import dev_prompts

rounds, levels, methods = int(sys.argv[1]), [int(x) for x in sys.argv[2].split(",")], sys.argv[3].split(",")
sampled = len(sys.argv) > 4 and sys.argv[4] == "sampled"
src = sys.argv[5] if len(sys.argv) > 5 and sys.argv[5] else None
cap = int(sys.argv[6]) if len(sys.argv) > 6 else 128
model = dasspec.load_model(src)
prompts = dev_prompts(model, "gsm8k,mbpp", 4, cap, ["gsm8k=0" if src else "gsm8k=2"],
                      os.environ.get("DASSPEC_DATA", "../shared/data"))
opts = dict(do_sample=True, temperature=0.7, top_p=0.95) if sampled else {}
engines = {}
for m in methods:                              # built and warmed as the server does before it listens
    e = engines[m] = dasspec.Engine(model, method=m, max_batch=8)
    e.add(prompts[0].ids, max_new_tokens=8)
    while e.has_work:
        e.step()


def level(eng, C, r):
    todo, live, outs, ntok = list(range(16)), {}, {}, 0
    t = time.perf_counter()
    while len(outs) < 16:
        while todo and len(live) < C:
            i = todo.pop(0)
            p = prompts[i % len(prompts)]
            live[eng.add(p.ids, max_new_tokens=cap, stop=list(p.task.stop) or None, seed=i + 100 * r, **opts)] = i
        for ev in eng.step():
            if ev.finished and ev.id in live:
                toks = eng.result(ev.id).tokens
                outs[live.pop(ev.id)] = toks
                ntok += len(toks)
    return ntok / (time.perf_counter() - t), outs


ratios = {C: {m: [] for m in methods[1:]} for C in levels}
for r in range(rounds):
    for C in levels:
        k = (r + levels.index(C)) % len(methods)
        got = {m: level(engines[m], C, r) for m in methods[k:] + methods[:k]}
        assert all(got[m][1] == got[methods[0]][1] for m in methods), "outputs differ"
        base = got[methods[0]][0]
        for m in methods[1:]:
            ratios[C][m].append(got[m][0] / base)
        print(f"round {r} C={C:2d} " + "  ".join(f"{m} {got[m][0]:6.1f}" for m in methods) + " tok/s  "
              + "  ".join(f"{m}/{methods[0]} {got[m][0] / base:.3f}" for m in methods[1:]), flush=True)
for C in levels:
    print(f"C={C:2d} " + "  ".join(f"{m}/{methods[0]} {statistics.median(v):.3f} [{min(v):.3f}, {max(v):.3f}]"
                                   for m, v in ratios[C].items()))
