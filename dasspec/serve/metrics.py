"""Prometheus text-format metrics (exposition format 0.0.4), without a client library: counters, gauges read at
scrape time, and histograms, all labelled, updated from the decode worker and the event loop under one lock."""

from __future__ import annotations

import math
import threading
import time
from typing import Callable, Iterable

TOKEN_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
RATE_WINDOW = 10.0           # seconds over which the generation rate gauge is measured
SECOND_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)] + ([extra] if extra else [])
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x)) if not float(x).is_integer() else str(int(x))


class _Metric:
    kind = ""

    def __init__(self, registry: "Registry", name: str, help: str, labels: tuple[str, ...] = ()):
        self.name, self.help, self.labelnames = name, help, tuple(labels)
        self._lock = registry.lock
        registry.metrics.append(self)

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {sorted(labels)}")
        return tuple(str(labels[n]) for n in self.labelnames)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, by: float = 1, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self.values[key] = self.values.get(key, 0) + by

    def get(self, **labels: str) -> float:
        with self._lock:
            return self.values.get(self._key(labels), 0)

    def lines(self) -> list[str]:
        with self._lock:
            values = sorted(self.values.items())
        if not self.labelnames and not values:
            return [f"{self.name} 0"]
        return [f"{self.name}{_labels(self.labelnames, k)} {_number(v)}" for k, v in values]


class Gauge(_Metric):
    """A value read at scrape time from ``read``."""
    kind = "gauge"

    def __init__(self, registry: "Registry", name: str, help: str, read: Callable[[], float]):
        super().__init__(registry, name, help)
        self.read = read

    def lines(self) -> list[str]:
        return [f"{self.name} {_number(self.read())}"]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, registry: "Registry", name: str, help: str, buckets: Iterable[float],
                 labels: tuple[str, ...] = ()):
        super().__init__(registry, name, help, labels)
        self.buckets = tuple(sorted(buckets))
        self.series: dict[tuple[str, ...], list] = {}     # key -> [bucket counts..., sum, count]

    def observe_many(self, values: Iterable[float], **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            s = self.series.setdefault(key, [0] * len(self.buckets) + [0.0, 0])
            for v in values:
                for i, b in enumerate(self.buckets):
                    if v <= b:
                        s[i] += 1
                s[-2] += v
                s[-1] += 1

    def observe(self, value: float, **labels: str) -> None:
        self.observe_many([value], **labels)

    def count(self, **labels: str) -> int:
        with self._lock:
            s = self.series.get(self._key(labels))
            return s[-1] if s else 0

    def lines(self) -> list[str]:
        with self._lock:
            series = [(key, list(s)) for key, s in sorted(self.series.items())]
        out = []
        for key, s in series:
            for b, c in zip(self.buckets + (math.inf,), s[:-2] + [s[-1]]):
                le = 'le="' + _number(b) + '"'
                out.append(f"{self.name}_bucket{_labels(self.labelnames, key, le)} {c}")
            out.append(f"{self.name}_sum{_labels(self.labelnames, key)} {_number(s[-2])}")
            out.append(f"{self.name}_count{_labels(self.labelnames, key)} {s[-1]}")
        return out


class Registry:
    def __init__(self):
        self.lock = threading.Lock()
        self.metrics: list[_Metric] = []

    def render(self) -> str:
        lines: list[str] = []
        for m in self.metrics:
            lines += m.header() + m.lines()
        return "\n".join(lines) + "\n"


class ServerMetrics:
    """What ``GET /metrics`` reports: requests by endpoint and outcome, tokens, the queue, accepted and committed
    tokens per verification, time to first token and time per generated token - per method where it matters."""

    def __init__(self, queue_length: Callable[[], int], running: Callable[[], int],
                 cache: Callable[[], dict[str, int]] | None = None):
        self._lock = threading.Lock()
        self._recent: list[tuple[float, int]] = []      # (time, tokens) committed within the last RATE_WINDOW
        r = self.registry = Registry()
        self.requests = Counter(r, "dasspec_requests_total", "Requests by endpoint and outcome (ok, cancelled: the "
                                "client went away; invalid: 4xx; rejected: 429 queue full; error: 5xx)",
                                ("endpoint", "outcome"))
        self.prompt_tokens = Counter(r, "dasspec_prompt_tokens_total", "Prompt tokens of decoded requests")
        self.cached_tokens = Counter(r, "dasspec_prompt_tokens_cached_total", "Prompt tokens taken from prompt blocks "
                                     "shared with earlier requests instead of prefilled")
        if cache is not None:
            Gauge(r, "dasspec_cache_blocks_used", "Depth-cache blocks held by requests", lambda: cache()["used"])
            Gauge(r, "dasspec_cache_blocks_cached", "Unreferenced prompt blocks kept for sharing (freed when "
                  "memory is needed)", lambda: cache()["cached"])
            Gauge(r, "dasspec_cache_blocks_total", "Depth-cache blocks in the pool", lambda: cache()["total"])
            Gauge(r, "dasspec_preemptions_total", "Requests swapped out to host memory when blocks ran out",
                  lambda: cache()["preemptions"])
        self.generated_tokens = Counter(r, "dasspec_generated_tokens_total", "Tokens generated", ("method",))
        self.choices = Counter(r, "dasspec_auto_steps_total", "Decode steps of method auto by the drafter it "
                               "chose (ar: a plain full-depth step)", ("method", "drafter"))
        Gauge(r, "dasspec_queue_length", "Requests waiting for the decode worker", queue_length)
        Gauge(r, "dasspec_running_requests", "Requests being decoded together (the engine's batch)", running)
        Gauge(r, "dasspec_generation_tokens_per_second", f"Tokens committed per second over the last "
              f"{RATE_WINDOW:g} s, every request together", self.rate)
        self.batch_size = Histogram(r, "dasspec_batch_size", "Requests in each decode step (drafted and verified "
                                    "together in one pass, prefilling ones included)", BATCH_BUCKETS)
        self.step_seconds = Histogram(r, "dasspec_step_seconds", "Wall time of each decode step", SECOND_BUCKETS)
        self.accepted = Histogram(r, "dasspec_accepted_tokens_per_verification", "Draft tokens accepted per "
                                  "verification (A is its mean)", TOKEN_BUCKETS, ("method",))
        self.committed = Histogram(r, "dasspec_committed_tokens_per_verification", "Tokens committed per "
                                   "verification, the target's own token included (G is its mean)", TOKEN_BUCKETS,
                                   ("method",))
        self.ttft = Histogram(r, "dasspec_time_to_first_token_seconds", "From accepting a request to its first "
                              "generated token (queue wait and prefill included)", SECOND_BUCKETS, ("method",))
        self.time_per_token = Histogram(r, "dasspec_time_per_token_seconds", "Decoding time per generated token "
                                        "of a request, from its first token to its last", SECOND_BUCKETS,
                                        ("method",))

    def step(self, requests: int, tokens: int, seconds: float) -> None:
        """One engine step: its batch size, the tokens it committed and its wall time."""
        self.batch_size.observe(requests)
        self.step_seconds.observe(seconds)
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, tokens))
            while self._recent and self._recent[0][0] < now - RATE_WINDOW:
                self._recent.pop(0)

    def rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            tokens = sum(n for t, n in self._recent if t >= now - RATE_WINDOW)
        return tokens / RATE_WINDOW

    def render(self) -> str:
        return self.registry.render()
