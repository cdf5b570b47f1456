"""``dasspec serve --ray``: the server as a Ray Serve application - model replicas across a cluster behind one
ingress that speaks the same OpenAI API with the same checks (``app.create_app``'s routes, mounted on a
``ClusterService``), routes requests by prompt prefix (``routing``), and re-runs a request whose replica died on
another replica so that the client gets exactly the answer it would have got - a stream included.

    dasspec serve --ray --replicas 2                         # a local Ray instance, or --ray auto / ADDRESS
    serve run dasspec.serve.ray_app:build_app replicas=2     # Ray Serve's own CLI (or a config file: docs/serving.md)

Deployments:

* ``DasspecReplica`` (``replicas`` copies, or Ray Serve autoscaling on queue depth): one loaded model, its batched
  engine and decode worker - a ``Service``, exactly the single server's - answering ``generate(body, prompt,
  endpoint)`` as a stream of small dict events, and ``health`` / ``metrics``.
* ``DasspecIngress``: the FastAPI routes over a ``ClusterService``, a ``Frontend`` (tokenizer, context, chat
  template sandbox: no weights) that parses, checks and tokenizes every request as ``dasspec serve`` does, then
  sends it to a replica through a handle whose request router is ``routing.PrefixAwareRouter``.

Failover.  Every answer is a deterministic function of the request and its seed (lossless decoding), so the
ingress makes the seed explicit: a sampled request without one gets a fresh random seed, sent to the replica and
returned in ``dasspec.seed``.  When a replica dies (its process killed, its node lost) while it holds a request,
the ingress sends the same request, seed included, to another replica and skips the text the client already has
(a count of characters: the streamed text is always a prefix of the final text), so the stream continues with
neither a repeated nor a missing character - after comparing the re-run's token ids with those the sent text came
from (``splice.py``): a re-run that decodes differently ends the stream with an error event, never a spliced
answer.  After ``max_failovers`` deaths the request ends with a clear error
(a 503, or an error event in a stream), never a silently short answer.  Requests still waiting at the ingress are
only sent once a live replica takes them, so they survive a replica restart.

Ray is optional: this module imports it only when an application is built.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import dasspec

from ..engine.base.runtime import Runtime
from ..engine.core.policy import SpeculationPolicy
from ..host import set_threads
from ..methods import get_method
from ..model.checkpoint import read_json, resolve_source, weight_entries
from ..model.config import LoopedConfig
from ..model.tokenizer import load_tokenizer
from . import routing
from .metrics import Counter, Gauge, Registry
from .routing import POLICIES, mark_dead, prefix_key, router_for
from .schema import APIError, ChatRequest, CompletionRequest, parse_request
from .service import Frontend, ServeOptions, Service
from .splice import Diverged, Splice
from .worker import Cancelled, Delta, Done, Failed, Job, Started, error_for

RAY_HINT = "--ray needs Ray Serve: pip install 'dasspec[ray]' (or pip install 'ray[serve]>=2.9')"
APP_NAME = "dasspec"
REPLICA = "DasspecReplica"
CONTROL_TIMEOUT_S = 8.0          # a replica's health / metrics answer; past it the replica counts as unhealthy
CONTROL_SLOTS = 4                # Ray Serve slots per replica beyond its queue, kept for health and metrics calls
_SEED_RNG = random.SystemRandom()


def import_serve():
    try:
        # optional: Ray Serve (the [ray] extra), named below when it is missing
        import ray
        from ray import serve
    except ImportError:
        raise ValueError(RAY_HINT) from None
    return ray, serve


# --- options ------------------------------------------------------------------------------------------------------

@dataclass
class ClusterOptions:
    """The application's shape: the model each replica loads, how many replicas and what each takes, routing and
    failover.  ``server``: ``ServeOptions`` fields (every ``dasspec serve`` option but the execution ones)."""
    model: str | None = None                 # checkpoint folder or HF-cache repo id; None: the bundled model
    device: str | None = None                # None: the replica's GPU if Ray gave it one, else CPU
    dtype: str | None = None
    replicas: int = 1                        # fixed count (ignored with autoscaling)
    autoscaling: dict | None = None          # Ray Serve autoscaling_config (min_replicas, max_replicas, ...)
    num_cpus: float = 1.0                    # per replica
    num_gpus: float = 0.0                    # per replica (1: one GPU each)
    threads: int | None = None               # torch threads per replica (None: num_cpus, at least 1)
    routing: str = "prefix"                  # prefix | least-loaded | random
    prefix_tokens: int = 32                  # the routing key: the prompt's first K tokens
    load_factor: float = 1.25                # bounded loads: no replica above this x the mean (+ 1) ...
    spill_at: int | None = None              # ... unless it holds fewer than this (None: half of max_batch)
    max_failovers: int = 3                   # replica deaths one request survives
    warmup: bool = True
    runtime: dict = field(default_factory=dict)      # Runtime options: static_shapes, compile, cuda_graphs
    speculate_up_to: int | None = None
    server: dict = field(default_factory=dict)       # ServeOptions fields

    def check(self) -> "ClusterOptions":
        if self.autoscaling is None and (isinstance(self.replicas, bool) or not isinstance(self.replicas, int)
                                         or self.replicas < 1):
            raise ValueError(f"replicas must be an integer >= 1, got {self.replicas!r}")
        if self.routing not in POLICIES:
            raise ValueError(f"routing must be one of {', '.join(POLICIES)}, got {self.routing!r}")
        if not self.num_cpus >= 0 or not self.num_gpus >= 0:
            raise ValueError("num_cpus and num_gpus must be >= 0")
        if self.max_failovers < 0 or self.prefix_tokens < 1 or not self.load_factor >= 1:
            raise ValueError("max_failovers >= 0, prefix_tokens >= 1 and load_factor >= 1 are required")
        bad = set(self.server) - {f for f in ServeOptions.__dataclass_fields__ if f not in ("runtime", "policy")}
        if bad:
            raise ValueError(f"unknown server option(s): {', '.join(sorted(bad))}")
        return self

    def serve_options(self) -> ServeOptions:
        return ServeOptions(**self.server)

    @property
    def capacity(self) -> int:
        """Requests the ingress holds at once: every replica's batch and queue, and one more queue at the
        ingress (requests waiting for a replica, which survive a replica's restart); beyond it, 429 at once."""
        o = self.serve_options()
        most = (self.autoscaling or {}).get("max_replicas", self.replicas) if self.autoscaling else self.replicas
        return most * (o.max_batch + o.max_queue) + o.max_queue


def model_info(source: str | None):
    """What the ingress needs of the checkpoint without its weights: (tokenizer, context, vocabulary size)."""
    folder = resolve_source(source)
    cfg = LoopedConfig.from_hf(read_json(folder / "config.json"), weight_entries(folder).keys())
    return load_tokenizer(folder), cfg.block_size, cfg.vocab_size


# --- the replica -------------------------------------------------------------------------------------------------

class DasspecReplica:
    """One model, its engine and decode worker: the single server's ``Service``, answering the ingress."""

    def __init__(self, cluster: dict):
        from ray import serve                   # optional: Ray Serve; a replica runs inside it

        c = ClusterOptions(**cluster)
        set_threads(c.threads or max(1, int(c.num_cpus)))
        model = dasspec.load_model(c.model, device=c.device, dtype=c.dtype)
        policy = None if c.speculate_up_to is None else SpeculationPolicy(off_above=c.speculate_up_to)
        options = ServeOptions(**c.server, runtime=Runtime(**c.runtime) if c.runtime else None, policy=policy)
        self.service = Service(model, options)
        if c.warmup:
            self.service.warmup()
        self.id = serve.get_replica_context().replica_id.unique_id

    async def generate(self, body: dict, prompt: list[int], endpoint: str, **routing) -> AsyncIterator[dict]:
        """The request's events: {"replica", "pid"}, {"started"}, {"text", "tokens"}..., then {"done"} or
        {"error"}.  Cancelled by the ingress (its client went away): the job stops at the next step."""
        service = self.service
        try:
            req = parse_request(ChatRequest if endpoint == "chat" else CompletionRequest, body)
            job = service.job(req, prompt, endpoint, asyncio.get_running_loop())
            service.submit(job)
        except APIError as err:
            yield {"error": err.status, "body": err.body(), "counted": False}
            return
        yield {"replica": self.id, "pid": os.getpid()}
        queue_time = 0.0
        try:
            while True:
                event = await job.events.get()
                if isinstance(event, Started):
                    queue_time = event.queue_time
                    yield {"started": event.queue_time}
                elif isinstance(event, Delta):
                    if event.text or event.ids:     # ids even when the text is held back: failover compares them
                        yield {"text": event.text, "tokens": event.tokens, "ids": event.ids}
                elif isinstance(event, Done):
                    r = event.result
                    yield {"done": {"text": r.text or "", "tokens": list(r.tokens), "stop_reason": r.stop_reason,
                                    "tail": event.tail, "cancelled": event.cancelled,
                                    "stats": service.stats(job, r, queue_time)}}
                    return
                elif isinstance(event, Failed):
                    err = error_for(event.error)
                    yield {"error": err.status, "body": err.body(), "counted": True}
                    return
                elif isinstance(event, Cancelled):
                    return
        finally:
            if not job.finished:
                service.cancel(job)

    async def health(self, **routing) -> dict:
        body, ok = await self.service.health()
        served = sum(self.service.metrics.requests.values.values())
        return {**body, "ok": ok, "replica": self.id, "pid": os.getpid(), "requests": served}

    async def metrics(self, **routing) -> str:
        return await self.service.metrics_text()

    def __del__(self):
        service = getattr(self, "service", None)
        if service is not None:
            service.close()


# --- the ingress -------------------------------------------------------------------------------------------------

@dataclass
class RemoteResult:
    """What the routes read of a finished request (``GenerationResult``'s fields they use)."""
    text: str
    tokens: list[int]
    stop_reason: str
    stats: dict


@dataclass(eq=False)
class ClusterJob(Job):
    body: dict = field(default_factory=dict)       # the validated request, seed explicit
    seed: int = 0
    route_key: str | None = None
    task: asyncio.Task | None = None
    replica: str | None = None                     # where it runs now
    failovers: int = 0
    started_once: bool = False


class ClusterService(Frontend):
    """The ingress's service: ``create_app``'s routes over replicas (see the module's docstring)."""

    def __init__(self, handle, tok, context: int, vocab_size: int, cluster: ClusterOptions):
        super().__init__(tok, context, vocab_size, cluster.serve_options())
        self.handle, self.cluster = handle, cluster
        self.method = get_method(self.options.method).name
        self._pending = 0                 # requests accepted by the ingress and not finished
        self._waiting = 0                 # ... not yet started on any replica
        r = self.registry = Registry()

        class _M:                         # the routes count outcomes through ``metrics.requests``
            requests = Counter(r, "dasspec_requests_total", "Requests by endpoint and outcome (ok, cancelled: the "
                               "client went away; invalid: 4xx; rejected: 429 queue full; error: 5xx)",
                               ("endpoint", "outcome"))
        self.metrics = _M()
        self.failovers = Counter(r, "dasspec_failovers_total", "Requests re-run on another replica after theirs "
                                 "died (resumed), requests given up after max_failovers deaths (failed), and "
                                 "re-runs that decoded other tokens than those streamed (diverged: an error)",
                                 ("outcome",))
        Gauge(r, "dasspec_ingress_waiting", "Requests at the ingress not yet decoding on a replica",
              lambda: self._waiting)
        self.replicas_gauge = 0
        Gauge(r, "dasspec_replicas", "Replicas that answered the last health or metrics call",
              lambda: self.replicas_gauge)
        Gauge(r, "dasspec_route_prefix_requests_total", "Requests routed by a prompt prefix an earlier request had "
              "(this ingress)",
              lambda: routing.locality["keyed"])
        Gauge(r, "dasspec_route_prefix_local_total", "Requests routed by a prefix to the replica that had that "
              "prefix's previous request", lambda: routing.locality["local"])

    def _router(self):
        return router_for(REPLICA)

    # --- the job ---------------------------------------------------------------------------------------------
    def job(self, req, prompt: list[int], endpoint: str, loop: asyncio.AbstractEventLoop) -> ClusterJob:
        params = self.params(req, prompt, endpoint)
        seed = req.seed if req.seed is not None else \
            _SEED_RNG.randrange(2**31) if params.get("do_sample") else 0
        body = {**req.model_dump(exclude_unset=True), "seed": seed}
        key = prefix_key(prompt, self.cluster.prefix_tokens)
        return ClusterJob(loop, prompt, None, params, endpoint, stream=bool(req.stream), body=body, seed=seed,
                          route_key=key)

    def submit(self, job: ClusterJob) -> None:
        if self._pending >= self.cluster.capacity:
            raise APIError(429, f"the server is busy: all {self.cluster.capacity} request slots of the cluster "
                           "are taken; retry shortly", type="rate_limit_error", code="queue_full")
        self._pending += 1
        self._waiting += 1
        job.task = job.loop.create_task(self._run(job))

    def cancel(self, job: ClusterJob) -> None:
        if job.finished:
            return
        if job.task is not None:
            job.task.cancel()              # cancels the replica's call: its job stops at the next step
        if job.replica is None:            # never reached a replica: nobody else counts it
            self.metrics.requests.inc(endpoint=job.endpoint, outcome="cancelled")
        job.post(Cancelled())

    def stats(self, job: ClusterJob, result: RemoteResult, queue_time: float) -> dict[str, Any]:
        return {**result.stats, "seed": job.seed, "failovers": job.failovers}

    async def _run(self, job: ClusterJob) -> None:
        import ray                              # optional: Ray Serve, present on an ingress
        from ray.serve.exceptions import BackPressureError

        splice = Splice(job.stream)        # the text the client has, and the token ids it came from
        avoid: list[str] = []
        try:
            while True:
                splice.restart()
                job.replica = None
                call = self.handle.options(method_name="generate", stream=True)
                events = None
                try:
                    events = call.remote(job.body, job.prompt, job.endpoint, route_key=job.route_key, avoid=avoid)
                    async for ev in events:
                        if "replica" in ev:
                            job.replica = ev["replica"]
                        elif "started" in ev:
                            if not job.started_once:
                                job.started_once = True
                                self._waiting -= 1
                                job.queue_time = ev["started"]
                                job.post(Started(ev["started"]))
                        elif "text" in ev:
                            text = splice.chunk(ev["text"], ev.get("ids", ()))
                            if text:
                                job.post(Delta(text, ev["tokens"]))
                        elif "done" in ev:
                            d = ev["done"]
                            if d["cancelled"]:             # not by us (that cancels this task): it is stopping
                                raise RuntimeError("the replica stopped the request (it is shutting down)")
                            tail = splice.done(d["tail"], d["tokens"])
                            result = RemoteResult(d["text"], d["tokens"], d["stop_reason"], d["stats"])
                            job.post(Done(result, tail, False))
                            return
                        elif "error" in ev:
                            err = APIError(ev["error"], ev["body"]["error"]["message"], ev["body"]["error"]["param"],
                                           ev["body"]["error"]["type"], ev["body"]["error"]["code"])
                            err.counted = ev["counted"]
                            job.post(Failed(err))
                            return
                    raise RuntimeError("the replica ended the request without an answer (it is shutting down)")
                except BackPressureError:
                    job.post(Failed(APIError(429, "the server is busy: every replica's queue and the ingress's "
                                             "queue are full; retry shortly", type="rate_limit_error",
                                             code="queue_full")))
                    return
                except Diverged as err:
                    # never splice two trajectories: the stream ends with an error event (the text sent so far
                    # stays what it was, a prefix of the first attempt's answer), and the re-run stops
                    if events is not None:
                        events.cancel()
                    self.failovers.inc(outcome="diverged")
                    self.metrics.requests.inc(endpoint=job.endpoint, outcome="error")
                    e = APIError(500, f"the request could not be finished: its replica failed and the re-run on "
                                 f"another replica decoded differently ({err}); the {splice.sent} characters "
                                 "streamed so far are a prefix of the first attempt's answer", type="server_error",
                                 code="failover_diverged")
                    e.counted = True
                    job.post(Failed(e))
                    return
                except ray.exceptions.RayTaskError:
                    raise
                except (ray.exceptions.RayError, RuntimeError) as err:
                    # the replica died (actor or node lost) or stopped: the same request, seed included, elsewhere
                    mark_dead(job.replica)
                    if job.replica:
                        avoid.append(job.replica)
                    if job.failovers >= self.cluster.max_failovers:
                        self.failovers.inc(outcome="failed")
                        self.metrics.requests.inc(endpoint=job.endpoint, outcome="error")
                        e = APIError(503, f"the request could not be finished: its replica failed "
                                     f"{job.failovers + 1} times (last: {type(err).__name__}); "
                                     + (f"the {splice.sent} characters streamed so far are a prefix of the answer"
                                        if job.stream else "no answer was produced"),
                                     type="server_error", code="replica_failed")
                        e.counted = True
                        job.post(Failed(e))
                        return
                    job.failovers += 1
                    self.failovers.inc(outcome="resumed")
        except asyncio.CancelledError:
            raise
        except Exception as err:           # a bug, not a replica's death: the request's 500
            e = APIError(500, f"internal error: {type(err).__name__}: {err}", type="server_error")
            job.post(Failed(e))
        finally:
            self._pending -= 1
            if not job.started_once:
                self._waiting -= 1
            if not job.finished:
                job.post(Cancelled())

    # --- health and metrics: every replica asked, the answers added up ------------------------------------------
    async def _ask_all(self, method: str) -> list[tuple[str, Any]]:
        router = self._router()
        if router is None:                 # the handle's router exists after its first call: make one
            try:
                await asyncio.wait_for(self.handle.options(method_name="health").remote(), CONTROL_TIMEOUT_S)
            except Exception:
                pass
            router = self._router()
        ids = router.replica_ids() if router is not None else []

        async def ask(rid: str):
            if routing.is_dead(rid):                # a call to it failed: not asked again (no wait on the dead)
                return rid, RuntimeError("a call to it failed; it is being replaced")
            try:
                call = self.handle.options(method_name=method).remote(replica_id=rid)
                return rid, await asyncio.wait_for(call, CONTROL_TIMEOUT_S)
            except Exception as err:
                import ray                      # optional: Ray Serve, present on an ingress
                if isinstance(err, ray.exceptions.ActorDiedError):
                    routing.mark_dead(rid)
                return rid, err
        # one at a time: calls made while serving one HTTP request share its request id, and Ray Serve's router
        # matches a chosen replica to a pending call by that id (concurrent calls would take each other's replica)
        answers = [await ask(i) for i in ids]
        self.replicas_gauge = sum(not isinstance(a, Exception) for _, a in answers)
        return answers

    async def health(self) -> tuple[dict[str, Any], bool]:
        rendering = self.templates.rendering          # now, not after the replicas' answers
        answers = await self._ask_all("health")
        replicas = [{"replica": rid, "status": f"unreachable: {type(a).__name__}"} if isinstance(a, Exception)
                    else {k: a.get(k) for k in ("replica", "status", "pid", "queue_length", "running", "requests",
                                                "exactness")}
                    for rid, a in answers]
        good = [a for _, a in answers if not isinstance(a, Exception) and a["ok"]]
        exactness = cluster_promise([a.get("exactness") for a in good])
        loads = self._router().loads() if self._router() is not None else {}
        for r in replicas:
            r["routed_in_flight"] = loads.get(r["replica"], 0)     # this ingress's count, which routing uses
        ok = bool(good)
        return {"status": "ok" if ok else "no replica is answering", "model": self.model_name,
                "method": self.method, "queue_length": sum(a["queue_length"] for a in good) + self._waiting,
                "running": sum(a["running"] for a in good), "exactness": exactness,
                "templates_rendering": rendering, "replicas": replicas}, ok

    async def metrics_text(self) -> str:
        answers = await self._ask_all("metrics")
        return merge_metrics([self.registry.render()] + [a for _, a in answers if isinstance(a, str)])

    def close(self) -> None:
        super().close()


def cluster_promise(promises: list[str | None]) -> str | None:
    """What a cluster's /health promises about each answer's bits: its answering replicas' promise where they agree;
    where they do not (a node whose kernels did not build, a GPU beside CPUs) each, named as differing - a failover
    between such replicas may end a stream in an error event rather than splice two trajectories."""
    found = list(dict.fromkeys(p or "unknown (a replica that does not state it)" for p in promises))
    if len(found) <= 1:
        return found[0] if found else None
    return "replicas differ: " + " | ".join(found)


# --- metrics: the replicas' series added up ------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{.*\})?) (\S+)$")


def merge_metrics(texts: list[str]) -> str:
    """Prometheus texts added up series by series (counters, gauges, histogram buckets / sums / counts: every
    series of a server is a sum over requests or over its parts), in the order they first appear."""
    headers: dict[str, list[str]] = {}
    values: dict[str, dict[str, float]] = {}
    for text in texts:
        family = None
        for line in text.splitlines():
            if line.startswith("# HELP "):
                family = line.split(" ", 3)[2]
                headers.setdefault(family, [])
                values.setdefault(family, {})
                if len(headers[family]) < 2:
                    headers[family].append(line)
            elif line.startswith("# TYPE "):
                family = line.split(" ", 3)[2]
                if len(headers.setdefault(family, [])) < 2:
                    headers[family].append(line)
                values.setdefault(family, {})
            elif line and not line.startswith("#"):
                m = _SAMPLE.match(line)
                if m is None or family is None:
                    continue
                series = values[family]
                series[m.group(1)] = series.get(m.group(1), 0.0) + float(m.group(2))
    out: list[str] = []
    for family, lines in headers.items():
        out += lines
        for name, v in values.get(family, {}).items():
            out.append(f"{name} {int(v) if float(v).is_integer() else repr(v)}")
    return "\n".join(out) + "\n"


class DasspecIngress:
    """The HTTP ingress: ``create_app``'s routes over a ``ClusterService`` (wrapped by ``serve.ingress``)."""

    def __init__(self, replicas, cluster: dict):
        c = ClusterOptions(**cluster)
        tok, context, vocab = model_info(c.model)
        self.service = ClusterService(replicas, tok, context, vocab, c)

    def __serve_build_asgi_app__(self):
        from .app import create_app             # lazy: FastAPI, in the ingress only (not for serve --help)
        return create_app(self.service)


# --- the application -------------------------------------------------------------------------------------------

def build_app(args: dict | None = None):
    """The Ray Serve application (``serve run dasspec.serve.ray_app:build_app replicas=2 model=PATH``, or
    ``import_path`` in a Serve config file with ``args``): ``args`` are ``ClusterOptions`` fields; the
    ``ServeOptions`` ones (max_batch, max_queue, method, ...) may be given at the top level or under ``server``."""
    _, serve = import_serve()
    from ray.serve.config import RequestRouterConfig    # optional: Ray Serve, checked just above

    args = dict(args or {})
    server = dict(args.pop("server", None) or {})
    for name in list(args):
        if name in ServeOptions.__dataclass_fields__ and name not in ClusterOptions.__dataclass_fields__:
            server[name] = args.pop(name)
    for name, kind in (("replicas", int), ("num_cpus", float), ("num_gpus", float), ("prefix_tokens", int),
                       ("spill_at", int),
                       ("load_factor", float), ("max_failovers", int), ("threads", int)):
        if isinstance(args.get(name), str):          # serve run's key=value arguments are strings
            args[name] = kind(args[name])
    for name in ("max_batch", "max_queue", "max_tokens_cap", "kv_budget", "max_body"):
        if isinstance(server.get(name), str):
            server[name] = int(server[name])
    for name in ("request_timeout", "template_timeout"):
        if isinstance(server.get(name), str):
            server[name] = float(server[name])
    unknown = sorted(set(args) - set(ClusterOptions.__dataclass_fields__))
    if unknown:
        raise ValueError(f"unknown argument(s) of the dasspec application: {', '.join(unknown)} (ClusterOptions "
                         "and ServeOptions fields are accepted)")
    if isinstance(args.get("warmup"), str):
        args["warmup"] = args["warmup"].lower() not in ("0", "false", "no")
    c = ClusterOptions(**args, server=server).check()
    o = c.serve_options()
    per_replica = o.max_batch + o.max_queue
    scale = {"autoscaling_config": {"target_ongoing_requests": o.max_batch, **c.autoscaling}} if c.autoscaling \
        else {"num_replicas": c.replicas}
    replica = serve.deployment(name=REPLICA)(DasspecReplica).options(
        ray_actor_options={"num_cpus": c.num_cpus, "num_gpus": c.num_gpus},
        max_ongoing_requests=per_replica + CONTROL_SLOTS,
        max_queued_requests=o.max_queue if o.max_queue > 0 else -1,
        graceful_shutdown_timeout_s=30, health_check_period_s=2, health_check_timeout_s=30,
        request_router_config=RequestRouterConfig(
            request_router_class="dasspec.serve.ray_router.PrefixAwareRouter",
            request_router_kwargs={"prefix_tokens": c.prefix_tokens, "load_factor": c.load_factor,
                                   "policy": c.routing,
                                   "spill_at": c.spill_at if c.spill_at is not None else max(1, o.max_batch // 2)}),
        **scale)
    ingress = serve.deployment(name="DasspecIngress")(serve.ingress()(DasspecIngress)).options(
        ray_actor_options={"num_cpus": 0}, max_ongoing_requests=max(1000, 2 * c.capacity))
    return ingress.bind(replica.bind(asdict(c)), asdict(c))


# Ray Serve gives a starting HTTP proxy 5 s to answer its readiness check and a running one 10 s per health check,
# then restarts it; on a loaded machine (a shared CI box) a proxy that is merely slow to import is restarted over
# and over and ``serve.start`` gives up after its fixed 60 s.  And its router gives a replica 0.1 s (backing off to
# 1 s) to say how many requests it holds before sending a request to the next replica in the router's ranking: on a
# loaded machine a prefix's requests then scatter from the replica holding its blocks.  A local instance gets this
# much patience instead (Ray Serve reads these variables in its controller and routers), and ``start_serve`` waits
# up to SERVE_START_S.
LOCAL_PATIENCE = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
                  "RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "2",
                  "RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "10"}
SERVE_START_S = 600


def local_ray_env() -> dict:
    """A runtime_env for a local Ray instance: its workers import this dasspec (a source checkout not on their
    path), and Ray Serve's proxy checks and queue probes are patient with a loaded machine (``LOCAL_PATIENCE``)."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return {"env_vars": {"PYTHONPATH": path, **{k: os.environ.get(k, v) for k, v in LOCAL_PATIENCE.items()}}}


def start_serve(serve, http_options: dict, wait_s: float = SERVE_START_S) -> None:
    """``serve.start`` that waits up to ``wait_s`` for every HTTP proxy to be healthy (``serve.start`` alone
    raises after a fixed 60 s while its controller goes on starting the proxy; a later call connects to that
    controller), and otherwise says what did not start and how long it was given."""
    deadline = time.monotonic() + wait_s
    last: object = None
    while True:
        try:
            serve.start(http_options=http_options)
            last = proxies = serve.status().proxies
            if proxies and all(str(getattr(v, "value", v)) == "HEALTHY" for v in proxies.values()):
                return
        except TimeoutError as err:
            last = err
        if time.monotonic() >= deadline:
            raise TimeoutError(f"Ray Serve's HTTP proxy did not become healthy within {wait_s:.0f} s (an "
                               f"overloaded machine?); last seen: {last}")
        time.sleep(1.0)


def run(cluster: ClusterOptions, host: str, port: int, address: str | None, log: bool = True) -> int:
    """``dasspec serve --ray``: join (``address``: "auto" or an address) or start a local Ray instance, run the
    application on ``host:port`` until Ctrl-C / SIGTERM, then take it down (and the local instance)."""
    ray, serve = import_serve()

    cluster.check()
    app = build_app({**asdict(cluster)})
    local = address in (None, "", "local")
    if not ray.is_initialized():
        kw = {"include_dashboard": False, "configure_logging": False, "log_to_driver": log}
        if local:
            cpus = max(os.cpu_count() or 1, int(cluster.num_cpus * cluster.replicas + 0.999))
            ray.init(num_cpus=cpus, object_store_memory=256 * 2**20, runtime_env=local_ray_env(),
                     _node_ip_address="127.0.0.1", **kw)          # a local instance listens on loopback only
        else:
            ray.init(address=address, **kw)
    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)           # SIGTERM as Ctrl-C: the application and a local Ray go down
    try:
        start_serve(serve, {"host": host, "port": port})
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        n = f"autoscaling {cluster.autoscaling}" if cluster.autoscaling else f"{cluster.replicas} replica(s)"
        print(f"dasspec serve --ray: {n} of {cluster.model or 'dasspec-tiny'} ({cluster.num_cpus:g} CPU, "
              f"{cluster.num_gpus:g} GPU each), {cluster.routing} routing, on http://{host}:{port}/v1",
              file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        try:
            serve.delete(APP_NAME)
            if local:
                serve.shutdown()
        finally:
            if local:
                ray.shutdown()
