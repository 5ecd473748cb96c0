"""The "triton" attention backend: the default on CUDA when flash-attn is not installed.

* Decode: `paged_decode`, a Triton kernel that reads K/V straight from the cache blocks
  through the block table (no gather of the context into a workspace). One program per
  (sequence, KV head, split) streams that head's keys in tiles of BLOCK_N tokens with an
  online softmax; all q heads of the GQA group ride along as rows of one tile, so each K/V
  byte is read once per step. When sequences x KV heads would not fill the GPU, each
  sequence's context is split (flash-decoding) and a second kernel combines the partial
  results. The split count depends only on the batch size, so the launch is the same for
  every replay of a captured CUDA graph.
* Prefill: PyTorch SDPA per chunk (flash / memory-efficient kernels). KV heads are repeated
  to the q heads first, so SDPA never falls back to its O(L^2)-memory math kernel for GQA.

Metadata: the decode path reads `meta.flash.decode_seqlens` ([D] int32) and
`meta.flash.decode_block_table` ([D, max_blocks] int32), built by `build_attention_metadata`
on CUDA or held as static buffers by the CUDA graph runner (cluster/worker/cuda_graphs.py).
The kernels also run under Triton's CPU interpreter (TRITON_INTERPRET=1 before this module
is imported), which is how the tests check their arithmetic without a GPU.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from cluster.model.context import AttentionMetadata, PrefillChunk

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs may lack it; the backend is then never selected
    triton = tl = None

MAX_SPLITS = 16
BLOCK_N = 64  # tokens per tile


if triton is not None:
    @triton.jit
    def _paged_decode_kernel(
            q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, part_acc_ptr, part_ml_ptr, scale,
            stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            stride_table, stride_ot, stride_oh, num_heads,
            GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
            BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, NUM_SPLITS: tl.constexpr,
            PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        ctx = tl.load(lens_ptr + seq)
        per_split = ((ctx + NUM_SPLITS - 1) // NUM_SPLITS + TILE - 1) // TILE * TILE  # whole tiles
        lo = split * per_split
        hi = tl.minimum(lo + per_split, ctx)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, DIM_PAD)
        heads = kv_head * GROUP + g
        row_ok = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
        q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=row_ok, other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
        for start in range(lo, hi, TILE):
            t = start + tl.arange(0, TILE)
            t_ok = t < hi
            block = tl.load(table_ptr + seq * stride_table + t // BLOCK_SIZE, mask=t_ok, other=0).to(tl.int64)
            slot = t % BLOCK_SIZE
            kv_ok = t_ok[:, None] & (d < HEAD_DIM)[None, :]
            k = tl.load(k_ptr + (block * stride_kb + slot * stride_kt + kv_head * stride_kh)[:, None] + d[None, :],
                        mask=kv_ok, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            s = tl.where(t_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + (block * stride_vb + slot * stride_vt + kv_head * stride_vh)[:, None] + d[None, :],
                        mask=kv_ok, other=0.0)
            if UPCAST:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        if NUM_SPLITS == 1:
            out = acc / l_i[:, None]
            tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok)
        else:  # unnormalised partials: acc [T, H, S, D], (m, l) [T, H, S, 2]
            part = (seq * num_heads + heads) * NUM_SPLITS + split
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok)
            tl.store(part_ml_ptr + part * 2, m_i, mask=g < GROUP)
            tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=g < GROUP)

    @triton.jit
    def _combine_splits_kernel(part_acc_ptr, part_ml_ptr, out_ptr, stride_ot, stride_oh, num_heads,
                               HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
                               SPLITS_PAD: tl.constexpr):
        seq, head = tl.program_id(0), tl.program_id(1)
        s = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, DIM_PAD)
        part = (seq * num_heads + head) * NUM_SPLITS + s
        s_ok = s < NUM_SPLITS
        m = tl.load(part_ml_ptr + part * 2, mask=s_ok, other=float("-inf"))
        l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=s_ok, other=0.0)
        m_max = tl.max(m, 0)  # split 0 always holds the first token: finite
        w = tl.exp(m - m_max)  # empty splits (m = -inf) weigh 0
        acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :],
                      mask=s_ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
        out = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
        tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
                 mask=d < HEAD_DIM)


def _interpreting() -> bool:
    # Triton's CPU interpreter multiplies 16-bit floats as raw bits (triton 3.9): under it,
    # tiles are upcast to fp32 before tl.dot. On a GPU the dots run in the cache dtype.
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (n - 1).bit_length())


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def num_splits_for(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Splits per sequence so that about two waves of programs cover the GPU; 1 once
    sequences x KV heads alone do. A function of the batch shape only (graph-safe)."""
    programs = num_seqs * num_kv_heads
    if programs >= num_sms:
        return 1
    return max(1, min(MAX_SPLITS, -(-2 * num_sms // programs)))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, num_splits: int | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence against its paged context.

    q: [B, num_heads, head_dim]; k_cache / v_cache: [num_blocks, block_size, num_kv_heads,
    head_dim] (last dim contiguous); block_table: [B, >= max blocks] int32; context_lens: [B]
    int32, each >= 1 and covered by its table row (the query's own K/V already written).
    Returns out [B, num_heads, head_dim] in q's dtype. Scores and softmax are fp32; fp32
    inputs are multiplied in IEEE fp32 (no TF32), others as Triton's tl.dot does."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("paged_decode needs q and the caches contiguous in head_dim")
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    splits = num_splits or num_splits_for(num_seqs, num_kv_heads, _num_sms(q.device))
    dim_pad = _pow2(head_dim)
    if splits > 1:
        part_acc = torch.empty(num_seqs, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(num_seqs, num_heads, splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    _paged_decode_kernel[(num_seqs, num_kv_heads, splits)](
        q, k_cache, v_cache, block_table, context_lens, out, part_acc, part_ml, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        out.stride(0), out.stride(1), num_heads,
        GROUP=group, GROUP_PAD=_pow2(group), HEAD_DIM=head_dim, DIM_PAD=dim_pad, BLOCK_SIZE=block_size,
        TILE=BLOCK_N, NUM_SPLITS=splits, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=q.dtype != torch.float32 and _interpreting(), num_warps=4)
    if splits > 1:
        _combine_splits_kernel[(num_seqs, num_heads)](
            part_acc, part_ml, out, out.stride(0), out.stride(1), num_heads,
            HEAD_DIM=head_dim, DIM_PAD=dim_pad, NUM_SPLITS=splits, SPLITS_PAD=_pow2(splits, 2))
    return out


def sdpa_prefill(layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: PrefillChunk) -> torch.Tensor:
    """One prefill chunk through SDPA: causal over its own K/V, or, with a cached prefix,
    over the whole context read back from the cache with the chunk's mask."""
    nh, nkv, hd = layer.num_heads, layer.num_kv_heads, layer.head_dim
    if chunk.context_index is None:
        k, v, mask, causal = k.view(-1, nkv, hd), v.view(-1, nkv, hd), None, True
    else:
        k = layer.k_cache.view(-1, nkv, hd).index_select(0, chunk.context_index)
        v = layer.v_cache.view(-1, nkv, hd).index_select(0, chunk.context_index)
        mask, causal = chunk.mask, False
    if nkv != nh:
        k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
    # 4-D [1, heads, L, head_dim]: SDPA's fused CUDA kernels take no other rank.
    q, k, v = (x.view(-1, nh, hd).transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=layer.scale)
    return o.squeeze(0).transpose(0, 1).reshape(-1, nh * hd)


class TritonAttentionBackend:
    name = "triton"

    def forward(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(q)
        d = meta.num_decodes
        if d:
            fm = meta.flash
            if fm is None:
                raise RuntimeError("triton backend needs decode_seqlens / decode_block_table (meta.flash)")
            nh, hd = layer.num_heads, layer.head_dim
            paged_decode(q[:d].view(d, nh, hd), layer.k_cache, layer.v_cache, fm.decode_block_table,
                         fm.decode_seqlens, layer.scale, out=out[:d].view(d, nh, hd))
        for chunk in meta.prefills:
            rows = slice(chunk.start, chunk.start + chunk.query_len)
            out[rows] = sdpa_prefill(layer, q[rows], k[rows], v[rows], chunk)
        return out
