"""Paged attention: the `Attention` layer and its backends.

Each step the layer writes this step's K/V into the paged cache ([num_blocks, block_size,
kv_heads, head_dim] per layer), then attends every query over its sequence's whole context
through the block table, causally. Backends:

* "torch" (CPU and CUDA): decodes are batched per length bucket (see context.py). Each
  bucket's K/V rows are gathered into a reused workspace (the gather, not the matmul, is
  the cost on CPU) and attended with two bmms and an fp32 masked softmax; GQA never
  repeats KV (see _decode_blockdiag / _decode_per_head). Prefill chunks go one sequence at
  a time through SDPA, causal with the cached prefix offset.
* "cpu_paged" (CPU, the default there when it builds): the C++ kernel in cluster/kernels reads
  K/V straight from the cache blocks through the block table (no gather), threaded over
  (sequence, kv head) pairs, bf16 loads and fp32 math. It takes the decodes and the prefill
  chunks of up to context.KERNEL_PREFILL_MAX_QUERY (64) queries (cached prefix or not). Longer
  chunks in bf16, on a CPU with AVX512-BF16, go to the kernel library's prefill_attention
  (bf16 pair dot products, flash style: 2.1-3.0x SDPA at 128-1024 tokens, SmolLM2's heads);
  others take the torch backend's SDPA path. Built on first use; without a compiler "auto"
  falls back to "torch" (cluster/kernels/cpu_kernels.py logs why, once).
* "flash_attn" (CUDA, when flash_attn imports): `flash_attn_with_kvcache` for decodes and
  `flash_attn_varlen_func` with a block table for prefill chunks. Upstream flash-attn 2.x
  needs the paged block size to be a multiple of 256.
* "triton" (CUDA, the default there without flash-attn): attention_triton.py, a paged decode
  kernel reading K/V from the blocks and SDPA prefill.

"auto" picks flash_attn on CUDA when it imports and block_size % 256 == 0, else triton on
CUDA; on CPU cpu_paged when the kernel builds, else torch.

The cache may be of another dtype than the model's (kv_cache_dtype: bf16 under an fp32 model,
as llama.cpp keeps a 16-bit cache under fp32 activations); attention then runs in the cache's
dtype on every backend, q, k and v rounded to it on the way in.
"""
from __future__ import annotations

import importlib.util
import sys

import torch
import torch.nn.functional as F
from torch import nn

from cluster.kernels import cpu_kernels
from cluster.model.context import AttentionMetadata, DecodeBucket, get_forward_context

BACKENDS = ("auto", "torch", "cpu_paged", "flash_attn", "triton")
# Up to this many local KV heads the torch decode path uses the block-diagonal matmul.
BLOCKDIAG_MAX_KV_HEADS = 4
FLASH_BLOCK_MULTIPLE = 256


def flash_attn_available() -> bool:
    try:
        return importlib.util.find_spec("flash_attn") is not None
    except ValueError:  # a module object without a spec (stubbed in sys.modules)
        return "flash_attn" in sys.modules


def select_backend(name: str, device: torch.device | str, block_size: int,
                   dtype: torch.dtype | None = None) -> str:
    """Resolve `EngineConfig.attention_backend` for a device, cache block size and cache
    dtype. "auto": flash_attn on CUDA where it fits, else triton; the CPU kernel on CPU where
    it builds (the first call may compile it); else torch."""
    device = torch.device(device)
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    flash_ok = device.type == "cuda" and flash_attn_available()
    triton_ok = device.type == "cuda" and _triton_available()
    cpu_ok = device.type == "cpu" and (dtype is None or dtype in cpu_kernels.DTYPES)
    if name == "auto":
        if flash_ok and block_size % FLASH_BLOCK_MULTIPLE == 0:
            return "flash_attn"
        if triton_ok:
            return "triton"
        return "cpu_paged" if cpu_ok and cpu_kernels.load() is not None else "torch"
    if name == "triton" and not triton_ok:
        raise ValueError(f"attention_backend 'triton' needs a CUDA device and the triton package "
                         f"(device={device.type!r}, triton importable={_triton_available()})")
    if name == "cpu_paged":
        if not cpu_ok:
            raise ValueError(f"attention_backend 'cpu_paged' needs device 'cpu' and a float32 or bfloat16 "
                             f"cache, got device={device.type!r}, dtype={dtype}")
        if cpu_kernels.load() is None:
            raise ValueError("attention_backend 'cpu_paged': the CPU attention kernel could not be built "
                             "here (see the warning logged above); use 'torch' or 'auto'")
    if name == "flash_attn":
        if not flash_ok:
            raise ValueError(f"attention_backend 'flash_attn' needs a CUDA device and the flash_attn "
                             f"package (device={device.type!r}, flash_attn importable={flash_attn_available()})")
        if block_size % FLASH_BLOCK_MULTIPLE:
            raise ValueError(f"attention_backend 'flash_attn' needs block_size to be a multiple of "
                             f"{FLASH_BLOCK_MULTIPLE} (flash-attn's paged KV), got {block_size}")
    return name


class _Workspace:
    """Gather buffers reused by every layer and step. Fresh multi-MB tensors each call would
    be mmap'd and page-faulted anew by the allocator, costing more than the copy itself."""

    def __init__(self) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}

    def get(self, key: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        slot = (key, dtype, device)
        buf = self.buffers.get(slot)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, int(buf.numel() * 1.5) if buf is not None else 0),
                              dtype=dtype, device=device)
            self.buffers[slot] = buf
        return buf[:numel]


class TorchAttentionBackend:
    name = "torch"

    def __init__(self) -> None:
        self.workspace = _Workspace()  # one per model: layers run one after another

    def forward(self, layer: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(q)
        if meta.num_decodes:
            self._decode(layer, q[: meta.num_decodes], out[: meta.num_decodes], meta)
        for chunk in meta.prefills:
            rows = slice(chunk.start, chunk.start + chunk.query_len)
            out[rows] = self._prefill(layer, q[rows], k[rows], v[rows], chunk)
        return out

    def _decode(self, layer: "Attention", q: torch.Tensor, out: torch.Tensor,
                meta: AttentionMetadata) -> None:
        blockdiag = layer.num_kv_heads <= BLOCKDIAG_MAX_KV_HEADS
        for b in meta.decode_buckets:
            qb = q if b.rows is None else q.index_select(0, b.rows)
            res = self._decode_blockdiag(layer, qb, b) if blockdiag else self._decode_per_head(layer, qb, b)
            if b.rows is None:
                out.copy_(res)
            else:
                out.index_copy_(0, b.rows, res)

    def _decode_blockdiag(self, layer: "Attention", q: torch.Tensor, b: DecodeBucket) -> torch.Tensor:
        """Gather whole cache rows (all KV heads of a token, contiguous) and multiply by a
        block-diagonal q: row (kv head h, group member j) holds q only in h's column block.
        That wastes (kv_heads - 1) / kv_heads of the matmul FLOPs but gathers 2x faster than
        per head, which wins for few KV heads (a decode matmul is tiny next to the gather)."""
        nkv, hd, group = layer.num_kv_heads, layer.head_dim, layer.num_heads // layer.num_kv_heads
        n, length, width = b.num_seqs, b.max_len, layer.num_kv_heads * layer.head_dim
        keys = self.workspace.get("k", n * length * width, q.dtype, q.device).view(n * length, width)
        values = self.workspace.get("v", n * length * width, q.dtype, q.device).view(n * length, width)
        torch.index_select(layer.k_cache.view(-1, width), 0, b.token_index, out=keys)
        torch.index_select(layer.v_cache.view(-1, width), 0, b.token_index, out=values)
        q_bd = q.new_zeros(n, nkv, group, nkv, hd)
        torch.diagonal(q_bd, dim1=1, dim2=3).copy_(q.view(n, nkv, group, hd).permute(0, 2, 3, 1))
        scores = torch.bmm(q_bd.view(n, nkv * group, width), keys.view(n, length, width).transpose(1, 2))
        probs = torch.softmax(scores.float().mul_(layer.scale).add_(b.mask), dim=-1).to(q.dtype)
        res = torch.bmm(probs, values.view(n, length, width)).view(n, nkv, group, nkv, hd)
        return torch.diagonal(res, dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(n, nkv * group * hd)

    def _decode_per_head(self, layer: "Attention", q: torch.Tensor, b: DecodeBucket) -> torch.Tensor:
        """Gather each KV head's rows contiguous ([kv_heads, n * L, hd]) and run one bmm per
        (head, row) with that head's q group stacked as rows: no repeated KV, no waste."""
        nkv, hd, group = layer.num_kv_heads, layer.head_dim, layer.num_heads // layer.num_kv_heads
        n, length = b.num_seqs, b.max_len
        k_rows = layer.k_cache.view(-1, nkv, hd)
        v_rows = layer.v_cache.view(-1, nkv, hd)
        numel = nkv * n * length * hd
        keys = self.workspace.get("k", numel, q.dtype, q.device).view(nkv, n * length, hd)
        values = self.workspace.get("v", numel, q.dtype, q.device).view(nkv, n * length, hd)
        for h in range(nkv):
            torch.index_select(k_rows[:, h], 0, b.token_index, out=keys[h])
            torch.index_select(v_rows[:, h], 0, b.token_index, out=values[h])
        qh = q.view(n, nkv, group, hd).transpose(0, 1).reshape(nkv * n, group, hd)
        scores = torch.bmm(qh, keys.view(nkv * n, length, hd).transpose(1, 2))
        scores = scores.view(nkv, n, group, length).float().mul_(layer.scale).add_(b.mask)
        probs = torch.softmax(scores, dim=-1).to(q.dtype).view(nkv * n, group, length)
        res = torch.bmm(probs, values.view(nkv * n, length, hd))
        return res.view(nkv, n, group * hd).transpose(0, 1).reshape(n, nkv * group * hd)

    def _prefill(self, layer: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 chunk) -> torch.Tensor:
        nh, nkv, hd = layer.num_heads, layer.num_kv_heads, layer.head_dim
        q = q.view(-1, nh, hd).transpose(0, 1).unsqueeze(0)
        if chunk.context_index is None:
            k = k.view(-1, nkv, hd)
            v = v.view(-1, nkv, hd)
            mask, causal = None, True
        else:  # cached prefix: the whole context comes from the cache (this chunk included)
            k = layer.k_cache.view(-1, nkv, hd).index_select(0, chunk.context_index)
            v = layer.v_cache.view(-1, nkv, hd).index_select(0, chunk.context_index)
            mask, causal = chunk.mask, False
        k = k.transpose(0, 1).unsqueeze(0)
        v = v.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                           scale=layer.scale, enable_gqa=nkv != nh)
        return o.squeeze(0).transpose(0, 1).reshape(-1, nh * hd)


class FlashAttentionBackend:
    """flash-attn 2.8's paged API; the cache is already written when it is called."""

    name = "flash_attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self.varlen = flash_attn_varlen_func
        self.with_kvcache = flash_attn_with_kvcache

    def forward(self, layer: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        fm = meta.flash
        if fm is None:
            raise RuntimeError("flash_attn backend needs metadata built for a CUDA device")
        nh, hd, d = layer.num_heads, layer.head_dim, meta.num_decodes
        q = q.view(-1, nh, hd)
        out = torch.empty_like(q)
        if d:
            out[:d] = self.with_kvcache(
                q[:d].unsqueeze(1), layer.k_cache, layer.v_cache, cache_seqlens=fm.decode_seqlens,
                block_table=fm.decode_block_table, softmax_scale=layer.scale, causal=True).squeeze(1)
        if meta.prefills:
            out[d:] = self.varlen(
                q[d:], layer.k_cache, layer.v_cache, cu_seqlens_q=fm.cu_seqlens_q,
                cu_seqlens_k=fm.cu_seqlens_k, max_seqlen_q=fm.max_seqlen_q,
                max_seqlen_k=fm.max_seqlen_k, softmax_scale=layer.scale, causal=True,
                block_table=fm.prefill_block_table)
        return out.view(-1, nh * hd)


class CpuPagedAttentionBackend(TorchAttentionBackend):
    """The CPU kernel for what `meta.kernel` lists; the torch backend's SDPA for `meta.prefills`."""

    name = "cpu_paged"

    def __init__(self) -> None:
        super().__init__()
        self.kernel = cpu_kernels.load()
        if self.kernel is None:
            raise RuntimeError("the CPU attention kernel is not available (select_backend checks this)")

    def forward(self, layer: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        km = meta.kernel
        if km is None:
            raise RuntimeError("the cpu_paged backend needs metadata built with backend='cpu_paged'")
        q = q if q.stride(-1) == 1 else q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if km.num_seqs:
            self.kernel.paged_attention(out, q, layer.k_cache, layer.v_cache, km.block_table, km.seq_lens,
                                        km.query_start, km.query_len, layer.scale)
        for chunk in meta.prefills:
            rows = slice(chunk.start, chunk.start + chunk.query_len)
            out[rows] = self._prefill(layer, q[rows], k[rows], v[rows], chunk)
        return out

    def _prefill(self, layer: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 chunk) -> torch.Tensor:
        nh, nkv, hd = layer.num_heads, layer.num_kv_heads, layer.head_dim
        if q.dtype != torch.bfloat16 or hd % 16 or not self.kernel.has_prefill_attention:
            return super()._prefill(layer, q, k, v, chunk)
        if chunk.context_index is not None:  # cached prefix: the whole context from the cache
            k = layer.k_cache.view(-1, nkv, hd).index_select(0, chunk.context_index)
            v = layer.v_cache.view(-1, nkv, hd).index_select(0, chunk.context_index)
        return self.kernel.prefill_attention(q.view(-1, nh, hd), k.view(-1, nkv, hd), v.view(-1, nkv, hd),
                                             layer.scale)


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def make_backend(name: str):
    if name == "triton":
        from cluster.model.layers.attention_triton import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "flash_attn":
        return FlashAttentionBackend()
    return CpuPagedAttentionBackend() if name == "cpu_paged" else TorchAttentionBackend()


class Attention(nn.Module):
    """Attention over the paged KV cache for this rank's heads. q: [T, num_heads * head_dim],
    k/v: [T, num_kv_heads * head_dim] (already rotated) -> [T, num_heads * head_dim]."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.backend_name = "auto"  # requested; resolved by bind_kv_cache
        self.backend = TorchAttentionBackend()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention runs in the cache's dtype: under a cache of another dtype than the model's
        (kv_cache_dtype), q, k and v are rounded to it on the way in and the output widened back."""
        meta = self._metadata(q.shape[0])
        model_dtype, cache_dtype = q.dtype, self.k_cache.dtype
        if cache_dtype != model_dtype:
            q, k, v = q.to(cache_dtype), k.to(cache_dtype), v.to(cache_dtype)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        self.k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, k)
        self.v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, v)
        return self.backend.forward(self, q, k, v, meta).to(model_dtype)

    def forward_qkv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
        """The step's attention straight from the fused projection's output qkv ([T, (heads + 2
        kv_heads) * head_dim], q and k not yet rotated; cos / sin [T, rotary_dim / 2] in its
        dtype) where the backend does it in one call: the CPU kernel, when it takes every query
        of the step (no SDPA prefill chunk). It rotates q and k in qkv in place, writes the cache
        and attends, with the same result as rotating, then `forward` (under a bf16 cache, an fp32
        qkv is rotated in fp32 and rounded as `forward` rounds it). None (nothing done) otherwise.

        At batch 1 the separate route costs ~12 torch calls a layer (views, two index_copy_, the
        rotation, the output's allocation), about 1 ms of a 13 ms SmolLM2 decode step on 2 cores."""
        meta = self._metadata(qkv.shape[0])
        if not self.kernel_takes(meta) or qkv.stride(-1) != 1 or qkv.dtype not in cpu_kernels.DTYPES:
            return None
        km = meta.kernel
        return self.backend.kernel.qkv_attention(qkv, cos, sin, self.k_cache, self.v_cache, meta.slot_mapping,
                                                 km.block_table, km.seq_lens, km.query_start, km.query_len,
                                                 self.scale)

    def kernel_takes(self, meta: AttentionMetadata) -> bool:
        """Whether the CPU kernel takes every query of the step `meta` describes (no SDPA chunk)."""
        return isinstance(self.backend, CpuPagedAttentionBackend) and meta.kernel is not None and not meta.prefills

    def _metadata(self, tokens: int) -> AttentionMetadata:
        meta = get_forward_context()
        if self.k_cache.numel() == 0:
            raise RuntimeError("attention has no KV cache: call bind_kv_cache(model, ...) first")
        if tokens != meta.num_tokens:
            raise ValueError(f"the batch has {tokens} tokens but the attention metadata describes "
                             f"{meta.num_tokens}")
        return meta
