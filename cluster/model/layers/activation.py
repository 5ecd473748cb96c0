from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:] for the merged gate_up projection."""

    kernels = None  # CpuKernels, set by load_model on CPU: one pass instead of silu, then mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.dim() == 2:
            return self.kernels.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
