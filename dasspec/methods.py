"""The registry of decoding methods selectable by name in ``generate(..., method=...)`` and the CLI.

A method is a ``run(dec, knobs)`` loop over a ``Decoding`` plus its knobs: defaults per model family (the paper's
Table 5), a validator that names the bad value, and the widest verifier block it can produce (for cache scratch).
Generation-config files can override defaults per model (``generation_config.json`` -> ``"dasspec": {...}``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from .model.config import LoopedConfig
from .decoding import Decoding


@dataclass(frozen=True)
class MethodSpec:
    name: str
    run: Callable[[Decoding, dict], None]
    defaults: Callable[[LoopedConfig], dict] = lambda cfg: {}
    validate: Callable[[dict, int], dict] = lambda knobs, R: knobs
    width: Callable[[dict], int] = lambda knobs: 1
    doc: str = ""
    stateful: bool = False          # keeps drafter state across requests (bootstrap by blocks of requests)
    aliases: tuple[str, ...] = field(default_factory=tuple)
    # Fit defaulted knobs to the caller's explicit ones (e.g. a default W_init above a caller's smaller gamma);
    # gets (knobs, names the caller set) and edits knobs in place.  Explicit values are never changed.
    fit: Callable[[dict, set], None] = lambda knobs, explicit: None


METHODS: dict[str, MethodSpec] = {}


def register(spec: MethodSpec) -> MethodSpec:
    for name in (spec.name, *spec.aliases):
        METHODS[name] = spec
    return spec


def get_method(name: str) -> MethodSpec:
    _load_builtin()
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(method_names())}")
    return METHODS[name]


def method_names() -> list[str]:
    _load_builtin()
    return sorted({spec.name for spec in METHODS.values()})


def resolve_knobs(spec: MethodSpec, cfg: LoopedConfig, model_defaults: dict, user: dict[str, Any],
                  R: int) -> dict:
    """Family defaults <- the model folder's generation defaults <- the caller's knobs; then validate."""
    knobs = dict(spec.defaults(cfg))
    per_method = (model_defaults.get("dasspec") or {}).get(spec.name) or {}
    knobs.update({k: v for k, v in per_method.items() if k in knobs})
    unknown = sorted(set(user) - set(knobs))
    if unknown:
        allowed = ", ".join(sorted(knobs)) or "none"
        raise ValueError(f"method {spec.name!r} does not take {', '.join(unknown)}; its knobs: {allowed}")
    knobs.update(user)
    spec.fit(knobs, set(user))
    return spec.validate(knobs, R)


def _load_builtin() -> None:
    # Importing the decoder and drafter modules registers them.
    from . import decoders  # noqa: F401
    from . import drafters  # noqa: F401


def positive_int(knobs: dict, *names: str) -> None:
    for name in names:
        v = knobs[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
