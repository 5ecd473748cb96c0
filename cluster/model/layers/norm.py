"""RMSNorm with an optional fused residual add. On CPU it runs the kernel library's one-pass
ops (cluster/kernels/cpu_kernels.py) when `load_model` attached them."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cluster.model.layers.weights import default_weight_loader


class RMSNorm(nn.Module):
    kernels = None  # CpuKernels, set by load_model on CPU

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
        the norm in one call so decoder layers carry the residual stream along. With the CPU
        kernels the residual form works in place: x and residual are the layer's own temporaries
        (a projection's output and the residual stream) and hold the results afterwards."""
        if self.kernels is not None:
            if residual is None:
                return self.kernels.rms_norm(x, self.weight, self.eps)
            return self.kernels.fused_add_rms_norm_(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
