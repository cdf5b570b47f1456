"""The training corpus holds no evaluation prompt, and the check that says so can fail."""

from __future__ import annotations

from pathlib import Path

import pytest

from dasspec.eval.data import DATA_ENV, DataError, data_dir
from dasspec.train.corpus import (MBPP_TRAIN, Document, build_corpus, contamination, corpus_stats, eval_prompts,
                                  format_gsm8k, split_corpus)

NEEDED = ("gsm8k/train.jsonl", "gsm8k/test.jsonl", "math500/test.jsonl", "humaneval/HumanEval.jsonl.gz",
          "mbpp/mbpp.jsonl")


def _data() -> tuple[Path | None, str]:
    """The data folder of ``$DASSPEC_DATA``, or None and why the tests are skipped."""
    try:
        root = data_dir()
    except DataError as err:
        return None, str(err)
    if root is None:
        return None, f"no evaluation data: set {DATA_ENV} to the data folder"
    missing = [name for name in NEEDED if not (root / name).exists()]
    return (None, f"{root} lacks {', '.join(missing)}") if missing else (root, "")


DATA, WHY_SKIPPED = _data()
pytestmark = pytest.mark.skipif(DATA is None, reason=WHY_SKIPPED)


@pytest.fixture(scope="module")
def prompts():
    return eval_prompts(DATA)


@pytest.fixture(scope="module")
def corpus():
    return build_corpus(DATA)


def test_eval_prompts_cover_every_split(prompts):
    assert {k: len(v) for k, v in prompts.items()} == {"gsm8k-test": 1319, "math500": 500, "humaneval": 164,
                                                       "mbpp-test": 500}


def test_corpus_sources_are_train_splits_only(corpus):
    stats = corpus_stats(corpus)
    assert set(stats) == {"stdlib", "gsm8k", "mbpp"}
    assert stats["stdlib"]["chars"] > 1_000_000
    assert all(int(d.name.split("/")[1]) in MBPP_TRAIN for d in corpus if d.source == "mbpp")
    assert all(d.name.startswith("train/") for d in corpus if d.source == "gsm8k")
    assert not any("test" in Path(d.name).parts for d in corpus if d.source == "stdlib")


def test_corpus_has_no_eval_prompt(corpus, prompts):
    assert contamination(corpus, prompts) == []


def test_injected_eval_prompts_are_detected(prompts):
    """The check must be able to fail: plant one prompt of every split inside otherwise clean text."""
    clean = Document("stdlib", "clean.py", "import os\n\ndef main():\n    return os.getcwd()\n")
    planted = [Document("gsm8k", f"planted/{split}", "Some preamble.\n" + items[7] + "\nTrailing text.")
               for split, items in prompts.items()]
    # GSM8K-train formatting around a test question still counts
    planted.append(Document("gsm8k", "planted/formatted", format_gsm8k(prompts["gsm8k-test"][3], "It is 4.\n#### 4")))
    hits = contamination([clean] + planted, prompts)
    found = {(split, i) for split, i, _ in hits}
    for split in prompts:
        assert (split, 7) in found, split
    assert ("gsm8k-test", 3) in found
    assert not any(name == "clean.py" for _, _, name in hits)


def test_partial_overlap_is_not_a_hit(prompts):
    q = prompts["gsm8k-test"][0]
    half = " ".join(q.split()[: len(q.split()) // 2])
    assert contamination([Document("gsm8k", "half", half)], {"gsm8k-test": [q]}) == []


def test_split_is_deterministic_and_disjoint(corpus):
    a_train, a_val = split_corpus(corpus, 0.02, seed=0)
    b_train, b_val = split_corpus(corpus, 0.02, seed=0)
    assert [d.name for d in a_val] == [d.name for d in b_val]
    assert not {d.name for d in a_train} & {d.name for d in a_val}
    assert {d.source for d in a_val} == {"stdlib", "gsm8k", "mbpp"}
