"""Weight-loader helpers shared by the layers."""
from __future__ import annotations

import torch


def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{what}: expected a tensor of shape {tuple(dst.shape)}, got {tuple(src.shape)}")
    dst.copy_(src)


def default_weight_loader(param: torch.nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """A replicated parameter: every rank holds the full tensor."""
    copy_checked(param.data, loaded, "replicated parameter")
