"""Random engines at the edges (issue 51, "nothing near the edges crashes or loses a request"): does every request of
an ``Engine`` end with its own batch-1 AR tokens, or a prefix of them when it was cancelled, timed out or aborted,
whatever else the engine was doing - and does the pool get every block back?

    python benchmarks/engine_fuzz.py --out runs/engine-fuzz --minutes 10
    python benchmarks/engine_fuzz.py --out runs/engine-fuzz --seed 1234 --cases 1     # one case again, by its seed

A case is drawn from its seed alone: a tiny random model (Huginn, Ouro, Nanbeige or IQuest-Loop; context 48-128
positions), an engine (executor in process or its own, overlap, ``max_batch``, block size 4-16, a small
``kv_budget`` that forces preemption, a small ``max_step_tokens`` that slices prefills by depth, the windowed pool or
the full one, the default method) and 1-10 requests arriving over its first steps: every method or the default,
greedy or sampled (temperature, top-k, the seed), prompts that share a prefix (some through a ``PrefixCache``),
repeat a pattern or repeat another request, prompts of whole blocks, requests that run to the end of the context,
stop ids, EOS, cancels and timeouts, streamers that raise.  Some cases inject failing steps (``abort_running``
after each) and some run ``generate_batch`` instead.  ``--tight`` sizes every pool to the largest request plus a few
positions.  Settings a model refuses (a knob above its ceiling, a request larger than the pool) are skipped.

Per case, its failures: an exception other than an injected one; a request whose tokens or stop reason are not its
AR reference's (cut at its first stop id); a cancelled, timed-out or aborted one whose tokens are not a prefix of it,
or whose reason has no cause; streamed tokens unlike the result's; a missing result; work left; blocks not given
back.  Records: ``DIR/cases.jsonl`` (a line per case, appended: a killed run resumes after its last case) and
``DIR/summary.md``.  A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import dasspec  # noqa: E402
import dasspec.engine.core.executor as executor_mod  # noqa: E402
from dasspec.methods.knobs import CeilingError  # noqa: E402
from dasspec.model.cache import CacheCapacityError  # noqa: E402
from dasspec.testing import random_model  # noqa: E402

METHODS = [("ar", {}), ("self-spec", {"draft_depth": 2, "block": 3}), ("mature-spec", {"draft_depth": 2, "block": 3}),
           ("das-wave", {"gamma": 4, "rounds": 3, "w_init": 2, "k": 1}), ("pld", {}),
           ("lookahead", {"window": 3, "ngram": 3, "guess_set": 3}), ("token-recycling", {}), ("sam", {}),
           ("auto", {"calibrate": False})]
FAMILIES = ["huginn", "ouro", "nanbeige"] * 3 + ["iquest-loop"]


class Injected(RuntimeError):
    """The failure a case injects into a step."""


class BrokenStreamer:
    """A streamer that raises after ``n`` tokens."""

    def __init__(self, n: int):
        self.n = n

    def put(self, value) -> None:
        self.n -= 1
        if self.n < 0:
            raise RuntimeError("streamer broke")

    def end(self) -> None:
        pass


class Fuzzer:
    def __init__(self):
        self._models: dict[tuple, object] = {}
        self._refs: dict[tuple, list[int]] = {}

    def model(self, c: dict):
        key = (c["family"], c["ctx"], c["variant"])
        if key not in self._models:
            fam, v = c["family"], c["variant"]
            depth = ([4, 3] if fam in ("huginn", "ouro") else [3, 4])[v]
            shape = dict(n_prelude=1, n_core=1, n_coda=1) if fam == "huginn" else dict(n_core=2)
            self._models[key] = random_model(fam, seed=7 + v, vocab_size=[256, 64][v], block_size=c["ctx"],
                                             mean_recurrence=depth, **shape)
        return self._models[key]

    def reference(self, c: dict, model, r: dict) -> list[int]:
        key = (c["family"], c["ctx"], c["variant"], tuple(r["prompt"]), r["n"], tuple(sorted(r["sampling"].items())))
        if key not in self._refs:
            self._refs[key] = dasspec.generate(model, list(r["prompt"]), "ar", max_new_tokens=r["n"], eos=False,
                                               **r["sampling"]).tokens
        return self._refs[key]


def draw(seed: int, tight: bool) -> dict:
    """A case, from its seed alone."""
    rng = random.Random(seed)
    ctx = rng.choice([48, 64, 96, 128])
    c = dict(seed=seed, family=rng.choice(FAMILIES), ctx=ctx, variant=rng.randrange(2))
    c["executor"] = "process" if rng.random() < 0.12 else "local"
    c["overlap"] = rng.random() < 0.5
    c["max_batch"] = rng.randint(1, 6)
    c["block_size"] = rng.choice([4, 8, 8, 16])
    c["kv_budget"] = rng.choice([None, rng.randint(ctx // 2, 3 * ctx), rng.randint(ctx, 2 * ctx)])
    c["max_step_tokens"] = rng.choice([None, rng.randint(1, 12), rng.randint(4, 40)])
    c["default"] = rng.choice(METHODS)
    c["window_kv"] = rng.random() < 0.5
    c["generate_batch"] = rng.random() < 0.08 and c["executor"] == "local"
    vocab = [256, 64][c["variant"]]
    shared = [rng.randrange(2, vocab) for _ in range(rng.randint(1, 30))]
    if rng.random() < 0.5:
        shared = (shared[:rng.randint(1, 4)] * 12)[:len(shared)]
    c["prefix_cache"] = shared if c["executor"] == "local" and rng.random() < 0.3 else None
    reqs: list[dict] = []
    for _ in range(rng.randint(1, 10)):
        kind = rng.random()
        if kind < 0.4:
            p = shared + [rng.randrange(2, vocab) for _ in range(rng.randint(0, 10))]
        elif kind < 0.6:
            p = ([rng.randrange(2, vocab) for _ in range(rng.randint(1, 4))] * 20)[:rng.randint(1, 30)]
        else:
            p = [rng.randrange(2, vocab) for _ in range(rng.randint(1, 25))]
        if reqs and rng.random() < 0.12:
            p = list(rng.choice(reqs)["prompt"])
        if rng.random() < 0.15:                       # whole blocks
            p = (p * 10)[:max(c["block_size"], len(p) // c["block_size"] * c["block_size"])]
        p = p[:ctx - 2]
        n = ctx - len(p) - rng.randint(0, 2) if rng.random() < 0.25 else rng.randint(1, min(30, ctx - len(p)))
        r = dict(prompt=p, n=max(1, n), at_step=0 if rng.random() < 0.6 else rng.randint(1, 25),
                 method=rng.choice(METHODS + [None]))
        r["sampling"] = (dict(do_sample=True, temperature=round(rng.uniform(0.5, 1.3), 2), seed=rng.randrange(100))
                         if rng.random() < 0.4 else ({"seed": rng.randrange(5)} if rng.random() < 0.2 else {}))
        r["eos"] = rng.random() < 0.2
        if r["sampling"].get("do_sample") and rng.random() < 0.3:
            r["sampling"]["top_k"] = rng.choice([1, 5, 20])
        if c["family"] == "huginn" and rng.random() < 0.2:
            r["sampling"]["state_seed"] = rng.randrange(3)
        r["broken_after"] = rng.randint(0, 10) if c["executor"] == "local" and rng.random() < 0.05 else None
        r["stop_from_ref"] = rng.randint(0, 40) if rng.random() < 0.3 else None     # a token of its own reference
        r["stop"] = [rng.randrange(0, vocab)] if rng.random() < 0.15 else []
        r["cancel_at"] = rng.randint(0, 20) if rng.random() < 0.15 else None
        r["timeout"] = rng.choice([1e-4, 0.005, 0.03, 0.2]) if rng.random() < 0.1 else None
        r["prefix_cache"] = (c["prefix_cache"] is not None and rng.random() < 0.6
                             and not r["sampling"].get("state_seed"))
        reqs.append(r)
    c["requests"] = reqs
    c["inject_at"] = (sorted(rng.sample(range(25), rng.choice([1, 1, 2, 3])))
                      if c["executor"] == "local" and rng.random() < 0.2 else [])
    if tight:
        tr = random.Random(seed * 7919 + 13)
        c["max_batch"] = tr.randint(2, 8)
        if tr.random() < 0.3:                         # as many again, arriving later, some cancelled
            c["requests"] += [dict(r, sampling=dict(r["sampling"]), at_step=tr.randint(0, 30),
                                   cancel_at=tr.randint(0, 30) if tr.random() < 0.2 else None) for r in reqs]
        c["kv_budget"] = max(len(r["prompt"]) + r["n"] for r in c["requests"]) + tr.randint(2, 30)
        c["max_step_tokens"] = tr.choice([None, tr.randint(1, 6)])
    return c


def expected(ref: list[int], stops: set[int]) -> tuple[list[int], str]:
    for i, t in enumerate(ref):
        if t in stops:
            return ref[:i + 1], "eos"
    return ref, "max_new_tokens"


def run_case(fz: Fuzzer, c: dict) -> tuple[list[str], dict]:
    """The case's failures, and what it did (requests refused, cancelled, aborted; preemptions; steps)."""
    model = fz.model(c)
    eos = set(model.config.eos_token_id)
    for r in c["requests"]:
        ref = fz.reference(c, model, r)
        r["stops"] = r["stop"] + ([ref[min(r["stop_from_ref"], len(ref) - 1)]]
                                  if r["stop_from_ref"] is not None and ref else [])
        r["expected"] = expected(ref, set(r["stops"]) | (eos if r["eos"] else set()))
    if c["generate_batch"]:
        return run_batch(fz, c, model), {}
    kw = dict(max_batch=c["max_batch"], block_size=c["block_size"], overlap=c["overlap"], executor=c["executor"],
              window_kv=c["window_kv"])
    kw.update({k: c[k] for k in ("kv_budget", "max_step_tokens") if c[k] is not None})
    pc = dasspec.PrefixCache(model, c["prefix_cache"], block_size=c["block_size"]) if c["prefix_cache"] else None
    try:
        engine = dasspec.Engine(model, *c["default"], **kw)
    except (CeilingError, ValueError):                # a default method this model refuses
        engine = dasspec.Engine(model, "ar", **kw)
    step_fn = executor_mod.loop_step
    fails: list[str] = []
    ids: dict[int, int] = {}
    streamed: dict[int, list[int]] = {}
    cancelled, aborted, refused = set(), set(), set()
    injected, step = False, 0
    pending = list(range(len(c["requests"])))
    try:
        while True:
            for j in [j for j in pending if c["requests"][j]["at_step"] <= step]:
                pending.remove(j)
                r = c["requests"][j]
                args = dict(max_new_tokens=r["n"], eos=r["eos"], stop=r["stops"] or None, timeout=r["timeout"],
                            **r["sampling"])
                if r["method"] is not None:
                    args["method"], args["knobs"] = r["method"]
                if r["prefix_cache"]:
                    args["prefix_cache"] = pc
                if r["broken_after"] is not None:
                    args["streamer"] = BrokenStreamer(r["broken_after"])
                try:
                    ids[j] = engine.add(r["prompt"], **args)
                    streamed[ids[j]] = []
                except (CacheCapacityError, ValueError) as err:
                    refused.add(j)
                    if not (isinstance(err, (CacheCapacityError, CeilingError))
                            or any(w in str(err) for w in ("kv_budget", "pool", "window_kv"))):
                        fails.append(f"request {j} refused: {type(err).__name__}: {str(err)[:200]}")
            for j, rid in ids.items():
                if c["requests"][j]["cancel_at"] == step:
                    engine.cancel(rid)
                    cancelled.add(j)
            if not engine.has_work and not pending:
                break
            if step in c["inject_at"]:
                def boom(*args, **kwargs):
                    raise Injected("injected")
                executor_mod.loop_step = boom
            try:
                events = engine.step()
            except Injected:
                injected = True
                rid_of = {v: k for k, v in ids.items()}
                aborted |= {rid_of[a] for a in engine.abort_running()}
                events = engine.take_events()
            finally:
                executor_mod.loop_step = step_fn
            for ev in events:
                streamed.setdefault(ev.id, []).extend(ev.tokens)
            step += 1
            if step > 4000:
                fails.append("no end after 4,000 steps")
                break
    except Exception as err:                          # noqa: BLE001 - what the case found
        fails.append("raised: " + "".join(traceback.format_exception(type(err), err, err.__traceback__))[-2500:])
        executor_mod.loop_step = step_fn
        engine.close()
        return fails, {}
    for j, rid in ids.items():
        r = c["requests"][j]
        try:
            res = engine.result(rid)
        except KeyError:
            fails.append(f"request {j}: no result")
            continue
        toks, reason = list(res.tokens), str(res.stats.stop_reason)
        want, want_reason = r["expected"]
        tag = f"request {j} ({r['method'] and r['method'][0]}, P {len(r['prompt'])}, N {r['n']})"
        if reason in ("cancelled", "timeout", "error"):
            cause = {"cancelled": j in cancelled, "timeout": r["timeout"] is not None,
                     "error": j in aborted or r["broken_after"] is not None}[reason]
            if not cause:
                fails.append(f"{tag}: {reason} without a cause")
            if toks != want[:len(toks)]:
                fails.append(f"{tag}: {reason}, tokens not a prefix of AR's: {toks[:20]} / {want[:20]}")
        elif toks != want or reason != want_reason:
            k = next((i for i, (a, b) in enumerate(zip(toks, want)) if a != b), min(len(toks), len(want)))
            fails.append(f"{tag}: {reason} (AR: {want_reason}), first difference at {k}: {toks[k:k + 5]} / "
                         f"{want[k:k + 5]}")
        if not injected and r["broken_after"] is None and streamed.get(rid, []) != toks:
            fails.append(f"{tag}: streamed {streamed.get(rid, [])[:20]}, result {toks[:20]}")
    if engine.has_work:
        fails.append("work left at the end")
    if engine.pool.available != engine.pool.capacity_blocks:
        fails.append(f"blocks not given back: {engine.pool.available} of {engine.pool.capacity_blocks} available")
    did = dict(refused=len(refused), cancelled=len(cancelled), aborted=len(aborted),
               preemptions=engine.scheduler.preemptions, steps=step)
    engine.close()
    return fails, did


def run_batch(fz: Fuzzer, c: dict, model) -> list[str]:
    """``generate_batch`` of the case's prompts (one sampling setting: the first request's, its seed for all)."""
    reqs, sampling = c["requests"], dict(c["requests"][0]["sampling"])
    seed = sampling.pop("seed", 0)
    refs = [fz.reference(c, model, dict(r, sampling={**sampling, "seed": seed} if sampling else {})) for r in reqs]
    kw = {k: c[k] for k in ("kv_budget", "max_step_tokens") if c[k] is not None}
    method, knobs = c["default"]
    try:
        outs = dasspec.generate_batch(model, [r["prompt"] for r in reqs], method, max_new_tokens=[r["n"] for r in reqs],
                                      seed=seed, eos=False, max_batch=c["max_batch"], **sampling, **kw, **knobs)
    except (CacheCapacityError, CeilingError):
        return []
    except Exception as err:                          # noqa: BLE001
        return ["generate_batch raised: " + "".join(traceback.format_exception(type(err), err,
                                                                                err.__traceback__))[-2500:]]
    return [f"generate_batch request {j}: {list(o.tokens)[:20]} / AR {ref[:20]}"
            for j, (o, ref) in enumerate(zip(outs, refs)) if list(o.tokens) != ref]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seed", type=int, default=0, help="the first case's seed (cases take consecutive seeds)")
    p.add_argument("--cases", type=int, default=10**9, help="at most this many cases")
    p.add_argument("--minutes", type=float, default=10.0, help="stop starting cases after this long")
    p.add_argument("--tight", action="store_true", help="pools sized to the largest request plus a few positions")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    from tqdm import tqdm
    a.out.mkdir(parents=True, exist_ok=True)
    log = a.out / "cases.jsonl"
    done = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    seen = {d["seed"] for d in done}
    fz, deadline = Fuzzer(), time.monotonic() + 60 * a.minutes
    bar = tqdm(unit="case", file=sys.stderr, desc="engine fuzz")
    with log.open("a") as f:
        for seed in range(a.seed, a.seed + a.cases):
            if time.monotonic() > deadline:
                break
            if seed in seen:
                continue
            c = draw(seed, a.tight)
            t = time.perf_counter()
            fails, did = run_case(fz, c)
            rec = dict(seed=seed, tight=a.tight, family=c["family"], ctx=c["ctx"], executor=c["executor"],
                       overlap=c["overlap"], window_kv=c["window_kv"], generate_batch=c["generate_batch"],
                       requests=len(c["requests"]), injected=len(c["inject_at"]), seconds=time.perf_counter() - t,
                       failures=fails, **did)
            f.write(json.dumps(rec) + "\n")
            f.flush()
            done.append(rec)
            bar.update(1)
            bar.set_postfix(failed=sum(bool(d["failures"]) for d in done))
            for x in fails:
                tqdm.write(f"seed {seed}: {x}", file=sys.stderr)
    bar.close()
    failed = [d for d in done if d["failures"]]

    def count(key: str) -> int:
        return sum(1 for d in done if d.get(key))

    lines = ["# Random engines at the edges (`benchmarks/engine_fuzz.py`)", "",
             f"{len(done)} cases ({sum(d['requests'] for d in done):,} requests), "
             f"{len(failed)} with failures.", "",
             "| what the cases had | cases |", "|---|---|"]
    for fam in sorted({d["family"] for d in done}):
        lines.append(f"| model: {fam} | {sum(1 for d in done if d['family'] == fam)} |")
    lines += [f"| executor in its own process | {sum(1 for d in done if d['executor'] == 'process')} |",
              f"| overlap | {count('overlap')} |", f"| generate_batch | {count('generate_batch')} |",
              f"| preemption | {count('preemptions')} |", f"| cancels | {count('cancelled')} |",
              f"| injected failing steps | {count('injected')} |", f"| tight pools | {count('tight')} |", ""]
    for d in failed:
        lines.append(f"- seed {d['seed']}: " + "; ".join(x.splitlines()[0] if x else x for x in d["failures"][:3]))
    (a.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
