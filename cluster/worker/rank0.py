"""Rank 0's sampling step: persistent batch, grammar bitmask, processors and sampler.

Order (DESIGN.md): grammar bitmask, then the sampler's own order (allowed ids, bad words,
non-argmax-invariant processors, penalties, thinking budget, greedy / temperature,
argmax-invariant processors, top-k / top-p, random sampling).
"""
from __future__ import annotations

import torch

from cluster.config import EngineConfig
from cluster.messages import Logprobs, StepPlan, StepResult
from cluster.sample.logits_processor import build_logitsprocs
from cluster.sample.sampler import Sampler, SamplerOutput
from cluster.structured_output import StructuredOutputManager
from cluster.worker.input_batch import InputBatch


class Rank0Sampling:
    def __init__(self, config: EngineConfig, device: torch.device, eos_token_id: int | None,
                 reasoning_token_ids: tuple[list[int], list[int]] | None) -> None:
        vocab = config.model_config.vocab_size
        procs = build_logitsprocs(config, device, False, eos_token_id)
        self.input_batch = InputBatch(config.scheduler_config.max_num_seqs, vocab, device, procs,
                                      reasoning_token_ids=reasoning_token_ids)
        self.sampler = Sampler()
        self.grammars: StructuredOutputManager | None = None
        self._config, self._eos = config, eos_token_id

    # ---- grammar state (one matcher per constrained request) ---------------------------
    def add_grammar(self, req_id: str, grammar: str | None, outputs: list[int]) -> None:
        if grammar is None:
            return
        if self.grammars is None:
            self.grammars = StructuredOutputManager.for_model(self._config, self._eos)
        self.grammars.add(req_id, grammar, outputs)

    def accept_tokens(self, req_id: str, tokens: list[int]) -> None:
        if self.grammars is not None and tokens and self.grammars.has(req_id):
            for t in tokens:
                self.grammars.accept(req_id, t)

    def remove_grammar(self, req_id: str) -> None:
        if self.grammars is not None:
            self.grammars.remove(req_id)

    # ---- the sampling step ---------------------------------------------------------------
    def sample(self, plan: StepPlan, logits: torch.Tensor) -> StepResult:
        batch = self.input_batch
        meta = batch.refresh()
        rows = batch.req_ids[: batch.num_reqs]
        wanted = set(plan.sample_ids)
        sampling = [r in wanted for r in rows]
        logits = logits.float()
        if self.grammars is not None:
            constrained = [(i, r) for i, r in enumerate(rows) if sampling[i] and self.grammars.has(r)]
            if constrained:
                mask = self.grammars.fill_bitmask(constrained, len(rows))
                self.grammars.apply(logits, mask)
        rows_mask = None if all(sampling) else torch.tensor(sampling, device=logits.device)
        out = self.sampler(logits, meta, rows_mask)
        idx = [i for i, s in enumerate(sampling) if s]
        tokens = out.sampled_token_ids.tolist()
        return StepResult(plan.step, [rows[i] for i in idx], [tokens[i] for i in idx],
                          _logprobs(out, idx, [batch.requests_params(rows[i]) for i in idx]))


def _logprobs(out: SamplerOutput, idx: list[int], params: list) -> Logprobs | None:
    if out.logprobs is None:
        return None
    ids, lps, ranks = out.logprob_token_ids.tolist(), out.logprobs.tolist(), out.sampled_ranks.tolist()
    keep = [(p.logprobs + 1) if p.logprobs is not None else 0 for p in params]
    return Logprobs([ids[i][:k] for i, k in zip(idx, keep)],
                    [lps[i][:k] for i, k in zip(idx, keep)],
                    [ranks[i] for i in idx])
