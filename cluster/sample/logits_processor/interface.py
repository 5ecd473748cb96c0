"""The logits-processor extension interface, with vLLM V1's names and semantics.

A processor sees the whole batch: `update_state` is told how the persistent batch changed
since the last step (a `BatchUpdate`, or None when nothing moved), then `apply` transforms
the `[num_reqs, vocab]` logits, row i belonging to batch row i.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING

import torch

from cluster.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cluster.config import EngineConfig


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = auto()  # i1 -> i2; i1 is left empty, i2's previous occupant is gone
    SWAP = auto()  # i1 <-> i2


RemovedRequest = int
# (row, params, prompt_token_ids, output_token_ids). The output list is the request's live
# list: it grows as tokens are sampled, so a processor that keeps it always sees them all.
AddedRequest = tuple[int, SamplingParams, "list[int] | None", "list[int]"]
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """How the persistent batch changed this step. Apply in order: removed, added, moved.

    An added or moved request may replace whatever state the destination row held.
    """

    batch_size: int
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        """Reject a request this processor cannot serve (raise ValueError). Default: accept."""
        return None

    def __init__(self, vllm_config: "EngineConfig | None" = None, device: torch.device | None = None,
                 is_pin_memory: bool = False, *, config: "EngineConfig | None" = None) -> None:
        """vLLM's signature: `super().__init__(vllm_config=..., device=..., is_pin_memory=...)`
        from a processor written for vLLM runs as is (`config=` is accepted too). The config is
        the finalized `EngineConfig`; it answers what vLLM's docs use, e.g.
        `model_config.get_vocab_size()` and `scheduler_config.max_num_seqs`."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Transform the batch's logits; may modify them in place, must return the result."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True when this processor never changes a row's argmax (so greedy rows skip it)."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called once per step before `apply`; batch_update is None when the batch kept its
        make-up (output lists may still have grown)."""
