"""Per-request limits, checked where requests enter (ValueError / HTTP 400) before anything is
queued. Prompt text is also bounded before tokenizing: no prompt longer than max_model_len x the
vocabulary's longest token (in characters) can fit."""
from __future__ import annotations

from dataclasses import dataclass

from cluster.config.options import Freezable, check_options, option


@dataclass
class LimitsConfig(Freezable):
    max_n: int = option(128, ge=1, doc="completions per request (OpenAI's limit)")
    max_logprobs: int = option(20, ge=0, doc="logprobs / top_logprobs / prompt_logprobs (vLLM's default)")
    max_request_body_bytes: int = option(4 << 20, ge=1, doc="HTTP bodies, refused before they are parsed")

    def validate(self) -> None:
        check_options(self)
