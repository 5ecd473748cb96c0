"""One prompt of an HTTP request, as the stream lifecycle (actors/http/streams.py) and the
response formats (actors/http/openai_format.py, the Responses API) both see it."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from cluster.lora.adapter import LoRARequest
from cluster.outputs import RequestOutput
from cluster.sampling_params import SamplingParams


@dataclass
class PromptState:
    """One prompt of an HTTP request: its engine stream and, once done, its final output."""

    request_id: str
    text: str | None
    token_ids: list[int]
    params: SamplingParams
    queue: Any = None  # asyncio.Queue of EngineOutputs after the first (actors/fleet/demux.py)
    first: list | None = None  # the EngineOutputs of the call's first item
    replica: str | None = None  # the engine replica serving it, once its call is open
    live: bool = False  # the engine may still hold it: abort it if the handler stops early
    ended: bool = False  # its engine call ended (its last outputs may still be on the way)
    final: RequestOutput | None = None
    arrival: float = field(default_factory=time.monotonic)
    lora_request: LoRARequest | None = None  # the adapter it runs under
    priority: int = 0  # the engine request's, kept to send it again (a retry on another copy)
    group_id: str | None = None
