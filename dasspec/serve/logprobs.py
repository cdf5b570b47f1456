"""What lm-eval's ``local-completions`` / ``local-chat-completions`` send beyond plain generation: ``echo``,
``logprobs`` (completions: the top-N alternatives per token; chat: ``logprobs`` / ``top_logprobs``),
``max_tokens: 0`` with ``echo`` (score the prompt only), a list of prompts in one completions request (one choice per
prompt, in order), and the tokenizer routes lm-eval's remote tokenizer reads (``GET /tokenizer_info``,
``POST /tokenize``, ``POST /detokenize``, vLLM's shapes).

Every log-probability is the full-depth target's: after decoding (any method), one plain forward
``model(prompt + output)`` with the server's initial states (state seed 0: a request's ``seed`` only seeds its
sampling) and the request's exit options (``dasspec/eval/logprobs.py``) scores the prompt and the emitted tokens.  The target is what every method was verified against, so the numbers do not depend on
the method that decoded the text.  Log-probabilities are the model's own distribution (log-softmax of the logits),
not the temperature / top-p warped one a sampled request drew from.

Forwards run on a thread of their own, one at a time, beside the decode worker (``Scorer``); at most
``max_batch + max_queue`` scoring requests wait, a further one is answered 429.  A request's prompts are at most
``max_batch + max_queue`` (what the server can hold at once).  Streaming with ``echo``, ``logprobs`` or several
prompts is refused (400).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..eval.logprobs import Scored, score
from .responses import Reply, decoding_stats, finish_reason, usage
from .schema import APIError, ChatRequest, CompletionRequest, _Strict, parse_json, parse_request
from .textstream import IncrementalText
from .worker import Cancelled, Done, Failed, Job, error_for


class Scorer:
    """Full-depth scoring forwards for the server: one at a time on a worker thread, a bounded number waiting."""

    def __init__(self, service):
        self.service = service
        self.limit = service.engine.max_batch + service.options.max_queue
        self._lock = threading.Lock()
        self._count = threading.Lock()
        self.waiting = 0

    async def score(self, seqs: list[list[int]], seed: int, exit: dict[str, Any], top: int) -> list[Scored]:
        with self._count:
            if self.waiting >= self.limit:
                raise APIError(429, f"the server is busy: {self.limit} scoring requests are waiting; retry shortly",
                               type="rate_limit_error", code="queue_full")
            self.waiting += 1
        try:
            return await asyncio.to_thread(self._run, seqs, seed, exit, top)
        finally:
            with self._count:
                self.waiting -= 1

    def _run(self, seqs, seed, exit, top) -> list[Scored]:
        with self._lock:
            try:
                return score(self.service.model, seqs, seed=seed, top=top,
                             max_batch=self.service.engine.max_batch, **exit)
            except ValueError as err:          # (checked before: a request the forward refuses is still a 400)
                raise APIError(400, str(err)) from None


def scorer(service) -> Scorer:
    s = getattr(service, "_scorer", None)
    if s is None:
        s = service._scorer = Scorer(service)
    return s


def _exit(req) -> dict[str, Any]:
    opts = req.dasspec
    if opts is None:
        return {}
    return {k: v for k, v in (("exit_threshold", opts.exit_threshold), ("exit_at_step", opts.exit_at_step))
            if v is not None}


def check_exit(service, req) -> None:
    """The request's exit options, checked as a generating request's are (``Service.job``): a 400 naming the
    option on a model without an exit gate or a bad value."""
    options = _exit(req)
    if not options:
        return
    try:
        service.model.exit_rule(options.get("exit_threshold"), options.get("exit_at_step"))
    except ValueError as err:
        param = "dasspec.exit_at_step" if "exit_at_step" in str(err) and "exit_threshold" not in options \
            else "dasspec.exit_threshold"
        raise APIError(400, f"'{param}': {err}", param=param) from None


# --- the token strings --------------------------------------------------------------------------------------------

def pieces(tok, ids: list[int], before: list[int] = ()) -> list[str]:
    """The text each of ``ids`` adds after ``before`` (incremental decoding; a token that ends inside a multi-byte
    character adds what completes first, so the pieces concatenate to the decoded text)."""
    text = IncrementalText(tok.decode)
    if before:
        text.feed(before)
    return [text.feed([t]) for t in ids]


def _alternatives(tok, top: list[tuple[int, float]]) -> dict[str, float]:
    """OpenAI's ``top_logprobs`` entry: token string -> log-probability, most likely first (two ids that decode
    to the same string keep the likelier)."""
    out: dict[str, float] = {}
    for t, lp in top:
        out.setdefault(tok.decode([t]), lp)
    return out


def completion_logprobs(tok, ids: list[int], scored: Scored, start: int, top: int, offset: int = 0) -> dict:
    """OpenAI's completions ``logprobs`` object for ``ids[start:]`` (``scored`` covers all of ``ids``): tokens,
    token_logprobs, top_logprobs, text_offset (from ``offset``); the first token of a sequence has no
    log-probability (None), as OpenAI answers."""
    strs = pieces(tok, ids[start:], ids[:start])
    tokens, lps, tops, offsets = [], [], [], []
    pos = offset
    for i, s in zip(range(start, len(ids)), strs):
        tokens.append(s)
        offsets.append(pos)
        pos += len(s)
        if i == 0:
            lps.append(None)
            tops.append(None)
        else:
            lps.append(scored.logprobs[i - 1])
            tops.append(_alternatives(tok, scored.top[i - 1]) if top else None)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tok, ids: list[int], scored: Scored, start: int, top: int) -> dict:
    """OpenAI's chat ``logprobs`` object for the generated tokens ``ids[start:]``."""
    content = []
    for i, s in zip(range(start, len(ids)), pieces(tok, ids[start:], ids[:start])):
        alts = [{"token": tok.decode([t]), "logprob": lp, "bytes": list(tok.decode([t]).encode())}
                for t, lp in (scored.top[i - 1] if top else [])]
        content.append({"token": s, "logprob": scored.logprobs[i - 1], "bytes": list(s.encode()),
                        "top_logprobs": alts})
    return {"content": content}


# --- decoding ----------------------------------------------------------------------------------------------------

async def _decode(service, request: Request, req, prompts: list[list[int]], endpoint: str):
    """Decode every prompt (one job each, all in the worker's queue at once); [(result, stats)] in order."""
    loop = asyncio.get_running_loop()
    jobs: list[Job] = []
    try:
        for p in prompts:
            job = service.job(req, p, endpoint, loop)
            job.stream = False
            service.submit(job)
            jobs.append(job)
    except APIError:
        for job in jobs:
            service.worker.cancel(job)
        raise

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        for job in jobs:
            if not job.finished:
                service.worker.cancel(job)

    watcher = asyncio.create_task(watch())
    out = []
    try:
        for job in jobs:
            queue_time = 0.0
            while True:
                event = await job.events.get()
                if isinstance(event, Done):
                    out.append((event.result, decoding_stats(event.result, job.drafter, service.depth, queue_time)))
                    break
                if isinstance(event, Failed):
                    raise error_for(event.error)
                if isinstance(event, Cancelled):
                    return None
                queue_time = getattr(event, "queue_time", queue_time)
    finally:
        watcher.cancel()
        for job in jobs:
            if not job.finished:
                service.worker.cancel(job)
    return out


def completion_prompts(service, req: CompletionRequest) -> list[list[int]]:
    """The request's prompts as token ids (one, or each of a list), each checked as a single prompt is."""
    p = req.prompt
    many = isinstance(p, list) and bool(p) and isinstance(p[0], (str, list))
    if not many:
        return [service.completion_prompt(req)]
    limit = service.engine.max_batch + service.options.max_queue
    if len(p) > limit:
        raise APIError(400, f"'prompt': {len(p)} prompts in one request; at most {limit} (--max-batch + "
                       "--max-queue: what the server holds at once)", param="prompt")
    out = []
    for i, one in enumerate(p):
        try:
            out.append(service.completion_prompt(req.model_copy(update={"prompt": one})))
        except APIError as err:
            raise APIError(err.status, err.message.replace("'prompt'", f"'prompt[{i}]'", 1), param=f"prompt[{i}]",
                           code=err.code) from None
    return out


async def completions(service, request: Request, req: CompletionRequest, prompts: list[list[int]]) -> Response:
    tok = service.tok
    if req.model is not None and req.model != service.model_name:
        raise APIError(404, f"the model '{req.model}' does not exist; this server serves '{service.model_name}'",
                       param="model", code="model_not_found")
    generate = req.max_tokens != 0
    if generate:
        decoded = await _decode(service, request, req, prompts, "completions")
        if decoded is None:
            return Response(status_code=499)
    else:
        check_exit(service, req)
        for p in prompts:
            if len(p) > service.context:
                raise APIError(400, f"the prompt has {len(p)} tokens; the model's context is {service.context} "
                               "positions", param="prompt", code="context_length_exceeded")
        decoded = [(None, None)] * len(prompts)
    scored: list[Scored | None] = [None] * len(prompts)
    if req.logprobs is not None:
        seqs = [p + (r.tokens if r is not None else []) for p, (r, _s) in zip(prompts, decoded)]
        scored = await scorer(service).score(seqs, 0, _exit(req), req.logprobs)
    reply = Reply(chat=False, model=service.model_name)
    choices, stats, n_prompt, n_gen = [], [], 0, 0
    for i, (p, (result, st), sc) in enumerate(zip(prompts, decoded, scored)):
        text = result.text or "" if result is not None else ""
        gen = result.tokens if result is not None else []
        head = tok.decode(p) if req.echo else ""
        lp = None
        if sc is not None:
            ids = p + gen
            lp = completion_logprobs(tok, ids, sc, 0 if req.echo else len(p), req.logprobs)
        choices.append({"index": i, "text": head + text, "logprobs": lp,
                        "finish_reason": finish_reason(result) if result is not None else "length"})
        stats.append(st)
        n_prompt += len(p)
        n_gen += len(gen)
    if not generate:
        service.metrics.requests.inc(endpoint="completions", outcome="ok")
    body = {**reply._head(False), "choices": choices, "usage": usage(n_prompt, n_gen)}
    if generate:
        body["dasspec"] = stats[0] if len(stats) == 1 else stats
    return JSONResponse(body)


async def chat(service, request: Request, req: ChatRequest, prompt: list[int]) -> Response:
    decoded = await _decode(service, request, req, [prompt], "chat")
    if decoded is None:
        return Response(status_code=499)
    (result, stats), = decoded
    top = req.top_logprobs or 0
    sc, = await scorer(service).score([prompt + result.tokens], 0, _exit(req), top)
    reply = Reply(chat=True, model=service.model_name)
    body = reply.body(result, len(prompt), stats)
    body["choices"][0]["logprobs"] = chat_logprobs(service.tok, prompt + result.tokens, sc, len(prompt), top)
    return JSONResponse(body)


# --- the tokenizer routes (lm-eval's remote tokenizer; vLLM's shapes) ----------------------------------------------

class TokenizeRequest(_Strict):
    prompt: str
    add_special_tokens: bool = True
    model: str | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        return []


class DetokenizeRequest(_Strict):
    tokens: list[int]
    model: str | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        return []


def add_routes(app: FastAPI, service, read_body) -> None:
    """``GET /tokenizer_info``, ``POST /tokenize``, ``POST /detokenize``: bodies bounded like every request's
    (``--max-body``); a detokenize request takes at most the context's worth of ids, each in the vocabulary."""
    tok = service.tok

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        special = tok.special_tokens
        return {"eos_token": special.get("eos_token"), "bos_token": special.get("bos_token"),
                "pad_token": special.get("pad_token"), "chat_template": service.chat_template,
                "model_max_length": service.context, "tokenizer_class": "dasspec"}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        req = parse_request(TokenizeRequest, parse_json(await read_body(request)))
        ids = await asyncio.to_thread(tok.encode, req.prompt, req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": service.context}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        req = parse_request(DetokenizeRequest, parse_json(await read_body(request)))
        if len(req.tokens) > service.context:
            raise APIError(400, f"'tokens': {len(req.tokens)} ids; at most the model's context, "
                           f"{service.context}", param="tokens")
        V = service.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < V]
        if bad:
            raise APIError(400, f"'tokens': token id {bad[0]} is outside the vocabulary [0, {V})", param="tokens")
        return {"prompt": tok.decode(req.tokens)}


def extended(req) -> bool:
    """Whether ``req`` asks for what this module answers."""
    if isinstance(req, CompletionRequest):
        return req.extended
    return bool(getattr(req, "logprobs", False))


def require_model(service, req) -> None:
    """Scoring runs forwards of the model in the serving process: a front end without one (the Ray ingress) answers
    these requests with a 400 naming the field, never a 500."""
    if getattr(service, "model", None) is None:
        field = "logprobs" if getattr(req, "logprobs", None) else "echo" if getattr(req, "echo", False) else \
            "max_tokens" if getattr(req, "max_tokens", None) == 0 else "prompt"
        raise APIError(400, f"'{field}': log-probabilities, echo, max_tokens 0 and lists of prompts are answered by "
                       "a single dasspec serve, not yet through dasspec serve --ray", param=field)
