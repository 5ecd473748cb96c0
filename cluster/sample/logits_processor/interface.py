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


@dataclass(frozen=True)
class SpecDecodeMetadata:
    """The row layout of a speculative step's logits, for `apply_with_spec_decode`.

    Batch row i (a request) owns `num_draft_tokens[i] + 1` consecutive logits rows, starting at
    `first_row[i]`: position j < k scores draft token j (the request's output so far plus
    `draft_token_ids[i][:j]` precede it), position k is the bonus token after all k drafts.
    Requests without drafts own one row. Position j of a row sees the stream a plain step
    would see if drafts 0..j-1 are accepted; rows past a rejection are discarded, so a
    processor that treats each position as that plain step is exact.
    """

    num_draft_tokens: list[int]  # per batch row
    draft_token_ids: list[list[int]]  # per batch row ([] without drafts)
    first_row: list[int]  # per batch row: its first logits row
    row_of: torch.Tensor  # [num_rows] int64: the batch row of every logits row
    position: torch.Tensor  # [num_rows] int64: j, the row's draft position

    @property
    def num_rows(self) -> int:
        return self.row_of.numel()

    def rows_of(self, batch_row: int) -> range:
        """The logits rows of a batch row, in position order."""
        start = self.first_row[batch_row]
        return range(start, start + self.num_draft_tokens[batch_row] + 1)

    def expand(self, batch_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For entries belonging to batch rows `batch_rows` ([m] int64): (entry index, logits
        row) for every position of each entry's row, e.g. to repeat per-row index_put_s."""
        counts = torch.tensor([n + 1 for n in self.num_draft_tokens], dtype=torch.long,
                              device=batch_rows.device)[batch_rows]
        entry = torch.repeat_interleave(torch.arange(batch_rows.numel(), device=batch_rows.device), counts)
        firsts = torch.tensor(self.first_row, dtype=torch.long, device=batch_rows.device)[batch_rows]
        offset = torch.arange(entry.numel(), device=batch_rows.device) - \
            torch.repeat_interleave(counts.cumsum(0) - counts, counts)
        return entry, firsts[entry] + offset


class LogitsProcessor(ABC):
    @classmethod
    def supports_spec_decode(cls) -> bool:
        """True when `apply_with_spec_decode` is exact at every speculative position. With
        speculative decoding configured, an engine refuses to start with a processor that
        does not say so (vLLM's rule). Default: False."""
        return False

    def apply_with_spec_decode(self, logits: torch.Tensor, spec: SpecDecodeMetadata) -> torch.Tensor:
        """`apply` for a speculative step: `logits` has `spec.num_rows` rows laid out as
        `spec` describes, not one per batch row. `update_state` has run as usual (the output
        lists hold accepted tokens only); position j must be treated as if the row's output
        ended with `spec.draft_token_ids[i][:j]`. Unlike vLLM's, one call covers every
        position, the bonus rows included."""
        raise NotImplementedError(f"{type(self).__name__} does not implement apply_with_spec_decode")

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
