"""OpenAI response bodies and stream chunks (``text_completion``, ``chat.completion``, ``chat.completion.chunk``),
plus the ``dasspec`` object: the decoding statistics of the request."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..engine.api.generate import GenerationResult
from ..engine.drafting.draft import Drafter

# every other stop (EOS, a stop string, ...) is OpenAI's "stop"; a request out of time (--request-timeout) ran out of
# its budget like one out of tokens
FINISH = {"max_new_tokens": "length", "timeout": "length"}


def decoding_stats(result: GenerationResult, drafter: Drafter, depth: int, queue_time: float,
                   seed: int | None = None) -> dict[str, Any]:
    """What the method did: A and G (the paper's eq. 9 and 10), the sequential core passes it spent and those
    full-depth AR spends on the same tokens (prefill + R per token after the first), their ratio, and times; the
    prompt rows taken from shared blocks (``cached_tokens``); and the ``seed`` it decoded with (drawn by the server
    when a sampled request gave none: send it back to get the same answer); for method auto, the steps it drafted
    with each drafter (``choices``; empty for the other methods)."""
    s = result.stats
    knobs = getattr(drafter, "knobs", None)
    ar_passes = s.prefill_passes + depth * max(s.new_tokens - 1, 0)
    return {
        "method": s.method,
        "knobs": knobs.as_json() if knobs is not None else {},
        "A": s.A, "G": s.G, "verifications": s.verify_events,
        "sequential_passes": s.sequential_passes, "prefill_passes": s.prefill_passes,
        "draft_passes": s.draft_passes, "verify_passes": s.verify_passes,
        "ar_sequential_passes": ar_passes,
        "pass_speedup": ar_passes / s.sequential_passes if s.sequential_passes else 0.0,
        "stop_reason": s.stop_reason, "queue_time": queue_time, "decode_time": s.wall_time,
        "tokens_per_second": s.tokens_per_second, "cached_tokens": s.cached_tokens, "seed": seed,
        "choices": dict(s.choices),             # method auto: decode steps per drafter it chose ("ar": plain)
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(result: GenerationResult) -> str:
    return FINISH.get(result.stop_reason, "stop")


@dataclass
class Reply:
    """One request's response in either form: ``body`` (non-streamed) or ``chunk`` / ``final_chunks`` (SSE)."""
    chat: bool
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.id = self.id or ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex

    def _choice(self, text: str, reason: str | None, delta: dict | None = None) -> dict:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        if delta is None:
            return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                    "finish_reason": reason}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}

    def _head(self, streamed: bool) -> dict:
        kind = ("chat.completion.chunk" if streamed else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def body(self, result: GenerationResult, prompt_tokens: int, stats: dict) -> dict:
        return {**self._head(False), "choices": [self._choice(result.text or "", finish_reason(result))],
                "usage": usage(prompt_tokens, len(result.tokens)), "dasspec": stats}

    def chunk(self, text: str = "", role: bool = False) -> dict:
        delta = {"role": "assistant", "content": ""} if role else {"content": text}
        return {**self._head(True), "choices": [self._choice(text, None, delta)]}

    def final_chunks(self, result: GenerationResult, prompt_tokens: int, stats: dict,
                     include_usage: bool) -> list[dict]:
        last = {**self._head(True), "choices": [self._choice("", finish_reason(result), {})], "dasspec": stats}
        if not include_usage:
            return [last]
        return [last, {**self._head(True), "choices": [], "usage": usage(prompt_tokens, len(result.tokens))}]


def sse(data: dict | str) -> str:
    """One server-sent event; ``data`` a JSON object or the literal ``[DONE]``."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
