"""Helpers for tests of GGUF k-quants: random valid blocks, simple quantizers into Q4_K / Q5_K /
Q6_K (gguf-py has dequantizers for them, no quantizers), and a llama GGUF written from an HF model
in llama.cpp's layout (names, q / k row permutation) with chosen types per tensor and SmolLM2's
tokenizer. The quantizers need not be llama.cpp's (its search for the best scales): any valid
blocks are a file to serve, and tests compare against gguf-py's dequantization of the same bytes."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

QK = 256
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def random_blocks(gguf_type: str, rows: int, inputs: int, rng: np.random.Generator, scale: float = 0.01) -> np.ndarray:
    """uint8 [rows, inputs / 256 * block bytes]: random bytes (every 6-bit scale and min, every
    quant) with finite fp16 d (and dmin) in [0, scale)."""
    blocks = inputs // QK
    raw = rng.integers(0, 256, (rows, blocks, BLOCK_BYTES[gguf_type]), dtype=np.uint8)

    def fp16() -> np.ndarray:
        return (rng.random((rows, blocks)) * scale).astype(np.float16).view(np.uint8).reshape(rows, blocks, 2)

    if gguf_type == "Q6_K":
        raw[..., 208:210] = fp16()
    else:
        raw[..., 0:2] = fp16()
        raw[..., 2:4] = fp16()
    return raw.reshape(rows, -1)


def _fp16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape, 2)


def _scales_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 6-bit scales and mins per block [..., 8] -> llama.cpp's 12 packed bytes (get_scale_min_k4's inverse)."""
    out = np.zeros((*sc.shape[:-1], 12), dtype=np.uint8)
    out[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    out[..., 4:8] = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:] & 0xF) | ((mn[..., 4:] & 0xF) << 4)
    return out


def _affine_runs(w: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """w [N, blocks, 8, 32] -> per block fp16 d, dmin and 6-bit sc, m per run, and q in [0, levels]
    with w ~ d sc q - dmin m."""
    lo = np.minimum(w.min(-1), 0.0)
    scale = (w.max(-1) - lo) / levels
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = ((-lo).max(-1) / 63).astype(np.float16).astype(np.float32)
    safe = lambda v: np.where(v > 0, v, 1.0)  # noqa: E731
    sc = np.clip(np.round(scale / safe(d)[..., None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / safe(dmin)[..., None]), 0, 63).astype(np.uint8)
    step = d[..., None] * sc
    q = np.round((w + (dmin[..., None] * mn)[..., None]) / safe(step)[..., None])
    q = np.where(step[..., None] > 0, np.clip(q, 0, levels), 0).astype(np.uint8)
    return d, dmin, sc, mn, q


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """[N, K] float -> Q4_K blocks uint8 [N, K / 256 * 144]."""
    n = w.shape[0]
    d, dmin, sc, mn, q = _affine_runs(w.astype(np.float32).reshape(n, -1, 8, 32), 15)
    pairs = q.reshape(n, -1, 4, 2, 32)  # runs 2c, 2c + 1: low and high nibbles of 32 bytes
    qs = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(n, -1, 128)
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(dmin), _scales_bytes(sc, mn), qs], axis=-1).reshape(n, -1)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    """[N, K] float -> Q5_K blocks uint8 [N, K / 256 * 176]."""
    n = w.shape[0]
    d, dmin, sc, mn, q = _affine_runs(w.astype(np.float32).reshape(n, -1, 8, 32), 31)
    low = q & 0xF
    pairs = low.reshape(n, -1, 4, 2, 32)
    qs = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(n, -1, 128)
    qh = np.zeros((n, q.shape[1], 32), dtype=np.uint8)
    for run in range(8):  # bit `run` of qh[l]: the fifth bit of run `run`'s value l
        qh |= ((q[:, :, run, :] >> 4) & 1) << run
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(dmin), _scales_bytes(sc, mn), qh, qs], axis=-1).reshape(n, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """[N, K] float -> Q6_K blocks uint8 [N, K / 256 * 210]: per run of 16 an int8 scale of fp16 d."""
    n = w.shape[0]
    runs = w.astype(np.float32).reshape(n, -1, 16, 16)
    scale = np.abs(runs).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16).astype(np.float32)
    safe = lambda v: np.where(v > 0, v, 1.0)  # noqa: E731
    sc = np.clip(np.round(scale / safe(d)[..., None]), -128, 127).astype(np.int8)
    step = d[..., None] * sc
    q = np.where(step[..., None] != 0, np.clip(np.round(runs / safe(step)[..., None]), -32, 31), 0)
    q = (q + 32).astype(np.uint8).reshape(n, -1, 2, 4, 32)  # [half][quarter][l]: input 128 h + 32 k + l
    ql = np.concatenate([(q[..., 0, :] & 0xF) | ((q[..., 2, :] & 0xF) << 4),
                         (q[..., 1, :] & 0xF) | ((q[..., 3, :] & 0xF) << 4)], axis=-1).reshape(n, -1, 128)
    qh = ((q[..., 0, :] >> 4) | ((q[..., 1, :] >> 4) << 2) | ((q[..., 2, :] >> 4) << 4)
          | ((q[..., 3, :] >> 4) << 6)).reshape(n, -1, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _fp16_bytes(d)], axis=-1).reshape(n, -1)


QUANTIZERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}

_HF_TO_GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
                     "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                     "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_HF_TO_GGUF_LAYER[module]}.{kind}"


def permute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's q / k row order -> llama.cpp's (convert_hf_to_gguf.py's LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_writer(out: Path, layers: int, context: int, hidden: int, ffn: int, heads: int, kv_heads: int,
                 rope_theta: float, rms_norm_eps: float, vocab: int, tokenizer_gguf: str | None = None):
    """A gguf.GGUFWriter for a llama file at `out` with its metadata set (head size hidden / heads)
    and the tokenizer's fields copied from `tokenizer_gguf`; the caller adds the tensors."""
    import gguf

    writer = gguf.GGUFWriter(out, "llama")
    if tokenizer_gguf is not None:
        reader = gguf.GGUFReader(tokenizer_gguf)
        for key, field in reader.fields.items():
            if key.startswith("tokenizer."):
                sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
                writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(rms_norm_eps)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(hidden // heads)
    return writer


def llama_rows(gguf_name: str, w: np.ndarray, heads: int, kv_heads: int) -> np.ndarray:
    """`w` (HF's row order) as llama.cpp stores tensor `gguf_name`: q / k rows permuted."""
    part = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
    return permute_rotary(w, {"attn_q": heads, "attn_k": kv_heads}[part]) if part in ("attn_q", "attn_k") else w


def write_llama_gguf(out: Path, config, tensors: dict[str, np.ndarray], types: Callable[[str], str],
                     tokenizer_gguf: str | None = None, extra: dict[str, np.ndarray] | None = None) -> None:
    """A llama GGUF at `out` of `tensors` (HF names, fp32) in llama.cpp's layout: each tensor of
    type `types(gguf name)` ("F32", a k-quant, or a type gguf-py quantizes: Q8_0, Q5_0, ...), q / k
    rows permuted, metadata from `config`,
    the tokenizer (and its fields) copied from `tokenizer_gguf`; `extra`: tensors under their GGUF
    names (e.g. rope_freqs.weight), written as F32 after the rest."""
    import gguf

    writer = llama_writer(out, config.num_hidden_layers, config.max_position_embeddings, config.hidden_size,
                          config.intermediate_size, config.num_attention_heads, config.num_key_value_heads,
                          float(getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]),
                          config.rms_norm_eps, config.vocab_size, tokenizer_gguf)
    for hf, w in tensors.items():
        name = gguf_name(hf)
        w = llama_rows(name, w, config.num_attention_heads, config.num_key_value_heads)
        kind = types(name) if w.ndim == 2 else "F32"
        if kind == "F32":
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
            continue
        qtype = gguf.GGMLQuantizationType[kind]
        blocks = QUANTIZERS[kind](w) if kind in QUANTIZERS else gguf.quants.quantize(w.astype(np.float32), qtype)
        writer.add_tensor(name, blocks, raw_dtype=qtype)
    for name, w in (extra or {}).items():
        writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
