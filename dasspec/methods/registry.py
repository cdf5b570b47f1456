"""The method registry: every method by name (``Method``: its knobs dataclass and how to build its drafter),
filled on first use by importing every module of this folder (each calls ``register``) and the ``dasspec.methods``
entry-point group.  It imports neither the knobs nor a method at module level, so ``knobs.py`` may ask it which
other methods take a knob."""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from ..engine.drafting import Drafter
    from .knobs import Knobs

# The folder's modules that define no method (imported by whoever needs them, not by ``_load``).
NOT_METHODS = {"knobs", "registry"}


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
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if info.name not in NOT_METHODS:
            importlib.import_module(f"{__package__}.{info.name}")
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
