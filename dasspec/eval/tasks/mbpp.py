"""MBPP (Austin et al. 2021): code completion, cap 512 (paper Table 4).

Prompt: the code-completion format of bigcode-evaluation-harness (used for code LMs such as StarCoder): the task
description and its first test in a docstring, and the model writes the function from the next line::

    \"\"\"
    Write a python function to remove first and last occurrence of a given character from the string.
    assert remove_Occ("hello","l") == "heo"
    \"\"\"

Stops: that harness's stop strings (a new top-level ``class``, ``assert``, docstring, ``print``, ``if`` or code
fence), or EOS, or the cap.

Pool: the test split, task_ids 11..510 (500 tasks, the MBPP paper's convention); ids ``mbpp/<task_id>``.
"""

from __future__ import annotations

from pathlib import Path

from .base import Example, Task, from_hub, data_file, read_jsonl

STOP = ("\nclass", "\nassert", '\n"""', "\nprint", "\nif", "\n```")
CAP = 512
TEST_IDS = range(11, 511)


def prompt(text: str, first_test: str) -> str:
    return f'"""\n{text.strip()}\n{first_test.strip()}\n"""\n'


def load(root: Path | None) -> list[dict]:
    path = data_file(root, "mbpp/mbpp.jsonl")
    rows = read_jsonl(path) if path else from_hub("MBPP", "mbpp/mbpp.jsonl", "google-research-datasets/mbpp",
                                                  "full", split="test")
    rows = sorted((r for r in rows if r["task_id"] in TEST_IDS), key=lambda r: r["task_id"])
    if len(rows) != len(TEST_IDS):
        raise ValueError(f"MBPP: expected task_ids 11..510 ({len(TEST_IDS)} rows), found {len(rows)}")
    return rows


def build(row: dict, shots: int) -> Example:
    return Example("mbpp", f"mbpp/{row['task_id']}", prompt(row["text"], row["test_list"][0]), row["code"])


TASK = Task("mbpp", CAP, STOP, load, build)
