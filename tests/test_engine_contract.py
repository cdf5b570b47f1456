"""The engine's contract (issue 52): every ``StepPlan`` the scheduler makes and every ``StepOutput`` the executor
answers is plain data - it pickles, and nothing in it is a callable, a live object or (outside a requested trace) a
tensor - over full runs of every method with sampled, traced, cancelled, timed-out, preempted and prefix-cached
requests; and the statistics users read are written by the output processor alone."""

from __future__ import annotations

import ast
import dataclasses
import enum
import pathlib
import pickle

import pytest
import torch

import dasspec
from dasspec.engine.base.contract import StepOutput, StepPlan
from dasspec.engine.api.engine import Engine
from dasspec.testing import random_model

METHODS = [("ar", {}), ("self-spec", {"draft_depth": 2, "block": 3}), ("mature-spec", {"draft_depth": 2, "block": 3}),
           ("das-wave", {"gamma": 4, "rounds": 3, "w_init": 2, "k": 1}), ("pld", {}),
           ("lookahead", {"window": 3, "ngram": 3, "guess_set": 3}), ("token-recycling", {}), ("sam", {}),
           ("auto", {})]
PLAIN = (int, float, str, bool, type(None), bytes)


def _plain(x, where: str, trace: bool = False) -> None:
    """Fail unless ``x`` is built of plain values: numbers, strings, enums, lists / tuples / dicts of them and the
    contract's dataclasses (a tensor only inside a trace)."""
    if isinstance(x, (enum.Enum,) + PLAIN):
        return
    if isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            _plain(v, f"{where}[{i}]", trace)
        return
    if isinstance(x, dict):
        for k, v in x.items():
            _plain(k, f"{where} key", trace)
            _plain(v, f"{where}[{k!r}]", trace)
        return
    if trace:                                    # a trace's (Draft, Verdict) pairs hold tensors and layouts
        return
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        mod = type(x).__module__
        assert mod in ("dasspec.engine.base.contract", "dasspec.engine.base.sampling", "dasspec.model.exit"), \
            f"{where}: a {type(x).__name__} from {mod} is not part of the contract"
        for f in dataclasses.fields(x):
            _plain(getattr(x, f.name), f"{where}.{f.name}", trace or f.name == "trace")
        return
    raise AssertionError(f"{where}: {type(x).__name__} is not plain data ({x!r:.80})")


def _checked(engine: Engine) -> list:
    """Wrap the engine's executor so every plan and output is checked plain and round-tripped through pickle."""
    seen = []
    execute = engine.executor.execute

    def spy(plan: StepPlan) -> StepOutput:
        _plain(plan, "plan")
        assert pickle.loads(pickle.dumps(plan)) == plan
        out = execute(plan)
        _plain(out, "output")
        again = pickle.loads(pickle.dumps(out))
        assert again.requests.keys() == out.requests.keys() and again.failed == out.failed
        seen.append((plan, out))
        return out

    engine.executor.execute = spy
    return seen


@pytest.fixture(scope="module")
def model():
    return random_model("huginn", seed=7, mean_recurrence=4, n_prelude=1, n_core=1, n_coda=1, vocab_size=256)


@pytest.mark.parametrize("method,knobs", METHODS, ids=[m for m, _ in METHODS])
def test_every_plan_and_output_of_a_run_is_plain_data(model, method, knobs):
    pc = dasspec.PrefixCache(model, [11, 12, 13, 14] * 5, block_size=8)
    engine = Engine(model, method, knobs, max_batch=3, kv_budget=160, block_size=8)
    seen = _checked(engine)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 7] * 3, [8, 9, 4], [11, 12, 13, 14] * 5 + [3, 4], [2, 3] * 12, [9] * 20]
    ids = [engine.add(prompts[0], max_new_tokens=24, eos=False, trace=True),
           engine.add(prompts[1], max_new_tokens=24, eos=False, do_sample=True, temperature=0.8, seed=3),
           engine.add(prompts[2], max_new_tokens=16, eos=False, prefix_cache=pc),
           engine.add(prompts[3], max_new_tokens=30, eos=False),
           engine.add(prompts[4], max_new_tokens=30, eos=False, timeout=1e-6)]
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        if steps == 3:
            engine.cancel(ids[3])
    results = [engine.result(i) for i in ids]
    assert [r.stop_reason for r in results] == ["max_new_tokens"] * 3 + ["cancelled", "timeout"]
    assert results[0].trace and all(len(t) == 2 for t in results[0].trace)
    assert results[2].stats.cached_tokens == 16
    assert results[0].stats.verify_events > 0 and results[0].stats.sequential_passes > 0
    assert any(p.start for p, _ in seen) and any(p.release for p, _ in seen)
    assert any(o.requests and o.verify_time > 0 for _, o in seen)
    alone = dasspec.generate(model, prompts[0], max_new_tokens=24, eos=False)
    assert results[0].tokens == alone.tokens


def test_preempted_requests_plans_are_plain_data(model):
    """Swap-out and swap-in travel as ids and block ids."""
    engine = Engine(model, "das-wave", {"gamma": 4, "rounds": 2, "w_init": 2, "k": 1}, max_batch=4, kv_budget=96,
                    block_size=8)
    seen = _checked(engine)
    for j in range(4):
        engine.add([3 + j, 4, 5] * 4, max_new_tokens=40, eos=False)
    while engine.has_work:
        engine.step()
    assert any(p.swap_out for p, _ in seen) and any(p.swap_in for p, _ in seen)


def test_a_drafter_object_is_named_by_a_handle_and_refused_elsewhere(model):
    """A drafter handed in (``generate(drafter=)``) crosses the contract as a handle; a cache in another process
    (another ``DrafterCache``) refuses it with a message instead of guessing."""
    from dasspec.engine.core.drafters import DrafterCache
    from dasspec.methods import build_drafter

    d = build_drafter(model, "pld", {}, model.R)
    engine = Engine(model, drafter=d, max_batch=1)
    key = engine.drafters.key_of(d)
    assert key.handle is not None and engine.drafters.resolve(key) is d
    built = engine.drafters.get("das-wave", {"gamma": 4})
    recipe = engine.drafters.key_of(built)
    assert recipe.handle is None and pickle.loads(pickle.dumps(recipe)) == recipe
    other = DrafterCache.of_registry(model, model.R)
    assert other.resolve(recipe).knobs == built.knobs
    with pytest.raises(ValueError, match="another process"):
        other.resolve(key)


def test_only_the_output_processor_writes_statistics():
    """``GenerationStats`` is made and written by ``engine/api/output.py`` alone (the scheduler, the executor, the
    verifier and the drafters report plain counts)."""
    root = pathlib.Path(dasspec.__file__).parent
    users = set()
    for path in list((root / "engine").glob("*.py")) + list((root / "methods").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and any(a.name == "GenerationStats" for a in node.names):
                users.add(path.name)
            if isinstance(node, ast.Attribute) and node.attr == "stats" and isinstance(node.ctx, ast.Load) \
                    and path.name not in ("output.py", "generate.py", "options.py"):
                raise AssertionError(f"{path.name}:{node.lineno} reads a request's stats")
    assert users <= {"output.py", "options.py", "generate.py"}, users


def test_events_and_results_equal_an_in_process_run_with_every_output_round_tripped(model):
    """The engine consumes outputs that went through pickle (what a process boundary does) and ends with the same
    tokens, events and statistics counts."""
    def run(roundtrip: bool):
        engine = Engine(model, "das-wave", {"gamma": 4, "rounds": 3, "w_init": 2, "k": 1}, max_batch=2)
        if roundtrip:
            execute = engine.executor.execute
            engine.executor.execute = lambda plan: pickle.loads(pickle.dumps(execute(pickle.loads(pickle.dumps(plan)))))
        ids = [engine.add([5 + j, 6, 7] * 3, max_new_tokens=20, eos=False) for j in range(3)]
        events = [(e.id, list(e.tokens), e.finished, e.reason) for e in engine.run()]
        res = [engine.result(i) for i in ids]
        return events, [(r.tokens, r.stats.verify_passes, r.stats.draft_passes, r.stats.accepted) for r in res]

    with torch.inference_mode():
        assert run(True) == run(False)


def test_the_executor_in_its_own_process_gives_the_same_tokens_for_every_method(model):
    """``executor="process"``: the plans cross a process boundary and every method's tokens equal the in-process
    engine's (greedy and sampled, requests of every method mixed in one batch), and so do every step's events and
    counts but auto's (its choices follow measured times); what cannot cross (a drafter object, a prefix cache) is
    refused with a message."""
    from dasspec.methods import build_drafter

    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 7] * 2, [8, 9, 4], [2, 3] * 10, [9, 1, 9, 1] * 4]

    def run(executor: str):
        with Engine(model, "ar", max_batch=4, executor=executor) as engine:
            ids = []
            for j, (m, k) in enumerate(METHODS):
                sampled = dict(do_sample=True, temperature=0.8, seed=j) if j % 2 else {}
                ids.append(engine.add(prompts[j % len(prompts)], method=m, knobs=k, max_new_tokens=14, eos=False,
                                      **sampled))
            auto = ids[-1]
            events = [(e.id, list(e.tokens), e.finished, str(e.reason)) for e in engine.run() if e.id != auto]
            res = [engine.result(i) for i in ids]
            if executor == "process":
                with pytest.raises(ValueError, match="another process"):
                    engine.add([1, 2], drafter=build_drafter(model, "pld", {}, model.R), max_new_tokens=2)
                with pytest.raises(ValueError, match="another process"):
                    engine.add([1, 2], prefix_cache=dasspec.PrefixCache(model, [1, 2, 3]), max_new_tokens=2)
        return events, [r.tokens for r in res], [(r.stats.verify_passes, r.stats.draft_passes, r.stats.accepted)
                                                 for r in res[:-1]]

    assert METHODS[-1][0] == "auto"
    assert run("process") == run("local")


def test_a_script_read_from_stdin_starts_the_executor_process():
    """A spawned child re-runs the parent's main file; for a script piped to ``python -`` there is none, the child
    died before reading its start-up data and the parent blocked writing it for good (before the fix: a hang)."""
    import subprocess
    import sys

    script = ("import dasspec\nfrom dasspec.engine.api.engine import Engine\nfrom dasspec.testing import random_model\n"
              "m = random_model('huginn', seed=1, mean_recurrence=2, n_prelude=1, n_core=1, n_coda=1)\n"
              "with Engine(m, executor='process') as e:\n"
              "    rid = e.add([3, 4, 5], max_new_tokens=4, eos=False)\n"
              "    list(e.run())\n"
              "    print(e.result(rid).tokens == dasspec.generate(m, [3, 4, 5], max_new_tokens=4, eos=False).tokens)\n")
    got = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0 and got.stdout.strip() == "True", got.stderr[-2000:]
