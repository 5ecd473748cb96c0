"""Rank 0's speculative step: sample every draft position, keep the accepted prefix.

A request with drafts d_0..d_{k-1} owns k + 1 logits rows; row j is the model's prediction
after the request's output plus d_0..d_{j-1}. Each row goes through the whole sampling order
(grammar mask, processors, penalties, temperature, top-k/p) as the plain step at that
position would, with every per-row input (processor state, penalty counts, bad words, the
grammar state) advanced over the drafts before it: `expand_metadata` builds that batch.

Verification: row j's sample t_j is kept; the request emits t_0..t_m where m is the first j
with t_j != d_j (or k: all accepted, t_k is the bonus token). For greedy rows this accepts
while the argmax matches. For random rows it is the rejection sampler with a one-hot draft
(q = 1 at d_j): it accepts d_j with probability p(d_j) = min(1, p/q), and on a rejection
the emitted t_j is p conditioned on t_j != d_j, i.e. the residual norm(max(0, p - q)). So
every emitted token has the target distribution. A seeded request's generator is rewound
and advanced by the emitted tokens only, so it ends where plain decoding would have left it.
"""
from __future__ import annotations

import torch

from cluster.messages import StepPlan, StepResult
from cluster.sample.logits_processor import LogitsProcessor, LogitsProcessors, SpecDecodeMetadata
from cluster.sample.metadata import SamplingMetadata
from cluster.sample.ops import skip_samples
from cluster.sample.sampler import Sampler
from cluster.structured_output import StructuredOutputManager
from cluster.worker.input_batch import InputBatch


def spec_metadata(drafts: list[list[int]], device: torch.device) -> SpecDecodeMetadata:
    """The row layout for batch rows with these drafts (one row each, plus one per draft)."""
    counts = [len(d) + 1 for d in drafts]
    first, total = [], 0
    for c in counts:
        first.append(total)
        total += c
    rows = torch.repeat_interleave(torch.arange(len(drafts)), torch.tensor(counts, dtype=torch.long))
    position = torch.cat([torch.arange(c) for c in counts]) if counts else torch.zeros(0, dtype=torch.long)
    return SpecDecodeMetadata([len(d) for d in drafts], drafts, first, rows.to(device), position.to(device))


def sample_with_drafts(batch: InputBatch, meta: SamplingMetadata, sampler: Sampler,
                       grammars: StructuredOutputManager | None, plan: StepPlan,
                       logits: torch.Tensor, order: list[str]) -> StepResult:
    """logits: the runner's layout, requests in `order` with 1 + len(drafts) rows each."""
    rows = batch.req_ids[: batch.num_reqs]
    drafts = [plan.draft_token_ids.get(r, []) for r in rows]
    start, offset = {}, 0
    for r in order:
        start[r], offset = offset, offset + 1 + len(plan.draft_token_ids.get(r, ()))
    logits = logits[[start[r] + j for r, d in zip(rows, drafts) for j in range(len(d) + 1)]].float()
    spec = spec_metadata(drafts, logits.device)
    wanted = set(plan.sample_ids)
    sampling = [r in wanted for r in rows]
    if grammars is not None:
        constrained = [(spec.first_row[i], r, drafts[i]) for i, r in enumerate(rows)
                       if sampling[i] and grammars.has(r)]
        if constrained:
            grammars.apply(logits, grammars.fill_bitmask_with_drafts(constrained, spec.num_rows))
    row_mask = None
    if not all(sampling):
        row_mask = torch.tensor([sampling[i] for i in spec.row_of.tolist()], device=logits.device)
    # The sampler draws a seeded row's noise position by position from its generator; after
    # verification it is rewound and advanced by the emitted tokens only.
    saved = {i: g.get_state() for i, g in meta.generators.items() if drafts[i] and sampling[i]}
    out = sampler(logits, expand_metadata(meta, spec), row_mask)
    tokens = out.sampled_token_ids.tolist()

    req_ids, emitted, lp_rows, lp_params = [], [], [], []
    for i, r in enumerate(rows):
        if not sampling[i]:
            continue
        first, draft = spec.first_row[i], drafts[i]
        m = 0
        while m < len(draft) and tokens[first + m] == draft[m]:
            m += 1
        req_ids.append(r)
        emitted.append(tokens[first: first + m + 1])
        lp_rows.extend(range(first, first + m + 1))
        lp_params.extend([batch.get_state(r).sampling_params.logprobs] * (m + 1))
        if i in saved:
            gen = meta.generators[i]
            gen.set_state(saved[i])
            skip_samples(gen, logits.shape[1], m + 1)
    return StepResult(plan.step, req_ids, emitted, out.select_logprobs(lp_rows, lp_params))


class _AtDraftPositions:
    """A processor seen through the step's row layout: `apply` is its spec-decode apply."""

    def __init__(self, proc: LogitsProcessor, spec: SpecDecodeMetadata) -> None:
        self.proc, self.spec = proc, spec

    def is_argmax_invariant(self) -> bool:
        return self.proc.is_argmax_invariant()

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return self.proc.apply_with_spec_decode(logits, self.spec)


def expand_metadata(meta: SamplingMetadata, spec: SpecDecodeMetadata) -> SamplingMetadata:
    """The step's SamplingMetadata with one row per logits row of `spec`."""
    idx = spec.row_of

    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[idx.to(t.device)]

    out = SamplingMetadata(
        temperature=pick(meta.temperature), all_greedy=meta.all_greedy, all_random=meta.all_random,
        top_p=pick(meta.top_p), top_k=pick(meta.top_k),
        generators={e: g for i, g in sorted(meta.generators.items()) for e in spec.rows_of(i)},
        max_num_logprobs=meta.max_num_logprobs,
        allowed_token_ids_mask=pick(meta.allowed_token_ids_mask),
        logitsprocs=LogitsProcessors([_AtDraftPositions(p, spec) for p in meta.logitsprocs.all]),
    )
    if meta.bad_words_token_ids:
        _expand_bad_words(meta, spec, out)
    if meta.penalty_rows is not None:
        _expand_penalties(meta, spec, out)
    return out


def _expand_bad_words(meta: SamplingMetadata, spec: SpecDecodeMetadata, out: SamplingMetadata) -> None:
    """Bad words look at the output's last few tokens: give each position its own."""
    outputs: list[list[int]] = [[] for _ in range(spec.num_rows)]
    for i, words in meta.bad_words_token_ids.items():
        tail = max(len(w) for w in words) - 1
        base, draft = meta.output_token_ids[i], spec.draft_token_ids[i]
        for j, r in enumerate(spec.rows_of(i)):
            out.bad_words_token_ids[r] = words
            outputs[r] = base[max(0, len(base) - tail):] + draft[:j]
    out.output_token_ids = outputs


def _expand_penalties(meta: SamplingMetadata, spec: SpecDecodeMetadata, out: SamplingMetadata) -> None:
    """Penalties count the output so far: position j adds the drafts before it."""
    dev = meta.seen_token_mask.device
    idx = spec.row_of.to(dev)
    _, rows = spec.expand(meta.penalty_rows.to(dev))
    seen, counts = meta.seen_token_mask[idx], meta.output_token_counts[idx]
    add_rows, add_tokens = [], []
    for i in meta.penalty_rows.tolist():
        draft = spec.draft_token_ids[i]
        for j, r in enumerate(spec.rows_of(i)):
            add_rows.extend([r] * j)
            add_tokens.extend(draft[:j])
    if add_rows:
        at = (torch.tensor(add_rows, dtype=torch.long, device=dev),
              torch.tensor(add_tokens, dtype=torch.long, device=dev))
        counts.index_put_(at, torch.ones(len(add_rows), dtype=counts.dtype, device=dev), accumulate=True)
        seen[at] = True
    out.penalty_rows = rows
    out.frequency_penalties = meta.frequency_penalties[idx.to(meta.frequency_penalties.device)]
    out.presence_penalties = meta.presence_penalties[idx.to(meta.presence_penalties.device)]
    out.repetition_penalties = meta.repetition_penalties[idx.to(meta.repetition_penalties.device)]
    out.seen_token_mask, out.output_token_counts = seen, counts
