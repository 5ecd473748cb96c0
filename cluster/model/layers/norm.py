"""RMSNorm with an optional fused residual add."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cluster.model.layers.weights import default_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op; it accumulates in fp32 for bf16/fp16 inputs as HF's explicit upcast does.
        return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """`norm(x)`, or with a residual: `(norm(x + residual), x + residual)` — the add and
        the norm in one call so decoder layers carry the residual stream along."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
