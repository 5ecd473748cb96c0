"""Built-in processors: min-p (argmax invariant), logit bias and min-tokens.

Each keeps its per-row state in a sparse dict or a small tensor updated from the step's
`BatchUpdate`; `apply` is a handful of batched tensor ops and returns at once when no row
uses it. Each is exact under speculative decoding (`apply_with_spec_decode`): min-p and logit
bias do not depend on the tokens so far, min-tokens counts the drafts before each position.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch

from cluster.sample.logits_processor.interface import (BatchUpdate, LogitsProcessor, MoveDirectionality,
                                                       SpecDecodeMetadata)
from cluster.sample.ops import mask_below_
from cluster.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cluster.config import EngineConfig

T = TypeVar("T")


def process_dict_updates(req_entries: dict[int, T], batch_update: BatchUpdate | None,
                         new_state: Callable[[SamplingParams, list[int] | None, list[int]], T | None]
                         ) -> bool:
    """Apply a BatchUpdate to a row -> state dict (rows without state have no entry).

    `new_state(params, prompt_ids, output_ids)` builds an added request's state, or None
    when the processor does not act on it. Returns whether any entry changed.
    """
    if batch_update is None:
        return False
    updated = False
    for index in batch_update.removed:
        if req_entries.pop(index, None) is not None:
            updated = True
    for index, params, prompt_ids, output_ids in batch_update.added:
        state = new_state(params, prompt_ids, output_ids)
        if state is not None:
            req_entries[index] = state
            updated = True
        elif req_entries.pop(index, None) is not None:
            updated = True
    for a, b, direction in batch_update.moved:
        a_entry, b_entry = req_entries.pop(a, None), req_entries.pop(b, None)
        if a_entry is not None:
            req_entries[b] = a_entry
        if b_entry is not None and direction == MoveDirectionality.SWAP:
            req_entries[a] = b_entry
        updated = updated or a_entry is not None or b_entry is not None
    return updated


def _tensor(values: list, dtype: torch.dtype, device: torch.device, pin: bool) -> torch.Tensor:
    t = torch.tensor(values, dtype=dtype, pin_memory=pin and device.type != "cpu")
    return t.to(device, non_blocking=True) if device.type != "cpu" else t


class MinPLogitsProcessor(LogitsProcessor):
    """Drops tokens whose probability is below min_p times the row's top probability.

    Done in logit space: p_i < min_p * p_max  <=>  l_i < l_max + log(min_p), so no softmax is
    needed and rows with min_p = 0 get a threshold of -inf (untouched).
    """

    def __init__(self, config: "EngineConfig", device: torch.device, is_pin_memory: bool) -> None:
        self.device, self.pin = torch.device(device), is_pin_memory
        self._min_p = [0.0] * config.scheduler_config.max_num_seqs
        self._log_min_p: torch.Tensor | None = None  # [batch, 1], None when no row uses min-p
        self._workspace: torch.Tensor | None = None  # reused scratch: no fresh pages per step

    def is_argmax_invariant(self) -> bool:
        return True

    @classmethod
    def supports_spec_decode(cls) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        vals = self._min_p
        top = max([batch_update.batch_size - 1] + [a[0] for a in batch_update.added]
                  + [max(m[0], m[1]) for m in batch_update.moved])
        if top >= len(vals):  # a batch larger than scheduler_config.max_num_seqs
            vals.extend([0.0] * (top + 1 - len(vals)))
        for index in batch_update.removed:
            vals[index] = 0.0
        for index, params, _, _ in batch_update.added:
            vals[index] = params.min_p
        for a, b, direction in batch_update.moved:
            vals[a], vals[b] = (vals[b] if direction == MoveDirectionality.SWAP else 0.0), vals[a]
        rows = vals[: batch_update.batch_size]
        self._log_min_p = None
        if any(rows):
            logs = [math.log(p) if p > 0 else -math.inf for p in rows]
            self._log_min_p = _tensor(logs, torch.float32, self.device, self.pin).unsqueeze(1)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self._log_min_p is None:
            return logits
        return self._mask(logits, self._log_min_p)

    def apply_with_spec_decode(self, logits: torch.Tensor, spec: SpecDecodeMetadata) -> torch.Tensor:
        if self._log_min_p is None:
            return logits
        return self._mask(logits, self._log_min_p[spec.row_of.to(self._log_min_p.device)])

    def _mask(self, logits: torch.Tensor, log_min_p: torch.Tensor) -> torch.Tensor:
        threshold = logits.amax(dim=-1, keepdim=True) + log_min_p.to(logits.dtype)
        return mask_below_(logits, threshold, self._scratch(logits))

    def _scratch(self, logits: torch.Tensor) -> torch.Tensor:
        ws, (n, vocab) = self._workspace, logits.shape
        if ws is None or ws.shape[0] < n or ws.shape[1] != vocab or ws.dtype != logits.dtype \
                or ws.device != logits.device:
            ws = self._workspace = logits.new_empty(max(n, len(self._min_p)), vocab)
        return ws[:n]


class LogitBiasLogitsProcessor(LogitsProcessor):
    """Adds each request's `logit_bias` {token: bias} to its row."""

    def __init__(self, config: "EngineConfig", device: torch.device, is_pin_memory: bool) -> None:
        self.device, self.pin = torch.device(device), is_pin_memory
        self.biases: dict[int, dict[int, float]] = {}
        self._index: tuple[torch.Tensor, torch.Tensor] | None = None
        self._values: torch.Tensor | None = None

    def is_argmax_invariant(self) -> bool:
        return False

    @classmethod
    def supports_spec_decode(cls) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not process_dict_updates(self.biases, batch_update, lambda p, _, __: p.logit_bias or None):
            return
        rows, cols, vals = [], [], []
        for row, bias in self.biases.items():
            rows.extend([row] * len(bias))
            cols.extend(int(t) for t in bias)
            vals.extend(float(v) for v in bias.values())
        self._index = (_tensor(rows, torch.long, self.device, self.pin),
                       _tensor(cols, torch.long, self.device, self.pin))
        self._values = _tensor(vals, torch.float32, self.device, self.pin)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.biases:
            return logits
        return logits.index_put_(self._index, self._values.to(logits.dtype), accumulate=True)

    def apply_with_spec_decode(self, logits: torch.Tensor, spec: SpecDecodeMetadata) -> torch.Tensor:
        if not self.biases:
            return logits
        rows, cols = self._index
        entry, logit_rows = spec.expand(rows)
        return logits.index_put_((logit_rows, cols[entry]), self._values[entry].to(logits.dtype),
                                 accumulate=True)


class MinTokensLogitsProcessor(LogitsProcessor):
    """Bans a request's stop tokens (its stop_token_ids, plus EOS unless ignore_eos) while it
    has produced fewer than min_tokens tokens."""

    def __init__(self, config: "EngineConfig", device: torch.device, is_pin_memory: bool) -> None:
        self.device, self.pin = torch.device(device), is_pin_memory
        eos_token_id = config.model_config.eos_token_id
        eos = [] if eos_token_id is None else (
            [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        # row -> (min_tokens, live output list, stop ids)
        self.min_toks: dict[int, tuple[int, list[int], tuple[int, ...]]] = {}
        self._index: tuple[torch.Tensor, torch.Tensor] | None = None

    def is_argmax_invariant(self) -> bool:
        return False

    @classmethod
    def supports_spec_decode(cls) -> bool:
        return True

    def _new_state(self, params: SamplingParams, _prompt: list[int] | None, output: list[int]):
        if not params.min_tokens or len(output) >= params.min_tokens:
            return None
        stops = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stops.update(self.eos_token_ids)
        return (params.min_tokens, output, tuple(sorted(stops))) if stops else None

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        changed = process_dict_updates(self.min_toks, batch_update, self._new_state)
        # Output lists grow every step: drop rows that reached their minimum.
        done = [row for row, (n, out, _) in self.min_toks.items() if len(out) >= n]
        for row in done:
            del self.min_toks[row]
        if changed or done:
            rows, cols = [], []
            for row, (_, _, stops) in self.min_toks.items():
                rows.extend([row] * len(stops))
                cols.extend(stops)
            self._index = (_tensor(rows, torch.long, self.device, self.pin),
                           _tensor(cols, torch.long, self.device, self.pin))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.min_toks:
            return logits
        return logits.index_put_(self._index, torch.tensor(-math.inf, dtype=logits.dtype,
                                                           device=logits.device))

    def apply_with_spec_decode(self, logits: torch.Tensor, spec: SpecDecodeMetadata) -> torch.Tensor:
        """Position j follows j drafts: its stop tokens stay banned while len(output) + j <
        min_tokens."""
        if not self.min_toks:
            return logits
        rows, cols = [], []
        for row, (n, out, stops) in self.min_toks.items():
            for r in spec.rows_of(row)[: n - len(out)]:
                rows.extend([r] * len(stops))
                cols.extend(stops)
        index = (_tensor(rows, torch.long, logits.device, False), _tensor(cols, torch.long, logits.device, False))
        return logits.index_put_(index, torch.tensor(-math.inf, dtype=logits.dtype, device=logits.device))
