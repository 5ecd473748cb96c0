"""Rotary position embedding (neox / HF "rotate_half" layout) with the rope types the
supported models' configs use: default, linear, dynamic, llama3 and yarn.

Transformers 5 configs carry everything in `config.rope_parameters` ({"rope_type",
"rope_theta", ...scaling keys}); older configs use `rope_theta` + `rope_scaling` (whose type
key may be "type"). Both are read. A GGUF's per-frequency divisors (`rope_freqs.weight`, which
llama.cpp's converter writes for "llama3" scaling) come as `config.rope_freq_factors`.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    if params["rope_type"] in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings",
                          getattr(hf_config, "original_max_position_embeddings", None)
                          or hf_config.max_position_embeddings)
    return params


def _inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, p: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    base, orig = p["rope_theta"], p["original_max_position_embeddings"]
    factor = p.get("factor") or max_position / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = p.get("attention_factor")
    if attn is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolate = 1 - ramp  # 1 -> keep the original frequency, 0 -> interpolate
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv, float(attn)


def compute_inv_freq(params: dict[str, Any], rotary_dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2], attention scaling applied to cos/sin)."""
    rope_type = params["rope_type"]
    base = params["rope_theta"]
    if rope_type == "default" or rope_type == "dynamic":
        # Dynamic NTK only changes frequencies past max_position_embeddings, which the
        # engine never reaches (max_model_len is capped at it).
        return _inv_freq(base, rotary_dim), 1.0
    if rope_type == "linear":
        return _inv_freq(base, rotary_dim) / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(_inv_freq(base, rotary_dim), params), 1.0
    if rope_type == "yarn":
        return _yarn(rotary_dim, params, max_position)
    raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to `max_position`, built once in fp32. A model
    looks up (cos, sin) once per step and every layer rotates with them."""

    kernels = None  # CpuKernels, set by load_model on CPU: `apply` then rotates in place

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, inv_freq: torch.Tensor,
                 attention_scaling: float = 1.0) -> None:
        super().__init__()
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq.float())
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_scaling
        self.register_buffer("cos_sin", cos_sin, persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, rotary_dim / 2] in `dtype`."""
        cos, sin = self.cos_sin.index_select(0, positions).to(dtype).chunk(2, dim=-1)
        return cos, sin

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] -> a rotated copy (HF's rotate_half layout)."""
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        x1, x2 = x[..., : self.rotary_dim].chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        if self.rotary_dim < self.head_dim:
            out = torch.cat((out, x[..., self.rotary_dim:]), dim=-1)
        return out

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x rotated: in place by the CPU kernel when attached (x may be a view into the qkv
        projection's output), else `rotate`'s copy. The caller uses the result, not x."""
        if self.kernels is not None and x.stride(-1) == 1:
            return self.kernels.rotary_(x, cos, sin)
        return self.rotate(x, cos, sin)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, Hq, D], k [T, Hk, D] -> rotated copies."""
        cos, sin = self.lookup(positions, q.dtype)
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin)


def get_rope(hf_config: Any, head_dim: int) -> RotaryEmbedding:
    params = rope_parameters(hf_config)
    rotary_dim = int(head_dim * (params.get("partial_rotary_factor")
                                 or getattr(hf_config, "partial_rotary_factor", None) or 1.0))
    max_position = hf_config.max_position_embeddings
    inv_freq, scaling = compute_inv_freq(params, rotary_dim, max_position)
    factors = getattr(hf_config, "rope_freq_factors", None)
    if factors is not None:  # a GGUF's rope_freqs (gguf_file.rope_freq_factors): theta_i / factor_i
        if len(factors) != rotary_dim // 2:
            raise ValueError(f"rope_freq_factors has {len(factors)} values, expected rotary_dim / 2 = {rotary_dim // 2}")
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32)
    return RotaryEmbedding(head_dim, rotary_dim, max_position, inv_freq, scaling)
