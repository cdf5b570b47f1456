"""``dasspec serve``: an OpenAI-compatible HTTP server over one loaded model.

    schema.py      the request bodies (strict), OpenAI-shaped errors
    service.py     a request -> a decode job: prompt ids, token limit, sampling, the method's drafter
    worker.py      the one decode thread per model and its bounded FIFO queue; cancellation
    textstream.py  streamed text released only when final (multi-byte characters, stop strings)
    responses.py   response bodies, stream chunks, the decoding statistics
    metrics.py     Prometheus text metrics
    app.py         the FastAPI routes (over a Service, or over anything answering its calls)
    cli.py         the ``dasspec serve`` command
    ray_app.py     ``dasspec serve --ray``: the Ray Serve application (replicas, the ingress over the same routes,
                   explicit seeds, failover)
    routing.py     prefix-aware routing: prefix keys, consistent hashing with bounded loads (no Ray needed)
    ray_router.py  the Ray Serve request router built on it

    from dasspec.serve import Service, ServeOptions, create_app
    app = create_app(Service(dasspec.load_model(), ServeOptions()))     # any ASGI server runs it
"""

from __future__ import annotations

__all__ = ["create_app", "Service", "ServeOptions"]


def __getattr__(name: str):
    # imported on use (PEP 562): importing dasspec.serve (as serve.cli does) pays for neither FastAPI nor torch
    if name == "create_app":
        from .app import create_app         # lazy: FastAPI and torch
        return create_app
    if name in ("Service", "ServeOptions"):
        from . import service               # lazy: torch
        return getattr(service, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
