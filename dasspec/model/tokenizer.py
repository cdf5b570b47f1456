"""Tokenizer: a thin wrapper over a Hugging Face ``tokenizer.json`` (the format Huginn and Raven ship).

Special ids come from the tokenizer files (``tokenizer_config.json`` / ``special_tokens_map.json`` / known token
names), never from a Raven ``config.json``, which carries Huginn's ids (65504/65505/65509) by mistake.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

# Token strings that end a document in the families we load, in priority order.
_EOS_NAMES = ("<|end_text|>", "<|end_of_text|>", "<|endoftext|>", "</s>", "<|eos|>")
_EXTRA_STOPS = ("<|end_turn|>", "<|eot_id|>")
_BOS_NAMES = ("<|begin_text|>", "<|begin_of_text|>", "<s>", "<|bos|>")


def _token_text(entry) -> str | None:
    if isinstance(entry, dict):
        return entry.get("content")
    return entry if isinstance(entry, str) else None


class Tokenizer:
    """``encode(text) -> list[int]`` (with BOS when the tokenizer's template adds it), ``decode(ids) -> str``."""

    def __init__(self, tok: HFTokenizer, bos_id: int | None, eos_ids: list[int], pad_id: int | None):
        self._tok = tok
        self.bos_id, self.eos_ids, self.pad_id = bos_id, eos_ids, pad_id

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def backend(self) -> HFTokenizer:
        return self._tok


def load_tokenizer(source: str | os.PathLike | None = None) -> Tokenizer:
    """Tokenizer of a checkpoint folder (or HF cache repo id); None -> the bundled model's."""
    from .checkpoint import CheckpointError, resolve_source

    folder = resolve_source(source)
    path = folder / "tokenizer.json"
    if not path.exists():
        raise CheckpointError(f"no tokenizer.json in {folder}")
    try:
        tok = HFTokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception on malformed files
        raise CheckpointError(f"cannot read {path}: {err}") from None
    meta: dict = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        p = Path(folder) / name
        if p.exists():
            try:
                meta.update({k: v for k, v in json.loads(p.read_text()).items() if v is not None})
            except json.JSONDecodeError:
                pass

    def tid(text):
        return tok.token_to_id(text) if text else None

    eos: list[int] = []
    named = tid(_token_text(meta.get("eos_token")))
    if named is not None:
        eos.append(named)
    for name in _EOS_NAMES + _EXTRA_STOPS:
        i = tid(name)
        if i is not None and i not in eos and (not eos or name in _EXTRA_STOPS):
            eos.append(i)
    bos = tid(_token_text(meta.get("bos_token")))
    if bos is None:
        bos = next((tid(n) for n in _BOS_NAMES if tid(n) is not None), None)
    pad = tid(_token_text(meta.get("pad_token")))
    if pad is None:
        pad = tid("<|pad|>")
    return Tokenizer(tok, bos, eos, pad)
