"""Which replica a request goes to (the Ray Serve application, ``ray_app``): prefix-aware routing.

Requests that share the first ``prefix_tokens`` tokens of their prompt (few-shot exemplars, a system prompt) go to
the replica most likely to hold those tokens' blocks - consistent hashing of the prefix onto a ring of the live
replicas, so a replica joining or leaving moves only its share of the prefixes - with a bound on load: a replica
whose in-flight requests would pass ``load_factor`` x the mean (plus one) is passed over for the next one on the
ring (consistent hashing with bounded loads, Mirrokni, Thorup and Zadimoghaddam 2018) - unless it holds fewer than
``spill_at`` requests (default half a batch): a replica with free batch slots is not flooded.  Requests without such a
prefix (shorter prompts) go to the least loaded replica.  Loads are this router's own count of requests in flight
per replica; Ray Serve then still refuses a replica whose queue is full (``max_ongoing_requests``) and tries the
next rank.

Two more keys of a call's keyword arguments steer it: ``replica_id`` sends it to that replica only (the ingress
asks each replica for its health and metrics this way), ``avoid`` keeps it off replicas that just failed it.

    prefix_key(prompt_ids, 32)                                 # the routing key of a prompt, or None
    HashRing(replica_ids).choose(key, loads, 1.25)             # its replica under the load bound

This module imports without Ray; the Ray Serve router class built on it is ``ray_router.PrefixAwareRouter``.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import threading
import time
from typing import Iterable, Sequence

DEFAULT_PREFIX_TOKENS = 32
DEFAULT_LOAD_FACTOR = 1.25
VIRTUAL_NODES = 64
POLICIES = ("prefix", "least-loaded", "random")


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def prefix_key(prompt: Sequence[int], tokens: int = DEFAULT_PREFIX_TOKENS) -> str | None:
    """The routing key of a prompt: a hash of its first ``tokens`` ids, or None when the prompt is not longer than
    that (nothing after the prefix: there is no shared prefix worth keeping together)."""
    if tokens < 1 or len(prompt) <= tokens:
        return None
    return hashlib.blake2b(",".join(map(str, prompt[:tokens])).encode(), digest_size=8).hexdigest()


class HashRing:
    """Consistent hashing with bounded loads over named members (``VIRTUAL_NODES`` points each)."""

    def __init__(self, members: Iterable[str], virtual_nodes: int = VIRTUAL_NODES):
        self.members = sorted(set(members))
        points = sorted((_hash(f"{m}#{i}"), m) for m in self.members for i in range(virtual_nodes))
        self._keys = [h for h, _ in points]
        self._owners = [m for _, m in points]

    def order(self, key: str) -> list[str]:
        """Every member once, in ring order from ``key``'s point: the first is its home."""
        if not self.members:
            return []
        start = bisect.bisect(self._keys, _hash(key))
        seen: dict[str, None] = {}
        n = len(self._owners)
        for i in range(n):
            seen.setdefault(self._owners[(start + i) % n])
            if len(seen) == len(self.members):
                break
        return list(seen)

    def choose(self, key: str, loads: dict[str, int], load_factor: float = DEFAULT_LOAD_FACTOR,
               floor: int = 0) -> str | None:
        """The first member in ring order whose load is under the bound: ceil(load_factor x (total + 1) / n), or
        ``floor`` if that is larger (a replica with fewer requests than that has free batch slots: it is not
        flooded, and sending the request elsewhere would only lose its prefix)."""
        order = self.order(key)
        if not order:
            return None
        bound = max(floor, math.ceil(load_factor * (sum(loads.get(m, 0) for m in order) + 1) / len(order)))
        for m in order:
            if loads.get(m, 0) < bound:
                return m
        return order[0]          # unreachable: some member is at or below the mean


# --- shared with the ingress in the same process ---------------------------------------------------------------------
_lock = threading.Lock()
_dead: dict[str, float] = {}            # replica id -> when a call to it failed (it is avoided for DEAD_S)
DEAD_S = 60.0
_routers: dict[str, "object"] = {}      # deployment name -> its router in this process


def mark_dead(replica_id: str | None) -> None:
    """The ingress saw ``replica_id`` fail a call (its actor died): route nothing more there."""
    if replica_id:
        with _lock:
            _dead[replica_id] = time.monotonic()


def is_dead(replica_id: str) -> bool:
    with _lock:
        t = _dead.get(replica_id)
        if t is not None and time.monotonic() - t > DEAD_S:
            del _dead[replica_id]
            return False
        return t is not None


# requests routed by a prefix key that an earlier request had, and those that went where that key's previous
# request went (every router of this process together: Ray Serve may keep one per handle)
locality = {"keyed": 0, "local": 0}
_last: dict[str, str] = {}


def record_keyed(key: str, replica_id: str) -> None:
    """A request with prefix ``key`` went to ``replica_id``: counted when an earlier request had the key (the first
    of a prefix has nowhere to be local to), local when it went where the previous one went."""
    with _lock:
        last = _last.get(key)
        if last is not None:
            locality["keyed"] += 1
            locality["local"] += last == replica_id
        _last[key] = replica_id
        if len(_last) > 100_000:              # bounded: forget the oldest keys
            for k in list(_last)[:50_000]:
                del _last[k]


def register(deployment: str, router) -> None:
    with _lock:
        _routers[deployment] = router


def router_for(deployment: str):
    """This process's router of ``deployment`` (created by Ray Serve on the handle's first call), or None."""
    with _lock:
        return _routers.get(deployment)
