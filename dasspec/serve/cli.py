"""``dasspec serve``: an OpenAI-compatible HTTP server that decodes with ``auto`` (or any method), losslessly.

    dasspec serve                                       # the bundled model on http://127.0.0.1:8000
    dasspec serve --model /path/to/huginn-0125 --device cuda --dtype bfloat16 --port 8000
    dasspec serve --method das-wave --set gamma=16 --set rounds=8 --max-queue 32 --max-tokens-cap 1024

One process holds one model and decodes up to --max-batch requests together (continuous batching, every answer
equal to that request's own AR decode); --ray runs replicas of it as a Ray Serve application (dasspec serve --ray
--replicas 2; docs/serving.md, "Ray Serve").
docs/serving.md has the endpoints, the request options and the metrics.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import socket
import sys
import typing
from pathlib import Path

import dasspec

from ..engine.core.policy import SpeculationPolicy
from ..flags import add_exec_flags, runtime_from_args
from ..host import THREADS_HELP, check_threads, set_threads
from ..methods import get_method, method_names
from ..methods.knobs import parse_set_items
from .ray_app import ClusterOptions, import_serve
from .ray_app import run as run_ray
from .service import ServeOptions, Service

# ServeOptions fields whose flags are derived from the dataclass (type, default and help in one place).
DERIVED = ("max_batch", "kv_budget", "max_step_tokens", "request_timeout", "max_body", "template_timeout")


def _server_knobs(method: str, items: list[str]) -> dict:
    """``--set NAME=VALUE`` items as the method's knobs, parsed by their declared types."""
    knobs_cls = get_method(method).knobs
    return parse_set_items(items, {name: knobs_cls for name in knobs_cls.names()}, f"method {method!r} has no",
                           method)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, metrics)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder or HF repo id in the local cache (default: the "
                                                 "bundled model)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send and /v1/models lists "
                                                             "(default: the folder's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--method", default="auto", choices=method_names(),
                   help="decoding method of requests that name none (a request may choose another; default: "
                        "%(default)s, which picks DAS-Wave, SAM, PLD or plain AR steps per request and step from "
                        "what they measure, so a checkpoint nobody tuned DAS-Wave for is served at about AR's speed "
                        "or faster)")
    p.add_argument("--set", dest="knobs", action="append", default=[], metavar="NAME=VALUE",
                   help="a knob of --method (repeatable), e.g. --method das-wave --set gamma=16; requests override "
                        "them")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--overlap", action="store_true",
                   help=next(f for f in dataclasses.fields(ServeOptions) if f.name == "overlap").metadata["help"])
    p.add_argument("--full-depth-kv", action="store_true",
                   help=next(f for f in dataclasses.fields(ServeOptions) if f.name == "full_depth_kv").metadata["help"])
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait while one decodes; beyond it the server answers 429 at once")
    p.add_argument("--max-tokens-cap", type=int, default=None,
                   help="the most tokens one request may ask for (default: the model's context); bounds the "
                        "memory of a request's depth cache")
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    p.add_argument("--speculate-up-to", type=int, default=None, metavar="N",
                   help="with more than N requests decoding, a step drafts nothing (plain AR steps; the same "
                        "answers) - speculation pays less as the batch grows (default: the engine's policy)")
    _add_option_flags(p)
    add_exec_flags(p)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (warning: no access log)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the short generation run before listening")
    g = p.add_argument_group("Ray Serve: replicas across a cluster (docs/serving.md, 'Ray Serve')")
    g.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="serve as a Ray Serve application: replicas of the model behind one ingress with the same "
                        "API, prefix-aware routing and failover; no ADDRESS: a local Ray instance, 'auto': the "
                        "running cluster, or its address (needs pip install 'dasspec[ray]')")
    g.add_argument("--replicas", type=int, default=None, help="model replicas (default 1)")
    g.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves per replica (default 1)")
    g.add_argument("--replica-gpus", type=float, default=0.0, help="GPUs per replica (1: one GPU each; default 0)")
    g.add_argument("--autoscale", default=None, metavar="MIN:MAX",
                   help="Ray Serve autoscaling on queue depth between MIN and MAX replicas (instead of --replicas)")
    g.add_argument("--routing", default="prefix", choices=["prefix", "least-loaded", "random"],
                   help="prefix: requests sharing their first --prefix-tokens tokens go to one replica (consistent "
                        "hashing with bounded loads), others to the least loaded (default)")
    g.add_argument("--prefix-tokens", type=int, default=32, help="the routing key's length in tokens (default 32)")
    g.add_argument("--max-failovers", type=int, default=3,
                   help="replica deaths one request survives before it is answered with an error (default 3)")
    p.set_defaults(func=cmd_serve)
    return p


def _add_option_flags(p: argparse.ArgumentParser) -> None:
    """One flag per ``DERIVED`` ServeOptions field: its type parses the value, its metadata is the help."""
    fields = {f.name: f for f in dataclasses.fields(ServeOptions)}
    hints = typing.get_type_hints(ServeOptions)
    for name in DERIVED:
        f = fields[name]
        kind = next(a for a in (typing.get_args(hints[name]) or (hints[name],)) if a is not type(None))
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, default=f.default,
                       metavar=name.upper(), help=f.metadata["help"] + (
                           f" (default: {f.default})" if f.default is not None else ""))


def _options_from_args(args: argparse.Namespace) -> dict:
    values = {name: getattr(args, name) for name in DERIVED}
    for name, value in values.items():
        if value is not None and not 0 < value < math.inf:          # also NaN
            raise ValueError(f"--{name.replace('_', '-')} must be a number > 0, got {value}")
    return values


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before the model loads: a bad or taken port is an error in a second,
    not after the load (and no other process can take the port in between)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"--port must be a TCP port, 1..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as err:
        raise ValueError(f"--host {host!r}: not an address of this machine ({err})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as err:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    sock.set_inheritable(True)
    return sock


def cmd_serve(args: argparse.Namespace) -> int:
    # lazy: FastAPI and uvicorn load only to serve, not for `dasspec serve --help`
    import uvicorn

    from .app import create_app             # lazy: FastAPI, as uvicorn

    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.speculate_up_to is not None and args.speculate_up_to < 0:
        raise ValueError(f"--speculate-up-to must be >= 0, got {args.speculate_up_to}")
    if args.max_tokens_cap is not None and args.max_tokens_cap < 1:
        raise ValueError(f"--max-tokens-cap must be >= 1, got {args.max_tokens_cap}")
    options = _options_from_args(args)
    knobs = _server_knobs(args.method, args.knobs)
    check_threads(args.threads)
    if args.ray is not None:
        return _serve_ray(args, options, knobs)
    if args.replicas is not None or args.autoscale is not None:
        raise ValueError("--replicas and --autoscale need --ray (one process serves one model)")
    sock = listen_socket(args.host, args.port)          # every check that needs no model, before it loads
    set_threads(args.threads)
    model = dasspec.load_model(args.model, device=args.device, dtype=args.dtype)
    name = args.served_model_name or (Path(args.model).name if args.model else "dasspec-tiny")
    policy = None if args.speculate_up_to is None else SpeculationPolicy(off_above=args.speculate_up_to)
    service = Service(model, ServeOptions(model_name=name, method=args.method, knobs=knobs, max_queue=args.max_queue,
                                          max_tokens_cap=args.max_tokens_cap, runtime=runtime_from_args(args),
                                          policy=policy, overlap=args.overlap,
                                          full_depth_kv=args.full_depth_kv, **options))
    if args.warmup:       # first-call costs (allocator, kernels) before the first client, not in its latency
        service.warmup()
    print(f"dasspec serve: {name} ({model.config.family}, R={service.depth}, context {service.context}) with "
          f"{service.method}, up to {service.engine.max_batch} requests at once in a pool of "
          f"{service.engine.pool.describe()}, on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    config = uvicorn.Config(create_app(service), host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def _serve_ray(args: argparse.Namespace, options: dict, knobs: dict) -> int:
    """``dasspec serve --ray``: the same server as a Ray Serve application (``serve/ray_app.py``)."""
    import_serve()                                       # a clear message when Ray Serve is missing
    autoscaling = None
    if args.autoscale is not None:
        if args.replicas is not None:
            raise ValueError("give --replicas or --autoscale, not both")
        lo, sep, hi = args.autoscale.partition(":")
        if not (sep and lo.isdigit() and hi.isdigit() and 1 <= int(lo) <= int(hi)):
            raise ValueError(f"--autoscale must be MIN:MAX with 1 <= MIN <= MAX, got {args.autoscale!r}")
        autoscaling = {"min_replicas": int(lo), "max_replicas": int(hi)}
    if args.replicas is not None and args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    server = {name: value for name, value in options.items() if value is not None}
    server.update(model_name=args.served_model_name or (Path(args.model).name if args.model else "dasspec-tiny"),
                  method=args.method, knobs=knobs, max_queue=args.max_queue, max_tokens_cap=args.max_tokens_cap)
    runtime = {name: True for name in ("static_shapes", "compile", "cuda_graphs") if getattr(args, name, False)}
    cluster = ClusterOptions(model=args.model, device=args.device, dtype=args.dtype, replicas=args.replicas or 1,
                             autoscaling=autoscaling, num_cpus=args.replica_cpus, num_gpus=args.replica_gpus,
                             threads=args.threads, routing=args.routing, prefix_tokens=args.prefix_tokens,
                             max_failovers=args.max_failovers, warmup=args.warmup, runtime=runtime,
                             speculate_up_to=args.speculate_up_to, server=server).check()
    listen_socket(args.host, args.port).close()          # a bad or taken port fails now, not inside Ray
    return run_ray(cluster, args.host, args.port, None if args.ray == "local" else args.ray)
