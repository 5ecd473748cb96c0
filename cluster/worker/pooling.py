"""Rank 0's pooling for embedding models (`task: embed`): each prompt's hidden states, chunk by
chunk as its prefill runs, into one vector per request. No LM head runs and nothing is sampled.

LAST takes the hidden state of the prompt's last token (computed in its last chunk whatever the
prefix cache held). MEAN averages every prompt token's, so every token must be computed: the
scheduler reads no prefix-cache hits for it (cluster/engine/scheduler.py). A request that starts
again from its first token (preempted) starts its sum again.
"""
from __future__ import annotations

import torch


class PromptPooler:
    def __init__(self, pooling_type: str) -> None:
        self.pooling_type = pooling_type
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}

    def add(self, req_id: str, start: int, rows: torch.Tensor) -> None:
        """The hidden states of the prompt tokens at positions start .. start + len(rows) - 1."""
        if self.pooling_type != "MEAN":
            return
        if start == 0:
            self.forget(req_id)
        total = rows.float().sum(0)
        self.sums[req_id] = total if req_id not in self.sums else self.sums[req_id] + total
        self.counts[req_id] = self.counts.get(req_id, 0) + len(rows)

    def pooled(self, req_id: str, last_row: torch.Tensor) -> list[float]:
        """The request's vector once its prompt is complete (`last_row`: its last token's)."""
        if self.pooling_type == "LAST":
            return last_row.float().tolist()
        vec = self.sums.pop(req_id) / self.counts.pop(req_id)
        return vec.tolist()

    def forget(self, req_id: str) -> None:
        self.sums.pop(req_id, None)
        self.counts.pop(req_id, None)
