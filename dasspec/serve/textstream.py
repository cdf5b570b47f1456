"""Incremental text for streamed responses: the decoded text of a growing token list, released only when it can
no longer change, so the concatenated stream equals the non-streamed text exactly.

Two things can still change the tail of the text decoded so far:

* an incomplete UTF-8 sequence (a multi-byte character split across tokens) decodes to trailing U+FFFD until its
  last byte arrives - held back;
* a tail that could be the start of a stop string - held back, because the final text is cut before the stop
  string (``GenerationResult.text``); once a stop string appears, the text is cut before it.

The held-back text is released by the next chunk or by ``finish`` with the final text.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence


def _stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    last = text[-1:]
    for s in stops:
        # Only an n whose prefix s[:n] ends with text's last character can match: rfind jumps between those (a
        # long stop string costs a scan in C per chunk, not one slice per length - quadratic in a long stream).
        n = min(len(s) - 1, len(text))
        while n > best and last:
            n = s.rfind(last, 0, n) + 1
            if n <= best:
                break
            if text[-n] == s[0] and text.endswith(s[:n]):
                best = n
                break
            n -= 1
    return best


class IncrementalText:
    """``feed(ids) -> new text`` for each committed chunk, ``finish(final_text) -> the rest``."""

    def __init__(self, decode: Callable[[list[int]], str], stop_strings: Iterable[str] = ()):
        self.decode = decode
        self.stops = tuple(s for s in stop_strings if s)
        self.ids: list[int] = []
        self.sent = ""

    def _safe_text(self) -> str:
        text = self.decode(self.ids)
        cuts = [text.find(s) for s in self.stops if s in text]
        if cuts:
            return text[: min(cuts)]        # generation ends at this token; nothing after the stop string is text
        text = text.rstrip("\ufffd")          # an incomplete multi-byte character: wait for its last byte
        return text[: len(text) - _stop_prefix_len(text, self.stops)]

    def feed(self, ids: Iterable[int]) -> str:
        self.ids.extend(int(i) for i in ids)
        text = self._safe_text()
        if len(text) <= len(self.sent):
            return ""
        delta = text[len(self.sent):]
        self.sent = text
        return delta

    def finish(self, final_text: str) -> str:
        """What remains to send of ``final_text`` (the result's text: cut before any stop string)."""
        if not final_text.startswith(self.sent):
            # Cannot happen for tokenizers whose decoding of a prefix is a prefix of the full decoding (byte-level
            # BPE, SentencePiece); say so rather than send a stream that silently differs.
            raise RuntimeError("streamed text is not a prefix of the final text; this tokenizer's decoding is not "
                               "incremental")
        rest = final_text[len(self.sent):]
        self.sent = final_text
        return rest
