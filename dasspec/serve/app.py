"""The HTTP surface: FastAPI routes in OpenAI's shapes over a ``Service``.

    POST /v1/completions, POST /v1/chat/completions   (stream: server-sent events ending with ``data: [DONE]``)
    GET  /v1/models, /v1/models/{id}, /health, /metrics (Prometheus text)
    GET  /tokenizer_info, POST /tokenize, /detokenize   (lm-eval's remote tokenizer: serve/logprobs.py)

echo, logprobs, max_tokens 0 and lists of prompts are answered by ``serve/logprobs.py``.

A request body is read up to the server's limit (larger: 413 at once), then parsed, checked and tokenized - its
chat template rendered in the sandbox - in a thread, so no body and no template can stall the event loop (errors
answer at once, 4xx), queued for the decode worker (a full queue answers 429 at once), then awaited: the worker's events become the JSON body or the stream's chunks.
While it waits or streams, a watcher listens for the client's disconnect and cancels the job: out of the queue,
or stopped at its next verification step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import logprobs
from .responses import Reply, sse
from .schema import APIError, ChatRequest, CompletionRequest, parse_json, parse_request
from .service import Service
from .worker import Cancelled, Delta, Done, Failed, Job, Started, error_for

log = logging.getLogger("dasspec.serve")
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


def create_app(service: Service) -> FastAPI:
    """The routes over ``service``: a ``Service`` (one model in this process) or anything answering the same calls
    - ``max_body``, ``completion_prompt`` / ``chat_prompt``, ``job`` / ``submit`` / ``cancel`` / ``stats``,
    ``health`` / ``metrics_text``, ``metrics.requests``, ``model_name``, ``context``, ``close`` - such as the Ray
    Serve ingress over many replicas (``ray_app.ClusterService``)."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        service.close()          # cancels every job, so open streams end and shutdown is not held up

    app = FastAPI(title="dasspec", summary="OpenAI-compatible server for looped transformers (lossless DAS-Wave)",
                  lifespan=lifespan)
    started = int(time.time())

    def count(path: str, outcome: str) -> None:
        if path in ENDPOINTS:
            service.metrics.requests.inc(endpoint=ENDPOINTS[path], outcome=outcome)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        if not getattr(err, "counted", False):
            count(request.url.path, "rejected" if err.status == 429 else "invalid" if err.status < 500 else "error")
        headers = {"Retry-After": "1"} if err.status == 429 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(APIError(err.status_code, str(err.detail)).body(), status_code=err.status_code,
                            headers=getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def server_error(request: Request, err: Exception) -> JSONResponse:
        log.exception("unhandled error")
        count(request.url.path, "error")
        return JSONResponse(APIError(500, f"internal error: {type(err).__name__}", type="server_error").body(),
                            status_code=500)

    # --- plain routes -------------------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> JSONResponse:
        body, ok = await service.health()
        return JSONResponse(body, status_code=200 if ok else 503)

    def model_card() -> dict:
        return {"id": service.model_name, "object": "model", "created": started, "owned_by": "dasspec",
                "max_model_len": service.context}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != service.model_name:
            raise APIError(404, f"the model '{model_id}' does not exist", param="model", code="model_not_found")
        return model_card()

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(await service.metrics_text(), media_type="text/plain; version=0.0.4")

    # --- generation -------------------------------------------------------------------------------------------
    async def read_body(request: Request) -> bytes:
        """The body, refused (413) as soon as it is known to pass the server's limit."""
        limit = service.max_body
        declared = request.headers.get("content-length")
        too_large = APIError(413, f"the request body is larger than this server's limit of {limit} bytes "
                                  "(dasspec serve --max-body)", code="request_too_large")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    def completion_input(raw: bytes):
        req = parse_request(CompletionRequest, parse_json(raw))
        if logprobs.extended(req):           # echo, logprobs, max_tokens 0, several prompts: a list of prompts
            logprobs.require_model(service, req)
            return req, logprobs.completion_prompts(service, req)
        return req, service.completion_prompt(req)

    def chat_input(raw: bytes):
        req = parse_request(ChatRequest, parse_json(raw))
        if logprobs.extended(req):
            logprobs.require_model(service, req)
        return req, service.chat_prompt(req)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req, prompt = await asyncio.to_thread(completion_input, await read_body(request))
        if logprobs.extended(req):
            return await logprobs.completions(service, request, req, prompt)
        return await generate(request, req, prompt, "completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req, prompt = await asyncio.to_thread(chat_input, await read_body(request))
        if logprobs.extended(req):
            return await logprobs.chat(service, request, req, prompt)
        return await generate(request, req, prompt, "chat")

    logprobs.add_routes(app, service, read_body)      # /tokenizer_info, /tokenize, /detokenize

    async def generate(request: Request, req, prompt: list[int], endpoint: str) -> Response:
        job = service.job(req, prompt, endpoint, asyncio.get_running_loop())
        service.submit(job)
        reply = Reply(chat=endpoint == "chat", model=service.model_name)
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            return StreamingResponse(stream(request, job, reply, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        watcher = asyncio.create_task(watch_disconnect(request, job))
        try:
            queue_time = 0.0
            while True:
                event = await job.events.get()
                if isinstance(event, Started):
                    queue_time = event.queue_time
                elif isinstance(event, Done):
                    stats = service.stats(job, event.result, queue_time)
                    return JSONResponse(reply.body(event.result, len(prompt), stats))
                elif isinstance(event, Failed):
                    raise error_for(event.error)
                elif isinstance(event, Cancelled):
                    return Response(status_code=499)        # the client has gone; nobody reads this
        finally:
            watcher.cancel()
            if not job.finished:
                service.cancel(job)

    async def stream(request: Request, job: Job, reply: Reply, include_usage: bool) -> AsyncIterator[str]:
        watcher = asyncio.create_task(watch_disconnect(request, job))
        try:
            if reply.chat:
                yield sse(reply.chunk(role=True))
            queue_time = 0.0
            while True:
                event = await job.events.get()
                if isinstance(event, Started):
                    queue_time = event.queue_time
                elif isinstance(event, Delta):
                    if event.text:
                        yield sse(reply.chunk(event.text))
                elif isinstance(event, Done):
                    if event.tail:
                        yield sse(reply.chunk(event.tail))
                    stats = service.stats(job, event.result, queue_time)
                    for chunk in reply.final_chunks(event.result, len(job.prompt), stats, include_usage):
                        yield sse(chunk)
                    break
                elif isinstance(event, Failed):
                    yield sse(error_for(event.error).body())
                    break
                elif isinstance(event, Cancelled):
                    return
            yield sse("[DONE]")
        finally:
            watcher.cancel()
            if not job.finished:             # the client went away mid-stream (or the server is stopping)
                service.cancel(job)

    async def watch_disconnect(request: Request, job: Job) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        if not job.finished:
            service.cancel(job)

    return app
