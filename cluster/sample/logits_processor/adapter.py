"""Wrap per-request logits processors (callables on one row) as a batch processor."""
from __future__ import annotations

import inspect
from abc import abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Union

import torch

from cluster.sample.logits_processor.builtin import process_dict_updates
from cluster.sample.logits_processor.interface import BatchUpdate, LogitsProcessor, SpecDecodeMetadata
from cluster.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cluster.config import EngineConfig

# (output_ids, logits_row) -> logits_row, or (prompt_ids, output_ids, logits_row) -> logits_row
RequestLogitsProcessor = Union[Callable[[list[int], torch.Tensor], torch.Tensor],
                               Callable[[list[int], list[int], torch.Tensor], torch.Tensor]]


class AdapterLogitsProcessor(LogitsProcessor):
    """Subclasses say, per request, which row callable to run (or None for none).

    Under speculative decoding the callable runs once per draft position with the output list
    extended by the drafts before it. That is exact when the callable is a function of its
    arguments (vLLM's contract for request-level processors); a subclass whose callables are
    opts in with `supports_spec_decode() -> True`."""

    def __init__(self, vllm_config: "EngineConfig | None" = None, device: torch.device | None = None,
                 is_pin_memory: bool = False, *, config: "EngineConfig | None" = None) -> None:
        # row -> (callable, prompt ids or None when it takes two arguments, live output ids)
        self.req_info: dict[int, tuple[Callable, list[int] | None, list[int]]] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        """The callable for a request with these params, or None when it does not apply."""

    def _new_state(self, params: SamplingParams, prompt_ids: list[int] | None,
                   output_ids: list[int]) -> tuple[Callable, list[int] | None, list[int]] | None:
        req_lp = self.new_req_logits_processor(params)
        if req_lp is None:
            return None
        # Like vLLM: three parameters means the callable also wants the prompt ids.
        if len(inspect.signature(req_lp).parameters) == 3:
            return req_lp, list(prompt_ids or ()), output_ids
        return req_lp, None, output_ids

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.req_info, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (req_lp, prompt_ids, output_ids) in self.req_info.items():
            _run(req_lp, prompt_ids, output_ids, logits, row)
        return logits

    def apply_with_spec_decode(self, logits: torch.Tensor, spec: SpecDecodeMetadata) -> torch.Tensor:
        for row, (req_lp, prompt_ids, output_ids) in self.req_info.items():
            draft = spec.draft_token_ids[row]
            for j, r in enumerate(spec.rows_of(row)):
                _run(req_lp, prompt_ids, output_ids + draft[:j] if j else output_ids, logits, r)
        return logits


def _run(req_lp: Callable, prompt_ids: list[int] | None, output_ids: list[int],
         logits: torch.Tensor, row: int) -> None:
    row_logits = logits[row]
    new = req_lp(output_ids, row_logits) if prompt_ids is None else req_lp(prompt_ids, output_ids, row_logits)
    if new is not row_logits:
        logits[row] = new
