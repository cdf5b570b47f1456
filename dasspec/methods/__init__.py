"""The decoding methods: one module each, every one a drafter for the one decode loop (``dasspec.engine.loop``).

    ar.py            full-depth AR (the drafter that proposes nothing)
    sequential.py    self-spec and Mature-Spec (depth-d sequential drafts, a prefix read policy)
    wave.py          DAS-Wave (carried parallel refinement, Deep K/V reads) and its extensions
    pld.py           prompt lookup        lookahead.py   Lookahead decoding
    recycling.py     Token Recycling      sam.py         SAM-Decoding
    tree.py          static draft trees (for Token Recycling)

A method is a ``Method``: its name, its knobs dataclass (``knobs.py``) and how to build its drafter from them.
Every module in this folder is imported on first use, so a new method is one new file that calls ``register``;
packages outside dasspec can add methods through the ``dasspec.methods`` entry-point group.
"""

from __future__ import annotations

import importlib
import pkgutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..engine.draft import Drafter
from .knobs import SAMPLED, Knobs, Scope


@dataclass(frozen=True)
class Method:
    name: str
    knobs: type[Knobs]
    drafter: Callable[[Knobs], Drafter]       # a fresh drafter from validated knobs
    aliases: tuple[str, ...] = ()
    stateful: bool = False                    # its drafter keeps state across requests (Token Recycling)


METHODS: dict[str, Method] = {}
_loaded = False


def register(method: Method) -> Method:
    for name in (method.name, *method.aliases):
        if name in METHODS and METHODS[name] is not method:
            raise ValueError(f"method name {name!r} is already registered")
        METHODS[name] = method
    return method


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for info in pkgutil.iter_modules(__path__):
        if info.name != "knobs":
            importlib.import_module(f"{__name__}.{info.name}")
    from importlib.metadata import entry_points
    for ep in entry_points(group="dasspec.methods"):
        ep.load()


def get_method(name: str) -> Method:
    _load()
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(method_names())}")
    return METHODS[name]


def method_names() -> list[str]:
    _load()
    return sorted({m.name for m in METHODS.values()})


# The paper's order (Table 1): the target-model decoders, then the model-agnostic baselines.
ORDER = ("ar", "self-spec", "mature-spec", "das-wave", "pld", "lookahead", "token-recycling", "sam", "auto")


def all_knobs() -> list[type[Knobs]]:
    """Every registered method's knobs class (once each, in the paper's order), for deriving CLI flags."""
    names = method_names()
    names.sort(key=lambda m: ORDER.index(m) if m in ORDER else len(ORDER))
    return list(dict.fromkeys(METHODS[m].knobs for m in names))


def resolve_knobs(model, method: str, user: dict | None = None, num_steps: int | None = None,
                  sampled: bool = False) -> Knobs:
    """``method``'s knobs on ``model``: family defaults <- the model folder's (with its ``"<method>:sampled"``
    section when ``sampled``) <- the caller's, validated at the call's depth R and held to every knob's ceiling on
    this model (``Knobs.check_ceilings``)."""
    m = get_method(method)
    source = getattr(model, "source", None)
    origin = str(Path(source) / "generation_config.json") if source else None    # named when its values are bad
    _warn_unknown_sections(model.generation_defaults, origin)
    R = model.depth(num_steps)
    return m.knobs.resolve(model.config.family, model.generation_defaults, dict(user or {}), R, origin=origin,
                           sampled=sampled, scope=Scope.of(model, R), folder=source)


def _warn_unknown_sections(model_defaults, origin: str | None) -> None:
    """A generation_config.json section that names no method (a typo: "das-wav") is named, never silently unused;
    a warning, as for a knob a method does not take there (Python shows each once)."""
    section = model_defaults.get("dasspec") if isinstance(model_defaults, dict) else None
    if not isinstance(section, dict):
        return
    known = set(method_names())
    unknown = sorted(k for k in section if str(k).removesuffix(SAMPLED) not in known)
    if unknown:
        where = origin or "the model's generation_config.json"
        warnings.warn(f'{where}: "dasspec" has sections {", ".join(map(repr, unknown))}, which name no method '
                      f"(methods: {', '.join(sorted(known))}); ignored", UserWarning, stacklevel=4)


def build_drafter(model, method: str, user: dict | None = None, num_steps: int | None = None,
                  sampled: bool = False) -> Drafter:
    """A drafter for ``method`` on ``model`` (knobs as ``resolve_knobs``).  Keep it to reuse its cross-request
    state (Token Recycling's table, SAM's corpus automaton) across requests.  Refused when its drafts could not
    fit the model's context, naming the knobs that size them."""
    knobs = resolve_knobs(model, method, user, num_steps, sampled)
    drafter = get_method(method).drafter(knobs)
    bind = getattr(drafter, "bind", None)       # a drafter that needs the model itself (auto: its sub-drafters)
    if callable(bind):
        bind(model, num_steps, sampled)
    context = model.config.block_size
    if drafter.width > context:
        named = ", ".join(_show(n, getattr(knobs, n)) for n in drafter.width_knobs)
        raise ValueError(f"{method}: drafts of up to {drafter.width} verifier positions ({named}) exceed the model "
                         f"context of {context}; lower {' or '.join(drafter.width_knobs) or 'its knobs'}")
    return drafter


def _show(name: str, value) -> str:
    size = getattr(value, "size", None)
    return f"{name} of {size} nodes" if isinstance(size, int) else f"{name}={value}"
