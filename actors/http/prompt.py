"""One prompt of an HTTP request, as the stream lifecycle (actors/http/streams.py) and the
response formats (actors/http/openai_format.py, the Responses API) both see it."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cluster.lora.adapter import LoRARequest
from cluster.outputs import RequestOutput
from cluster.sampling_params import SamplingParams

if TYPE_CHECKING:
    from actors.channel.ingress import RequestStream


@dataclass
class PromptState:
    """One prompt of an HTTP request: its engine stream and, once done, its final output."""

    request_id: str
    text: str | None
    token_ids: list[int]
    params: SamplingParams
    stream: RequestStream | None = None  # its engine stream, once open (actors/channel/ingress.py)
    final: RequestOutput | None = None
    arrival: float = field(default_factory=time.monotonic)
    lora_request: LoRARequest | None = None  # the adapter it runs under
