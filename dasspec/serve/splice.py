"""Failover splicing: what a re-run of a request on another replica may add to the stream its client already has.

Every answer is a deterministic function of the request and its seed, so a re-run commits the same token ids and
releases the same text; the ingress skips the characters the client already has and streams the rest.  That holds
only while the re-run's ids are the first attempt's: another replica's hardware, dtype or a bug could decode
differently, and a splice by character count would then hand the client one trajectory's prefix and another's
suffix.  So every id a re-run commits is compared with the id received at that position before; the first
difference ends the request with ``Diverged`` (the ingress sends an error event, never a spliced answer).

    s = Splice(stream=True)
    for attempt in attempts:
        s.restart()
        for text, ids in attempt.chunks:
            new = s.chunk(text, ids)          # raises Diverged; else the text past what the client has
        tail = s.done(attempt.tail, attempt.all_ids)
"""

from __future__ import annotations

from typing import Sequence


class Diverged(Exception):
    """A re-run committed other token ids than the ones the client's stream came from."""


class Splice:
    def __init__(self, stream: bool):
        """``stream``: the client receives text as it comes (a non-streamed answer is taken whole from the attempt
        that finishes, so nothing is spliced and ids are not compared)."""
        self.stream = stream
        self.ids: list[int] = []       # the ids received so far, over all attempts (the longest run)
        self.sent = 0                  # characters the client has been handed
        self.seen = 0                  # characters of the current attempt's text so far
        self.pos = 0                   # ids of the current attempt so far

    def restart(self) -> None:
        """A new attempt (the first, or a re-run after its replica died) starts from the beginning."""
        self.seen = self.pos = 0

    def _compare(self, ids: Sequence[int]) -> None:
        if not self.stream:
            return
        for k, t in enumerate(ids):
            p = self.pos + k
            if p < len(self.ids):
                if self.ids[p] != int(t):
                    raise Diverged(f"token {p} of the re-run is {int(t)}, but the stream already sent came from "
                                   f"token {self.ids[p]} there")
            else:
                self.ids.append(int(t))
        self.pos += len(ids)

    def _skip(self, text: str) -> str:
        out = text[max(0, self.sent - self.seen):]
        self.seen += len(text)
        self.sent += len(out)
        return out

    def chunk(self, text: str, ids: Sequence[int]) -> str:
        """One chunk of the current attempt (its ``text`` released with ``ids`` committed): the text to send."""
        self._compare(ids)
        return self._skip(text)

    def done(self, tail: str, ids: Sequence[int]) -> str:
        """The attempt finished with ``tail`` still to send and ``ids`` its whole answer: the text to send."""
        if self.stream:
            if list(map(int, ids[: len(self.ids)])) != self.ids[: len(ids)] or len(ids) < len(self.ids):
                p = next((i for i, (a, b) in enumerate(zip(ids, self.ids)) if int(a) != b), min(len(ids),
                                                                                                len(self.ids)))
                raise Diverged(f"the re-run's answer differs from the stream already sent at token {p}")
        out = self._skip(tail)
        if self.stream and self.seen < self.sent:
            raise Diverged("a re-run's text is shorter than what the client already has")
        return out
