"""Corpus -> tokenizer -> token streams: everything the loop reads, built before the first step.

The split and the tokenizer are deterministic from the config and the corpus, so a resumed run rebuilds the
streams; it reuses the tokenizer already saved in the output folder, and the resume state's fingerprint of the
training stream proves that the rebuilt stream is the one the run was trained on.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from . import corpus
from .config import TrainConfig
from .corpus import Document

BOS, EOS, PAD = "<|begin_text|>", "<|end_text|>", "<|pad|>"


def train_tokenizer(texts, vocab_size: int):
    """Byte-level BPE (HF ``tokenizers``) with Huginn's special-token names; the post-processor prepends BOS."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, bos)])
    return tok


def save_tokenizer(tok, folder: Path) -> None:
    """``tokenizer.json`` plus the two small files ``transformers`` reads to find the special tokens."""
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {**special, "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True, "add_eos_token": False,
         "model_max_length": 4096}, indent=2) + "\n")


def encode_documents(tok, docs: list[Document], counts: dict | None = None) -> np.ndarray:
    """One token stream: BOS text EOS per document (uint16).  ``counts`` (optional) receives tokens per source."""
    eos = tok.token_to_id(EOS)
    out = []
    for doc, enc in zip(docs, tok.encode_batch([d.text for d in docs])):
        out.append(np.asarray(enc.ids + [eos], dtype=np.uint16))     # encode() adds BOS
        if counts is not None:
            counts[doc.source] = counts.get(doc.source, 0) + len(out[-1])
    return np.concatenate(out)


def fingerprint(stream: np.ndarray) -> str:
    """A short hash of a token stream: a resumed run must read the stream it was trained on."""
    return hashlib.blake2b(np.ascontiguousarray(stream).tobytes(), digest_size=16).hexdigest()


@dataclass
class Prepared:
    """The corpus split, the tokenizer, the training stream and the per-source token counts."""
    tokenizer: object
    docs: list[Document]
    train_docs: list[Document]
    val_docs: list[Document]
    train_ids: np.ndarray
    train_counts: dict[str, int]
    val_counts: dict[str, int]

    def special_ids(self) -> tuple[int, int, int]:
        return tuple(self.tokenizer.token_to_id(t) for t in (BOS, EOS, PAD))


def prepare(cfg: TrainConfig, out: Path, data: str | os.PathLike | None = None, docs: list[Document] | None = None,
            reuse_tokenizer: bool = False) -> Prepared:
    """Build (or take ``docs``) the corpus, split it, train the tokenizer into ``out`` (or, ``reuse_tokenizer``,
    read the one saved there) and encode both splits."""
    docs = corpus.build_corpus(data) if docs is None else docs
    train_docs, val_docs = corpus.split_corpus(docs, cfg.val_fraction, cfg.seed)
    saved = out / "tokenizer.json"
    if reuse_tokenizer and saved.exists():
        tok = Tokenizer.from_file(str(saved))
    else:
        tok = train_tokenizer((d.text for d in train_docs), cfg.vocab_size)
        save_tokenizer(tok, out)
    train_counts: dict[str, int] = {}
    val_counts: dict[str, int] = {}
    train_ids = encode_documents(tok, train_docs, train_counts)
    encode_documents(tok, val_docs, val_counts)          # for its counts: evaluation encodes each source itself
    return Prepared(tok, docs, train_docs, val_docs, train_ids, train_counts, val_counts)
