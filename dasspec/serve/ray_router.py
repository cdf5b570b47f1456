"""The Ray Serve request router of the replica deployment (``request_router_class``): prefix-aware routing -
consistent hashing with bounded loads of the prompt's first K tokens - else the least loaded replica; the policy
and its parameters are ``routing``'s (which imports without Ray)."""

from __future__ import annotations

import random
from collections import defaultdict

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from . import routing
from .routing import DEFAULT_LOAD_FACTOR, DEFAULT_PREFIX_TOKENS, POLICIES, HashRing, mark_dead


class PrefixAwareRouter(RequestRouter):
    """Ray Serve request router: prefix-aware (consistent hashing with bounded loads), else least loaded."""

    # Ray Serve asks a replica for its queue length before sending (0.1 s by default): a replica busy decoding on
    # a loaded CPU answers later than that and would be passed over as unavailable
    queue_len_response_deadline_s = 1.0
    max_queue_len_response_deadline_s = 10.0

    def initialize_state(self, prefix_tokens: int = DEFAULT_PREFIX_TOKENS,
                         load_factor: float = DEFAULT_LOAD_FACTOR, policy: str = "prefix", spill_at: int = 0,
                         **_):
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {policy!r}")
        self.prefix_tokens, self.load_factor, self.policy = prefix_tokens, load_factor, policy
        self.spill_at = spill_at
        self._inflight: dict[str, str] = {}                 # internal request id -> replica id
        self._load: dict[str, int] = defaultdict(int)
        self._ring: HashRing | None = None
        self.routed = 0
        self.per_replica: dict[str, int] = defaultdict(int)
        self._rng = random.Random(0)
        routing.register(self._deployment_id.name, self)

    # what the ingress reads (another thread: copies)
    def replica_ids(self) -> list[str]:
        return [rid.unique_id for rid in list(self.curr_replicas)]

    def loads(self) -> dict[str, int]:
        return dict(self._load)

    def _ring_of(self, ids: list[str]) -> HashRing:
        if self._ring is None or self._ring.members != sorted(ids):
            self._ring = HashRing(ids)
        return self._ring

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True     # no locality rounds: back off at once
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        target = kwargs.get("replica_id")
        if target is not None:
            return [[by_id[target]]] if target in by_id else []
        avoid = set(kwargs.get("avoid") or ())
        live = [i for i in by_id if i not in avoid and not routing.is_dead(i)]
        if not live:             # every replica failed: wait (Ray Serve backs off) for the restarted ones
            return []
        # least loaded; among equals the one given fewest requests so far (sequential requests alternate)
        ranked = sorted(live, key=lambda i: (self._load.get(i, 0), self.per_replica.get(i, 0), i))
        key = kwargs.get("route_key")
        if self.policy == "random":
            first = self._rng.choice(live)
        elif key is not None and self.policy == "prefix":
            first = self._ring_of(live).choose(key, self._load, self.load_factor, self.spill_at)
        else:
            first = ranked[0]
        return [[by_id[first]], [by_id[i] for i in ranked if i != first]]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        rid = replica_id.unique_id
        kwargs = pending_request.kwargs or {}
        if kwargs.get("replica_id") is not None:      # a health / metrics call, not a request
            return
        self._inflight[pending_request.metadata.internal_request_id] = rid
        self._load[rid] += 1
        self.routed += 1
        self.per_replica[rid] += 1
        key = kwargs.get("route_key")
        if key is not None:
            routing.record_keyed(key, rid)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        rid = self._inflight.pop(internal_request_id, None)
        if rid is not None:
            self._load[rid] = max(0, self._load[rid] - 1)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        mark_dead(replica_id.unique_id)

