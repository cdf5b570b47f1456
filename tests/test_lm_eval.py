"""lm-evaluation-harness through dasspec, with lm-eval itself: the in-process model (``DasspecLM``), the offline
tasks shipped in ``dasspec/eval/lm_eval_tasks``, ``dasspec eval``, and ``local-completions`` against
``dasspec serve``.

* log-likelihoods (and rolling ones) equal a plain full-depth forward ``model(ids)`` to float32 precision, and
  ``is_greedy`` is the target's argmax;
* a generate_until task gives the same per-sample outputs and scores with method ``ar``, ``das-wave`` and the
  default (``auto``), each output the text of ``dasspec.generate(method="ar")`` with the task's stop string and
  cap;
* the in-process model (ar, das-wave) and ``local-completions`` against the server give the same samples and
  scores on a generate_until task and a log-likelihood (multiple-choice) task;
* on the two-loop families (tiny random Nanbeige4.2 and IQuest-Loop folders with a tokenizer): scores equal each
  sequence's own forward at the default and a deeper loop count, AR's cached greedy continuation is the scoring
  forward's greedy one, and das-wave, self-spec and auto (with a shared few-shot prefix too) give AR's
  generate_until samples, greedy and sampled.

Needs lm-eval (the ``eval`` extra; scripts/setup.sh installs it) and the evaluation data ($DASSPEC_DATA).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed: pip install 'dasspec[eval]' "
                              "(scripts/setup.sh installs it)")

import dasspec  # noqa: E402
from dasspec.eval.lm_eval_model import DasspecLM, task_manager  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from iquest_reference import write_iquest_checkpoint  # noqa: E402
from reference_impl import write_nanbeige_checkpoint, write_tokenizer  # noqa: E402

BUNDLED = Path(dasspec.__file__).parent / "assets" / "dasspec-tiny"
TOL = dict(rel=1e-5, abs=2e-5)
GSM8K, MC = "dasspec_gsm8k_cot", "dasspec_mbpp_mc"


@pytest.fixture(scope="module")
def model():
    return dasspec.load_model(device="cpu")


def forward(model, ids, **options) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids]), **options)[0].float(), -1)


def instance(kind: str, args: tuple) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def _scores_are_the_forwards(model, pairs, num_steps) -> list:
    """DasspecLM's (das-wave) log-likelihood of each (context, continuation) is the sum over the continuation of a
    plain forward's log-probabilities of that sequence alone (no padding beside a longer one), and its is-greedy flag
    the forward's argmax; returns lm-eval's answers."""
    tok = model.tokenizer
    lm = DasspecLM(model=model, method="das-wave", num_steps=num_steps, batch_size=2)
    got = lm.loglikelihood([instance("loglikelihood", p) for p in pairs])
    for (c, x), (lp, is_greedy) in zip(pairs, got):
        whole = tok.encode(c + x, add_special_tokens=False)
        n = len(whole) - len(tok.encode(c, add_special_tokens=False))
        ref = forward(model, whole, num_steps=num_steps)
        positions = range(len(whole) - n, len(whole))
        assert lp == pytest.approx(sum(ref[t - 1, whole[t]].item() for t in positions), **TOL)
        assert is_greedy == all(ref[t - 1].argmax().item() == whole[t] for t in positions)
    return got


def test_loglikelihood_is_the_full_depth_forward(model):
    tok = model.tokenizer
    context = "Question: Tom has 3 apples and buys 4 more. How many apples does he have?\nAnswer:"
    ctx = tok.encode(context, add_special_tokens=False)
    greedy = dasspec.generate(model, ctx, method="ar", max_new_tokens=4).text
    pairs = [(context, greedy), (context, " He has 7 apples."), ("def add(a, b):", "\n    return a + b")]
    for num_steps in (None, 8):
        got = _scores_are_the_forwards(model, pairs, num_steps)
        assert got[0][1] is True and got[1][1] is False             # AR's own continuation is the greedy one


def test_loglikelihood_rolling_is_the_full_depth_forward(model):
    tok = model.tokenizer
    text = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    ids = tok.encode(text, add_special_tokens=False)
    whole = [tok.bos_id] + ids                           # conditioned on the prefix token (BOS)
    ref = forward(model, whole)
    want = sum(ref[t - 1, whole[t]].item() for t in range(1, len(whole)))
    lm = DasspecLM(model=model, method="ar")
    assert lm.loglikelihood_rolling([instance("loglikelihood_rolling", (text,))]) == [pytest.approx(want, **TOL)]
    # windows of 8 tokens: every token is scored once, with less context, so the total differs
    short = DasspecLM(model=model, method="ar", max_length=8).loglikelihood_rolling(
        [instance("loglikelihood_rolling", (text,))])[0]
    assert short != pytest.approx(want, abs=1e-3)


def samples(result, task):
    return [(s["doc_id"], s["arguments"], s["resps"], s["filtered_resps"]) for s in result["samples"][task]]


def test_generate_until_same_outputs_for_ar_das_wave_and_the_default(model, eval_data):
    eval_data("gsm8k/test.jsonl")
    tm = task_manager(include_defaults=False)         # dasspec's tasks only: indexing lm-eval's own is slow
    # the bundled model ends its answers with EOS before the task's "Question:"; a stop at the end of the first
    # line (lm-eval's gen_kwargs override the task's) exercises the stop strings, and one at "$" only some answers
    cap, until = 40, ["\n", "$"]
    runs = {}
    for method in ("ar", "das-wave", None):               # None: the backend's default method (auto)
        lm = DasspecLM(model=model, batch_size=2, **({} if method is None else {"method": method}))
        runs[method or lm.method] = lm_eval.simple_evaluate(
            model=lm, tasks=[GSM8K], task_manager=tm, limit=2, num_fewshot=2,
            gen_kwargs={"max_gen_toks": cap, "until": until}, bootstrap_iters=0)
    assert set(runs) == {"ar", "das-wave", "auto"}
    a = samples(runs["ar"], GSM8K)
    for method in ("das-wave", "auto"):
        assert samples(runs[method], GSM8K) == a and runs[method]["results"] == runs["ar"]["results"], method
    # each output is AR's decode of the prompt (no BOS, as lm-eval's models) cut at the task's stop string
    stopped = 0
    for _doc, args, resps, _f in a:
        prompt, gen = args[0]
        assert gen["until"] == until
        ref = dasspec.generate(model, model.tokenizer.encode(prompt, add_special_tokens=False), method="ar",
                               max_new_tokens=cap, stop=gen["until"])
        assert resps == [[ref.text]]
        stopped += ref.stop_reason == "stop_string"
    assert stopped >= 1                                   # the stop string is exercised


# --- the other looped families -------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["nanbeige", "iquest-loop"])
def looped(request, tmp_path_factory):
    """A tiny random checkpoint of a two-loop family, in upstream's layout with a tokenizer (IQuest: loop 2's
    window of 8 positions, so the few-shot prompts cross it many times)."""
    root = tmp_path_factory.mktemp(request.param) / "model"
    if request.param == "nanbeige":
        folder = write_nanbeige_checkpoint(root, vocab_size=320, seed=5, tokenizer=write_tokenizer("nanbeige"))
    else:
        folder = write_iquest_checkpoint(root, vocab_size=320, seed=3, tokenizer=write_tokenizer("ouro"))
    model = dasspec.load_model(folder, device="cpu")
    assert model.config.family == request.param and model.R == 2
    return model


def test_looped_families_score_and_generate_through_lm_eval(looped, eval_data):
    model, tok = looped, looped.tokenizer
    context = "Question: Tom has 3 apples and buys 4 more. How many apples does he have?\nAnswer:"
    ctx = tok.encode(context, add_special_tokens=False)
    assert len(ctx) > 2 * max(model.config.loop_window, 1)       # IQuest: scored rows past loop 2's window
    pairs = [(context, " 7 apples."), ("def add(a, b):", "\n    return a + b")]
    for num_steps in (None, 3):
        _scores_are_the_forwards(model, pairs, num_steps)
        lm = DasspecLM(model=model, method="das-wave", num_steps=num_steps, batch_size=2)
        # the cached decode's own continuation is the uncached scoring forward's greedy one; one token changed is not
        greedy = dasspec.generate(model, ctx, method="ar", max_new_tokens=16, num_steps=num_steps).tokens
        other = greedy[:-1] + [(greedy[-1] + 1) % model.config.vocab_size]
        assert [g for _lp, g in lm._loglikelihood_tokens([(None, ctx, greedy), (None, ctx, other)])] == [True, False]

    eval_data("gsm8k/test.jsonl")
    tm = task_manager(include_defaults=False)         # dasspec's tasks only: indexing lm-eval's own is slow
    cap, until = 12, ["\n"]
    runs = {}
    for name, method, extra in (("ar", "ar", {}), ("das-wave", "das-wave", {}), ("self-spec", "self-spec", {}),
                                ("auto", None, {}), ("auto+prefix", None, {"prefix_cache": True}),
                                ("ar sampled", "ar", {"t": 0.8}), ("das-wave sampled", "das-wave", {"t": 0.8})):
        t = extra.pop("t", None)
        lm = DasspecLM(model=model, batch_size=2, **({} if method is None else {"method": method}), **extra)
        gen = {"max_gen_toks": cap, "until": until, **({"do_sample": True, "temperature": t} if t else {})}
        runs[name] = samples(lm_eval.simple_evaluate(model=lm, tasks=[GSM8K], task_manager=tm, limit=2,
                                                     num_fewshot=2, gen_kwargs=gen, bootstrap_iters=0), GSM8K)
    for name in ("das-wave", "self-spec", "auto", "auto+prefix"):
        assert runs[name] == runs["ar"], name
    assert runs["das-wave sampled"] == runs["ar sampled"]
    assert runs["ar sampled"] != runs["ar"]               # the sampled runs sample
    for _doc, args, resps, _f in runs["ar"]:
        prompt, _gen = args[0]
        ids = tok.encode(prompt, add_special_tokens=False)
        assert len(ids) > 4 * max(model.config.loop_window, 1)       # (lm-eval's model cuts to the context)
        ref = dasspec.generate(model, ids[-(model.config.block_size - cap):], method="ar", max_new_tokens=cap,
                               stop=until)
        assert resps == [[ref.text]]


# --- the server ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from test_serve import start_server

    srv = start_server(BUNDLED, tmp_path_factory.mktemp("lm-eval-serve") / "server.log", "--method", "das-wave")
    yield srv
    srv.stop()


def close(a, b) -> bool:
    """Two samples' responses equal: texts exactly, log-likelihoods to float32 precision, is_greedy exactly."""
    if isinstance(a, float) and isinstance(b, float):
        return a == pytest.approx(b, **TOL)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("task", [MC, GSM8K])        # a log-likelihood task, a generate_until task
def test_in_process_and_local_completions_agree(model, server, eval_data, task):
    eval_data("gsm8k/test.jsonl" if task == GSM8K else "mbpp/mbpp.jsonl")
    tm = task_manager(include_defaults=False)         # dasspec's tasks only: indexing lm-eval's own is slow
    options = dict(tasks=[task], task_manager=tm, limit=2, num_fewshot=2 if task == GSM8K else None,
                   gen_kwargs={"max_gen_toks": 32} if task == GSM8K else None, bootstrap_iters=0)
    runs = {m: lm_eval.simple_evaluate(model=DasspecLM(model=model, method=m, batch_size=4), **options)
            for m in ("ar", "das-wave")}
    runs["local-completions"] = lm_eval.simple_evaluate(
        model="local-completions", model_args=f"base_url={server.url}/v1/completions,model=dasspec-tiny,seed=0,"
        "batch_size=4,max_length=4096,max_retries=1", **options)
    ref = runs["ar"]
    for name, run in runs.items():
        got, want = samples(run, task), samples(ref, task)
        assert len(got) == len(want) == (2 if task == MC else 4), name          # GSM8K: two filters
        assert close(got, want), name
        assert run["results"][task] == ref["results"][task], name


def eval_command(tmp_path, root, model_args: str) -> list[str]:
    return [sys.executable, "-m", "dasspec.cli", "eval", "--model", "dasspec", "--model_args", model_args, "--tasks",
            MC, "--limit", "2", "--batch_size", "4", "--output_path", str(tmp_path / "out"), "--log_samples"]


def test_dasspec_eval_command(tmp_path, eval_data):
    root = eval_data("mbpp/mbpp.jsonl")
    env = dict(os.environ, OMP_NUM_THREADS="1", DASSPEC_DATA=str(root))
    done = subprocess.run(eval_command(tmp_path, root, "method=das-wave,threads=1"), capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = list((tmp_path / "out").rglob("results_*.json"))
    assert len(results) == 1 and list((tmp_path / "out").rglob(f"samples_{MC}_*.jsonl"))
    body = json.loads(results[0].read_text())
    assert 0 <= body["results"][MC]["acc,none"] <= 1 and body["config"]["model"] == "dasspec"


def test_dasspec_eval_refuses_a_bad_model_argument_in_one_line(tmp_path, eval_data):
    root = eval_data("mbpp/mbpp.jsonl")
    env = dict(os.environ, OMP_NUM_THREADS="1", DASSPEC_DATA=str(root))
    done = subprocess.run(eval_command(tmp_path, root, "method=nope"), capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith("dasspec: error:")
    assert "nope" in done.stderr.strip().splitlines()[-1]


def test_tasks_read_the_local_data_only(monkeypatch, tmp_path):
    from dasspec.eval.data import DataError
    from dasspec.eval.lm_eval_tasks import utils

    monkeypatch.delenv("DASSPEC_DATA", raising=False)
    with pytest.raises(DataError, match="DASSPEC_DATA"):
        utils.gsm8k()
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text(json.dumps({"question": "1 + 1?", "answer": "2\n#### 2"}) + "\n")
    ds = utils.gsm8k(data=str(tmp_path))
    assert ds["test"][0]["question"] == "1 + 1?"
    with pytest.raises(DataError, match="mbpp"):
        utils.mbpp_mc(data=str(tmp_path))
