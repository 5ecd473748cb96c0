"""The speculative positions of rank 0's sampling step (`SamplingStep.sample`): their row
layout, the metadata that samples them, and the verification that keeps the accepted prefix.

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

A plain step is the case of zero drafts, passed as `spec=None`: every function here then
returns its input (or the one-position answer) at once, so the plain hot path builds nothing.
"""
from __future__ import annotations

import torch

from cluster.sample.logits_processor import LogitsProcessor, LogitsProcessors, SpecDecodeMetadata
from cluster.sample.metadata import SamplingMetadata
from cluster.sample.ops import skip_samples

# batch row -> (its seeded generator, the generator's state before the sampler drew the row's positions)
SavedGenerators = dict[int, tuple[torch.Generator, torch.Tensor]]


def spec_metadata(rows: list[str], drafts: dict[str, list[int]],
                  device: torch.device) -> SpecDecodeMetadata | None:
    """The row layout for batch rows `rows` (request ids) with these drafts: one logits row
    each, plus one per draft. None when no request has drafts (the plain step)."""
    if not drafts:
        return None
    per_row = [drafts.get(r, []) for r in rows]
    counts = [len(d) + 1 for d in per_row]
    first, total = [], 0
    for c in counts:
        first.append(total)
        total += c
    row_of = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(counts, dtype=torch.long))
    position = torch.cat([torch.arange(c) for c in counts]) if counts else torch.zeros(0, dtype=torch.long)
    return SpecDecodeMetadata([len(d) for d in per_row], per_row, first, row_of.to(device),
                              position.to(device))


def at_positions(t: torch.Tensor, spec: SpecDecodeMetadata | None) -> torch.Tensor:
    """A per-batch-row tensor with one entry per logits row (a row's value at each position)."""
    return t if spec is None else t[spec.row_of.to(t.device)]


def draft_generators(meta: SamplingMetadata, spec: SpecDecodeMetadata | None,
                     sampling: list[bool]) -> SavedGenerators:
    """The seeded generators of sampling rows with drafts, with their state now: the sampler
    draws every position of such a row from its generator, `verify` rewinds it."""
    if spec is None:
        return {}
    return {i: (g, g.get_state()) for i, g in meta.generators.items()
            if spec.num_draft_tokens[i] and sampling[i]}


def verify(tokens: list[int], spec: SpecDecodeMetadata | None, idx: list[int], saved: SavedGenerators,
           vocab: int) -> tuple[list[int], list[int]]:
    """For the sampling batch rows `idx`, given the step's sampled tokens (one per logits row):
    (first logits row, number of tokens emitted) per row; the generators in `saved` are left
    as if only the emitted tokens had been sampled."""
    if spec is None:  # one position each, emitted
        return idx, [1] * len(idx)
    first, kept = [spec.first_row[i] for i in idx], []
    for i, f in zip(idx, first):
        draft, m = spec.draft_token_ids[i], 0
        while m < len(draft) and tokens[f + m] == draft[m]:
            m += 1
        kept.append(m + 1)
        if i in saved:
            gen, state = saved[i]
            gen.set_state(state)
            skip_samples(gen, vocab, m + 1)
    return first, kept


class _AtDraftPositions:
    """A processor seen through the step's row layout: `apply` is its spec-decode apply."""

    def __init__(self, proc: LogitsProcessor, spec: SpecDecodeMetadata) -> None:
        self.proc, self.spec = proc, spec

    def is_argmax_invariant(self) -> bool:
        return self.proc.is_argmax_invariant()

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return self.proc.apply_with_spec_decode(logits, self.spec)


def expand_metadata(meta: SamplingMetadata, spec: SpecDecodeMetadata | None) -> SamplingMetadata:
    """The step's SamplingMetadata with one row per logits row of `spec`."""
    if spec is None:
        return meta

    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else at_positions(t, spec)

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
    _, rows = spec.expand(meta.penalty_rows.to(dev))
    seen, counts = at_positions(meta.seen_token_mask, spec), at_positions(meta.output_token_counts, spec)
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
    out.frequency_penalties = at_positions(meta.frequency_penalties, spec)
    out.presence_penalties = at_positions(meta.presence_penalties, spec)
    out.repetition_penalties = at_positions(meta.repetition_penalties, spec)
    out.seen_token_mask, out.output_token_counts = seen, counts
