"""Embeddings: what a pooled vector becomes for its caller (vLLM's embed task).

The engine pools each prompt's last hidden states into one vector (cluster/worker/pooling.py:
the last token's, or the mean over every prompt token, as the model's `pooler_config` says);
`embedding` then cuts it to the `dimensions` a request asks for (Matryoshka models: the leading
components) and normalizes it to unit length when the pooler normalizes, cut first as vLLM does,
so a shortened vector is still a unit vector.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class PoolingParams:
    """Per-request options of an embedding (vLLM's PoolingParams): `dimensions` keeps the first
    so many components (None: all); `normalize` overrides the model's pooler_config."""

    dimensions: int | None = None
    normalize: bool | None = None


def check_pooling_params(params: PoolingParams, hidden_size: int) -> None:
    """ValueError naming the field for options this model cannot honour."""
    d = params.dimensions
    if d is not None and (isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= hidden_size):
        raise ValueError(f"dimensions must be an integer in [1, {hidden_size}] for this model, got {d!r}")


def embedding(pooled: list[float], params: PoolingParams, pooler: dict) -> list[float]:
    """The vector a caller gets from a pooled one."""
    vec = pooled[: params.dimensions] if params.dimensions else list(pooled)
    normalize = pooler["normalize"] if params.normalize is None else params.normalize
    if normalize:
        norm = math.sqrt(sum(v * v for v in vec))
        vec = [v / norm for v in vec] if norm > 0 else vec
    return vec
