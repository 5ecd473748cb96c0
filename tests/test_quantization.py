"""Quantized weights on CPU (cluster/model/layers/quantization.py): the kernel library's int8 and
4-bit GEMMs against an fp64 reference of the dequantized weight, for every instruction set this
CPU runs; GGUF blocks re-derived bit for bit from gguf-py's own quantizers (llama.cpp's rounding);
the plan each option and checkpoint gets; and whole models: int8 close to bf16, and a GGUF served
in its blocks computing what its dequantized floats compute."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cluster.model.layers.quant_plan import quant_plan
from cluster.model.layers.quantization import GGUF_GROUP, INT8_X_MAX_ROWS, SKINNY_MAX_ROWS, QuantizedWeight, quantize_int8


def _fp64_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = x.double() @ w.double().T
    return out if bias is None else out + bias.double()


# ---- the ops -----------------------------------------------------------------------------------


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_int8_linear_is_the_dequantized_product(ops, groups, rows):
    """One scale per feature or per group of 32 inputs; 203 features (not whole blocks of 4). The
    AVX2 build (int8_int8_activations) quantizes x per row and run of 32 and sums each run's
    products exactly (W8A8, as llama.cpp's AVX2 Q8_0: a zero run and an outlier run here, weights
    of -128 as a file's block may hold); the others widen the weight and multiply x as it is, as
    the AVX2 build does where K is not whole runs of 32."""
    gen = torch.Generator().manual_seed(rows * 10 + groups)
    n, k = 203, 96
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    q[0, :8] = -128
    scales = torch.rand(n, groups, generator=gen) * 0.01
    weight = (q.float().view(n, groups, -1) * scales.unsqueeze(-1)).view(n, k)
    qp, sp = ops.int8_pack(q, scales)
    x, bias = torch.randn(rows, 1, k, generator=gen), torch.randn(n, generator=gen)
    x[0, 0, :GGUF_GROUP] = 0.0
    x[-1, 0, GGUF_GROUP:2 * GGUF_GROUP] *= 100
    assert ops.int8_int8_activations == (ops.isa == "avx2")
    out = torch.empty(n, k)
    assert torch.equal(ops.int8_dequant_(out, qp, sp), weight)
    for dtype in (torch.float32, torch.bfloat16):
        xd, bd = x.to(dtype), bias.to(dtype)
        got = ops.int8_linear(xd, qp, sp, bd, n)
        assert got.shape == (rows, 1, n) and got.dtype == dtype
        if ops.int8_int8_activations:
            want = _w8a8_reference(xd, q, scales, bd, size=GGUF_GROUP)
            bound = xd.view(rows, k).double().abs() @ weight.double().abs().T  # fp32 sums: within its epsilon
            tol = 1e-6 * bound + 1e-5 if dtype == torch.float32 else 2 ** -7 * want.abs() + 2e-2
            assert ((got.view(rows, n).double() - want).abs() <= tol).all()
            exact = _fp64_linear(xd.view(rows, k), weight, bd)  # x's rounding: small beside the product
            assert (got.view(rows, n).double() - exact).abs().max() < 0.01 * exact.abs().max()
        elif dtype == torch.float32:
            torch.testing.assert_close(got.double(), _fp64_linear(xd, weight, bd), atol=1e-4, rtol=1e-5)
        else:
            torch.testing.assert_close(got.double(), _fp64_linear(xd, weight, bd), atol=2e-2, rtol=2 ** -7)
    # K of 40 is not whole runs of 32: every build widens the weight.
    q40, s40 = q[:, :40].contiguous(), scales[:, :1].contiguous()
    x40 = x[..., :40].contiguous()
    got = ops.int8_linear(x40, *ops.int8_pack(q40, s40), bias, n)
    torch.testing.assert_close(got.double(), _fp64_linear(x40, q40.double() * s40.double(), bias), atol=1e-4, rtol=1e-5)


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as fh:
        return set(fh.read().split())


def _cpu_has_vnni() -> bool:
    return "avx512_vnni" in _cpu_flags()


def _w8a8_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                    size: int | None = None) -> torch.Tensor:
    """The documented math of int8_gemm in fp64: x quantized per row and group of inputs (fp32
    127 / absmax, round half to even), 64 inputs for one scale per feature, else the weight's
    groups (or `size` inputs: int8_linear's 32); each group's int products exact, the scales and
    bias after."""
    x = x.float().reshape(-1, x.shape[-1])
    k = x.shape[-1]
    size = size or (64 if scales.shape[1] == 1 else k // scales.shape[1])
    pad = -k % size
    groups = torch.nn.functional.pad(x, (0, pad)).view(x.shape[0], -1, size)
    absmax = groups.abs().amax(-1, keepdim=True)
    inv = torch.full_like(absmax, 127.0) / absmax  # a division, as the kernel's (127.0 / t is 127 * (1 / t))
    xq = torch.round(groups * torch.where(absmax > 0, inv, torch.zeros_like(absmax)))
    x_scale = (absmax / 127.0).double()  # an all-zero group: 0
    wq = torch.nn.functional.pad(q.double(), (0, pad)).view(q.shape[0], -1, size)
    sums = torch.einsum("mgk,ngk->mng", xq.double(), wq)  # per group, exact
    w_scale = scales.double().view(1, q.shape[0], -1)  # [1, N, 1] or [1, N, groups]
    out = (sums * x_scale.view(x.shape[0], 1, -1) * w_scale).sum(-1)
    return out if bias is None else out + bias.double()


# (inputs, scale groups per feature): one scale per feature over 100 inputs (x's groups of 64, a
# last one of 36, not whole vectors); Q8_0's scale per 32 inputs; a scale per 64.
@pytest.mark.parametrize("k,groups", [(100, 1), (96, 3), (128, 2)])
@pytest.mark.parametrize("rows", [1, 5, 13, 32, 33, 200])
def test_int8_gemm_is_the_w8a8_product(ops, rows, k, groups):
    """W8A8 on int8_pack's blocks: 203 features (a last panel of 16 with missing blocks), a zero
    row, bias; 200 rows cross the 192-row blocks; from 24 rows, on a CPU with AMX-INT8, the tiles
    (33: a last pass of one row). Runs where the CPU has AVX512-VNNI and the build is AVX-512;
    elsewhere the op refuses, naming why."""
    gen = torch.Generator().manual_seed(rows + k)
    n = 203
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, groups, generator=gen) * 0.01
    qp, sp = ops.int8_pack(q, scales)
    x, bias = torch.randn(rows, k, generator=gen) * 3, torch.randn(n, generator=gen)
    x[rows // 2] = 0.0
    x[-1, :32] *= 100  # an outlier group: the next group keeps its own scale
    assert ops.has_int8_gemm == (ops.isa == "avx512" and _cpu_has_vnni())
    if not ops.has_int8_gemm:
        with pytest.raises(RuntimeError, match="needs AVX512-VNNI"):
            ops.int8_gemm(x, qp, sp, torch.zeros(1, dtype=torch.int32), bias, n)
        return
    offsets = ops.int8_gemm_offsets(qp, sp)
    x_groups = -(-k // 64) if groups == 1 else groups
    assert offsets.shape == (51, x_groups, 4) and offsets.dtype == torch.int32
    got = ops.int8_gemm(x.view(rows, 1, k), qp, sp, offsets, bias, n)
    assert got.shape == (rows, 1, n) and got.dtype == torch.float32
    weight = (q.double().view(n, groups, -1) * scales.double().unsqueeze(-1)).view(n, k)
    # fp32 sums of the groups' products: error within fp32's epsilon of the sum of |products|
    bound = x.abs().double() @ weight.abs().T
    assert ((got.view(rows, n).double() - _w8a8_reference(x, q, scales, bias)).abs() <= 1e-6 * bound + 1e-5).all()
    if rows > 1:
        assert torch.equal(got[rows // 2, 0], bias)  # a zero row quantizes to zeros
    bf16 = ops.int8_gemm(x.bfloat16(), qp, sp, offsets, None, n)
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.double(), _w8a8_reference(x.bfloat16(), q, scales, None), atol=2e-2, rtol=2 ** -7)
    # Against the weights themselves: W8A8's error is x's rounding, under 1% of the output's scale.
    exact = _fp64_linear(x, weight, bias)
    assert (got.view(rows, n).double() - exact).abs().max() < 0.01 * exact.abs().max()


@pytest.mark.parametrize("k,groups", [(100, 1), (96, 3), (128, 2)])
def test_int8_gemm_on_amx_tiles_computes_what_the_vnni_kernel_does(ops, monkeypatch, k, groups):
    """On a CPU with AMX-INT8 (and the OS's permission, which Linux grants from 5.16), int8_gemm
    multiplies on tiles from 24 rows: the same integers and scales as the VNNI kernel
    (LLM_CLUSTER_INT8_AMX=0, read at each call), fp32 sums in another order. oneDNN's bf16 GEMM,
    which runs on the same tiles there, computes the same bits before and after (the kernel puts
    the thread's tile config back). Elsewhere has_int8_amx is false."""
    has_amx = ops.has_int8_gemm and {"amx_tile", "amx_int8"} <= _cpu_flags()
    assert ops.has_int8_amx == has_amx
    if not has_amx:
        return
    gen = torch.Generator().manual_seed(k + groups)
    n = 203
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, groups, generator=gen) * 0.01
    qp, sp = ops.int8_pack(q, scales)
    offsets = ops.int8_gemm_offsets(qp, sp)
    weight = (q.double().view(n, groups, -1) * scales.double().unsqueeze(-1)).view(n, k)
    w_bf16, x_bf16 = torch.randn(256, 512, generator=gen).bfloat16(), torch.randn(64, 512, generator=gen).bfloat16()
    onednn = torch.nn.functional.linear(x_bf16, w_bf16)
    for rows in (24, 47, 64, 200):
        x, bias = torch.randn(rows, k, generator=gen) * 3, torch.randn(n, generator=gen)
        x[-1, :32] *= 100
        bound = x.abs().double() @ weight.abs().T
        amx = ops.int8_gemm(x, qp, sp, offsets, bias, n)
        assert torch.equal(torch.nn.functional.linear(x_bf16, w_bf16), onednn)
        monkeypatch.setenv("LLM_CLUSTER_INT8_AMX", "0")
        vnni = ops.int8_gemm(x, qp, sp, offsets, bias, n)
        monkeypatch.delenv("LLM_CLUSTER_INT8_AMX")
        assert not torch.equal(amx, vnni)  # two kernels ran: the same products, summed in another order
        assert ((amx.double() - vnni.double()).abs() <= 2e-6 * bound + 1e-5).all(), rows
        assert ((amx.double() - _w8a8_reference(x, q, scales, bias)).abs() <= 1e-6 * bound + 1e-5).all(), rows
        amx_bf16 = ops.int8_gemm(x.bfloat16(), qp, sp, offsets, None, n)
        torch.testing.assert_close(amx_bf16.double(), _w8a8_reference(x.bfloat16(), q, scales, None), atol=2e-2, rtol=2 ** -7)


def test_packed_linear_widens_int8_for_two_rows_and_runs_w8a8_from_three(ops):
    """What the one-call layer and QuantizedWeight.linear run for an int8 weight with W8A8's
    offsets: in-register widening streams a row or two from memory faster, int8 dot products
    win from three rows."""
    if not ops.has_int8_gemm:
        assert ops.isa != "avx512" or not _cpu_has_vnni()
        return
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (40, 128), generator=gen, dtype=torch.int8)
    qp, sp = ops.int8_pack(q, torch.rand(40, 1, generator=gen) * 0.01)
    offsets = ops.int8_gemm_offsets(qp, sp)
    x, bias = torch.randn(13, 128, generator=gen).bfloat16(), torch.randn(40, generator=gen).bfloat16()
    for rows in (1, 2, 3, 13):
        got = ops.packed_linear(x[:rows], (qp, sp, offsets), bias, 40)
        want = ops.int8_linear(x[:rows], qp, sp, bias, 40) if rows <= 2 else ops.int8_gemm(x[:rows], qp, sp, offsets, bias, 40)
        assert torch.equal(got, want), rows
    assert not torch.equal(ops.int8_gemm(x[:1], qp, sp, offsets, bias, 40), ops.int8_linear(x[:1], qp, sp, bias, 40))


def test_int8_gemm_refuses_what_it_cannot_compute(ops):
    if not ops.has_int8_gemm:  # what it refuses there: test_int8_gemm_is_the_w8a8_product
        assert ops.isa != "avx512" or not _cpu_has_vnni()
        return
    q = torch.ones(8, 64, dtype=torch.int8)
    qp, sp = ops.int8_pack(q, torch.ones(8, 4))  # a scale per 16 inputs
    with pytest.raises(RuntimeError, match="one scale per feature or per group of 32 or 64 inputs"):
        ops.int8_gemm_offsets(qp, sp)
    with pytest.raises(RuntimeError, match="one scale per feature or per group of 32 or 64 inputs"):
        ops.int8_gemm(torch.randn(20, 64), qp, sp, torch.zeros(2, 4, 4, dtype=torch.int32), None, 8)
    qp, sp = ops.int8_pack(q, torch.ones(8, 1))
    offsets = ops.int8_gemm_offsets(qp, sp)
    with pytest.raises(RuntimeError, match="not int8_gemm_offsets of this weight"):
        ops.int8_gemm(torch.randn(20, 64), qp, sp, offsets[:1], None, 8)
    q8_0 = ops.int8_pack(q, torch.ones(8, 2))  # x's groups follow the weight's: 32, not 64
    with pytest.raises(RuntimeError, match="not int8_gemm_offsets of this weight"):
        ops.int8_gemm(torch.randn(20, 64), *q8_0, offsets, None, 8)
    with pytest.raises(RuntimeError, match="not int8_pack of a"):
        ops.int8_gemm(torch.randn(20, 32), qp, sp, offsets, None, 8)


def _w4a8_reference(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The documented math of q4_linear with int8 activations, in fp64: x quantized per row and run
    of 32 inputs (fp32 127 / absmax, round half to even), each run's q . xq exact, then d s per run,
    plus m times x's own sum over the run."""
    x = x.float()
    rows, k = x.shape
    runs = x.view(rows, k // GGUF_GROUP, GGUF_GROUP)
    absmax = runs.abs().amax(-1, keepdim=True)
    inv = torch.full_like(absmax, 127.0) / absmax
    xq = torch.round(runs * torch.where(absmax > 0, inv, torch.zeros_like(absmax)))
    x_scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax)).double().squeeze(-1)
    dots = torch.einsum("mrk,nrk->mnr", xq.double(), q.double().view(q.shape[0], -1, GGUF_GROUP))
    per_run = k // GGUF_GROUP // d.shape[1]
    d_run, m_run = (t.double().repeat_interleave(per_run, dim=1).unsqueeze(0) for t in (d, m))
    return (dots * d_run * x_scale.unsqueeze(1)).sum(-1) + (m_run * runs.double().sum(-1).unsqueeze(1)).sum(-1)


@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9])
def test_q4_linear_is_the_documented_product(ops, rows, groups):
    """w = q d + m per group of 32 inputs (or one d, m per feature), two values a byte; the
    dequantized weight is the fma of the fp16 d and m (one rounding), as gguf-py computes it. With
    int8 activations (the SIMD builds: AVX512-VNNI or AVX2) the product is the W4A8 one, x
    quantized per run of 32 (a zero run and an outlier run here); otherwise (the scalar build) the
    dequantized weight times x. 101 features: a last block of 4 with missing features."""
    gen = torch.Generator().manual_seed(rows * 10 + groups)
    n, k = 101, 128
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    d = (torch.rand(n, groups, generator=gen) * 0.01).half()
    m = (-torch.rand(n, groups, generator=gen) * 0.08).half()
    weight = (q.float().view(n, groups, -1) * d.float().unsqueeze(-1) + m.float().unsqueeze(-1)).view(n, k)
    qp, dp, mp = ops.q4_pack(q, d, m)
    assert qp.numel() == n * k // 2 + (-n % 4) * k // 2  # two values a byte (features padded to 4)
    assert torch.equal(ops.q4_dequant_(torch.empty(n, k), qp, dp, mp), weight)
    x = torch.randn(rows, k, generator=gen)
    x[0, :GGUF_GROUP] = 0.0
    x[-1, GGUF_GROUP:2 * GGUF_GROUP] *= 100
    assert ops.q4_int8_activations == (ops.isa != "scalar")  # VNNI or AVX2 kernels
    for dtype, tol in ((torch.float32, {"atol": 1e-4, "rtol": 1e-5}), (torch.bfloat16, {"atol": 2e-2, "rtol": 2 ** -7})):
        xd = x.to(dtype)
        expected = _w4a8_reference(xd, q, d, m) if ops.q4_int8_activations else _fp64_linear(xd, weight)
        got = ops.q4_linear(xd, qp, dp, mp, None, n)
        assert got.dtype == dtype and got.shape == (rows, n)
        torch.testing.assert_close(got.double(), expected, **tol)
    exact = _fp64_linear(x, weight)  # int8 activations cost llama.cpp's error: small beside the product
    assert (ops.q4_linear(x, qp, dp, mp, None, n).double() - exact).norm() <= 0.03 * exact.norm()  # 1-2% seen


def test_q4_blocks_run_w4a8_at_any_rows_on_the_avx2_build():
    """A Q4_1 tensor made by gguf-py (llama.cpp's rounding) served by QuantizedWeight, x of 1 to 300
    rows: on the AVX2 build (no VNNI GEMM, a float GEMM of fp32 FMAs) every size is the W4A8
    product of the file's own q, d and m; on the others, past INT8_X_MAX_ROWS (VNNI) or
    SKINNY_MAX_ROWS (scalar) rows, the dequantized weight times x as it is."""
    from cluster.kernels import cpu_kernels
    from gguf import GGMLQuantizationType, quants

    kernels = cpu_kernels.load()
    rng = np.random.default_rng(1)
    n, k = 70, 256
    raw = quants.quantize(rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType.Q4_1)
    blocks = raw.reshape(n, k // GGUF_GROUP, 20)  # fp16 d, fp16 m, 16 bytes of two 4-bit values
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0])
    m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0])
    packed = torch.from_numpy(blocks[..., 4:].copy())
    q = torch.cat([packed & 15, packed >> 4], dim=-1).view(n, k)  # byte j: values j and j + 16
    weight = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q4_1).copy())
    quantized = QuantizedWeight.quantize(weight, "q4_1", kernels)
    any_rows = kernels.int8_int8_activations  # the AVX2 build's mark
    assert any_rows == (kernels.isa == "avx2")
    for rows in (1, INT8_X_MAX_ROWS + 1, 300):
        x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
        got = quantized.linear(x, None).double()
        w4a8 = any_rows or (kernels.q4_int8_activations and rows <= INT8_X_MAX_ROWS)
        expected = _w4a8_reference(x, q, d, m) if w4a8 else _fp64_linear(x, weight)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


def test_quantized_ops_refuse_mismatched_weights(ops):
    q, scales = torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 2)
    qp, sp = ops.int8_pack(q, scales)
    with pytest.raises(RuntimeError, match="not int8_pack of a"):
        ops.int8_linear(torch.randn(1, 64), qp, sp, None, 12)
    with pytest.raises(RuntimeError, match="scale groups over 64 inputs"):
        ops.int8_pack(q, torch.ones(8, 3))
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16"):
        ops.int8_linear(torch.randn(1, 64).half(), qp, sp, None, 8)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.q4_pack(torch.zeros(4, 40, dtype=torch.uint8), torch.ones(4, 1).half(), torch.ones(4, 1).half())


# ---- GGUF blocks, back from their dequantized values -------------------------------------------


@pytest.mark.parametrize("gguf_type", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_come_back_exactly_from_their_dequantized_values(gguf_type):
    """gguf-py's quantizers round as llama.cpp's reference ones: its blocks, dequantized, then
    re-derived by QuantizedWeight, dequantize to the same values bit for bit (outliers, a zero
    block and a constant block included)."""
    from cluster.kernels import cpu_kernels
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(0)
    w = rng.standard_normal((67, 256)).astype(np.float32)
    w[3, :32] = 0.0
    w[5, 32:64] = 0.25
    w[7, 100] = 40.0
    kind = getattr(GGMLQuantizationType, gguf_type)
    dequantized = torch.from_numpy(quants.dequantize(quants.quantize(w, kind), kind).copy())
    quantized = QuantizedWeight.quantize(dequantized, gguf_type.lower(), cpu_kernels.load())
    assert torch.equal(quantized.dequantize(torch.float32), dequantized)
    # bits a weight: values, then per block of 32: Q8_0 an fp32 scale (and W8A8's int32 offset),
    # Q4 an fp16 d and m (the 67 features padded to 68)
    w8a8 = quantized.offsets is not None
    bits = {"Q8_0": 8 + (32 + 32 * w8a8) / GGUF_GROUP, "Q4_0": 4 + 32 / GGUF_GROUP, "Q4_1": 4 + 32 / GGUF_GROUP}[gguf_type]
    assert quantized.nbytes == 68 * 256 * bits / 8


def test_int8_quantization_is_symmetric_per_feature():
    w = torch.tensor([[0.5, -1.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0]])
    q, scales = quantize_int8(w)
    assert q.tolist() == [[64, -127, 32, 0], [0, 0, 0, 0]]  # 63.5 rounds to even
    assert torch.equal(scales, torch.tensor([[1.0], [127.0]]) / 127)


# ---- plans -------------------------------------------------------------------------------------


def test_plans_for_each_option_and_checkpoint(smollm2_path, tiny_llama_dir, tmp_path):
    """The shipped SmolLM2 GGUF with "gguf": Q4_1 layers and a Q8_0 (tied) head, both served in
    their blocks; without it, or an HF folder: floats unless int8 is asked for; a bad value, gguf
    on a folder, or any quantization on CUDA: a ValueError naming it."""
    plan = quant_plan("gguf", smollm2_path, "cpu")
    assert (plan.layers, plan.head) == ("q4_1", "q8_0")
    assert quant_plan(None, smollm2_path, "cpu") is None and quant_plan(None, tiny_llama_dir, "cpu") is None
    assert (quant_plan("int8", tiny_llama_dir, "cpu").layers, quant_plan("int8", smollm2_path, "cpu").head) == ("int8", "int8")
    assert quant_plan(None, smollm2_path, "cuda") is None
    with pytest.raises(ValueError, match="quantization must be one of .* got 'awq'"):
        quant_plan("awq", tiny_llama_dir, "cpu")
    with pytest.raises(ValueError, match="needs a .gguf model file"):
        quant_plan("gguf", tiny_llama_dir, "cpu")
    with pytest.raises(ValueError, match="runs on CPU only"):
        quant_plan("int8", tiny_llama_dir, "cuda")


def test_engine_option_is_checked_at_start(tiny_llama_dir):
    from cluster.config import EngineConfig

    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig.create(model=tiny_llama_dir, quantization="int4").finalize()


def test_quantized_layers_default_to_fp32_activations_over_the_auto_cache(tiny_llama_dir, smollm2_path):
    """dtype "auto" with quantized layers on CPU is llama.cpp's mix: fp32 activations, the cache in
    the dtype "auto" picks for an unquantized model (bf16 where the CPU has it). A dtype or
    kv_cache_dtype given is kept."""
    from cluster.config import EngineConfig, resolve_dtype

    def dtypes(**options):
        cfg = EngineConfig.create(model=options.pop("model", tiny_llama_dir), device="cpu", **options).finalize()
        return cfg.model_config.torch_dtype, cfg.cache_config.kv_torch_dtype

    auto = resolve_dtype("auto", "cpu")
    assert dtypes() == (auto, auto)
    assert dtypes(quantization="int8") == (torch.float32, auto)
    assert dtypes(model=smollm2_path, quantization="gguf") == (torch.float32, auto)
    assert dtypes(model=smollm2_path) == (auto, auto)  # a GGUF loaded dequantized
    assert dtypes(quantization="int8", dtype="bfloat16") == (torch.bfloat16, torch.bfloat16)
    assert dtypes(quantization="int8", dtype="float32") == (torch.float32, torch.float32)
    assert dtypes(quantization="int8", dtype="float32", kv_cache_dtype="bfloat16") == (torch.float32, torch.bfloat16)


# ---- whole models --------------------------------------------------------------------------------


def _load(path: str, dtype: torch.dtype, plan) -> torch.nn.Module:
    from test_model import BLOCK, _model_config

    from cluster.model.kv_cache import bind_kv_cache
    from cluster.model.loader import load_model
    from cluster.model.parallel import SINGLE

    mc = _model_config(path, dtype)
    mc = mc.with_facts(quant_plan=plan)
    model = load_model(mc, SINGLE, torch.device("cpu"))
    bind_kv_cache(model, 96, BLOCK, dtype, "cpu")
    return model


def _prefill_logits(path: str, dtype: torch.dtype, plan, prompts: list[list[int]] | None = None
                    ) -> tuple[list[torch.Tensor], torch.nn.Module]:
    from test_model import PROMPTS

    model = _load(path, dtype, plan)
    return _prefill(model, prompts or PROMPTS), model


def _prefill(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Every prompt prefilled from scratch in one step: per-prompt logits (fp32)."""
    from test_model import Pager, _prefill_all

    return [logits.float() for logits in _prefill_all(model, prompts, Pager(96))]


def _prefill_hidden(model, prompts: list[list[int]]) -> torch.Tensor:
    """Every prompt prefilled from scratch in one step: the final hidden states [rows, hidden]."""
    from test_model import Pager, _prefill_hidden

    return torch.cat(_prefill_hidden(model, prompts, Pager(96)))


def _quantized(model) -> list[QuantizedWeight]:
    return [m.packed for m in model.modules() if isinstance(getattr(m, "packed", None), QuantizedWeight)]


def test_gguf_served_in_its_blocks_computes_what_its_floats_compute(smollm2_path):
    """SmolLM2's GGUF (Q4_1 layers, Q8_0 tied head) in fp32, "gguf": served in its blocks, at 0.6
    bytes a layer weight, the embedding a float tensor. A step of many rows (99 here) computes
    the dequantized model's hidden states up to the order of fp32 sums, or on the AVX2 build, whose
    Q4 layers multiply int8 activations at any number of rows, each prompt's own step's bit for
    bit (and the floats' up to x's rounding); the Q8_0 head, with
    AVX512-VNNI or on the AVX2 build, is W8A8's product of them (int8_gemm's documented math, or
    int8_linear's, x per run of 32). A prompt alone (7 to 41 rows) takes the few-rows kernels,
    which with AVX512-VNNI or AVX2 multiply Q4 by int8 activations: close to the floats' logits
    and mostly the same argmax."""
    from test_model import PROMPTS

    prompts = [*PROMPTS, list(range(200, 240))]
    plan = quant_plan("gguf", smollm2_path, "cpu")
    model_floats, model = _load(smollm2_path, torch.float32, None), _load(smollm2_path, torch.float32, plan)
    quantized = _quantized(model)
    assert sorted({q.kind for q in quantized}) == ["q4_1", "q8_0"] and len(quantized) == 30 * 4 + 1
    layer_weights = sum(q.out_features * q.in_features for q in quantized if q.kind == "q4_1")
    assert sum(q.nbytes for q in quantized if q.kind == "q4_1") == layer_weights * 5 // 8  # Q4_1's 5 bits
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert sum(map(len, prompts)) > max(q.skinny_rows for q in quantized)
    ref_hidden = _prefill_hidden(model_floats, prompts)
    hidden = _prefill_hidden(model, prompts)
    if quantized[0].kernels.int8_int8_activations:  # the AVX2 build: W4A8 at any number of rows
        alone = torch.cat([_prefill_hidden(model, [p]) for p in prompts])  # 7 to 41 rows each
        assert torch.equal(hidden, alone)  # x quantized per row: each row as in its prompt's own step
        assert (hidden - ref_hidden).norm() < 0.1 * ref_hidden.norm()  # x's rounding: 5.8% seen
    else:
        assert (hidden - ref_hidden).abs().max() < 1e-3 * ref_hidden.abs().max()  # fp32 rounding of other sums
    (head,) = [q for q in quantized if q.kind == "q8_0"]
    with torch.inference_mode():
        logits, ref_logits = model.compute_logits(hidden), model_floats.compute_logits(hidden)
    if head.offsets is not None or head.kernels.int8_int8_activations:  # int8_gemm, or the AVX2 build's W8A8
        q, scales = quantize_int8(head.dequantize(torch.float32), GGUF_GROUP)  # the blocks, exactly
        want = _w8a8_reference(hidden, q, scales, None, size=None if head.offsets is not None else GGUF_GROUP)
        bound = hidden.abs().double() @ head.dequantize(torch.float32).double().abs().T
        # fp32 rounding of lanes that carry 128 q besides the products (int8_gemm_cpu.cpp): 0.9e-6 seen
        assert ((logits.double() - want).abs() <= 2e-6 * bound + 1e-5).all()
        assert (logits - ref_logits).norm() < 0.02 * ref_logits.norm()  # x's rounding: 0.55% seen
        assert (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean() >= 0.9  # 98% seen
    else:
        assert (logits - ref_logits).abs().max() < 2e-3 and torch.equal(logits.argmax(-1), ref_logits.argmax(-1))
    floats = _prefill(model_floats, PROMPTS)
    int8_activations = quantized[0].kernels.q4_int8_activations
    same_argmax = []
    for prompt, ref in zip(PROMPTS, floats):
        (ours,) = _prefill(model, [prompt])
        if int8_activations:  # Q4 layers W4A8 and the Q8_0 head W8A8
            assert (ours - ref).norm() < 0.1 * ref.norm()  # 3-5% seen (a wrong product: ~100%)
            same_argmax.append(ours.argmax(-1) == ref.argmax(-1))
        else:
            assert (ours - ref).abs().max() < 2e-3 and torch.equal(ours.argmax(-1), ref.argmax(-1))
    if same_argmax:
        assert torch.cat(same_argmax).float().mean() >= 0.75  # 88% of the 59 positions seen


def test_fused_decode_with_q4_blocks_equals_the_modular_layers(smollm2_path):
    """SmolLM2's GGUF in its blocks, bf16: decode steps of 1 and 13 rows (past the weight-only
    kernels' 12, within the int8-activation kernel's reach) run each layer as one call and give
    the modular layers' bits, hidden states and the K/V written."""
    from test_model import BLOCK, Pager, _assert_fused_step_is_modular, _model_config, _step

    from cluster.model.kv_cache import bind_kv_cache
    from cluster.model.layers.attention import Attention
    from cluster.model.loader import load_model
    from cluster.model.parallel import SINGLE

    mc = _model_config(smollm2_path, torch.bfloat16)
    mc = mc.with_facts(quant_plan=quant_plan("gguf", smollm2_path, "cpu"))
    model = load_model(mc, SINGLE, torch.device("cpu"))
    fused = model.model.fused_decode
    q4_rows = _quantized(model)[0].skinny_rows
    assert fused is not None and fused.max_rows == q4_rows
    assert q4_rows == (INT8_X_MAX_ROWS if _quantized(model)[0].kernels.q4_int8_activations else SKINNY_MAX_ROWS)
    bind_kv_cache(model, 128, BLOCK, torch.bfloat16, "cpu")
    caches = [(m.k_cache, m.v_cache) for m in model.modules() if isinstance(m, Attention)]
    pager = Pager(128)
    prompts = [[7 + i, 300 + 5 * i, 11, 2 + i] for i in range(13)]
    tables = [pager.blocks_for([], 4) for _ in prompts]
    _step(model, [(p, 0, 3, t) for p, t in zip(prompts, tables)])  # prefill
    for rows in (1, min(13, q4_rows)):
        _assert_fused_step_is_modular(model, [(p, 3, 4, t) for p, t in zip(prompts[:rows], tables)], caches)


def test_int8_model_tracks_bf16_with_no_float_copy(tiny_llama_dir):
    """A random-weight llama, int8 against its own bf16: every linear layer and the head
    quantized per feature, no float weight left but the embedding, logits within int8's error."""
    from cluster.model.layers.quant_plan import QuantPlan

    ref, _ = _prefill_logits(tiny_llama_dir, torch.bfloat16, None)
    got, model = _prefill_logits(tiny_llama_dir, torch.bfloat16, QuantPlan(layers="int8", head="int8"))
    quantized = _quantized(model)
    linears = [m for m in model.modules() if hasattr(m, "pack_weight")]
    assert len(quantized) == len(linears) and {q.kind for q in quantized} == {"int8"}
    assert all(m.weight is None for m in linears if not getattr(m, "is_lm_head", False))
    for ours, theirs in zip(got, ref):
        cos = torch.nn.functional.cosine_similarity(ours, theirs, dim=-1)
        assert cos.min() > 0.995, cos.min()


def test_int8_decode_through_the_engine(tiny_llama_dir):
    """`LLM(..., quantization="int8")` generates (W8A8 on this CPU when it has AVX512-VNNI, else
    in-register dequantization for decode and a float GEMM for prefill) and agrees with bf16 on
    the first greedy token."""
    from cluster import LLM, SamplingParams

    prompts = [{"prompt_token_ids": p} for p in ([1, 5, 9, 200, 31, 7], [4, 4, 4, 4], list(range(100, 160)))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    firsts = {}
    for quantization in (None, "int8"):
        llm = LLM(model=tiny_llama_dir, dtype="bfloat16", quantization=quantization, max_num_seqs=4)
        outs = llm.generate(prompts, params)
        assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
        firsts[quantization] = [o.outputs[0].token_ids[0] for o in outs]
    assert firsts["int8"] == firsts[None]
