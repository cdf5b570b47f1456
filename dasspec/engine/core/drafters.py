"""DrafterCache: the drafters an engine (and the server in front of it) keeps, one per (method, knobs, greedy or
sampled), built and validated on first use and then shared by every request that asks for it - so what a drafter
keeps across requests (Token Recycling's table, SAM's corpus automaton) persists.  The engine never imports the
methods: the registry's ``build`` is handed in (``dasspec.methods.build_drafter``, the default of ``Engine``).

A plan names a drafter by a ``DrafterKey`` (``key_of``), which an executor's cache ``resolve``s: the registry builds
the same drafter from the same key in any process.  A drafter object handed in by a caller (``generate(drafter=)``)
has no such recipe: its key holds a handle valid in this process only."""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Callable

from ...methods import build_drafter, get_method
from ...model.looped import LoopedLM
from ..base.contract import DrafterKey
from ..drafting.draft import Drafter

# (model, method name or alias, knobs, R, sampled) -> a validated drafter
BuildDrafter = Callable[..., Drafter]
# method name or alias -> its canonical name (raises ValueError for an unknown method)
MethodName = Callable[[str], str]


class DrafterCache:
    def __init__(self, model: LoopedLM, R: int, build: BuildDrafter, name: MethodName, keep: int | None = None):
        self.model, self.R, self.build, self.name, self.keep = model, R, build, name, keep
        self._kept: OrderedDict[tuple, Drafter] = OrderedDict()
        self._keys: dict[int, DrafterKey] = {}          # id(drafter) -> its key (built here or handed in)
        self._handed: dict[int, Drafter] = {}           # handle -> a drafter handed in

    @classmethod
    def of_registry(cls, model: LoopedLM, R: int, keep: int | None = None) -> "DrafterCache":
        """A cache that builds drafters with the methods' registry (``dasspec.methods``): the engine's default, the
        server's and the executor process's."""
        def build(model, name, knobs, R, sampled=False):
            return build_drafter(model, name, knobs, R, sampled=sampled)
        return cls(model, R, build, lambda m: get_method(m).name, keep)

    def key_of(self, drafter: Drafter) -> DrafterKey:
        """The key a plan names ``drafter`` by: its recipe when this cache built it, else a handle to the object."""
        key = self._keys.get(id(drafter))
        if key is None or (key.handle is None and self._kept.get(self._slot(key)) is not drafter):
            key = DrafterKey(drafter.name, handle=id(drafter))
            self._keys[id(drafter)] = key
            self._handed[id(drafter)] = drafter
        return key

    def resolve(self, key: DrafterKey) -> Drafter:
        """The drafter ``key`` names (built on first use from a recipe)."""
        if key.handle is not None:
            d = self._handed.get(key.handle)
            if d is None:
                raise ValueError(f"the plan names a drafter object ({key.method!r}) this process was not handed: "
                                 "an executor in another process builds drafters from a method and its knobs only")
            return d
        return self.get(key.method, dict(key.knobs), key.sampled)

    @staticmethod
    def _slot(key: DrafterKey) -> tuple:
        return key.method, json.dumps(dict(key.knobs), sort_keys=True, default=repr), key.sampled

    def get(self, method: str, knobs: dict | None = None, sampled: bool = False) -> Drafter:
        name = self.name(method)
        key = DrafterKey(name, tuple(sorted((knobs or {}).items())), sampled)
        slot = self._slot(key)
        d = self._kept.get(slot)
        if d is not None:
            self._kept.move_to_end(slot)
            return d
        d = self._kept[slot] = self.build(self.model, name, dict(knobs or {}), self.R, sampled=sampled)
        self._keys[id(d)] = key
        while self.keep is not None and len(self._kept) > self.keep:
            _, old = self._kept.popitem(last=False)
            self._keys.pop(id(old), None)
        return d
