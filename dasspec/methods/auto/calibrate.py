"""The calibration: the model's own pass costs on this machine (the prelude, one core step and the readout over W
rows), measured once per model and machine and cached, and what they imply (``Sizing``): the price of a
full-depth pass over W rows, of a DAS-Wave round, and DAS-Wave's window for this model."""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...model import decode_kernel
from .tuning import TUNING, Tuning

CAL_VERSION = 3             # the cache's format: a change of what is measured invalidates cached entries


# --- calibration -------------------------------------------------------------------------------------------------

def _cache_file() -> Path:
    root = os.environ.get("DASSPEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dasspec")
    return Path(root) / "calibration.json"


def cache_keys(model) -> tuple[str, str]:
    """The model's key (its shape, dtype, device) and this machine's (host, threads, torch, kernels or GPU): what a
    measured cost is valid for."""
    cfg = model.config
    shape = {k: v for k, v in sorted(vars(cfg).items()) if isinstance(v, (int, float, str, bool))}
    shape.update(dtype=str(model.dtype), device=str(model.device))
    mkey = hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:16]
    machine = f"{platform.node()}|{platform.machine()}|{platform.processor()}|{os.cpu_count()}|" \
              f"threads={torch.get_num_threads()}|torch={torch.__version__}"
    if model.device.type == "cuda":
        machine += "|" + torch.cuda.get_device_name(model.device)
    elif decode_kernel.available():                 # pass costs follow the kernels' build and path
        machine += f"|kernels={decode_kernel.build_tag()}:{decode_kernel.isa()}"
    return mkey, hashlib.sha256(machine.encode()).hexdigest()[:16]


def measure_costs(model, budget_s: float = TUNING.calibration_budget_s, widths=TUNING.cal_widths,
                  reps: int = TUNING.cal_reps, first_share: float = TUNING.cal_first_share
                  ) -> dict[str, dict[int, float]]:
    """Seconds of the prelude, one core step and the readout over W rows (no cache: own rows only), for each W in
    ``widths`` while the budget lasts: a first pass over the widths (the most telling first, while half the budget
    lasts), then up to ``reps - 1`` more passes round the widths it reached, keeping each width's minimum - a
    burst of load then touches every width alike instead of corrupting the one being measured."""
    cuda = model.device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(model.device)

    def once(W: int) -> tuple[float, float, float]:
        ids = torch.zeros(1, W, dtype=torch.long, device=model.device)
        span = model.span(0, 0, W)
        h0 = model.initial_state(torch.arange(W, device=model.device)).unsqueeze(0)
        sync()
        t0 = time.perf_counter()
        e = model.prelude(ids, span)
        sync()
        t1 = time.perf_counter()
        h = model.core_step(model.start_state(h0, e), e, span)
        sync()
        t2 = time.perf_counter()
        model.readout(h, span)
        sync()
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    t_start = time.perf_counter()
    out: dict[str, dict[int, float]] = {"prelude": {}, "core": {}, "head": {}}

    def keep(W: int, got: tuple[float, float, float]) -> None:
        for name, t in zip(out, got):
            out[name][W] = min(out[name].get(W, math.inf), t)

    with torch.no_grad():
        once(widths[0])                                  # warms up
        reached = []
        for W in widths:
            if reached and time.perf_counter() - t_start > budget_s * first_share:
                break
            keep(W, once(W))
            reached.append(W)
        for _ in range(reps - 1):
            for W in reached:
                if time.perf_counter() - t_start > budget_s:
                    return out
                keep(W, once(W))
    return out


def calibration(model, use_cache: bool = True, tuning: Tuning = TUNING) -> dict[str, dict[int, float]]:
    """``measure_costs`` for this model on this machine, from the model's own copy or the JSON cache when they
    have them (the copy kept on the model: a server builds an auto drafter per set of request knobs, and a
    read-only home must not cost a measurement each)."""
    mkey, machine = cache_keys(model)
    key = f"v{CAL_VERSION}:{mkey}:{machine}"
    kept: dict[str, dict] = model.__dict__.setdefault("_auto_calibrations", {})
    if use_cache and key in kept:
        return {name: dict(part) for name, part in kept[key].items()}
    path = _cache_file()
    table: dict[str, Any] = {}
    if use_cache:
        try:
            table = json.loads(path.read_text())
            hit = table.get(key)
            if hit:
                kept[key] = {name: {int(w): float(t) for w, t in part.items()} for name, part in hit.items()}
                return {name: dict(part) for name, part in kept[key].items()}
        except (OSError, ValueError, AttributeError):
            table = {}
    costs = measure_costs(model, tuning.calibration_budget_s, tuning.cal_widths, tuning.cal_reps,
                          tuning.cal_first_share)
    if costs["core"]:
        kept[key] = {name: dict(part) for name, part in costs.items()}
    if use_cache and costs["core"]:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            table = table if isinstance(table, dict) else {}
            table[key] = {name: {str(w): t for w, t in part.items()} for name, part in costs.items()}
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(table, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass                                        # a read-only home: measured again by the next process
    return costs


class Curve:
    """A table of seconds by width as a function of width: piecewise linear, extrapolated along the last two
    widths (one width: in proportion past it)."""
    __slots__ = ("ws", "ts")

    def __init__(self, table: dict[int, float]):
        self.ws = sorted(table)
        self.ts = [table[w] for w in self.ws]

    def __call__(self, W: float) -> float:
        ws, ts = self.ws, self.ts
        if len(ws) == 1:
            return ts[0] * W / ws[0] if W > ws[0] else ts[0]
        if W <= ws[0]:
            return ts[0]
        i = min(bisect.bisect_left(ws, W), len(ws) - 1)
        lo, hi = ws[i - 1], ws[i]
        if W > hi:
            return ts[i] + max(ts[i] - ts[i - 1], 0.0) * (W - hi) / (hi - lo)
        return ts[i - 1] + (ts[i] - ts[i - 1]) * (W - lo) / (hi - lo)


def monotone(table: dict[int, float]) -> dict[int, float]:
    """``table`` (width -> seconds) with each width's time at most every wider one's: a pass over more rows never
    costs less, so a narrower width measured dearer was measured under load."""
    out, low = {}, math.inf
    for W in sorted(table, reverse=True):
        low = min(low, table[W])
        out[W] = low
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class Sizing:
    """What the calibration implies: the model time of a full-depth pass over W rows (``full(W)``, seconds), of a
    DAS-Wave round, and DAS-Wave's window for this model."""
    costs: dict[str, dict[int, float]]
    R: int
    window: int | None          # the widest nearly-free window (None: only one width measured)

    def __post_init__(self) -> None:       # the cost model asks these per request and step: built once
        parts = {name: Curve(part) for name, part in self.costs.items()}
        widths = sorted(set().union(*(part.ws for part in parts.values())))
        object.__setattr__(self, "_parts", parts)
        object.__setattr__(self, "_full", Curve({W: self._sum(parts, W, self.R) for W in widths}))
        object.__setattr__(self, "_units", {})

    @staticmethod
    def _sum(parts: dict[str, Curve], W: float, k: int) -> float:
        return parts["prelude"](W) + k * parts["core"](W) + parts["head"](W)

    @classmethod
    def of(cls, costs: dict[str, dict[int, float]], R: int, wide_round: float = TUNING.wide_round) -> "Sizing | None":
        if 1 not in costs.get("core", {}):
            return None
        costs = {name: monotone(part) for name, part in costs.items()}
        core = costs["core"]
        s = cls(costs, R, None)
        if max(core) > 1:
            window = max(W for W in sorted(core) if s.round_cost(W, 1) <= wide_round * s.round_cost(1, 1))
            s = cls(costs, R, window)
        return s

    def full(self, W: float) -> float:
        return self._full(W)

    def round_cost(self, W: float, k: int) -> float:
        return self._sum(self._parts, W, k)

    def wave_units(self, gamma: int, w_init: int, k: int, rounds: int, m: int) -> float:
        """A DAS-Wave block's rounds over m windows (growing from W_init to gamma), in seconds; kept per schedule."""
        key = (gamma, w_init, k, rounds, m)
        if key not in self._units:
            self._units[key] = sum(self.round_cost(min(gamma, w_init + j) * m, k) for j in range(rounds))
        return self._units[key]

    @property
    def full1(self) -> float:
        return self.full(1)


