"""Full-depth autoregressive decoding: verification with a block of one (no proposals)."""

from __future__ import annotations

from ..decoding import Decoding
from ..methods import MethodSpec, register
from ..verify import verify_chain


def run_ar(dec: Decoding, knobs: dict) -> None:
    dec.prefill()
    while not dec.done:
        verify_chain(dec)


register(MethodSpec("ar", run_ar, doc="full-depth autoregressive decoding (R core passes per token)"))
