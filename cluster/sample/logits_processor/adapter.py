"""Wrap per-request logits processors (callables on one row) as a batch processor."""
from __future__ import annotations

import inspect
from abc import abstractmethod
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Union

import torch

from cluster.sample.logits_processor.builtin import process_dict_updates
from cluster.sample.logits_processor.interface import BatchUpdate, LogitsProcessor
from cluster.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cluster.config import EngineConfig

# (output_ids, logits_row) -> logits_row, or (prompt_ids, output_ids, logits_row) -> logits_row
RequestLogitsProcessor = Union[Callable[[list[int], torch.Tensor], torch.Tensor],
                               Callable[[list[int], list[int], torch.Tensor], torch.Tensor]]


class AdapterLogitsProcessor(LogitsProcessor):
    """Subclasses say, per request, which row callable to run (or None for none)."""

    def __init__(self, vllm_config: "EngineConfig | None" = None, device: torch.device | None = None,
                 is_pin_memory: bool = False, *, config: "EngineConfig | None" = None) -> None:
        self.req_info: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        """The callable for a request with these params, or None when it does not apply."""

    def _new_state(self, params: SamplingParams, prompt_ids: list[int] | None,
                   output_ids: list[int]) -> Callable[[torch.Tensor], torch.Tensor] | None:
        req_lp = self.new_req_logits_processor(params)
        if req_lp is None:
            return None
        # Like vLLM: three parameters means the callable also wants the prompt ids.
        if len(inspect.signature(req_lp).parameters) == 3:
            return partial(req_lp, prompt_ids, output_ids)
        return partial(req_lp, output_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.req_info, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, req_lp in self.req_info.items():
            row_logits = logits[row]
            new = req_lp(row_logits)
            if new is not row_logits:
                logits[row] = new
        return logits
