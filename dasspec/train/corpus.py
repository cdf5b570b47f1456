"""The bundled model's training corpus, built offline, and the check that it holds no evaluation prompt.

Sources (all on disk, no network):

* ``stdlib``  the running interpreter's standard-library ``.py`` files (test suites and site-packages excluded);
* ``gsm8k``   GSM8K *train* (``gsm8k/train.jsonl``) as ``Question: ...\\nAnswer: ...\\n#### N`` (calculator
              annotations ``<<...>>`` removed);
* ``mbpp``    MBPP *train* problems (task_ids 601-974 of ``mbpp/mbpp.jsonl``) as a comment, the tests, the code.

Evaluation splits are never read for training: GSM8K test, MATH-500, HumanEval and MBPP 11-510 are read only by
``eval_prompts`` so that ``build_corpus`` can drop any document that contains one of their prompts and
``contamination`` can prove that none is left (word n-gram probes, as in GPT-3's decontamination).
"""

from __future__ import annotations

import os
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from ..eval.data import data_dir as resolve_data_dir
from ..eval.data import data_file, read_jsonl

MBPP_TRAIN = range(601, 975)          # Hugging Face "train" split of MBPP
MBPP_TEST = range(11, 511)            # the benchmark split
NGRAM = 13                            # words per contamination probe
_EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3", "ensurepip"}


@dataclass
class Document:
    source: str      # "stdlib" | "gsm8k" | "mbpp"
    name: str        # file path or task id, for reports
    text: str


def _jsonl(root: Path, relative: str, *fields: str) -> list[dict]:
    """The rows of a data file, each checked to hold ``fields`` (an error names the file and line otherwise)."""
    return read_jsonl(data_file(root, relative), required=fields)


# --- training sources ------------------------------------------------------------------------------------------

def stdlib_documents(stdlib_dir: str | os.PathLike | None = None) -> list[Document]:
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in _EXCLUDED_DIRS or part.startswith("test_") for part in rel.parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            docs.append(Document("stdlib", str(rel), text))
    if not docs:
        raise FileNotFoundError(f"no standard-library .py files under {root}")
    return docs


def format_gsm8k(question: str, answer: str) -> str:
    answer = re.sub(r"<<[^>]*>>", "", answer)          # calculator annotations are not natural text
    return f"Question: {question.strip()}\nAnswer: {answer.strip()}\n"


def gsm8k_documents(data_dir: Path) -> list[Document]:
    rows = _jsonl(data_dir, "gsm8k/train.jsonl", "question", "answer")
    return [Document("gsm8k", f"train/{i}", format_gsm8k(r["question"], r["answer"])) for i, r in enumerate(rows)]


def format_mbpp(text: str, code: str, tests: list[str]) -> str:
    code = code.replace("\r\n", "\n").replace("\t", "    ")
    return f"# {text.strip()}\n" + "".join(f"# {t.strip()}\n" for t in tests) + code.rstrip() + "\n"


def mbpp_documents(data_dir: Path) -> list[Document]:
    rows = _jsonl(data_dir, "mbpp/mbpp.jsonl", "task_id", "text", "code", "test_list")
    return [Document("mbpp", f"task/{r['task_id']}", format_mbpp(r["text"], r["code"], r["test_list"]))
            for r in rows if r["task_id"] in MBPP_TRAIN]


# --- evaluation prompts (read only to keep them out) -------------------------------------------------------------

def eval_prompts(data_dir: str | os.PathLike | None = None) -> dict[str, list[str]]:
    """The prompts of every evaluation split: GSM8K test questions, MATH-500 problems, HumanEval prompts and
    MBPP 11-510 task texts.  ``data_dir``: the data folder (default ``$DASSPEC_DATA``; an error when neither)."""
    d = resolve_data_dir(data_dir, required=True)
    return {
        "gsm8k-test": [r["question"] for r in _jsonl(d, "gsm8k/test.jsonl", "question")],
        "math500": [r["problem"] for r in _jsonl(d, "math500/test.jsonl", "problem")],
        "humaneval": [r["prompt"] for r in _jsonl(d, "humaneval/HumanEval.jsonl.gz", "prompt")],
        "mbpp-test": [r["text"] for r in _jsonl(d, "mbpp/mbpp.jsonl", "task_id", "text")
                      if r["task_id"] in MBPP_TEST],
    }


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def _probes(prompt: str, n: int = NGRAM) -> list[tuple[str, ...]]:
    """First, middle and last word n-gram of a prompt (the whole prompt when it is shorter than n words)."""
    w = _words(prompt)
    if len(w) <= n:
        return [tuple(w)] if len(w) >= 2 else []
    mid = (len(w) - n) // 2
    return list(dict.fromkeys((tuple(w[:n]), tuple(w[mid: mid + n]), tuple(w[-n:]))))


def contamination(docs: list[Document], prompts: dict[str, list[str]], n: int = NGRAM) -> list[tuple[str, int, str]]:
    """Evaluation prompts found in ``docs``: (split, prompt index, document name) for every prompt all of whose
    probe n-grams occur in one document.  An empty list means the corpus is clean.

    One pass over each document's words: probes are indexed by their first two words, so only positions that
    start a probe are compared in full."""
    by_head: dict[tuple[str, ...], list[tuple[tuple[str, ...], tuple[str, int]]]] = {}
    need: dict[tuple[str, int], int] = {}
    for split, items in prompts.items():
        for i, p in enumerate(items):
            probes = _probes(p, n)
            need[(split, i)] = len(probes)
            for g in probes:
                by_head.setdefault(g[:2], []).append((g, (split, i)))
    hits = []
    for doc in docs:
        w = _words(doc.text)
        found: dict[tuple[str, int], set] = {}
        for j in range(len(w) - 1):
            cands = by_head.get((w[j], w[j + 1]))
            if cands:
                for g, owner in cands:
                    if tuple(w[j: j + len(g)]) == g:
                        found.setdefault(owner, set()).add(g)
        hits += [(s, i, doc.name) for (s, i), got in found.items() if len(got) == need[(s, i)]]
    return hits


# --- the corpus --------------------------------------------------------------------------------------------------

def build_corpus(data_dir: str | os.PathLike | None = None, stdlib_dir: str | os.PathLike | None = None,
                 decontaminate: bool = True) -> list[Document]:
    """Every training document (stdlib, GSM8K train, MBPP 601-974), with documents that contain an evaluation
    prompt removed.  ``data_dir``: the data folder (default ``$DASSPEC_DATA``; an error when neither)."""
    d = resolve_data_dir(data_dir, required=True)
    docs = stdlib_documents(stdlib_dir) + gsm8k_documents(d) + mbpp_documents(d)
    if decontaminate:
        bad = {name for _, _, name in contamination(docs, eval_prompts(d))}
        docs = [doc for doc in docs if doc.name not in bad]
    return docs


def split_corpus(docs: list[Document], val_fraction: float = 0.02, seed: int = 0
                 ) -> tuple[list[Document], list[Document]]:
    """Shuffle documents with a fixed seed and hold out ``val_fraction`` of each source for validation."""
    rng = random.Random(seed)
    train, val = [], []
    for source in sorted({doc.source for doc in docs}):
        part = [doc for doc in docs if doc.source == source]
        rng.shuffle(part)
        k = max(1, round(val_fraction * len(part)))
        val += part[:k]
        train += part[k:]
    rng.shuffle(train)
    return train, val


def corpus_stats(docs: list[Document]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for doc in docs:
        s = out.setdefault(doc.source, {"documents": 0, "chars": 0})
        s["documents"] += 1
        s["chars"] += len(doc.text)
    return out
