"""Full-depth autoregressive decoding: the drafter that proposes nothing, so every block is one R-pass step."""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.drafting import Drafter
from . import Method, register
from .knobs import Knobs


@dataclass(frozen=True)
class ARKnobs(Knobs):
    method = "ar"


register(Method("ar", ARKnobs, lambda knobs: Drafter()))
