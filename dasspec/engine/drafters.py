"""DrafterCache: the drafters an engine (and the server in front of it) keeps, one per (method, knobs, greedy or
sampled), built and validated on first use and then shared by every request that asks for it - so what a drafter
keeps across requests (Token Recycling's table, SAM's corpus automaton) persists.  The engine never imports the
methods: the registry's ``build`` is handed in (``dasspec.methods.build_drafter``, the default of ``Engine``)."""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Callable

from ..model.looped import LoopedLM
from .draft import Drafter

# (model, method name or alias, knobs, R, sampled) -> a validated drafter
BuildDrafter = Callable[..., Drafter]
# method name or alias -> its canonical name (raises ValueError for an unknown method)
MethodName = Callable[[str], str]


class DrafterCache:
    def __init__(self, model: LoopedLM, R: int, build: BuildDrafter, name: MethodName, keep: int | None = None):
        self.model, self.R, self.build, self.name, self.keep = model, R, build, name, keep
        self._kept: OrderedDict[tuple, Drafter] = OrderedDict()

    def get(self, method: str, knobs: dict | None = None, sampled: bool = False) -> Drafter:
        name = self.name(method)
        key = (name, json.dumps(knobs or {}, sort_keys=True, default=repr), sampled)
        d = self._kept.get(key)
        if d is not None:
            self._kept.move_to_end(key)
            return d
        d = self._kept[key] = self.build(self.model, name, dict(knobs or {}), self.R, sampled=sampled)
        while self.keep is not None and len(self._kept) > self.keep:
            self._kept.popitem(last=False)
        return d
