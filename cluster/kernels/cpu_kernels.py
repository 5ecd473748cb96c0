"""The CPU kernel library: paged attention (csrc/paged_attention_cpu.cpp), the decoder
layer's fused elementwise ops (csrc/layer_ops_cpu.cpp: RMSNorm with the residual add, SiLU-and-mul,
rotary), multi-LoRA's shrink + expand (csrc/lora_cpu.cpp), the decode GEMMs for a few rows,
bf16 / fp32 and int8 / 4-bit weights (csrc/skinny_gemm_cpu.cpp), GGUF's k-quants times int8
activations for any number of rows (csrc/kquant_gemm_cpu.cpp), and a model's decoder layers of
a decode step in one call from those (csrc/decoder_layer_cpu.cpp), built on first use with
`torch.utils.cpp_extension`, cached on disk, loaded into the process as one torch op library.
Every op's schema is registered in csrc/registration.cpp, the one file that includes
<torch/library.h>: the kernel files include only ATen's tensor and op headers, so they compile
in less time, in parallel.

The build is keyed by the source, the compile flags and the torch version, under
`<cache root>/kernels/` (see cluster/cache.py); later processes load the cached library in
milliseconds. The instruction set comes from torch's own CPU capability (AVX512 -> AVX-512
intrinsics, AVX2 -> AVX2 + FMA, else plain C++), so a cache shared between machines never runs
code a CPU lacks. `LLM_CLUSTER_CPU_ISA=avx512|avx2|scalar` overrides it.

Without a C++ compiler or ninja, or when the build fails, `load()` returns None and says why
once in the log; the layers then keep their torch code (the torch attention backend).

    python -m cluster.kernels.cpu_kernels     # build (or find) it now; prints where it is
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from cluster.cache import cache_root

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / "paged_attention_cpu.cpp", CSRC / "layer_ops_cpu.cpp", CSRC / "lora_cpu.cpp",
           CSRC / "skinny_gemm_cpu.cpp", CSRC / "int8_gemm_cpu.cpp", CSRC / "decoder_layer_cpu.cpp",
           CSRC / "prefill_attention_cpu.cpp", CSRC / "fma_gemm_cpu.cpp", CSRC / "kquant_gemm_cpu.cpp",
           CSRC / "registration.cpp"]
HEADERS = [CSRC / "simd.h", CSRC / "rotary.h", CSRC / "ops.h"]
ISA_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "scalar": [],
}
DTYPES = (torch.float32, torch.bfloat16)
# Queries per work item: the tile's rows (queries x GQA group) share every K/V row loaded.
TILE_QUERIES = 16


def default_isa() -> str:
    isa = os.environ.get("LLM_CLUSTER_CPU_ISA")
    if isa:
        if isa not in ISA_FLAGS:
            raise ValueError(f"LLM_CLUSTER_CPU_ISA must be one of {sorted(ISA_FLAGS)}, got {isa!r}")
        return isa
    cap = torch.backends.cpu.get_cpu_capability()
    return {"AVX512": "avx512", "AVX2": "avx2"}.get(cap, "scalar")


@dataclass(frozen=True)
class CpuKernels:
    """The loaded ops. They take CPU tensors of float32 or bfloat16 and check shapes (a
    RuntimeError names the mismatch); the calls that end in `_` write in place."""

    isa: str
    library: str  # path of the loaded shared library

    @functools.cached_property
    def _ops(self):
        return getattr(torch.ops, _namespace(self.isa))

    def simd_width(self) -> int:
        return int(self._ops.simd_width())

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """HF's RMSNorm of the rows of x ([..., n], any leading shape) into a new tensor."""
        rows = x.reshape(-1, x.shape[-1])
        out = torch.empty(rows.shape, dtype=x.dtype)
        self._ops.rms_norm(out, rows, weight, eps)
        return out.view(x.shape)

    def fused_add_rms_norm_(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """residual += x, then x = RMSNorm(residual), both in place ([tokens, n], rows contiguous);
        returns (x, residual)."""
        self._ops.fused_add_rms_norm_(x, residual, weight, eps)
        return x, residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, 2d] -> silu(x[:, :d]) * x[:, d:] ([tokens, d], new)."""
        out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype)
        self._ops.silu_and_mul(out, x)
        return out

    def rotary_(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate every head of qk ([tokens, heads, head_dim], heads contiguous) in place, neox
        layout, over the first 2 * cos.shape[-1] dims; cos / sin [tokens, half] in qk's dtype."""
        self._ops.rotary_(qk, cos, sin)
        return qk

    def paged_attention(self, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                        query_start: torch.Tensor, query_len: torch.Tensor, scale: float,
                        tile_queries: int = TILE_QUERIES) -> None:
        """q / out: [tokens, heads * head_dim] (rows contiguous); caches [blocks, block_size,
        kv_heads, head_dim]; per sequence s (int32): its block table row, context length,
        first query row and query count. Query i of s sees keys [0, seq_lens[s] - query_len[s] + i]."""
        self._ops.paged_attention(out, q, k_cache, v_cache, block_table, seq_lens, query_start,
                                  query_len, float(scale), int(tile_queries))

    def qkv_attention(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, query_start: torch.Tensor, query_len: torch.Tensor, scale: float,
                      tile_queries: int = TILE_QUERIES) -> torch.Tensor:
        """A step's attention from the fused projection's output qkv ([tokens, (heads + 2 kv_heads)
        * head_dim], rows contiguous; q and k not yet rotated) in one call: `rotary_` on q and k (in
        place, cos / sin [tokens, half]), k and v written to the caches' rows `slot_mapping` (int64),
        then `paged_attention` over q. Returns [tokens, heads * head_dim] (new), the same bits as
        those steps one by one."""
        return self._ops.qkv_attention(qkv, cos, sin, k_cache, v_cache, slot_mapping, block_table, seq_lens,
                                       query_start, query_len, float(scale), int(tile_queries))

    def decoder_layers(self, hidden: torch.Tensor, *args) -> tuple[torch.Tensor, torch.Tensor]:
        """A Llama-family model's decoder layers in one call (csrc/decoder_layer_cpu.cpp has the
        argument list and the math): (the last layer's output, the residual stream: `hidden`,
        updated in place). Steps of a few rows only: every projection goes through its skinny GEMM."""
        return self._ops.decoder_layers(hidden, *args)

    def skinny_pack(self, weight: torch.Tensor) -> torch.Tensor:
        """[N, K] float32 / bf16 -> the layout `skinny_linear` reads (blocks of 4 output features
        interleaved vector by vector, zero-padded; opaque beyond that)."""
        return self._ops.skinny_pack(weight.detach().contiguous())

    def skinny_linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                      out_features: int) -> torch.Tensor:
        """`F.linear(x, weight, bias)` ([..., K] -> [..., N], new) for the weight `packed` was
        made from, streaming it once per call: meant for a few rows (decode), where it runs at
        memory speed. fp32 accumulation, one rounding into x's dtype."""
        return self._ops.skinny_linear(x, packed, bias, out_features)

    def int8_pack(self, q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An int8 weight w = q * scale: q [N, K] int8, scales [N, groups] float32 (groups equal
        runs of K; 1 per feature, or runs of whole SIMD vectors, e.g. GGUF's 32) -> (q, scales)
        in the layout `int8_linear` / `int8_dequant_` read."""
        qp, sp = self._ops.int8_pack(q.contiguous(), scales.float().contiguous())
        return qp, sp

    def int8_linear(self, x: torch.Tensor, qp: torch.Tensor, sp: torch.Tensor, bias: torch.Tensor | None,
                    out_features: int) -> torch.Tensor:
        """`F.linear(x, q * scale, bias)` ([..., K] -> [..., N] in x's dtype, new), the weight read
        once, at one byte a weight. With `int8_int8_activations` (and K and the scale groups whole
        runs of 32), x is quantized per row and run of 32 inputs as for `q4_linear` and each run's
        q . xq is exact in int32: out = sum over runs of scale s (q . xq). Otherwise the weight is
        widened to fp32 in registers and multiplies x as it is: meant for a few rows."""
        return self._ops.int8_linear(x, qp, sp, bias, out_features)

    @functools.cached_property
    def int8_int8_activations(self) -> bool:
        """Whether `int8_linear` quantizes x to int8 here: the AVX2 build, where `int8_gemm` (AVX512-VNNI)
        is missing."""
        return bool(self._ops.int8_int8_activations())

    def int8_dequant_(self, out: torch.Tensor, qp: torch.Tensor, sp: torch.Tensor) -> torch.Tensor:
        """out [N, K] (float32 / bf16, contiguous) = q * scale, in place."""
        self._ops.int8_dequant_(out, qp, sp)
        return out

    def packed_linear(self, x: torch.Tensor, tensors: tuple[torch.Tensor, ...], bias: torch.Tensor | None,
                      out_features: int) -> torch.Tensor:
        """`F.linear` for a weight as `decoder_layers` takes it (a PackedWeight's, QuantizedWeight's
        or StackedWeight's `skinny_tensors`), through the same choice of GEMM, so a layer run alone
        computes the same bits as inside the one-call layer."""
        return self._ops.packed_linear(x, list(tensors), bias, out_features)

    @functools.cached_property
    def has_int8_gemm(self) -> bool:
        """Whether `int8_gemm` runs here: the AVX-512 build on a CPU with AVX512-VNNI."""
        return bool(self._ops.int8_gemm_available())

    @functools.cached_property
    def has_int8_amx(self) -> bool:
        """Whether `int8_gemm` multiplies on AMX tiles from 24 rows here: `has_int8_gemm` on a CPU
        with AMX-INT8 whose OS grants this process its tile state, unless LLM_CLUSTER_INT8_AMX=0."""
        return bool(self._ops.int8_amx_available())

    def int8_gemm_offsets(self, qp: torch.Tensor, sp: torch.Tensor) -> torch.Tensor:
        """What `int8_gemm` needs besides `int8_pack`'s blocks (qp, sp), computed once per weight:
        -128 x each activation group's sum of q, per feature ([N/4, groups, 4] int32; 1/16 of q's
        bytes for groups of 64, 1/8 for 32)."""
        return self._ops.int8_gemm_offsets(qp, sp)

    def int8_gemm(self, x: torch.Tensor, qp: torch.Tensor, sp: torch.Tensor, offsets: torch.Tensor,
                  bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
        """W8A8 `F.linear(x, q * scale, bias)`: x quantized on the fly per row and group of inputs
        (scale absmax / 127, round half to even), each group's int8 dot products exact in int32,
        scaled and summed in fp32, one rounding into x's dtype. `qp, sp` from `int8_pack` with one
        scale per feature (x's groups: 64 inputs) or per group of 32 or 64 inputs (x's groups: the
        weight's, as GGUF's Q8_0), `offsets` from `int8_gemm_offsets`. Needs `has_int8_gemm`."""
        return self._ops.int8_gemm(x, qp, sp, offsets, bias, out_features)

    @functools.cached_property
    def has_fma_gemm(self) -> bool:
        """Whether `fma_linear` runs here: the AVX-512 build."""
        return bool(self._ops.fma_gemm_available())

    def fma_pack(self, weight: torch.Tensor) -> torch.Tensor:
        """A [N, K] bf16 weight in `fma_linear`'s layout: panels of 32 features, each input's 32
        weights together ([ceil(N / 32), K, 32] bf16, zero-padded)."""
        return self._ops.fma_pack(weight)

    def fma_linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                   out_features: int) -> torch.Tensor:
        """`F.linear(x, weight, bias)` for many rows through fp32 FMAs on `fma_pack`'s layout
        (x float32 or bf16, [..., K] -> [..., N] new, in x's dtype): the products summed in fp32
        in input order, one rounding. Needs `has_fma_gemm`."""
        return self._ops.fma_linear(x, packed, bias, out_features)

    @functools.cached_property
    def has_prefill_attention(self) -> bool:
        """Whether `prefill_attention` runs here: the AVX-512 build on a CPU with AVX512-BF16."""
        return bool(self._ops.prefill_attention_available())

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Causal attention of one prefill chunk, bf16: q [Lq, heads, head_dim], k and v [Lk,
        kv_heads, head_dim] (each token's heads contiguous, any token stride), Lk >= Lq; query i
        sees keys [0, Lk - Lq + i]. Returns [Lq, heads * head_dim]. Needs `has_prefill_attention`."""
        return self._ops.prefill_attention(q, k, v, float(scale))

    def q4_pack(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A 4-bit weight w = q * d + m (GGUF's Q4_1; Q4_0 is m = -8 d): q [N, K] uint8 in [0, 15]
        (K a multiple of 32), d and m [N, groups] float16 -> (q two to a byte, d, m) in the layout
        `q4_linear` / `q4_dequant_` read."""
        return tuple(self._ops.q4_pack(q.contiguous(), d.half().contiguous(), m.half().contiguous()))

    def q4_linear(self, x: torch.Tensor, qp: torch.Tensor, dp: torch.Tensor, mp: torch.Tensor,
                  bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
        """`F.linear(x, q * d + m, bias)`, the 4-bit weight read once. With `q4_int8_activations`,
        x is quantized per row and run of 32 inputs (s = absmax / 127, round half to even, as
        llama.cpp's Q4 dot products take it) and each run's q . xq is exact in int32: out = sum
        over runs of d s (q . xq) + m (x's fp32 sum over the run). Otherwise the weight is widened
        to fp32 in registers and multiplies x as it is."""
        return self._ops.q4_linear(x, qp, dp, mp, bias, out_features)

    @functools.cached_property
    def q4_int8_activations(self) -> bool:
        """Whether `q4_linear` quantizes x to int8 here: the SIMD builds (AVX512-VNNI, else AVX2)."""
        return bool(self._ops.q4_int8_activations())

    def q4_dequant_(self, out: torch.Tensor, qp: torch.Tensor, dp: torch.Tensor, mp: torch.Tensor) -> torch.Tensor:
        """out [N, K] (float32 / bf16, contiguous) = q * d + m, in place (one rounding, as fma)."""
        self._ops.q4_dequant_(out, qp, dp, mp)
        return out

    @staticmethod
    def kquant_pack(raw: torch.Tensor, block_bytes: int) -> torch.Tensor:
        """A GGUF k-quant tensor's super-blocks (raw: uint8 [N, K / 256 * block_bytes], each row a
        feature's blocks as in the file; block_bytes 144 Q4_K, 176 Q5_K, 210 Q6_K) -> the layout
        `kquant_linear` / `kquant_dequant_` read: [ceil(N / 4), K / 256, 4, block_bytes], the blocks
        of four consecutive features side by side, each bit for bit as in the file; missing
        features of the last four are zero blocks (w = 0)."""
        if raw.dim() != 2 or raw.dtype != torch.uint8 or raw.shape[1] % block_bytes:
            raise ValueError(f"kquant_pack: raw must be uint8 [N, blocks * {block_bytes}], got "
                             f"{raw.dtype} {tuple(raw.shape)}")
        n, row = raw.shape
        padded = torch.zeros(-(-n // 4) * 4, row, dtype=torch.uint8)
        padded[:n] = raw
        return padded.view(-1, 4, row // block_bytes, block_bytes).transpose(1, 2).contiguous()

    def kquant_linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                      out_features: int) -> torch.Tensor:
        """`F.linear(x, w, bias)` for a k-quant weight (`kquant_pack`'s blocks), any number of rows:
        x quantized per row and super-block of 256 inputs as llama.cpp's Q8_K (s = absmax / 127,
        round half to even, with xq's sums per 16), each super-block's integer dot products and
        scales exact in int32, then fp32 (csrc/kquant_gemm_cpu.cpp has the formula); AVX512-VNNI
        where the CPU has it (`has_int8_gemm`), plain loops elsewhere, the same integers."""
        return self._ops.kquant_linear(x, packed, bias, out_features)

    def kquant_linear_plain(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                            out_features: int) -> torch.Tensor:
        """`kquant_linear` through its plain loops whatever the CPU: what runs without AVX512-VNNI
        (the same integers), for tests of the AVX-512 build."""
        return self._ops.kquant_linear_plain(x, packed, bias, out_features)

    def kquant_dequant_(self, out: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """out [N, K] (float32 / bf16, contiguous) = the k-quant weight, in place: as gguf-py's
        dequantize computes it (bit for bit in fp32)."""
        self._ops.kquant_dequant_(out, packed)
        return out

    def lora_add_(self, out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  seg_start: torch.Tensor, seg_len: torch.Tensor, seg_slot: torch.Tensor,
                  scales: torch.Tensor) -> torch.Tensor:
        """Per segment g (int64 [G]; s = seg_start[g], n = seg_len[g], k = seg_slot[g]):
        out[s:s+n] += scales[k] * ((x[s:s+n] @ a[k].T) @ b[k]), in place; other rows unchanged.
        x [T, in], out [T, out_features] (rows contiguous), a [S, R, in], b [S, R, out_features]
        (B transposed; both contiguous), all one dtype; scales [S] float32. The [n, R]
        intermediate and the sum stay fp32, rounded once into out. SIMD loops for every segment
        length: a shrink over blocks of ranks, an expand over chunks of output features."""
        self._ops.lora_add_(out, x, a, b, seg_start, seg_len, seg_slot, scales)
        return out


def _namespace(isa: str) -> str:
    return f"llm_cluster_{isa}"  # one per ISA, so tests can load several into one process


def _cflags(isa: str) -> list[str]:
    return ["-O3", "-fopenmp", f"-DLLMC_NAMESPACE={_namespace(isa)}", *ISA_FLAGS[isa]]


def _build_dir(isa: str) -> Path:
    text = "|".join([*(f.read_text() for f in SOURCES + HEADERS), torch.__version__, *_cflags(isa)])
    return cache_root() / "kernels" / f"cpu_kernels-{isa}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def _library_name(isa: str) -> str:
    return f"llm_cluster_cpu_kernels_{isa}"


def _toolchain_problem() -> str | None:
    from torch.utils.cpp_extension import get_cxx_compiler, is_ninja_available

    compiler = get_cxx_compiler()
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH; set CXX)"
    if not is_ninja_available():
        with contextlib.suppress(ImportError):  # the `ninja` wheel (a dependency) ships the binary
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        if not is_ninja_available():
            return "no ninja on PATH (pip install ninja)"
    return None


@contextlib.contextmanager
def _build_lock(directory: Path):
    """One build at a time per key across processes (TP ranks start together); the others
    wait and then find it built."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / f".{directory.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _compile(isa: str, out_dir: Path) -> None:
    from torch.utils.cpp_extension import load as cpp_load

    # Also loads the library into this process (from the temporary folder, renamed after).
    cpp_load(name=_library_name(isa), sources=[str(f) for f in SOURCES], extra_cflags=_cflags(isa),
             extra_ldflags=["-fopenmp"], build_directory=str(out_dir), is_python_module=False,
             verbose=False)


# isa -> path of the library loaded into this process. A library registers its op namespace
# when loaded, and registering one twice aborts the process, so each ISA is loaded once even if
# the cache folder or the source changes under a running process.
_LOADED: dict[str, str] = {}


def build_and_load(isa: str) -> str:
    """Load the library for `isa` (once per process), building it first if the cache lacks it;
    returns its path. Raises when the toolchain is missing or the build fails."""
    if isa not in _LOADED:
        _LOADED[isa] = _build_and_load(isa)
    return _LOADED[isa]


def _build_and_load(isa: str) -> str:
    directory = _build_dir(isa)
    library = directory / f"{_library_name(isa)}.so"
    if library.is_file():
        torch.ops.load_library(str(library))
        return str(library)
    problem = _toolchain_problem()
    if problem:
        raise RuntimeError(problem)
    with _build_lock(directory):
        if library.is_file():  # another process built it while this one waited
            torch.ops.load_library(str(library))
            return str(library)
        logger.info("building the CPU kernels (%s) in %s (once; 10-60 s)", isa, directory)
        tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.tmp-"))
        try:
            _compile(isa, tmp)  # also loads it into this process, from tmp (the inode survives the rename)
            shutil.rmtree(directory, ignore_errors=True)  # a leftover without the library
            os.replace(tmp, directory)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(library)


@functools.cache
def load(isa: str | None = None) -> CpuKernels | None:
    """The kernels for `isa` (default: this CPU's), or None when they cannot be built here.
    Cached per process; a failure is logged once, as a warning."""
    isa = isa or default_isa()
    try:
        path = build_and_load(isa)
    except Exception as exc:
        logger.warning("CPU kernels unavailable (%s); using the torch attention backend and torch ops", exc)
        return None
    return CpuKernels(isa, path)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    kernel = load()
    if kernel is None:
        raise SystemExit("the CPU kernels could not be built; the torch backend and ops will be used")
    print(f"CPU kernels ({kernel.isa}, {kernel.simd_width()} floats per vector): {kernel.library}")


if __name__ == "__main__":
    sys.exit(main())
