"""The OpenAI request bodies the server accepts, checked strictly, and OpenAI-shaped errors.

Strict on purpose: a wrong type (``"max_tokens": "10"``) is an error, not a conversion, and a field the server
does not know is refused rather than ignored (``tools`` ignored would silently answer a different question).
OpenAI fields the server cannot honour are accepted only at their no-op values (``n`` 1, ``best_of`` 1, no
``suffix``, penalties 0, ...); any other value is refused with a message naming the field.  ``echo``,
``logprobs`` / ``top_logprobs`` (at most ``MAX_LOGPROBS``), ``max_tokens: 0`` (with ``echo``) and a list of
prompts are answered by ``serve/logprobs.py``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class APIError(Exception):
    """An error answered as OpenAI does: ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class DasspecOptions(_Strict):
    """The ``dasspec`` extension object: the decoding method and its knobs (``dasspec generate``'s flags), and the
    target's early exit for models with an exit gate (Ouro: ``exit_threshold`` or ``exit_at_step``, 0-based)."""
    method: str | None = None
    knobs: dict[str, Any] = Field(default_factory=dict)
    exit_threshold: float | None = None
    exit_at_step: int | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str | None = None                      # optional: the server serves one model
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    user: str | None = None                       # an end-user id for the caller's records; not used
    dasspec: DasspecOptions | None = None
    # accepted at their no-op values only (checked in ``unsupported``)
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, why) for every OpenAI option set to a value this server cannot honour."""
        out = []
        if self.n not in (None, 1):
            out.append(("n", "one choice per request (n = 1): send several requests for several answers"))
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                out.append((name, "logit penalties would change the target distribution; only 0 is supported"))
        if self.logit_bias:
            out.append(("logit_bias", "logit biases would change the target distribution; not supported"))
        if self.stream_options is not None and not self.stream:
            out.append(("stream_options", "only allowed with stream: true"))
        if isinstance(self.stop, list) and len(self.stop) > 16:
            out.append(("stop", "at most 16 stop strings"))
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if any(s == "" for s in stops):
            out.append(("stop", "stop strings must not be empty"))
        return out


# The most alternatives a logprobs / top_logprobs field may ask for at each token (OpenAI's chat limit; vLLM's
# default --max-logprobs): each costs a sort over the vocabulary and a decoded string per token.
MAX_LOGPROBS = 20


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)    # 0: score the prompt only (with echo)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.max_tokens == 0 and not self.echo:
            out.append(("max_tokens", "0 only with echo: true (score the prompt without generating)"))
        if self.suffix is not None:
            out.append(("suffix", "insertion (a suffix) is not supported"))
        if self.best_of not in (None, 1):
            out.append(("best_of", "one candidate per request (best_of = 1)"))
        if self.stream and (self.echo or self.logprobs is not None):
            out.append(("echo" if self.echo else "logprobs", "not supported with stream: true (send the request "
                        "without streaming)"))
        if self.stream and isinstance(self.prompt, list) and len(self.prompt) > 1 \
                and isinstance(self.prompt[0], (str, list)):
            out.append(("prompt", "several prompts are not supported with stream: true (one per streamed request)"))
        return out

    @property
    def extended(self) -> bool:
        """Asks for echo, log-probabilities, no generation or several prompts (``serve/logprobs.py`` answers)."""
        p = self.prompt
        return bool(self.echo) or self.logprobs is not None or self.max_tokens == 0 or (
            isinstance(p, list) and len(p) > 1 and isinstance(p[0], (str, list)))


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: str = Field(min_length=1)
    content: str | list[TextPart] | None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


TEMPLATE_KWARGS = 16          # at most this many chat_template_kwargs, each a short name and a scalar value
TemplateValue = bool | int | float | str | None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)    # the newer name of max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # the template's own switches, as vLLM / SGLang take them ({"enable_thinking": false} for Nanbeige or Qwen3)
    chat_template_kwargs: dict[str, TemplateValue] | None = Field(None, max_length=TEMPLATE_KWARGS)

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        for k, v in (self.chat_template_kwargs or {}).items():
            if not (k.isidentifier() and len(k) <= 64) or k in ("messages", "add_generation_prompt"):
                out.append(("chat_template_kwargs", f"{k[:64]!r} is not a template variable a request may set"))
            elif isinstance(v, str) and len(v) > 1024:
                out.append(("chat_template_kwargs", f"the value of {k!r} is longer than 1024 characters"))
        if self.top_logprobs is not None and not self.logprobs:
            out.append(("top_logprobs", "only with logprobs: true"))
        if self.logprobs and self.stream:
            out.append(("logprobs", "not supported with stream: true (send the request without streaming)"))
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            out.append(("max_completion_tokens", "give max_tokens or max_completion_tokens, not both"))
        return out

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# What a field takes, for messages about unions (pydantic names each member's failure instead).
_EXPECTED = {
    "prompt": "a string, a list of token ids, or a list of either (one choice per prompt)",
    "stop": "a string or a list of strings",
    "content": "a string or a list of {'type': 'text', 'text': ...} parts",
}


_FIELDS = {name for m in (DasspecOptions, StreamOptions, CompletionRequest, TextPart, ChatMessage, ChatRequest)
           for name in m.model_fields}


def _param(loc: tuple) -> str:
    """``("messages", 0, "content", "list[TextPart]", 1)`` -> ``messages[0].content``: field names and list
    indices up to the first union-member tag (pydantic's loc names the member it tried)."""
    out = ""
    for item in loc:
        if isinstance(item, int):
            out += f"[{item}]"
        elif item in _FIELDS or not out:
            out += ("." if out else "") + item
        else:
            break
    return out


def _message(err: dict) -> tuple[str, str]:
    loc = tuple(err.get("loc", ()))
    param = _param(loc)
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        param = ".".join(filter(None, (_param(loc[:-1]), str(loc[-1]))))
        return param, f"unknown field '{param}' (the server refuses fields it does not support rather than ignore them)"
    if kind == "missing":
        return param, f"'{param}' is required"
    got = json.dumps(err.get("input"), default=str)[:80]
    union = any(not isinstance(i, int) and i not in _FIELDS for i in loc)
    expected = _EXPECTED.get(param.rsplit(".", 1)[-1]) if union else None
    if expected:
        return param, f"'{param}' must be {expected}, got {got}"
    return param, f"'{param}': {err.get('msg', 'invalid value')}, got {got}"


# No valid request nests deeper than 5 levels (dasspec.knobs.tree's list of choices); this leaves room and stops a
# hostile body long before any recursive step (validation, json.dumps, repr in a message) could overflow.
MAX_NESTING = 32


def check_body(body: Any) -> None:
    """Refuse, naming the field, a body nested deeper than ``MAX_NESTING`` or holding text that is not Unicode (a
    lone UTF-16 surrogate such as "\\ud800", which JSON allows and no tokenizer or UTF-8 encoder takes).  Iterative,
    so no body can make it recurse."""
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, str):
            _unicode(value, where)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth >= MAX_NESTING:
            raise APIError(400, f"'{where or 'body'}' nests more than {MAX_NESTING} levels deep; no field of a "
                           "request does", param=where or None)
        if isinstance(value, dict):
            for key, item in value.items():
                _unicode(key, where or "body", key=True)
                key = key if len(key) <= 64 else key[:61] + "..."      # a path in a message, not the whole key
                path = f"{where}.{key}" if where else key
                stack.append((item, path, depth + 1))
        else:
            stack.extend((item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value))


def _unicode(text: str, where: str, key: bool = False) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        what = "a key" if key else "the text"
        param = where if key or where else None
        raise APIError(400, f"'{where or 'body'}': {what} holds a lone UTF-16 surrogate "
                       f"(\\u{ord(text[err.start]):04x} at character {err.start}), which is not Unicode text; send "
                       "valid UTF-8 (surrogates only in pairs)", param=param) from None


def parse_request(kind: type[_Common], body: Any) -> _Common:
    """A validated request of ``kind`` from a decoded JSON body, or an ``APIError`` (400) naming the field."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    check_body(body)
    try:
        req = kind.model_validate(body)
    except ValidationError as err:
        param, message = _message(err.errors()[0])
        raise APIError(400, message, param=param) from None
    bad = req.unsupported()
    if bad:
        field, why = bad[0]
        raise APIError(400, f"'{field}': {why}", param=field)
    return req


def parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise APIError(400, f"the request body is not valid JSON: {err}") from None
    except RecursionError:
        raise APIError(400, f"the request body nests arrays or objects too deeply (at most {MAX_NESTING} levels)") \
            from None
    except ValueError as err:           # an integer past Python's digit limit, ...
        raise APIError(400, f"the request body holds a value JSON decoding refuses: {str(err)[:120]}") from None
