"""Rank 0's sampling step: the one owner of the persistent batch and the grammar matchers.

`update(plan, requests)` applies a step's plan in vLLM's order: removals (finished, preempted,
not scheduled this step), the grammar matchers of new requests, additions, then `refresh`,
which condenses the batch and hands one BatchUpdate to every logits processor. The matchers
take each sampled token as soon as it is sampled (the next step may already be planned).
With a reasoning config the grammar manager routes each request's tokens through its
reasoning state, so a matcher sees only the answer (`cluster.reasoning`).
`sample(plan, logits, order)` masks the constrained rows with their grammar bitmask and runs
the sampler (DESIGN.md's order). The model runner only hands it logits.
A speculative step (drafts in the plan) goes to `sample_with_drafts`, which runs the same
order at every draft position and keeps the accepted tokens.
"""
from __future__ import annotations

import torch

from cluster.config import EngineConfig
from cluster.messages import StepPlan, StepResult
from cluster.sample.logits_processor import build_logitsprocs
from cluster.sample.metadata import SamplingMetadata
from cluster.sample.sampler import Sampler
from cluster.structured_output import StructuredOutputManager
from cluster.worker.input_batch import CachedRequestState, InputBatch
from cluster.worker.spec_decode import sample_with_drafts


class Rank0Sampling:
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
            self.grammars = StructuredOutputManager.for_model(self.config)
        return self.grammars

    def sample(self, plan: StepPlan, logits: torch.Tensor, order: list[str]) -> StepResult:
        """logits: one row per request of `order` (the runner's token order); with drafts,
        1 + k rows for a request with k drafts (cluster/worker/spec_decode.py verifies)."""
        if plan.draft_token_ids:
            result = sample_with_drafts(self.input_batch, self.metadata, self.sampler, self.grammars,
                                        plan, logits, order)
        else:
            result = self._sample(plan, logits, order)
        if self.grammars is not None:
            self.grammars.accept_emitted(result.req_ids, result.sampled_token_ids)
        return result

    def _sample(self, plan: StepPlan, logits: torch.Tensor, order: list[str]) -> StepResult:
        batch = self.input_batch
        rows = batch.req_ids[: batch.num_reqs]
        where = {r: i for i, r in enumerate(order)}
        perm = [where[r] for r in rows]
        if perm != list(range(len(order))):  # the runner's order differs: gather, then upcast
            logits = torch.index_select(logits, 0, torch.tensor(perm, device=logits.device))
        logits = logits.float()
        wanted = set(plan.sample_ids)
        sampling = [r in wanted for r in rows]
        if self.grammars is not None:
            constrained = [(i, r) for i, r in enumerate(rows) if sampling[i] and self.grammars.has(r)]
            if constrained:
                self.grammars.apply(logits, self.grammars.fill_bitmask(constrained, len(rows)))
        rows_mask = None if all(sampling) else torch.tensor(sampling, device=logits.device)
        out = self.sampler(logits, self.metadata, rows_mask)
        idx = [i for i, s in enumerate(sampling) if s]
        tokens = out.sampled_token_ids.tolist()
        return StepResult(plan.step, [rows[i] for i in idx], [[tokens[i]] for i in idx],
                          out.select_logprobs(idx, [batch.get_state(rows[i]).sampling_params.logprobs
                                                    for i in idx]))
