"""Vocabulary-wide primitives for sampling, written for CPU speed; results are exact (but
softmax weights below e^-80 of a row's best count as 0).

torch's CPU argmax / topk over a 49k-wide last dimension, per-token random numbers, exp()
on -inf and masked_fill with a data-dependent mask are the slow parts of sampling. Here the
vocabulary is cut into chunks of ~sqrt(vocab) tokens: each chunk is reduced first (amax /
sum are vectorized), then only the few chunks that matter are searched; masking and softmax
weights are computed branch-free.
"""
from __future__ import annotations

import math

import torch


# torch's CPU exp() is ~10x slower on -inf and on inputs whose result is denormal (< -87),
# and masked logits are -inf. Clamping first keeps exp() on its fast path; the weights are
# then lowered by a floor just above e^-80 and clipped at 0, so anything at least 80 nats
# below the row's best (all -inf among them) gets weight exactly 0.
_LOG_FLOOR = -80.0
_FLOOR = math.exp(_LOG_FLOOR) * 1.001


def softmax_weights_(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: x -> w = exp(x - rowmax) (unnormalized softmax). Returns (w, rowmax [n, 1])."""
    m = x.amax(dim=-1, keepdim=True)
    w = x.sub_(m).clamp_(min=_LOG_FLOOR).exp_().sub_(_FLOOR).clamp_(min=0.0)
    return w, m


def mask_below_(x: torch.Tensor, threshold: torch.Tensor,
                workspace: torch.Tensor | None = None) -> torch.Tensor:
    """In place: x[i, j] = -inf where x[i, j] < threshold[i] (threshold [n, 1]); other values
    unchanged. Branch-free: masked_fill with a data-dependent mask runs ~3x slower on CPU.

    x >= t  <=>  x - t' > 0 with t' = nextafter(t, -inf) (exact for IEEE floats), so
    x + min(threshold(x - t', 0, -inf), 0) adds 0 to kept values and -inf to the rest.
    t' stays finite: -inf - -inf would be NaN."""
    t = torch.nextafter(threshold.to(x.dtype), torch.tensor(-math.inf, dtype=x.dtype, device=x.device))
    t.clamp_(min=torch.finfo(x.dtype).min)
    if workspace is None or workspace.shape != x.shape:
        workspace = torch.empty_like(x)
    diff = torch.sub(x, t, out=workspace)
    torch.nn.functional.threshold_(diff, 0.0, -math.inf)
    return x.add_(diff.clamp_(max=0.0))


def chunk_size(vocab: int) -> int:
    return 1 << max(0, round(math.log2(math.sqrt(vocab))))


def chunk_reduce(x: torch.Tensor, op: str) -> torch.Tensor:
    """[n, vocab] -> [n, num_chunks] with op in {"amax", "sum"}; a last partial chunk counts."""
    n, vocab = x.shape
    chunk = chunk_size(vocab)
    full = vocab // chunk
    x = x if x.stride(1) == 1 else x.contiguous()
    view = x.as_strided((n, full, chunk), (x.stride(0), chunk, 1))
    parts = [getattr(view, op)(dim=-1)]
    if full * chunk < vocab:
        parts.append(getattr(x[:, full * chunk:], op)(dim=-1, keepdim=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def gather_chunks(x: torch.Tensor, chunk_ids: torch.Tensor, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The values and column ids of chunks [n, m] -> ([n, m*chunk], [n, m*chunk]); columns past
    the vocabulary (in a last partial chunk) hold `fill`."""
    vocab = x.shape[1]
    chunk = chunk_size(vocab)
    cols = (chunk_ids.unsqueeze(-1) * chunk + torch.arange(chunk, device=x.device)).flatten(1)
    vals = x.gather(1, cols.clamp(max=vocab - 1))
    if vocab % chunk:  # decided on the host: asking the tensor would wait for the GPU mid-step
        vals.masked_fill_(cols >= vocab, fill)
    return vals, cols


def fast_argmax(x: torch.Tensor) -> torch.Tensor:
    """Row argmax (first occurrence of the maximum, like torch.argmax)."""
    best_chunk = chunk_reduce(x, "amax").argmax(dim=-1, keepdim=True)
    vals, cols = gather_chunks(x, best_chunk, -math.inf)
    return cols.gather(1, vals.argmax(dim=-1, keepdim=True)).squeeze(1)


def fast_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row top-k (values descending, indices). The k largest values lie in the k chunks with
    the largest maxima, so only those are searched."""
    maxima = chunk_reduce(x, "amax")
    if k > maxima.shape[1] or k * chunk_size(x.shape[1]) >= x.shape[1]:
        return x.topk(k, dim=-1)
    vals, cols = gather_chunks(x, maxima.topk(k, dim=-1).indices, -math.inf)
    top_vals, pos = vals.topk(k, dim=-1)
    idx = cols.gather(1, pos)
    if bool((idx >= x.shape[1]).any()):  # fewer than k finite values: padding was picked
        return x.topk(k, dim=-1)
    return top_vals, idx


def exponential_race(logits: torch.Tensor, generators: dict[int, torch.Generator],
                     sampling_rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one token per row from softmax(logits), in place.

    The race: argmax_i w_i / E_i with E_i ~ Exp(1) picks i with probability w_i / sum(w).
    Run in two levels: a race between chunks (weight = the chunk's mass) picks a chunk, a
    race inside it picks the token; exact, because a chunk's fastest runner finishes at
    Exp(chunk mass) whichever runner it is. So a step needs ~2*sqrt(vocab) draws per row.
    Seeded rows draw from their own generator, except rows whose sample will be discarded.

    Returns (tokens, row max m, row total weight); `logits` is left holding w = exp(l - m),
    so log p(token) = log(w[token]) - log(total).
    """
    n = logits.shape[0]
    w, m = softmax_weights_(logits)
    mass = chunk_reduce(w, "sum")
    noise = _exponentials(n, race_width(w.shape[1]), generators, sampling_rows, w.device)
    picked = mass.div(noise[:, : mass.shape[1]]).argmax(dim=-1, keepdim=True)
    vals, cols = gather_chunks(w, picked, 0.0)
    inner = vals.div_(noise[:, mass.shape[1]:]).argmax(dim=-1, keepdim=True)
    return cols.gather(1, inner).squeeze(1), m.squeeze(1), mass.sum(dim=-1)


def race_width(vocab: int) -> int:
    """Exponentials one sample draws: one per chunk, then one per token of a chunk."""
    chunk = chunk_size(vocab)
    return -(-vocab // chunk) + chunk


def skip_samples(generator: torch.Generator, vocab: int, num_samples: int) -> None:
    """Advance a seeded generator exactly as `num_samples` samples of one row would."""
    for _ in range(num_samples):
        torch.empty(race_width(vocab), device=generator.device).exponential_(generator=generator)


def _exponentials(n: int, width: int, generators: dict[int, torch.Generator],
                  sampling_rows: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    q = torch.empty(n, width, device=device).exponential_()
    keep = None if sampling_rows is None or not generators else sampling_rows.tolist()
    for row, gen in generators.items():
        if keep is None or keep[row]:  # a discarded sample must not advance the generator
            q[row].exponential_(generator=gen)
    # Exp(1) can round to 0; a zero-weight token must never win by 0 / 0.
    return q.clamp_(min=torch.finfo(q.dtype).tiny)
