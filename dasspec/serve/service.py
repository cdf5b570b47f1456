"""The server's state and its one job: turn a validated OpenAI request into a decode ``Job`` - the prompt's token
ids, the token limit checked against the context and the server's cap, greedy or sampled decoding, and the
method's drafter - refusing anything it cannot serve exactly with an ``APIError`` naming the field.

OpenAI semantics, mapped to ``dasspec.generate``:

* ``temperature`` absent or 0: greedy decoding.  ``temperature`` > 0, or ``top_p`` given: sampling
  (``do_sample=True``) at that temperature (1.0 when only ``top_p`` is given) and top-p - lossless, as AR sampling
  at the same seed.  ``seed`` seeds the sampling noise; a sampled request without one gets a fresh random seed,
  returned as ``dasspec.seed`` so the answer can be reproduced.  The latent initial states are the model's own
  (state seed 0) for every request, so requests that start alike share prompt blocks whatever their seeds.
* ``max_tokens``: default 16 for completions (OpenAI's), the rest of the context for chat; never above
  ``--max-tokens-cap``, and prompt + max_tokens must fit the model's context.  Memory is taken as tokens are
  written (the paged depth cache), so an unused allowance costs nothing.
* ``dasspec``: ``{"method": ..., "knobs": {...}, "exit_threshold": ..., "exit_at_step": ...}``; knobs given to
  the server (``--set``) apply to its default method, under the request's.  One drafter is kept per (method,
  knobs) - the benchmark's hot start: Token Recycling's table and SAM's corpus automaton persist across requests
  (and are shared by the requests decoding together); outputs never depend on it (lossless).

Requests are decoded together by one ``Engine`` (continuous batching, ``max_batch`` at a time, their depth caches
in blocks of one pool of ``kv_budget`` positions, prompt blocks shared between requests that start alike).  Each
answer is exactly what that request decoded alone would give in float32; in bfloat16 a batched product can round a
row differently from a batch of one, so a token can differ at a near-tie (docs/serving.md, "Exactness").
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field
from typing import Any

from ..engine.api.engine import MAX_STEP_TOKENS, Engine
from ..engine.api.generate import generate
from ..engine.base.runtime import Runtime
from ..engine.base.sampling import Sampling
from ..engine.core.drafters import DrafterCache
from ..engine.core.policy import SpeculationPolicy
from ..engine.drafting.draft import Drafter
from ..methods import build_drafter, get_method
from ..model import decode_kernel
from ..model.chat_template import TemplateLimit, TemplateSandbox
from ..model.looped import LoopedLM
from ..model.tokenizer import PLAIN_CHAT_TEMPLATE
from .metrics import ServerMetrics
from .responses import decoding_stats
from .schema import APIError, ChatRequest, CompletionRequest
from .worker import DecodeWorker, Job, QueueFull

COMPLETION_DEFAULT_MAX_TOKENS = 16
# Knobs that name files on the server: a client must not make the server read its files.
SERVER_ONLY_KNOBS = frozenset({"static_corpus"})
_DRAFTERS_KEPT = 16
_SEED_BITS = 63


# Slack in the derived body limit for what is not prompt text: the other fields, stop strings, knobs.
_BODY_SLACK = 64 << 10


@dataclass
class ServeOptions:
    model_name: str = "dasspec-tiny"
    method: str = "auto"                                     # requests that name no method
    knobs: dict[str, Any] = field(default_factory=dict)     # the default method's knobs (--set)
    max_queue: int = 64
    max_tokens_cap: int | None = None                        # None: the model's context
    runtime: Runtime | None = None                           # execution options (--compile, --cuda-graphs)
    policy: SpeculationPolicy | None = None                  # how much to speculate as the batch grows
    # Options below carry their flag's help (dasspec serve derives --max-body, --template-timeout from them).
    max_body: int | None = field(default=None, metadata={"help": (
        "the largest request body in bytes; a larger one is answered 413 before it is read (default: what the "
        "longest prompt that fits the context can take as JSON, 6 x context x the longest token + 64 KiB)")})
    template_timeout: float = field(default=1.0, metadata={"help": (
        "seconds a chat template may take to render one conversation; it renders in a separate process with "
        "bounded output and memory, and one that takes longer is stopped and the request answered 400")})
    max_batch: int = field(default=8, metadata={"help": (
        "requests decoded together (continuous batching: one verification pass per step for all of them); "
        "more wait in the queue")})
    kv_budget: int | None = field(default=None, metadata={"help": (
        "depth-cache positions of the pool the running requests share, allocated once and taken in blocks as "
        "tokens are written (prompt blocks shared between requests that start alike); a request that could never "
        "fit alone (prompt + max_tokens + its drafter's width) is answered 400; when blocks run out the most "
        "recently admitted request is swapped out and resumes later with the same tokens (default: max-batch "
        "requests of the whole context, at most half the free memory)")})
    max_step_tokens: int = field(default=MAX_STEP_TOKENS, metadata={"help": (
        "rows one decode step may verify and prefill together: running requests' drafts first, then prompt "
        "blocks with what is left (less than a block left: a slice of a block's depths), so a long prompt "
        "arriving never stalls the streams already running; lower it for steadier streams, raise it for faster "
        "prefill")})
    overlap: bool = field(default=False, metadata={"help": (
        "plan each decode step while the one before it runs, and make its events meanwhile (the same tokens; the "
        "engine's own work leaves the critical path - worth it where steps are short and requests many, as on a "
        "GPU; on a CPU within the noise, docs/performance.md)")})
    full_depth_kv: bool = field(default=False, metadata={"help": (
        "on a model whose loops >= 2 attend within a window (IQuest-Loop), keep every loop's K/V of every position "
        "instead of only the window's (about twice the pool memory at T = 2; prompt blocks are shared either way); "
        "other models keep every depth anyway")})
    request_timeout: float | None = field(default=None, metadata={"help": (
        "seconds a request may take from arrival to its last token, queue wait included; then it stops where "
        "it is (finish_reason length, dasspec.stop_reason timeout), even inside a drafting step (default: none)")})


class Frontend:
    """The model-free half of a server: what a request's text, limits and options are checked against - the
    tokenizer, the context, the vocabulary and the chat template (rendered in the sandbox) - and the checks
    themselves.  ``Service`` is a frontend over a loaded model; the Ray Serve ingress (``ray_app``) is one over
    replicas, so both answer the same request with the same refusal."""

    def __init__(self, tok, context: int, vocab_size: int, options: ServeOptions):
        cap = options.max_tokens_cap
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"max_tokens_cap must be an integer >= 1, got {cap!r}")
        body = options.max_body
        if body is not None and (isinstance(body, bool) or not isinstance(body, int) or body < 1):
            raise ValueError(f"max_body must be an integer >= 1 (bytes), got {body!r}")
        self.tok, self.options = tok, options
        self.context, self.vocab_size = context, vocab_size
        # No text longer than context x the longest token can fit the context: the bound of the template's output
        # and, escaped as JSON (at most 6 bytes per byte), of a request body.
        longest = max(map(len, self.tok.backend.get_vocab(with_added_tokens=True)), default=1)
        self.max_body = body or 6 * self.context * longest + _BODY_SLACK
        self.chat_template = self.tok.chat_template or PLAIN_CHAT_TEMPLATE
        self.templates = TemplateSandbox(options.template_timeout, self.context * longest)
        self._check_template()

    @property
    def model_name(self) -> str:
        return self.options.model_name

    # --- prompts --------------------------------------------------------------------------------------------
    def completion_prompt(self, req: CompletionRequest) -> list[int]:
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, f"'prompt': one prompt per request, got {len(p)} (send several requests; they "
                               "are decoded together)", param="prompt")
            p = p[0]
        if isinstance(p, str):
            ids = self.tok.encode(p)
        else:
            V = self.vocab_size
            bad = [t for t in p if not 0 <= t < V]
            if bad:
                raise APIError(400, f"'prompt': token id {bad[0]} is outside the vocabulary [0, {V})", param="prompt")
            ids = list(p)
        if not ids:
            raise APIError(400, "'prompt' is empty (and this tokenizer adds no BOS)", param="prompt")
        return ids

    def chat_prompt(self, req: ChatRequest) -> list[int]:
        """The conversation's token ids: the checkpoint's template rendered in the sandbox (bounded time, output
        and memory; blocks the calling thread, so call it off the event loop)."""
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in req.messages]
        try:
            text = self.templates.render(self.chat_template, messages, True, self.tok.special_tokens,
                                         req.chat_template_kwargs)
        except TemplateLimit as err:             # the template's raise_exception, or a bound it exceeded
            raise APIError(400, f"'messages': {err}", param="messages") from None
        return self.tok.encode(text, add_special_tokens=False)  # the template placed BOS itself

    def _check_template(self) -> None:
        """Render a one-message conversation at start: a template that exceeds the sandbox's bounds on it would
        exceed them on every chat request, so the server refuses to start (its own errors only 400 chat)."""
        try:
            self.templates.render(self.chat_template, [{"role": "user", "content": "Hello"}], True,
                                  self.tok.special_tokens)
        except TemplateLimit as err:
            if err.bound:
                self.templates.close()
                raise ValueError(f"the checkpoint's chat template, on a one-message conversation: {err}") from None

    # --- the request's options ---------------------------------------------------------------------------------
    def params(self, req: CompletionRequest | ChatRequest, prompt: list[int], endpoint: str) -> dict[str, Any]:
        """The ``Engine.add`` options every request has - token limit, seed, stop strings, sampling - checked
        against the model's name, context and the server's cap (the model-dependent ones: ``Service.job``)."""
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"the model '{req.model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")
        params = {"max_new_tokens": self._max_tokens(req, len(prompt), endpoint)}
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if stops:
            params["stop"] = stops
        params.update(self._sampling(req))
        if req.seed is not None:
            params["seed"] = req.seed
        elif params.get("do_sample"):               # two users' unseeded requests must not share their "random"
            params["seed"] = secrets.randbits(_SEED_BITS)
        else:
            params["seed"] = 0
        return params

    def _max_tokens(self, req, P: int, endpoint: str) -> int:
        field_name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else \
            "max_tokens"
        given = req.token_limit if isinstance(req, ChatRequest) else req.max_tokens
        room = self.context - P
        if room < 1:
            what = "messages" if endpoint == "chat" else "prompt"
            raise APIError(400, f"the prompt has {P} tokens; the model's context is {self.context} positions, so no "
                           "token can be generated", param=what, code="context_length_exceeded")
        cap = self.options.max_tokens_cap or self.context
        if given is None:                          # OpenAI's: 16 for completions, the rest of the context for chat
            return min(COMPLETION_DEFAULT_MAX_TOKENS if endpoint == "completions" else room, room, cap)
        if given > room:
            raise APIError(400, f"prompt ({P} tokens) + {field_name} ({given}) = {P + given} exceeds the model's "
                           f"context of {self.context} positions", param=field_name, code="context_length_exceeded")
        if given > cap:
            raise APIError(400, f"'{field_name}' {given} is above this server's limit of {cap} "
                           "(dasspec serve --max-tokens-cap)", param=field_name)
        return given

    @staticmethod
    def _sampling(req) -> dict[str, Any]:
        t, p = req.temperature, req.top_p
        if t == 0 or (t is None and p is None):
            return {}
        options = {"do_sample": True, "temperature": 1.0 if t is None else t, "top_p": p}
        try:
            Sampling(options["temperature"], None, p, None, 0 if req.seed is None else req.seed)
        except ValueError as err:
            param = "temperature" if "temperature" in str(err) else "top_p"
            raise APIError(400, f"'{param}': {err}", param=param) from None
        return options

    def close(self) -> None:
        self.templates.close()


class Service(Frontend):
    def __init__(self, model: LoopedLM, options: ServeOptions):
        if model.tokenizer is None:
            raise ValueError("the server needs the checkpoint's tokenizer.json (it takes and returns text)")
        self.model = model
        self.method = get_method(options.method).name            # canonical name (aliases resolved)
        self.depth = model.depth(None)
        rt = options.runtime
        self.exactness = decode_kernel.exactness(model.device, model.dtype,     # what /health promises
                                                 static_shapes=rt is not None and rt.static_shapes)
        super().__init__(model.tokenizer, model.config.block_size, model.config.vocab_size, options)
        self.drafters = DrafterCache.of_registry(model, self.depth, keep=_DRAFTERS_KEPT)
        for sampled in (False, True):       # the server's own knobs fail at start, not later (greedy or sampled)
            try:
                self.drafter(self.method, {}, sampled=sampled)
            except APIError as err:
                raise ValueError(f"--method {self.method} --set: {err.message}"
                                 + (" (with the model's sampled defaults)" if sampled else "")) from None
        self.metrics = ServerMetrics(lambda: self.worker.queue_length, lambda: self.worker.running,
                                     lambda: self.engine.cache_usage())
        self.engine = Engine(model, self.method, {**options.knobs}, runtime=options.runtime,
                             max_batch=options.max_batch, kv_budget=options.kv_budget, policy=options.policy,
                             max_step_tokens=options.max_step_tokens, drafters=self.drafters,
                             overlap=options.overlap, window_kv=not options.full_depth_kv)
        self.worker = DecodeWorker(self.engine, options.max_queue, self.metrics, options.request_timeout)

    def warmup(self) -> None:
        """A short generation before the first client (allocator, kernels), on an engine of its own (the worker's
        is idle: nothing is listening yet); a stateful method's on a drafter of its own, so that the server's (auto's
        cost model, Token Recycling's table) does not start from a cold process's times and a greeting's tokens."""
        drafter = build_drafter(self.model, self.method, dict(self.options.knobs), self.depth) \
            if get_method(self.method).stateful else self.drafter(self.method, {})
        generate(self.model, self.tok.encode("Hello"), drafter=drafter, max_new_tokens=4, runtime=self.options.runtime)

    # --- the job --------------------------------------------------------------------------------------------
    def job(self, req: CompletionRequest | ChatRequest, prompt: list[int], endpoint: str,
            loop: asyncio.AbstractEventLoop) -> Job:
        params = self.params(req, prompt, endpoint)
        opts = req.dasspec
        if opts is not None and (opts.exit_threshold is not None or opts.exit_at_step is not None):
            try:
                self.model.exit_rule(opts.exit_threshold, opts.exit_at_step)
            except ValueError as err:
                param = "dasspec.exit_at_step" if "exit_at_step" in str(err) and opts.exit_threshold is None \
                    else "dasspec.exit_threshold"
                raise APIError(400, f"'{param}': {err}", param=param) from None
            params.update(exit_threshold=opts.exit_threshold, exit_at_step=opts.exit_at_step)
        method = opts.method if opts is not None and opts.method is not None else self.method
        drafter = self.drafter(method, dict(opts.knobs) if opts is not None else {},
                               sampled=params.get("do_sample", False))
        return Job(loop, prompt, drafter, params, endpoint, stream=bool(req.stream))

    def drafter(self, method: str, knobs: dict[str, Any], sampled: bool = False) -> Drafter:
        """The kept drafter for (method, knobs, greedy or sampled: the model's defaults may differ), built (and its
        knobs validated) on first use."""
        try:
            name = get_method(method).name
        except ValueError as err:
            raise APIError(400, f"'dasspec.method': {err}", param="dasspec.method") from None
        denied = sorted(SERVER_ONLY_KNOBS & set(knobs))
        if denied:
            raise APIError(400, f"'dasspec.knobs': knob {denied[0]!r} names a file on the server; set it with "
                           "dasspec serve --set",
                           param=f"dasspec.knobs.{denied[0]}")
        if name == self.method:
            knobs = {**self.options.knobs, **knobs}
        try:
            return self.drafters.get(name, knobs, sampled)
        except (ValueError, TypeError) as err:
            raise APIError(400, f"'dasspec.knobs': {err}", param="dasspec.knobs") from None

    # --- the queue --------------------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        try:
            self.worker.submit(job)
        except QueueFull as err:
            raise APIError(429, f"the server is busy: {err}; retry shortly", type="rate_limit_error",
                           code="queue_full") from None

    # --- what the routes ask (app.py; the Ray ingress answers the same) -------------------------------------------
    def stats(self, job: Job, result, queue_time: float) -> dict[str, Any]:
        """The response's ``dasspec`` object."""
        return decoding_stats(result, job.drafter, self.depth, queue_time, job.params.get("seed"))

    def cancel(self, job: Job) -> None:
        self.worker.cancel(job)

    async def health(self) -> tuple[dict[str, Any], bool]:
        ok = self.worker.alive
        return {"status": "ok" if ok else "the decode worker has stopped", "model": self.model_name,
                "method": self.method, "queue_length": self.worker.queue_length,
                "running": self.worker.running, "exactness": self.exactness, "overlap": self.engine.overlap,
                "kv_window": self.engine.window, "templates_rendering": self.templates.rendering}, ok

    async def metrics_text(self) -> str:
        return self.metrics.render()

    def close(self) -> None:
        self.worker.close()
        self.engine.close()
        super().close()
