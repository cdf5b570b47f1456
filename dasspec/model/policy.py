"""Verified-prefix read policies (paper eq. 4): which recurrence depth of the materialised prefix a draft reads,
kappa for keys and nu for values, given the draft's own depth r and the full depth R.

    Aligned            (kappa, nu) = (r, r)
    Deep V / Mature-V  (kappa, nu) = (r, R)
    Deep K             (kappa, nu) = (R, r)
    Deep K/V           (kappa, nu) = (R, R)

Any explicit depths are allowed too ("k=2,v=32", or a (kappa, nu) tuple), for the read-depth grid probe.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReadPolicy:
    name: str
    key: str | int     # "r" (the draft's depth), "R" (full depth) or an explicit depth
    value: str | int

    def depths(self, r: int, R: int) -> tuple[int, int]:
        def pick(spec: str | int) -> int:
            d = r if spec == "r" else R if spec == "R" else int(spec)
            if not 1 <= d <= R:
                raise ValueError(f"policy {self.name}: read depth {d} outside 1..R={R}")
            return d
        return pick(self.key), pick(self.value)


ALIGNED = ReadPolicy("aligned", "r", "r")
DEEP_V = ReadPolicy("deep-v", "r", "R")
DEEP_K = ReadPolicy("deep-k", "R", "r")
DEEP_KV = ReadPolicy("deep-kv", "R", "R")
NAMED = {"aligned": ALIGNED, "deep-v": DEEP_V, "mature-v": DEEP_V, "deep-k": DEEP_K, "deep-kv": DEEP_KV}


def parse_policy(spec: "str | ReadPolicy | tuple[int | str, int | str]") -> ReadPolicy:
    """'aligned' | 'deep-v' | 'mature-v' | 'deep-k' | 'deep-kv' | 'k=R,v=r' | 'k=2,v=32' | (kappa, nu)."""
    if isinstance(spec, ReadPolicy):
        return spec
    if isinstance(spec, tuple):
        k, v = spec
        return ReadPolicy(f"k={k},v={v}", _depth_spec(k), _depth_spec(v))
    raw = str(spec).replace(" ", "")
    name = raw.lower().replace("_", "-").replace("/", "")
    if name in NAMED:
        return NAMED[name]
    if raw[:2].lower() == "k=" and ",v=" in raw.lower():
        k, v = raw[2:].split(",", 1)
        v = v[2:]
        return ReadPolicy(f"k={k},v={v}", _depth_spec(k), _depth_spec(v))
    raise ValueError(f"unknown read policy {str(spec)[:60]!r}; expected one of {sorted(NAMED)} or 'k=<depth>,v=<depth>' "
                     "with depths r, R or integers")


def _depth_spec(x: int | str) -> str | int:
    if x in ("r", "R"):      # case matters: r = the draft's own depth, R = full depth
        return x
    try:
        d = int(x)
    except (TypeError, ValueError):
        raise ValueError(f"bad read depth {str(x)[:60]!r}: expected r, R or an integer") from None
    if d < 1:
        raise ValueError(f"read depth must be >= 1, got {d}")
    return d
