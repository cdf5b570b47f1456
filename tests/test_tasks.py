"""Workloads: registry, seeded eval/dev selection, prompt construction, data sources and stop rules."""

import re
import sys

import pytest

from dasspec.engine.core.stopping import StopRule
from dasspec.eval.tasks import DataError, get_task, select, task_names
from dasspec.eval.tasks import gsm8k, math500, mbpp


class CharTokenizer:
    """One token per character (ids 2..), so stop-string tests do not depend on a BPE."""
    chars = "\n" + "".join(chr(c) for c in range(32, 127))

    def encode(self, text):
        return [2 + self.chars.index(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.chars[i - 2] for i in ids if i >= 2)


def stop_at(task, completion: str) -> str:
    """What a generation of ``completion`` keeps under the task's stop rule (as generate applies it)."""
    tok = CharTokenizer()
    rule = StopRule(10_000, [1], task.stop, tok.decode)
    ids = tok.encode(completion)
    hit = rule.scan(ids, 0)
    kept = ids if hit is None else ids[:hit[0]]
    return rule.trim_text(tok.decode(kept))


def test_registry_has_the_four_paper_tasks_with_table4_caps():
    assert task_names() == ["gsm8k", "math500", "humaneval", "mbpp"]
    assert {t: get_task(t).cap for t in task_names()} == {"gsm8k": 512, "math500": 1024, "humaneval": 512,
                                                          "mbpp": 512}
    assert get_task("MATH-500").name == "math500" and get_task("human-eval").name == "humaneval"
    with pytest.raises(ValueError, match="unknown task 'gsm9k'.*gsm8k"):
        get_task("gsm9k")


def test_selection_is_seeded_disjoint_and_prefix_stable():
    ev, dev = select(100, 40, "eval", 0), select(100, 40, "dev", 0)
    assert len(set(ev)) == 40 and len(set(dev)) == 40 and not set(ev) & set(dev)
    assert select(100, 40, "eval", 0) == ev                        # fixed
    assert select(100, 40, "eval", 1) != ev                        # seeded
    assert select(100, 45, "eval", 0)[:40] == ev                   # growing N keeps the first prompts
    assert select(100, 45, "dev", 0)[:40] == dev
    with pytest.raises(ValueError, match="disjoint"):
        select(100, 51)
    with pytest.raises(ValueError, match="split"):
        select(100, 5, "test")
    with pytest.raises(ValueError, match=">= 1"):
        select(100, 0)


def test_gsm8k_prompt_is_eight_shot_chain_of_thought():
    p = gsm8k.prompt("How many?")
    assert p.count("Question: ") == 9 and p.count("Answer: ") == 8
    assert p.startswith("Question: There are 15 trees in the grove.")
    assert p.endswith("\n\nQuestion: How many?\nAnswer:")
    # every exemplar's stated answer is the last number of its reasoning
    for q, reasoning, answer in gsm8k.EXEMPLARS:
        assert re.findall(r"\d+", reasoning)[-1] == answer
        assert f"{reasoning} The answer is {answer}.\n\n" in p
    two = get_task("gsm8k").with_shots(2)
    assert two.shots == 2 and gsm8k.prompt("x", 2).count("Question: ") == 3
    with pytest.raises(ValueError, match="0..8"):
        get_task("gsm8k").with_shots(9)


def test_math500_prompt_has_four_minerva_demonstrations():
    p = math500.prompt("What is $1+1$?")
    assert p.count("Problem:\n") == 5 and p.count("\n\nSolution:\n") == 5
    assert p.count("I hope it is correct.") == 4
    assert p.endswith("Problem:\nWhat is $1+1$?\n\nSolution:\n")
    for problem, solution, answer in math500.DEMONSTRATIONS:
        assert "\\boxed{" + answer + "}" in solution
        assert f"Final Answer: The final answer is ${answer}$. I hope it is correct.\n\n" in p


def test_humaneval_comes_from_the_package_without_a_data_folder(monkeypatch):
    monkeypatch.delenv("DASSPEC_DATA", raising=False)
    task = get_task("humaneval")
    rows = task.load(None)
    assert len(rows) == 164 and rows[0]["task_id"] == "HumanEval/0" and rows[-1]["task_id"] == "HumanEval/163"
    exs = task.examples(40)
    assert len({e.id for e in exs}) == 40
    row = next(r for r in rows if r["task_id"] == exs[0].id)
    assert exs[0].prompt == row["prompt"]                        # the prompt as-is
    dev = task.examples(40, split="dev")
    assert not {e.id for e in exs} & {e.id for e in dev}


def test_dataset_pools_and_prompt_formats_from_the_data_folder(eval_data, monkeypatch):
    DATA = eval_data("gsm8k/test.jsonl", "math500/test.jsonl", "mbpp/mbpp.jsonl")
    g = get_task("gsm8k").examples(3, data=DATA)
    assert all(e.id.startswith("gsm8k/test/") and e.prompt.endswith("\nAnswer:") for e in g)
    assert len(get_task("gsm8k").load(DATA)) == 1319
    m = get_task("math500").examples(2, data=DATA)
    assert m[0].id.startswith("test/") and m[0].prompt.endswith("\n\nSolution:\n")
    rows = get_task("mbpp").load(DATA)
    assert [r["task_id"] for r in rows] == list(range(11, 511))
    ex = mbpp.build(rows[0], 0)
    assert ex.id == "mbpp/11"
    assert ex.prompt == ('"""\nWrite a python function to remove first and last occurrence of a given character '
                         'from the string.\nassert remove_Occ("hello","l") == "heo"\n"""\n')
    # the environment variable is honoured, and is all there is: without it (and offline) there is no data
    monkeypatch.setitem(sys.modules, "datasets", None)
    assert get_task("mbpp").examples(2) == get_task("mbpp").examples(2, data=DATA)
    monkeypatch.delenv("DASSPEC_DATA")
    with pytest.raises(DataError, match="DASSPEC_DATA"):
        get_task("mbpp").examples(2)


def test_the_data_folder_is_the_flag_else_the_environment_never_a_guess(monkeypatch, tmp_path):
    from dasspec.eval.data import data_dir

    monkeypatch.delenv("DASSPEC_DATA", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "shared" / "data").mkdir(parents=True)            # a sibling folder that must not be picked up
    assert data_dir() is None
    with pytest.raises(DataError, match="no data folder: pass --data DIR or set DASSPEC_DATA"):
        data_dir(required=True)
    env, flag = tmp_path / "env", tmp_path / "flag"
    env.mkdir()
    flag.mkdir()
    monkeypatch.setenv("DASSPEC_DATA", str(env))
    assert data_dir() == env and data_dir(required=True) == env
    assert data_dir(flag) == flag                                  # the flag wins over the environment
    with pytest.raises(DataError, match="does not exist.*--data"):
        data_dir(tmp_path / "nope")
    monkeypatch.setenv("DASSPEC_DATA", str(tmp_path / "gone"))
    with pytest.raises(DataError, match="does not exist.*DASSPEC_DATA"):
        data_dir()


def test_without_a_network_the_hub_is_not_tried(monkeypatch):
    """No data folder, ``datasets`` installed, and the hub's name does not resolve: the task says so at once
    instead of letting ``datasets`` retry for tens of seconds (fails when the download is attempted anyway); in
    ``datasets``' offline mode the cache is asked (no name lookup)."""
    import socket
    import types

    from dasspec.eval.tasks import base
    calls = []
    rows = [{"question": "q", "answer": "#### 1"}]
    fake = types.SimpleNamespace(load_dataset=lambda *a, **k: calls.append(a) or rows)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    monkeypatch.delenv("DASSPEC_DATA", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def no_dns(*a, **k):
        raise socket.gaierror(-2, "Name or service not known")
    monkeypatch.setattr(base.socket, "getaddrinfo", no_dns)
    with pytest.raises(DataError, match="cannot resolve huggingface.co.*HF_DATASETS_OFFLINE=1"):
        base.from_hub("GSM8K", "gsm8k/test.jsonl", "openai/gsm8k", "main", split="test")
    assert calls == []
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert base.from_hub("GSM8K", "gsm8k/test.jsonl", "openai/gsm8k", "main", split="test") == rows


def test_missing_data_names_the_remedy(monkeypatch, tmp_path):
    monkeypatch.delenv("DASSPEC_DATA", raising=False)
    monkeypatch.setitem(sys.modules, "datasets", None)           # `import datasets` fails: offline fresh install
    with pytest.raises(DataError, match="--data DIR.*DASSPEC_DATA.*gsm8k/test.jsonl"):
        get_task("gsm8k").examples(2)
    with pytest.raises(DataError, match="math500/test.jsonl is missing"):
        get_task("math500").examples(2, data=tmp_path)
    with pytest.raises(DataError, match="does not exist"):
        get_task("mbpp").examples(2, data=tmp_path / "nope")
    assert len(get_task("humaneval").examples(2, data=tmp_path)) == 2   # falls back to the package


def test_stop_rules_end_at_the_next_exemplar_or_top_level_statement():
    g = get_task("gsm8k")
    assert stop_at(g, " 3 + 4 = 7. The answer is 7.\n\nQuestion: Next one") == " 3 + 4 = 7. The answer is 7.\n\n"
    m = get_task("math500")
    sol = "We get $\\boxed{2}$.\nFinal Answer: The final answer is $2$. I hope it is correct.\n\n"
    assert stop_at(m, sol + "Problem:\nAnother") == sol
    h = get_task("humaneval")
    body = "    # walk the list\n    for x in xs:\n        def inner(y):\n            return y\n    return 1\n"
    assert stop_at(h, body) == body                              # indented comments / defs do not stop
    for tail in ("\ndef other():", "\nclass A:", "\nif __name__ == '__main__':", "\nprint(f(1))", "\n# test"):
        assert stop_at(h, body + tail) == body
    b = get_task("mbpp")
    code = "def f(a):\n    if a:\n        return 1\n    return 2\n"
    assert stop_at(b, code) == code
    for tail in ("\nassert f(1) == 1", '\n"""', "\nprint(f(2))", "\nif True:", "\nclass B:", "\n```"):
        assert stop_at(b, code + tail) == code


def test_with_cap_validates():
    assert get_task("mbpp").with_cap(64).cap == 64
    assert get_task("mbpp").cap == 512                            # the registry entry is unchanged
    with pytest.raises(ValueError, match=">= 1"):
        get_task("mbpp").with_cap(0)
