"""The engine's view of one request: tokens, progress, status and why it finished."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from cluster.lora.adapter import LoRAAdapter
from cluster.messages import Logprobs
from cluster.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    WAITING_FOR_GRAMMAR = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED = enum.auto()


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: never past max_model_len or the KV capacity
    arrival_time: float = field(default_factory=time.monotonic)
    # Requests fanned out from one n > 1 request share this id; siblings wait until the first
    # one's prompt is in the prefix cache so they reuse its blocks instead of recomputing them.
    parent_id: str | None = None
    priority: int = 0  # lower first (scheduling_policy "priority"; always 0 under "fcfs")
    # Fair-scheduling unit (see WaitingQueue): the parent request, or the HTTP request whose
    # prompts these are. Defaults to the request itself.
    group_id: str = ""
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first schedule (-1: not scheduled yet)
    num_preemptions: int = 0
    # Tokens being sampled in steps on the workers that the engine has not seen yet (one per
    # such step): async scheduling schedules past them, each step's result takes one back.
    num_output_placeholders: int = 0
    # True once the workers hold state for it (later steps send it as a cached request).
    on_workers: bool = False
    grammar: str | None = None  # serialized compiled grammar, once compiled
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    error_code: str | None = None  # cluster.errors' codes (QUEUE_TIMEOUT, REQUEST_TIMEOUT)
    first_token_time: float | None = None
    # Prompt logprobs gathered over the prefill chunks; sent with the first output token.
    prompt_logprobs: Logprobs | None = None
    lora: LoRAAdapter | None = None  # the adapter it runs under (None: the base model)
    lora_slot: int = -1  # the workers' slot it holds, from its first step until it finishes
    lora_announced: bool = False  # its adapter was announced to the workers for reading ahead

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)  # prompt + outputs, extended in place
        self.group_id = self.group_id or self.parent_id or self.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def cache_salt(self) -> int | None:
        """Its prefix-cache chain's start: its adapter's, so no block is shared across adapters."""
        return None if self.lora is None else self.lora.cache_salt

    @property
    def needs_grammar(self) -> bool:
        return self.sampling_params.structured_outputs is not None

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)

    def finish(self, reason: str, stop_reason: int | str | None = None, error: str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason, self.stop_reason, self.error = reason, stop_reason, error
