"""What the sampler needs for one step, built by the persistent batch (`InputBatch.refresh`).

Row i of every per-row field is batch row i. Optional fields are None when no row uses
the feature, so the sampler skips it without looking at the rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cluster.sample.logits_processor import LogitsProcessors


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor | None  # [n] float32, greedy rows 0; None when all greedy
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None = None  # [n] float32, 1.0 where unused
    top_k: torch.Tensor | None = None  # [n] int64, vocab_size where unused
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> seeded generator
    max_num_logprobs: int | None = None  # largest `logprobs` in the batch, None when nobody asks
    # Penalties: rows that use any, their per-row values ([n]) and token statistics
    # (rows of [max_num_reqs, vocab] buffers, indexed by batch row).
    penalty_rows: torch.Tensor | None = None  # int64 row indices; None = no penalties
    frequency_penalties: torch.Tensor | None = None
    presence_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    seen_token_mask: torch.Tensor | None = None  # bool: token occurs in the prompt or output
    output_token_counts: torch.Tensor | None = None  # int32: occurrences in the output
    output_token_ids: list[list[int]] = field(default_factory=list)  # live lists, per row
    allowed_token_ids_mask: torch.Tensor | None = None  # [n, vocab] bool, True = not allowed
    bad_words_token_ids: dict[int, list[list[int]]] = field(default_factory=dict)  # row -> words
    logitsprocs: LogitsProcessors = field(default_factory=LogitsProcessors)
