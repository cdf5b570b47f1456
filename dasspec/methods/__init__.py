"""The decoding methods: one module each, every one a drafter for the one decode loop (``dasspec.engine.core.loop``).

    ar.py            full-depth AR (the drafter that proposes nothing)
    sequential.py    self-spec and Mature-Spec (depth-d sequential drafts, a prefix read policy)
    wave.py          DAS-Wave (carried parallel refinement, Deep K/V reads) and its extensions
    pld.py           prompt lookup        lookahead.py   Lookahead decoding
    recycling.py     Token Recycling      sam.py         SAM-Decoding
    tree.py          static draft trees (for Token Recycling)

A method is a ``Method``: its name, its knobs dataclass (``knobs.py``) and how to build its drafter from them,
kept by the registry (``registry.py``).  Every module in this folder is imported on first use, so a new method is
one new file that calls ``register``; packages outside dasspec can add methods through the ``dasspec.methods``
entry-point group.  Methods are written against the drafter interface (``dasspec.engine.drafting``) alone.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from ..engine.drafting import Drafter
from .knobs import SAMPLED, Knobs, Scope
from .registry import METHODS, ORDER, Method, all_knobs, get_method, method_names, register

__all__ = ["METHODS", "ORDER", "Knobs", "Method", "all_knobs", "build_drafter", "get_method", "method_names",
           "register", "resolve_knobs"]


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
