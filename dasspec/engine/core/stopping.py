"""When generation ends: EOS / stop token ids, stop strings, and the max_new_tokens cap.

Every method commits tokens in chunks (one token for AR, up to a verified block for speculative methods); the
rule is applied token by token inside a chunk, so every method stops at exactly the token AR stops at and drops
whatever follows it.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch

# A Hugging Face-style stopping criterion: called with input_ids [1, prompt + generated so far] and scores (None
# here: speculative methods commit verified chunks, not one scored step at a time); truthy -> stop after that token.
Criterion = Callable[[torch.Tensor, "torch.Tensor | None"], "bool | torch.Tensor"]


def check_max_new_tokens(value) -> int:
    """``max_new_tokens`` as an int >= 1, or a message naming the bad value (a fraction is never truncated)."""
    try:
        whole = not isinstance(value, bool) and int(value) == value
    except (TypeError, ValueError, OverflowError):
        whole = False
    if not whole:
        raise ValueError(f"max_new_tokens must be a whole number, got {value!r}")
    if value < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {value}")
    return int(value)


class StopRule:
    def __init__(self, max_new_tokens: int, stop_ids: Iterable[int] = (), stop_strings: Iterable[str] = (),
                 decode: Callable[[list[int]], str] | None = None, criteria: Iterable[Criterion] = (),
                 prompt: Sequence[int] = ()):
        self.max_new_tokens = check_max_new_tokens(max_new_tokens)
        self.stop_ids = frozenset(int(i) for i in stop_ids)
        self.stop_strings = tuple(s for s in stop_strings if s)
        if self.stop_strings and decode is None:
            raise ValueError("stop strings need a tokenizer to decode the generated tokens; load the model from a "
                             "folder with tokenizer.json or pass tokenizer=")
        self.decode = decode
        self.criteria = tuple(criteria)
        if not all(callable(c) for c in self.criteria):
            raise TypeError("stopping_criteria must be callables (input_ids, scores) -> bool, like Hugging Face's")
        self.prompt = list(prompt)
        # Every token decodes to >= 1 character except partial UTF-8 bytes, so this many trailing tokens always
        # cover a stop string that ends at the newest token.
        self._lookback = max((len(s.encode()) for s in self.stop_strings), default=0) + 1

    def scan(self, generated: list[int], start: int) -> tuple[int, str] | None:
        """If generation must end inside generated[start:], return (length to keep, reason)."""
        for i in range(start, len(generated)):
            if generated[i] in self.stop_ids:
                return i + 1, "eos"
            if self.stop_strings:
                text = self.decode(generated[max(0, i + 1 - self._lookback): i + 1])
                if any(s in text for s in self.stop_strings):
                    return i + 1, "stop_string"
            if self.criteria:
                ids = torch.tensor([self.prompt + generated[: i + 1]])
                if any(bool(torch.as_tensor(c(ids, None)).all()) for c in self.criteria):
                    return i + 1, "stopping_criteria"
            if i + 1 >= self.max_new_tokens:
                return i + 1, "max_new_tokens"
        return None

    def trim_text(self, text: str) -> str:
        """Cut decoded text before the first stop string (the token list keeps the completing token)."""
        cut = min((text.find(s) for s in self.stop_strings if s in text), default=-1)
        return text if cut < 0 else text[:cut]
