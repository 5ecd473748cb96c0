"""Rank 0's sampler, in vLLM V1's order.

(grammar bitmask, applied by the caller) -> allowed_token_ids -> bad words ->
non-argmax-invariant processors (logit bias, min tokens, thinking budget, custom ones) ->
presence / frequency / repetition penalties -> greedy argmax (all greedy: done) ->
temperature -> argmax-invariant processors -> top-k / top-p -> random sampling.

Logprobs are "processed" logprobs: log_softmax of the logits exactly as sampled from, i.e.
after processors, penalties, temperature (greedy rows: 1) and top-k/top-p
(filtered tokens are -inf). Column 0 is the sampled token; ranks count tokens whose logprob
is >= the sampled one's (1 = best), as vLLM does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cluster.messages import Logprobs
from cluster.sample.metadata import SamplingMetadata
from cluster.sample.ops import exponential_race, fast_argmax, fast_topk, mask_below_, softmax_weights_

_SAMPLING_EPS = 1e-5


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [n] int64
    logprob_token_ids: torch.Tensor | None = None  # [n, k+1] int64; column 0 = sampled token
    logprobs: torch.Tensor | None = None  # [n, k+1] float32
    sampled_ranks: torch.Tensor | None = None  # [n] int64

    def select_logprobs(self, rows: list[int], num_logprobs: list[int | None]) -> Logprobs | None:
        """The wire form for `rows`, each cut to its request's `logprobs` (+ the sampled
        token; None: no columns)."""
        if self.logprobs is None:
            return None
        ids, lps, ranks = self.logprob_token_ids.tolist(), self.logprobs.tolist(), self.sampled_ranks.tolist()
        keep = [0 if k is None else k + 1 for k in num_logprobs]
        return Logprobs([ids[i][:k] for i, k in zip(rows, keep)], [lps[i][:k] for i, k in zip(rows, keep)],
                        [ranks[i] for i in rows])


class Sampler:
    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata,
                 sampling_rows: torch.Tensor | None = None) -> SamplerOutput:
        """logits: [num_reqs, vocab]; float32 input is used (and overwritten) in place.
        sampling_rows: optional bool [num_reqs]; False rows (a non-final prefill chunk) get a
        token that will be discarded, so their seeded generators are not advanced."""
        meta = metadata
        logits = logits.float()
        if logits.shape[0] == 0:
            return SamplerOutput(torch.empty(0, dtype=torch.long, device=logits.device))
        logits = self.apply_constraints(logits, meta)
        greedy = None if meta.all_random else fast_argmax(logits)
        k = meta.max_num_logprobs
        if meta.all_greedy:
            return SamplerOutput(greedy) if k is None else logprobs_from_logits(logits, greedy, k)
        logits = apply_temperature(logits, meta.temperature, meta.all_random)
        for proc in meta.logitsprocs.argmax_invariant:
            logits = proc.apply(logits)
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        top = fast_topk(logits, k) if k else None  # before the race overwrites the logits
        sampled, row_max, total = exponential_race(logits, meta.generators, sampling_rows)
        if greedy is not None:
            sampled = torch.where(meta.temperature < _SAMPLING_EPS, greedy, sampled)
        if k is None:
            return SamplerOutput(sampled)
        # `logits` now holds w = exp(l - row_max): logprob = log(w) - log(total).
        w_sampled = logits.gather(1, sampled.unsqueeze(1))
        log_total = total.log().unsqueeze(1)
        ranks = (logits >= w_sampled).sum(dim=-1)
        lps = [w_sampled.log() - log_total]
        ids = [sampled.unsqueeze(1)]
        if top is not None:
            lps.append(top[0] - row_max.unsqueeze(1) - log_total)
            ids.append(top[1])
        return SamplerOutput(sampled, torch.cat(ids, dim=1), torch.cat(lps, dim=1), ranks)

    @staticmethod
    def apply_constraints(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Everything before the greedy argmax."""
        if meta.allowed_token_ids_mask is not None:
            logits.masked_fill_(meta.allowed_token_ids_mask, -math.inf)
        if meta.bad_words_token_ids:
            apply_bad_words(logits, meta.bad_words_token_ids, meta.output_token_ids)
        for proc in meta.logitsprocs.non_argmax_invariant:
            logits = proc.apply(logits)
        if meta.penalty_rows is not None:
            apply_penalties(logits, meta)
        return logits


def apply_bad_words(logits: torch.Tensor, bad_words: dict[int, list[list[int]]],
                    outputs: list[list[int]]) -> None:
    """Ban a word's last token where the output already ends with the word's other tokens."""
    rows, cols = [], []
    for row, words in bad_words.items():
        out = outputs[row]
        for word in words:
            prefix = len(word) - 1
            if prefix > len(out):
                continue
            if prefix == 0 or out[len(out) - prefix:] == list(word[:-1]):
                rows.append(row)
                cols.append(word[-1])
    if rows:
        logits[rows, cols] = -math.inf


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    """vLLM semantics: repetition over prompt + output (divide positive logits, multiply
    negative ones), frequency and presence over the output only.

    Sparse: only tokens a penalized row has seen can change, a few hundred of its vocab,
    so they are gathered, penalized and written back (dense where/masked_fill over the whole
    vocabulary is slow on CPU)."""
    rows, n = meta.penalty_rows, logits.shape[0]
    whole = rows.numel() == n  # rows are sorted: all rows penalized -> plain slices
    seen = meta.seen_token_mask[:n] if whole else meta.seen_token_mask[rows]
    sub_row, tok = seen.nonzero(as_tuple=True)
    row = sub_row if whole else rows[sub_row]
    x = logits[row, tok]
    counts = meta.output_token_counts[row, tok].to(x.dtype)
    rep = meta.repetition_penalties[row]
    x = torch.where(x > 0, x / rep, x * rep)
    x -= meta.frequency_penalties[row] * counts + meta.presence_penalties[row] * (counts > 0)
    logits[row, tok] = x


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor, all_random: bool) -> torch.Tensor:
    if not all_random:  # greedy rows keep their logits (their token is the argmax anyway)
        temperature = torch.where(temperature < _SAMPLING_EPS, 1.0, temperature)
    return logits.div_(temperature.unsqueeze(1))


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Filter (to -inf) outside each row's top-k, then outside the top-p nucleus of what is
    left (vLLM's rule: drop a token when the mass strictly above it is already >= p; the top
    token always stays). Only rows that use either are touched."""
    if k is None and p is None:
        return logits
    vocab = logits.shape[1]
    used = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    if k is not None:
        used |= k < vocab
    if p is not None:
        used |= p < 1.0
    rows = used.nonzero().squeeze(1)
    if rows.numel() == 0:
        return logits
    whole = rows.numel() == logits.shape[0]
    sub = logits if whole else logits[rows]
    if k is not None:
        sub = _top_k(sub, k if whole else k[rows])
    if p is not None:
        sub = _top_p(sub, p if whole else p[rows])
    if not whole:
        logits[rows] = sub
    return sub if whole else logits


def _top_k(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[1]
    k = k.clamp(1, vocab)
    kth = fast_topk(logits, int(k.max()))[0].gather(1, (k - 1).unsqueeze(1))
    kth.masked_fill_((k >= vocab).unsqueeze(1), -math.inf)
    return mask_below_(logits, kth)


def _top_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    probs, _ = softmax_weights_(logits.clone())
    probs /= probs.sum(dim=-1, keepdim=True)
    threshold = nucleus_threshold(probs, p.clamp(max=1.0))
    threshold.masked_fill_(p >= 1.0, 0.0)  # rows here only for their top-k keep everything
    return logits.masked_fill_(probs < threshold.unsqueeze(1), -math.inf)


def nucleus_threshold(probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest probability still inside the top-p nucleus.

    Sorting a 49k vocabulary per row is the slow part of top-p on CPU. Tokens above a
    cutoff eps form a top set; when their mass already reaches p the nucleus lies inside it,
    so only those few candidates are sorted. Rows too flat for that fall back to a full sort.
    """
    n = probs.shape[0]
    out = torch.empty(n, dtype=probs.dtype, device=probs.device)
    todo = torch.arange(n, device=probs.device)
    for eps in (1e-4, 1e-6):
        whole = todo.numel() == n  # no row gathers while every row is still open
        sub = probs if whole else probs[todo]
        threshold, ok = _threshold_from_candidates(sub, sub > eps, p if whole else p[todo])
        out[todo[ok]] = threshold[ok]
        todo = todo[~ok]
        if todo.numel() == 0:
            return out
    ranked = probs[todo].sort(dim=-1, descending=True).values
    above = ranked.double().cumsum(dim=-1) - ranked  # mass strictly above each token
    keep = (above < p[todo].unsqueeze(1)).sum(dim=-1).clamp(min=1)
    out[todo] = ranked.gather(1, (keep - 1).unsqueeze(1)).squeeze(1)
    return out


def _threshold_from_candidates(probs: torch.Tensor, cand: torch.Tensor,
                               p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(threshold per row, whether the row's candidates reach mass p)."""
    n = probs.shape[0]
    rows, cols = cand.nonzero(as_tuple=True)
    if rows.numel() == 0:
        return probs.new_full((n,), math.inf), torch.zeros(n, dtype=torch.bool, device=probs.device)
    vals = probs[rows, cols]
    order = vals.argsort(descending=True, stable=True)
    order = order[rows[order].argsort(stable=True)]  # by row, each row by probability desc
    v, r = vals[order].double(), rows[order]
    cum = v.cumsum(0)
    counts = torch.bincount(r, minlength=n)
    starts = counts.cumsum(0) - counts
    above = cum - v - (cum - v)[starts.clamp(max=len(v) - 1)][r]  # mass above, within the row
    keep = above < p.double()[r]
    threshold = torch.full((n,), math.inf, dtype=torch.float64, device=probs.device)
    threshold.scatter_reduce_(0, r[keep], v[keep], reduce="amin")
    mass = torch.zeros(n, dtype=torch.float64, device=probs.device).index_add_(0, r, v)
    return threshold.to(probs.dtype), mass >= p.double()


def logprobs_from_logits(logits: torch.Tensor, sampled: torch.Tensor, k: int) -> SamplerOutput:
    w, row_max = softmax_weights_(logits.clone())
    lse = row_max + w.sum(dim=-1, keepdim=True).log()
    picked = logits.gather(1, sampled.unsqueeze(1))
    ranks = (logits >= picked).sum(dim=-1)
    lps, ids = [picked - lse], [sampled.unsqueeze(1)]
    if k:
        top_vals, top_ids = fast_topk(logits, k)
        lps.append(top_vals - lse)
        ids.append(top_ids)
    return SamplerOutput(sampled, torch.cat(ids, dim=1), torch.cat(lps, dim=1), ranks)
