"""Offline datasets for the lm-eval tasks shipped with dasspec: read from the data folder this project already
uses (``$DASSPEC_DATA``, or ``--metadata '{"data": "DIR"}'``), never downloaded.  Each loader returns a
``datasets.DatasetDict`` with a ``test`` split, as lm-eval's ``custom_dataset`` hook expects."""

from __future__ import annotations

from dasspec.eval.data import data_dir, data_file, read_jsonl

# MBPP tasks 11..510: the test split, as dasspec's own MBPP task (dasspec/eval/tasks/mbpp.py)
MBPP_TEST = range(11, 511)
MC_CHOICES = 4


def _split(rows: list[dict]):
    import datasets                     # optional: Hugging Face datasets, which lm-eval's tasks use

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def _root(kwargs: dict):
    return data_dir(kwargs.get("data"), required=True)


def gsm8k(**kwargs):
    """GSM8K test (1319 rows, file order): question, answer (reasoning, then ``#### n``)."""
    rows = read_jsonl(data_file(_root(kwargs), "gsm8k/test.jsonl"), ("question", "answer"))
    return _split([{"question": r["question"], "answer": r["answer"]} for r in rows])


def _mbpp(kwargs: dict) -> list[dict]:
    rows = read_jsonl(data_file(_root(kwargs), "mbpp/mbpp.jsonl"), ("task_id", "text", "code", "test_list"))
    rows = sorted((r for r in rows if r["task_id"] in MBPP_TEST), key=lambda r: r["task_id"])
    if len(rows) != len(MBPP_TEST):
        raise ValueError(f"MBPP: expected task_ids 11..510 ({len(MBPP_TEST)} rows), found {len(rows)}")
    return rows


def mbpp_mc(**kwargs):
    """MBPP as multiple choice: which of four functions solves the task - its own reference solution, or that of
    three other tasks (rows i + 97, i + 194, i + 291, wrapping), the right one at position i mod 4."""
    rows = _mbpp(kwargs)
    n = len(rows)
    out = []
    for i, r in enumerate(rows):
        others = [rows[(i + 97 * k) % n]["code"] for k in range(1, MC_CHOICES)]
        label = i % MC_CHOICES
        choices = others[:label] + [r["code"]] + others[label:]
        out.append({"task_id": r["task_id"], "text": r["text"], "test": r["test_list"][0],
                    "choices": [c.replace("\r\n", "\n").strip() for c in choices], "label": label})
    return _split(out)


def mbpp_code(**kwargs):
    """MBPP test tasks' reference solutions, for perplexity."""
    return _split([{"task_id": r["task_id"], "code": r["code"].replace("\r\n", "\n").strip()} for r in _mbpp(kwargs)])
