"""Rank 0's sampling step: the one owner of the persistent batch and the grammar matchers.

`update(plan, requests)` applies a step's plan in vLLM's order: removals (finished, preempted,
not scheduled this step), the grammar matchers of new requests, additions, then `refresh`,
which condenses the batch and hands one BatchUpdate to every logits processor. The matchers
take each sampled token as soon as it is sampled (the next step may already be planned).
With a reasoning config the grammar manager routes each request's tokens through its
reasoning state, so a matcher sees only the answer (`cluster.reasoning`).

`sample(plan, logits, order)` is the one sampling path: it regroups the logits by batch row,
masks the constrained rows with their grammar bitmask and runs the sampler (DESIGN.md's
order) at every position. A plain step is a speculative step with zero drafts: a request owns
one position and emits its sample; with k drafts it owns 1 + k and emits its accepted drafts
plus one (`cluster/worker/spec_decode.py`, whose helpers return at once without drafts, so
the plain step builds nothing for them). The model runner only hands it logits.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cluster.config import EngineConfig
from cluster.messages import Logprobs, StepPlan, StepResult
from cluster.sample.logits_processor import SpecDecodeMetadata, build_logitsprocs
from cluster.sample.metadata import SamplingMetadata
from cluster.sample.sampler import Sampler, SamplerOutput
from cluster.worker.input_batch import CachedRequestState, InputBatch
from cluster.worker.spec_decode import at_positions, draft_generators, expand_metadata, spec_metadata, verify

if TYPE_CHECKING:
    from cluster.structured_output import StructuredOutputManager


class SamplingStep:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        procs = build_logitsprocs(config, device, False)
        self.input_batch = InputBatch(config.scheduler_config.max_num_seqs,
                                      config.model_config.vocab_size, device, procs)
        self.sampler = Sampler()
        self.grammars: StructuredOutputManager | None = None  # built for the first grammar
        self.metadata: SamplingMetadata | None = None

    def update(self, plan: StepPlan, requests: dict[str, CachedRequestState]) -> None:
        """Apply the plan; `requests` is the runner's state, already updated by the plan."""
        batch = self.input_batch
        for req_id in plan.finished_ids:
            batch.remove_request(req_id)
            if self.grammars is not None:
                self.grammars.remove(req_id)
        for req_id in [*plan.preempted_ids, *batch.req_id_to_index]:
            if req_id not in plan.num_scheduled_tokens:  # back in a later step
                batch.remove_request(req_id)
        for new in plan.new_requests:
            if new.grammar is not None:
                self._grammars().add(new.req_id, new.grammar, new.output_token_ids, new.prompt_token_ids,
                                     new.sampling_params.ignore_eos)
        for req_id in plan.num_scheduled_tokens:
            if req_id not in batch.req_id_to_index:
                batch.add_request(requests[req_id])
        # Every step, even one that samples nothing: the removals must reach the processors.
        self.metadata = batch.refresh()

    def _grammars(self) -> StructuredOutputManager:
        if self.grammars is None:
            # Imported here: xgrammar (and its tokenizer table) only for a worker that sees a grammar.
            from cluster.structured_output import StructuredOutputManager

            self.grammars = StructuredOutputManager.for_model(self.config)
        return self.grammars

    def sample(self, plan: StepPlan, logits: torch.Tensor, order: list[str]) -> StepResult:
        """logits: the runner's layout, requests in `order`, 1 + len(drafts) rows each (one
        without drafts). Returns the sampled requests in batch order with their tokens."""
        batch, drafts = self.input_batch, plan.draft_token_ids
        rows = batch.req_ids[: batch.num_reqs]
        wanted = set(plan.sample_ids)
        sampling = [r in wanted for r in rows]
        spec = spec_metadata(rows, drafts, logits.device)  # None: the plain step
        logits = _batch_order(logits, order, rows, drafts)
        if self.grammars is not None:
            self._mask_grammar(logits, rows, sampling, spec)
        row_mask = None if all(sampling) else at_positions(torch.tensor(sampling, device=logits.device), spec)
        saved = draft_generators(self.metadata, spec, sampling)
        out = self.sampler(logits, expand_metadata(self.metadata, spec), row_mask)
        idx = [i for i, s in enumerate(sampling) if s]
        req_ids, tokens = [rows[i] for i in idx], out.sampled_token_ids.tolist()
        first, kept = verify(tokens, spec, idx, saved, logits.shape[1])
        emitted = [tokens[f: f + k] for f, k in zip(first, kept)]
        if self.grammars is not None:
            self.grammars.accept_emitted(req_ids, emitted)
        return StepResult(plan.step, req_ids, emitted, self._logprobs(out, req_ids, first, kept))

    def _mask_grammar(self, logits: torch.Tensor, rows: list[str], sampling: list[bool],
                      spec: SpecDecodeMetadata | None) -> None:
        """The grammar bitmask on the constrained rows that sample (at each of their positions)."""
        g = self.grammars
        live = [i for i, r in enumerate(rows) if sampling[i] and g.has(r)]
        if spec is None:
            mask = g.fill_bitmask([(i, rows[i]) for i in live], len(rows))
        else:
            mask = g.fill_bitmask_with_drafts([(spec.first_row[i], rows[i], spec.draft_token_ids[i])
                                               for i in live], spec.num_rows)
        g.apply(logits, mask)

    def _logprobs(self, out: SamplerOutput, req_ids: list[str], first: list[int],
                  kept: list[int]) -> Logprobs | None:
        """One row per emitted token: the i-th request's are logits rows first[i] + 0..kept[i]-1."""
        if out.logprobs is None:
            return None
        want = [self.input_batch.get_state(r).sampling_params.logprobs for r in req_ids]
        return out.select_logprobs([f + j for f, k in zip(first, kept) for j in range(k)],
                                   [w for w, k in zip(want, kept) for _ in range(k)])


def _batch_order(logits: torch.Tensor, order: list[str], rows: list[str],
                 drafts: dict[str, list[int]]) -> torch.Tensor:
    """The logits regrouped by batch row (a request's positions consecutive), upcast to float32.
    No gather when the runner's order already is the batch's."""
    if drafts:
        start, offset = {}, 0
        for r in order:
            start[r], offset = offset, offset + 1 + len(drafts.get(r, ()))
        src = [start[r] + j for r in rows for j in range(1 + len(drafts.get(r, ())))]
    else:  # one row per request
        where = {r: i for i, r in enumerate(order)}
        src = [where[r] for r in rows]
    if src != list(range(logits.shape[0])):  # the runner's order differs: gather, then upcast
        logits = torch.index_select(logits, 0, torch.tensor(src, device=logits.device))
    return logits.float()
