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
    """``feed(ids) -> new text`` for each committed chunk, ``finish(final_text) -> the rest``.

    The text is decoded incrementally, as vLLM's detokenizer does: each chunk decodes only a window - the tokens
    since the last complete character boundary, after the chunk before them as context (a SentencePiece-style
    decoder treats a leading space specially) - and appends what the window adds, so a stream costs O(tokens)
    decoding, not O(tokens^2).  For byte-level BPE tokenizers (every family dasspec reads) the appended pieces concatenate
    to the full decoding; ``finish`` checks it against the final text and refuses to continue a stream that
    differs."""

    def __init__(self, decode: Callable[[list[int]], str], stop_strings: Iterable[str] = ()):
        self.decode = decode
        self.stops = tuple(s for s in stop_strings if s)
        self._longest = max((len(s) for s in self.stops), default=0)
        self.ids: list[int] = []
        self.text = ""                # the decoded text of ids[:read] (complete characters only)
        self._prefix = self._read = 0  # the window: ids[prefix:read] decodes to the end of ``text``
        self._appended = 0            # text appended from tokens after ``read`` (before an incomplete character)
        self.sent = ""
        self._cut: int | None = None  # where a stop string begins in ``text``, once one has appeared

    def _advance(self) -> None:
        """Append the text of the tokens after ``read``; the window moves on once they end on a complete
        character (until then, what precedes the incomplete one is appended and the rest waits for its bytes)."""
        window = self.decode(self.ids[self._prefix:])
        head = self.decode(self.ids[self._prefix: self._read])
        complete = not window.endswith("\ufffd")      # else: an incomplete multi-byte character at the end
        stable = window if complete else window.rstrip("\ufffd")
        done = len(head) + self._appended             # window text already in ``text``
        if len(stable) > done:
            self.text += stable[done:]
            self._appended += len(stable) - done
        if complete:
            self._prefix, self._read, self._appended = self._read, len(self.ids), 0   # both on character boundaries

    def _safe_len(self, before: int) -> int:
        """How much of ``text`` can no longer change: up to a stop string, or short of a possible stop prefix."""
        if self._cut is None and self.stops:
            start = max(0, before - self._longest + 1)          # a stop string ending in the new text
            cuts = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
            if cuts:
                self._cut = min(cuts)
        if self._cut is not None:
            return self._cut                # generation ends at this token; nothing after the stop string is text
        return len(self.text) - _stop_prefix_len(self.text[-self._longest:] if self._longest else "", self.stops)

    def feed(self, ids: Iterable[int]) -> str:
        self.ids.extend(int(i) for i in ids)
        before = len(self.text)
        self._advance()
        safe = self._safe_len(before)
        if safe <= len(self.sent):
            return ""
        delta = self.text[len(self.sent): safe]
        self.sent += delta
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
