"""auto's steps in a server's life (issue 37): one long-lived engine (bundled model, max_batch 8, 2 threads) serves
16 GSM8K 2-shot / MBPP requests one at a time, then 16 with 4 closed-loop clients; for each step of the second level
with 3 or more requests: the arms (``*``: a probe), each request's own DAS-Wave tokens per block (its blocks
measured), and the step as predicted (tokens, verification and drafting ms, verifier rows) against measured (tokens,
step and drafting ms, rows; JOIN: a prompt's prefill rode in the step).
    PYTHONPATH=. python docs/performance/auto/server_steps.py"""
import time, torch
torch.set_num_threads(2)
import dasspec
from dasspec.eval.bench.setup import dev_prompts
from dasspec.methods import auto as A

model = dasspec.load_model()
prompts = dev_prompts(model, "gsm8k,mbpp", 4, 128, ["gsm8k=2"], "../shared/data")
log = []
propose, observe = A.AutoDrafter.propose_batch, A.AutoSession.observe


def predicted(d, sessions, arms):
    """(tokens, verification s, drafting s, rows) the cost model expects of the step, None while a part is unmeasured."""
    step = d.batch_step(sessions, arms)
    return None if step is None else (step[0], step[2], step[3], step[1])


def traced(self, sessions):
    t0 = time.perf_counter()
    out = propose(self, sessions)
    log.append(dict(t0=t0, ids={id(s) for s in sessions}, arms=[s.arm + ("*" if s.probe else "") for s in sessions],
                    own=[(round(s.arms["das-wave"].tok or 0, 1), s.arms["das-wave"].n) for s in sessions],
                    pred=predicted(self, sessions, [s.arm for s in sessions]), draft=self._d_prev, tok=0, rows=0))
    return out


def observed(self, verdict):
    log[-1]["tok"] += len(verdict.tokens)
    log[-1]["rows"] += int(verdict.pred.shape[0])
    observe(self, verdict)


A.AutoDrafter.propose_batch, A.AutoSession.observe = traced, observed
eng = dasspec.Engine(model, method="auto", max_batch=8)
for C in (1, 4):
    log.clear()
    todo, live, done = list(range(16)), set(), 0
    while done < 16:
        while todo and len(live) < C:
            p = prompts[todo[0] % len(prompts)]
            todo.pop(0)
            live.add(eng.add(p.ids, max_new_tokens=128, stop=list(p.task.stop) or None))
        for ev in eng.step():
            if ev.finished and ev.id in live:
                live.discard(ev.id)
                done += 1
print("step | arms | own DAS-Wave tokens/block (blocks) | predicted tok verify draft rows | measured tok step draft rows")
for i in range(len(log) - 1):
    L, nxt = log[i], log[i + 1]
    if len(L["arms"]) < 3 or L["pred"] is None:
        continue
    tok, v, dr, rows = L["pred"]
    c = {x: L["arms"].count(x) for x in dict.fromkeys(L["arms"])}
    print(f"{i:3d} | {c} | {L['own']} | {tok:5.1f} {v * 1e3:6.1f} {dr * 1e3:6.1f} {rows:4.0f} | {L['tok']:3d} "
          f"{(nxt['t0'] - L['t0']) * 1e3:6.1f} {L['draft'] * 1e3:6.1f} {L['rows']:4d}{' JOIN' if nxt['ids'] - L['ids'] else ''}")
