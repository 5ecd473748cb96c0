"""Continuous batching: how much goes into a step, the waiting queue, its order and deadlines."""
from __future__ import annotations

from dataclasses import dataclass

from cluster.config.options import Freezable, check_options, option

SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class SchedulerConfig(Freezable):
    max_num_seqs: int = option(64, ge=1, doc="sequences in a step")
    max_num_batched_tokens: int = option(2048, ge=1, doc="tokens in a step (prefill chunks included)")
    max_waiting: int | None = option(None, ge=1, nullable=True,
                                     doc="queue limit in sequences (the server answers 503 past it)")
    # Either way a request with fewer sequences in the batch goes before more of a larger one.
    scheduling_policy: str = option("fcfs", choices=SCHEDULING_POLICIES,
                                    doc="fcfs, or priority: lower `priority` values first (vLLM's)")
    # Step N + 1 is scheduled and queued on the workers while step N runs, assuming one token per
    # sampled request (the workers fill it in from their own sample), so the engine's bookkeeping
    # overlaps the model instead of following it.
    async_scheduling: bool = option(False, boolean=True, doc="vLLM's async scheduling")
    # A request still waiting for its first step after max_queue_wait_s is refused (queue_timeout);
    # one not finished after request_timeout_s is ended (request_timeout). Either frees its blocks.
    max_queue_wait_s: float | None = option(None, gt=0, nullable=True, doc="seconds from admission")
    request_timeout_s: float | None = option(None, gt=0, nullable=True, doc="seconds from admission")

    def validate(self) -> None:
        check_options(self)
