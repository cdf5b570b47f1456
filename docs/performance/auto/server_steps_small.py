"""auto's steps in a server's life on the small random Ouro (issue 37): engines ``ar`` and ``auto`` (max_batch 8, 2
threads) each serve 16 requests (GSM8K 0-shot and MBPP, 64 tokens) with C closed-loop clients, taking turns round by
round (outputs checked equal); per round: tok/s of each, their steps and step time, auto's all-plain and drafted
steps, its own ``propose_batch`` time, and the kinds of drafted steps (sorted arms; ``*`` a probe).
    PYTHONPATH=. python docs/performance/auto/server_steps_small.py ROUNDS C [MODEL]
(MODEL: the small Ouro folder, by default where benchmarks/auto_speed.py builds it, /tmp/dasspec-auto-models)"""
import sys, time, statistics, collections, torch
torch.set_num_threads(2)
import dasspec
from dasspec.eval.bench.setup import dev_prompts
from dasspec.methods import auto as A
rounds = int(sys.argv[1]); C = int(sys.argv[2])
src = sys.argv[3] if len(sys.argv) > 3 else "/tmp/dasspec-auto-models/ouro-small"
cap = 64
model = dasspec.load_model(src)
prompts = dev_prompts(model, "gsm8k,mbpp", 4, cap, ["gsm8k=0"], "../shared/data")
log = []
propose = A.AutoDrafter.propose_batch
def traced(self, sessions):
    t0 = time.perf_counter()
    out = propose(self, sessions)
    log.append((t0, time.perf_counter() - t0, tuple(sorted(s.arm + ("*" if s.probe else "") for s in sessions))))
    return out
A.AutoDrafter.propose_batch = traced
engines = {m: dasspec.Engine(model, method=m, max_batch=8) for m in ("ar", "auto")}
for e in engines.values():
    e.add(prompts[0].ids, max_new_tokens=8)
    while e.has_work: e.step()
def level(eng, r, steps):
    todo, live, outs, ntok = list(range(16)), {}, {}, 0
    t = time.perf_counter()
    while len(outs) < 16:
        while todo and len(live) < C:
            i = todo.pop(0); p = prompts[i % len(prompts)]
            live[eng.add(p.ids, max_new_tokens=cap, stop=list(p.task.stop) or None, seed=i + 100 * r)] = i
        t1 = time.perf_counter()
        evs = eng.step()
        steps.append((time.perf_counter() - t1, None))
        for ev in evs:
            if ev.finished and ev.id in live:
                toks = eng.result(ev.id).tokens; outs[live.pop(ev.id)] = toks; ntok += len(toks)
    return ntok / (time.perf_counter() - t), outs
for r in range(rounds):
    log.clear()
    got, steps = {}, {}
    for m in (("ar", "auto") if r % 2 == 0 else ("auto", "ar")):
        steps[m] = []
        got[m] = level(engines[m], r, steps[m])
    assert got["ar"][1] == got["auto"][1]
    kinds = collections.Counter(k for _, _, k in log)
    # auto step time by whether any request drafted
    plain = [s for (s, _), (_, _, k) in zip(steps["auto"], log) if all(a == "ar" for a in k)]
    drafted = [s for (s, _), (_, _, k) in zip(steps["auto"], log) if not all(a == "ar" for a in k)]
    ar_s, au_s = [x for x, _ in steps["ar"]], [x for x, _ in steps["auto"]]
    print(f"round {r}: ar {got['ar'][0]:.1f} auto {got['auto'][0]:.1f} tok/s "
          f"ratio {got['auto'][0] / got['ar'][0]:.3f}; "
          f"steps ar {len(ar_s)} ({sum(ar_s):.2f}s, median {statistics.median(ar_s) * 1e3:.1f}ms) "
          f"auto {len(au_s)} ({sum(au_s):.2f}s) plain {len(plain)} ({sum(plain):.2f}s, median "
          f"{statistics.median(plain) * 1e3 if plain else 0:.1f}ms) drafted {len(drafted)} ({sum(drafted):.2f}s); "
          f"auto's propose {sum(x for _, x, _ in log) * 1e3:.0f}ms", flush=True)
    for k, n in kinds.most_common():
        if not all(a == "ar" for a in k):
            print("   ", n, k)
