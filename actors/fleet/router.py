"""Ray Serve request routers for the engine deployment (its `request_router_config`).

Both run inside each caller of the engine (the ingress replicas), one per deployment handle,
and both route around replicas that cannot serve: those whose last routing stats say
`healthy: False` (a failed step loop) and those the caller lists in the `generate` call's
`avoid_replicas` argument (replicas that already refused this request; see
actors/channel/failover.py), unless that leaves none. A call naming `pin_replica` (the ingress's
`abort` of a request, which only the replica serving it holds) goes to that replica while it
is there. These keywords are part of the engine's call protocol (actors/channel/protocol.py).

- `PrefixAwareRouter` (`request_router: prefix_affinity`, the default with more than one
  replica): `cluster.routing.PrefixAffinityPolicy` over the prefix-cache summaries the engine
  replicas publish through Serve's `record_routing_stats` (actors/engine_replica/deployment.py), with
  each replica's requests in flight (Serve's queue-length cache, probed when stale) as its load.
  Every routed `generate` call is counted by decision in `ray_llm_routing_decisions_total`.
- `PowerOfTwoRouter` (`request_router: power_of_two`): Serve's power-of-two choices.
"""
from __future__ import annotations

import logging
import random
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from actors.channel.protocol import AVOID_REPLICAS, PIN_REPLICA, ROUTING_STATS_KEY, request_of
from actors.metrics import RoutingMetrics
from cluster.messages import PrefixCacheSummary, decode
from cluster.routing import LOAD_FALLBACK, PrefixAffinityPolicy, RoutingDecision

logger = logging.getLogger("ray.serve")
_MAX_UNROUTED = 4096  # decisions kept for requests Serve has not dispatched yet


class _EngineRouter(RequestRouter):
    """Candidate filtering and per-replica loads shared by both routers."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.rng = random.Random()

    def _candidates(self, replicas: list[RunningReplica], pending: PendingRequest | None) -> list[RunningReplica]:
        if pending is not None:
            # Every call looks at all replicas: when none can take the request, Serve must back
            # off before asking again (instead of spinning).
            pending.routing_context.should_backoff = True
        pin = pending.kwargs.get(PIN_REPLICA) if pending is not None else None
        pinned = [r for r in replicas if r.replica_id.unique_id == pin]
        if pinned:
            return pinned
        avoid = set(pending.kwargs.get(AVOID_REPLICAS, ())) if pending is not None else set()
        usable = [r for r in replicas
                  if r.replica_id.unique_id not in avoid and r.routing_stats.get("healthy", True)]
        return usable or list(replicas)

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata: Any = None) -> None:
        """Hand `replica` to the very call it was chosen for. Serve's default matches calls by
        `internal_request_id`, which every call made while serving one HTTP request shares (a
        completion with several prompts makes several), so one of them would never be routed."""
        for pr in self._pending_requests_to_fulfill:
            if pr.metadata is request_metadata and not pr.future.done():
                self._cancel_routing_task_for_pending_request(pr)
                self._record_queue_wait_time(pr)
                pr.future.set_result(replica)
                self._remove_pending_request_from_indices(pr)
                return
        super()._fulfill_next_pending_request(replica, request_metadata)

    async def _loads(self, candidates: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Requests in flight per candidate; replicas that do not answer a probe are left out."""
        loads, stale = {}, []
        for r in candidates:
            n = self.replica_queue_len_cache.get(r.replica_id)
            if n is None:
                stale.append(r)
            else:
                loads[r.replica_id] = n
        if stale:
            for r, n in await self._probe_queue_lens(stale, 0):
                if n is not None:
                    loads[r.replica_id] = n
        return loads


class PowerOfTwoRouter(FIFOMixin, _EngineRouter):
    """Two usable replicas at random; Serve sends the request to the less busy one. As Serve's
    default router, the first replica found goes to the oldest waiting call (FIFO)."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        candidates = self._candidates(candidate_replicas, pending_request)
        # Shuffled even when there are two: of equally busy replicas Serve takes the first.
        return [self.rng.sample(candidates, min(2, len(candidates)))]


class PrefixAwareRouter(_EngineRouter):
    """The replica holding the longest cached prefix of the prompt, unless it is overloaded."""

    def initialize_state(self, block_size: int, model_name: str = "", **policy: Any) -> None:
        super().initialize_state()
        self.policy = PrefixAffinityPolicy(block_size, **policy)
        self.metrics = RoutingMetrics(model_name)
        self.summaries: dict[ReplicaID, bytes] = {}  # the last summary bytes read per replica
        # Decisions for calls Serve has not dispatched yet, by id() of their PendingRequest (the
        # same object when Serve asks again after a backoff or a rejection); holding the object
        # keeps its id from being reused while the entry exists.
        self.unrouted: OrderedDict[int, tuple[PendingRequest, RoutingDecision, list[int]]] = OrderedDict()

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        for gone in set(self.summaries) - {r.replica_id for r in replicas}:
            del self.summaries[gone]
            self.policy.forget(gone)
        for r in replicas:
            raw = r.routing_stats.get(ROUTING_STATS_KEY)
            if raw is not None and raw != self.summaries.get(r.replica_id):
                self.summaries[r.replica_id] = raw
                try:
                    self.policy.report(r.replica_id, decode(raw, PrefixCacheSummary))
                except Exception:  # never break Serve's replica updates; route that one by load
                    logger.exception("ignoring the prefix-cache summary of replica %s", r.replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.summaries.pop(replica_id, None)
        self.policy.forget(replica_id)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        candidates = self._candidates(candidate_replicas, pending_request)
        loads = await self._loads(candidates)
        if not loads:  # nobody answered: let Serve probe them all
            return [candidates]
        keys = self._prompt_keys(pending_request)
        decision = self.policy.choose(keys or [], loads)
        if keys is not None:
            self.unrouted[id(pending_request)] = (pending_request, decision, keys)
            while len(self.unrouted) > _MAX_UNROUTED:
                self.unrouted.popitem(last=False)
        by_id = {r.replica_id: r for r in candidates}
        rest = sorted((r for r in candidates if r.replica_id in loads and r.replica_id != decision.replica),
                      key=lambda r: loads[r.replica_id])
        # If the chosen replica is full (max_ongoing_requests), Serve tries the others in order.
        return [[by_id[decision.replica]], rest]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        entry = self.unrouted.pop(id(pending_request), None)
        if entry is None:
            return
        _, decision, keys = entry
        self.policy.routed(replica_id, keys)
        reason = decision.reason if replica_id == decision.replica else LOAD_FALLBACK
        self.metrics.decision(reason, replica_id.unique_id)

    def _prompt_keys(self, pending: PendingRequest | None) -> list[int] | None:
        """Routing keys of a `generate` call's prompt; None for other calls (stats, health)."""
        if pending is None or pending.metadata.call_method != "generate" or not pending.args:
            return None
        entry = self.unrouted.get(id(pending))
        if entry is not None:  # asked again after a backoff
            return entry[2]
        try:
            request = request_of(pending.args[0])
            return self.policy.keys(request.prompt_token_ids, request.lora_request)
        except Exception:  # not ours to reject here: the engine answers it properly
            logger.warning("could not read the prompt of a generate call; routing by load", exc_info=True)
            return []
