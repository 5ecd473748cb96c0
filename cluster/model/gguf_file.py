"""A GGUF file read straight from its tensors, for `quantization: gguf`: `read_gguf` maps the
file into memory (reading its tensor table; the metadata's arrays, such as the vocabulary, are
stepped over) and the tensors go to the model one by one. Those the quantization plan
serves in their own blocks (QuantPlan.gguf_tensors: linear layers and the head of a type in
GGUF_SERVED, a k-quant embedding) are handed over as `GGUFBlocks`, their bytes untouched (a view
of the mapped file until the layer packs them; Q5_0's are rewritten as the Q8_0 blocks of the same
values, `q5_0_as_q8_0`); every other tensor is dequantized alone
(gguf-py's dequantize, as transformers' GGUF loader does) to fp32. So no fp32 copy of a quantized weight is ever made, and
the memory a load takes stays near the file's size plus the tensors served in floats (the norms,
an embedding not in k-quants, any type the kernels do not take).

Names follow HF's (the model's `load_weights` takes them as it takes a checkpoint's), and q / k
rows come back in HF's order: llama.cpp's converter permutes them for its rotary layout on
"llama" files, and transformers undoes it (LlamaTensorProcessor); here the same permutation of
whole rows applies to blocks and floats alike (a row's blocks are all along its inputs).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import struct
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

import numpy as np
import torch

logger = logging.getLogger(__name__)

# llama.cpp's tensor names -> HF's (Llama, Qwen2, Qwen3 layouts), blk.N.<part> -> model.layers.N.<part>.
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
                "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj",
                "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# Architectures whose q / k rows llama.cpp's converter permutes (transformers' TENSOR_PROCESSORS).
_PERMUTED_ARCHS = ("llama",)


def hf_name(gguf_name: str) -> str | None:
    """HF's name for a GGUF tensor (blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight),
    None for one the models here do not take (rope_freqs: read into the config, rope_freq_factors)."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    return None


@dataclass(frozen=True)
class GGUFBlocks:
    """A quantized GGUF tensor's blocks as they lie in the file: `raw` uint8 [rows, row bytes]
    (each row one output feature's blocks along its `in_features` inputs), of GGUF type
    `gguf_type` (e.g. "Q4_K"). Layers take this rank's rows (`select_rows`) or inputs (`inputs`)
    and pack the bytes for the kernels as they are. `order`, when set, lists the rows of `raw`
    that this tensor is, in order (q / k rows in HF's order, a shard of them): they are gathered
    only when packed (`in_order`), so the load holds views of the file, not copies."""

    raw: torch.Tensor
    gguf_type: str
    in_features: int
    # The mapped file `raw` may be a view of (read_gguf's buffer), for release_pages.
    mapped: np.ndarray | None = field(default=None, repr=False, compare=False)
    order: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.raw.shape[0] if self.order is None else len(self.order)), self.in_features

    @property
    def rows(self) -> torch.Tensor:
        """What a choice of rows indexes along dim 0: `order` where it is set, else `raw`."""
        return self.raw if self.order is None else self.order

    def select_rows(self, rows: torch.Tensor) -> "GGUFBlocks":
        """This tensor's rows `rows` (a narrow or index of `self.rows` along dim 0)."""
        return replace(self, raw=rows) if self.order is None else replace(self, order=rows)

    def in_order(self) -> "GGUFBlocks":
        """The same rows with `raw` holding them in order (a copy where `order` was set)."""
        if self.order is None:
            return self
        return replace(self, raw=self.raw.index_select(0, self.order), order=None, mapped=None)

    @property
    def block_inputs(self) -> int:
        """Inputs per block (32 for Q8_0 / Q4_0 / Q4_1, 256 for the k-quants)."""
        return _block_size(self.gguf_type)[0]

    @property
    def block_bytes(self) -> int:
        return _block_size(self.gguf_type)[1]

    def with_rows(self, raw: torch.Tensor) -> "GGUFBlocks":
        """The same type's blocks `raw`, in order (rows taken or stacked from such blocks)."""
        return replace(self, raw=raw, order=None)

    def inputs(self, start: int, length: int) -> "GGUFBlocks | None":
        """Inputs [start, start + length) of every row, or None unless both ends fall on block
        boundaries (a row-parallel shard cutting a block)."""
        per = self.block_inputs
        if start % per or length % per or start + length > self.in_features:
            return None
        raw = self.raw.narrow(1, start // per * self.block_bytes, length // per * self.block_bytes)
        return replace(self, raw=raw, in_features=length)

    def release_pages(self) -> None:
        """Drop the file's pages under `raw` from this process's resident memory, once they have
        been copied out (packed or dequantized): they stay in the page cache, and a later read
        maps them again, so nothing is lost; without it a load's peak holds the whole file's pages
        beside the packed copy. A `raw` that is not a view of the mapped file (a copy: a padded
        shard) is left alone."""
        if self.mapped is None or self.raw.numel() == 0:
            return
        first = self.raw.data_ptr()
        last = first + (self.raw.shape[0] - 1) * self.raw.stride(0) + self.raw.shape[1] * self.raw.stride(1)
        release_file_pages(self.mapped, first, last)

    def dequantize(self) -> torch.Tensor:
        """fp32 [rows, in_features], as gguf-py (and so transformers) dequantizes it."""
        from gguf import GGMLQuantizationType, quants

        values = quants.dequantize(self.in_order().raw.contiguous().numpy(), GGMLQuantizationType[self.gguf_type])
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(self.shape)


_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4  # Linux: a shared file mapping's pages are dropped, read again from the page cache on access


def release_file_pages(mapped: np.ndarray, first: int, last: int) -> None:
    """madvise(MADV_DONTNEED) over the pages holding bytes [first, last) of `mapped` (a read-only
    mapped file; a neighbour's bytes on a shared page are read again if needed): only addresses
    inside it, so a copy elsewhere in memory is never touched."""
    base, end_of_file = mapped.ctypes.data, mapped.ctypes.data + mapped.nbytes
    if not (base <= first < last <= end_of_file):
        return
    start = max(first // _PAGE * _PAGE, -(-base // _PAGE) * _PAGE)
    end = min(-(-last // _PAGE) * _PAGE, end_of_file // _PAGE * _PAGE)
    if end > start:
        _madvise()(start, end - start, _MADV_DONTNEED)


@functools.cache
def _madvise() -> Any:
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def _block_size(gguf_type: str) -> tuple[int, int]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[gguf_type]]


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A torch view of a (read-only) memory-mapped array: the file's pages, no copy. Nothing
    writes to it (layers copy out of it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def _heads_permuted(gguf_name: str, arch: str, config: Any) -> int | None:
    """The head count whose q / k row permutation `gguf_name` carries, or None."""
    if arch not in _PERMUTED_ARCHS:
        return None
    part = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
    if part == "attn_q":
        return config.num_attention_heads
    if part == "attn_k":
        return getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return None


def unpermute_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q / k row order -> HF's (transformers' _reverse_permute_weights), any row width."""
    half = t.shape[0] // heads // 2
    return t.reshape(heads, half, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


# GGUF metadata value types -> struct format of one value (8: string, 9: array).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# Tensor types whose data gguf-py gives as numbers (the rest: raw bytes, [rows, bytes per row]).
_PLAIN_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                 "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class TableTensor:
    """One tensor of a GGUF's table; `data` is a read-only view of the mapped file, shaped as
    gguf-py's reader shapes it (what its `quants.dequantize` takes)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the fastest-moving dimension first
    data: np.ndarray


@dataclass(frozen=True)
class GGUFTable:
    """A GGUF file's metadata scalars and strings (arrays, such as the vocabulary, are stepped
    over by their lengths, never parsed) and its tensors."""

    fields: dict[str, Any]
    tensors: list[TableTensor]
    buffer: np.ndarray  # the whole file, mapped read-only (every tensor's data is a view of it)


def read_gguf(path: str) -> GGUFTable:
    """The GGUF at `path`, memory-mapped read-only. gguf-py's GGUFReader parses every metadata
    value into numpy first, the vocabulary's strings one by one; this reads what the loader uses.
    Little-endian GGUF v2 / v3 (what llama.cpp writes); ValueError naming the file otherwise."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    buf = np.memmap(path, mode="r")
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0) if len(buf) >= 24 else (b"", 0, 0, 0)
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"{path}: not a little-endian GGUF v2 / v3 file (magic {magic!r}, version {version})")
    pos, fields = 24, {}
    for _ in range(n_kv):
        key, pos = _string(buf, pos)
        (kind,) = struct.unpack_from("<I", buf, pos)
        fields[key], pos = _value(buf, pos + 4, kind)
    table = []
    for _ in range(n_tensors):
        name, pos = _string(buf, pos)
        (dims,) = struct.unpack_from("<I", buf, pos)
        shape = struct.unpack_from(f"<{dims}Q", buf, pos + 4)
        kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * dims)
        table.append((name, GGMLQuantizationType(kind), shape, offset))
        pos += 4 + 8 * dims + 12
    align = int(fields.get("general.alignment", 32))
    start = -(-pos // align) * align
    tensors = []
    for name, kind, shape, offset in table:
        count, (block, block_bytes) = int(np.prod(shape)), GGML_QUANT_SIZES[kind]
        dims = tuple(reversed(shape))
        dtype = _PLAIN_DTYPES.get(kind.name)
        if dtype is None:
            dtype, count, dims = np.uint8, count * block_bytes // block, quant_shape_to_byte_shape(dims, kind)
        first = start + offset
        data = buf[first:first + count * np.dtype(dtype).itemsize].view(dtype).reshape(dims)
        tensors.append(TableTensor(name, kind, shape, data))
    return GGUFTable(fields, tensors, buf)


def tensor_types(path: str) -> dict[str, str]:
    """Each tensor of the GGUF at `path`: name -> GGML type name ("Q4_K", "F32", ...)."""
    return {t.name: t.tensor_type.name for t in read_gguf(path).tensors}


def _string(buf: np.ndarray, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, pos)
    return bytes(buf[pos + 8:pos + 8 + length]).decode("utf-8", errors="replace"), pos + 8 + length


def _value(buf: np.ndarray, pos: int, kind: int) -> tuple[Any, int]:
    """(the value at `pos` of GGUF value type `kind`, where the next begins); an array's value is None."""
    if kind in _SCALARS:
        return struct.unpack_from("<" + _SCALARS[kind], buf, pos)[0], pos + struct.calcsize(_SCALARS[kind])
    if kind == 8:
        return _string(buf, pos)
    if kind != 9:
        raise ValueError(f"GGUF metadata value of unknown type {kind} at byte {pos}")
    item, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if item in _SCALARS:
        return None, pos + count * struct.calcsize(_SCALARS[item])
    for _ in range(count):
        pos = _skip(buf, pos, item)
    return None, pos


def _skip(buf: np.ndarray, pos: int, kind: int) -> int:
    if kind == 8:
        (length,) = struct.unpack_from("<Q", buf, pos)
        return pos + 8 + length
    return _value(buf, pos, kind)[1]


def rope_freq_factors(path: str) -> list[float] | None:
    """The GGUF's `rope_freqs.weight`, or None: one divisor per rotary frequency (rotary_dim / 2),
    which llama.cpp applies to every position's angle (theta_i / factor_i). Its converter writes
    it for Llama 3's "llama3" rope scaling instead of the scaling keys, and transformers' GGUF
    config drops it (rope_type "default"), so the loader carries it in the config as
    `rope_freq_factors` (rotary.get_rope applies it)."""
    from gguf import quants

    for t in read_gguf(path).tensors:
        if t.name == "rope_freqs.weight":
            values = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1)
            return [float(v) for v in values]
    return None


def iter_gguf_tensors(path: str, config: Any, served: dict[str, str]) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
    """(HF name, tensor) for every tensor of the GGUF at `path` that the models take: `GGUFBlocks`
    for the tensors named in `served` (GGUF name -> format), fp32 for the rest, one at a time. A
    head tied to the embedding and served in blocks comes twice, as lm_head.weight and as the
    embedding's (which looks rows up in them, or dequantizes a type it cannot read row by row)."""
    from gguf import quants

    table = read_gguf(path)  # memory-mapped: a tensor's data is a view of the file
    arch = str(table.fields["general.architecture"])
    has_output = any(t.name == "output.weight" for t in table.tensors)
    for t in table.tensors:
        name = hf_name(t.name)
        if name is None:
            logger.debug("%s: GGUF tensor %s is not used", path, t.name)
            continue
        heads = _heads_permuted(t.name, arch, config)
        if t.name in served:
            blocks = _served_blocks(table, t)
            if heads:  # HF's row order, gathered when packed
                blocks = replace(blocks, order=unpermute_rows(torch.arange(blocks.raw.shape[0]), heads))
            if t.name == "token_embd.weight" and not has_output:  # the tied head's blocks, then the embedding's
                yield "lm_head.weight", blocks
            yield name, blocks
            continue
        values = quants.dequantize(t.data, t.tensor_type)
        if not values.flags.writeable:  # F32: a view of the file
            values = values.copy()
        values = torch.from_numpy(values.astype(np.float32, copy=False)).view(*reversed([int(n) for n in t.shape]))
        yield name, unpermute_rows(values, heads) if heads else values
        _release(table, t)


def _served_blocks(table: GGUFTable, t: TableTensor) -> GGUFBlocks:
    """Tensor `t`'s blocks: a view of the mapped file, or for Q5_0 a Q8_0 copy of them (the
    file's pages then released, as for a tensor read into floats)."""
    if t.tensor_type.name != "Q5_0":
        return GGUFBlocks(_tensor(t.data), t.tensor_type.name, int(t.shape[0]), mapped=table.buffer)
    rows, step = t.data.shape[0], 4096  # a few rows at a time: the rewrite's temporaries are ~5x a row
    out = np.empty((rows, t.data.shape[1] // 22 * 34), dtype=np.uint8)
    for start in range(0, rows, step):
        out[start:start + step] = q5_0_as_q8_0(t.data[start:start + step])
    _release(table, t)
    return GGUFBlocks(torch.from_numpy(out), "Q8_0", int(t.shape[0]))


def q5_0_as_q8_0(raw: np.ndarray) -> np.ndarray:
    """Q5_0 rows (uint8 [rows, blocks x 22]: fp16 d, 32 high bits, 16 bytes of low nibbles, the
    low nibble of byte j being input j and its high nibble input j + 16) as Q8_0 rows (uint8
    [rows, blocks x 34]: the same d, 32 int8 q). A Q5_0 weight is d * (q5 - 16) with q5 in
    [0, 31], which Q8_0 holds exactly as q = q5 - 16: the Q8_0 kernels serve every weight
    unchanged, in 34 bytes per 32 inputs instead of the 64 of bf16 (llama.cpp's Q4_K_M falls back
    to Q5_0 for rows whose length is not a multiple of 256, most of a 576-wide model's)."""
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, 22)
    high_bits = np.ascontiguousarray(b[..., 2:6]).view("<u4")  # [rows, blocks, 1]
    low = np.concatenate([b[..., 6:22] & 0x0F, b[..., 6:22] >> 4], axis=-1)
    high = ((high_bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
    q = ((low | high).astype(np.int16) - 16).astype(np.int8)
    return np.concatenate([b[..., 0:2], q.view(np.uint8)], axis=-1).reshape(rows, -1)


def _release(table: GGUFTable, t: TableTensor) -> None:
    """The file's pages of tensor `t` out of the resident set (its values are copied out)."""
    release_file_pages(table.buffer, t.data.ctypes.data, t.data.ctypes.data + t.data.nbytes)
