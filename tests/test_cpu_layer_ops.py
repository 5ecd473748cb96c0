"""The CPU kernel library's fused layer ops (rms_norm, fused_add_rms_norm_, silu_and_mul, rotary_)
against the unfused torch sequence of HF's modelling code, for every instruction set this CPU
runs, the decode GEMM (skinny_linear) and the many-rows FMA GEMM (fma_linear) against an fp32
reference, and packed linear weights (oneDNN's or fma_linear's layout, and the skinny one beside
it) against F.linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cluster.model.layers import cpu_gemm
from cluster.model.layers.cpu_gemm import (GEMM_ENV, SKINNY_EVERY_ROW, SKINNY_MAX_ROWS,
                                           PackedWeight, can_pack, pack_linears)
from cluster.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from cluster.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from cluster.model.layers.rotary import RotaryEmbedding, _inv_freq




def _hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _assert_matches(got: torch.Tensor, ref: torch.Tensor) -> None:
    """bf16: equal but for rare elements a bit or two apart (the fp32 sum of squares in another
    order; exp's last bit, which SiLU's two roundings can double); fp32: within a few ulps."""
    if got.dtype == torch.bfloat16:
        differ = (got != ref).float().mean().item()
        assert differ <= 1e-3, f"{differ:.2%} of the elements differ"
        torch.testing.assert_close(got, ref, atol=0, rtol=2 ** -6)
    else:
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)


DTYPES = [torch.bfloat16, torch.float32]
ROWS = [(1, 576), (64, 576), (7, 100), (300, 64)]  # decode / batch rows, an odd width (scalar tail)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("rows,n", ROWS)
def test_norms_match_hf(ops, dtype, rows, n):
    gen = torch.Generator().manual_seed(rows * n)
    x = (torch.randn(rows, n, generator=gen) * 3).to(dtype)
    res = torch.randn(rows, n, generator=gen).to(dtype)
    w = (torch.rand(n, generator=gen) + 0.5).to(dtype)
    _assert_matches(ops.rms_norm(x, w, 1e-5), _hf_rms_norm(x, w, 1e-5))
    x2, res2 = x.clone(), res.clone()
    out, new_res = ops.fused_add_rms_norm_(x2, res2, w, 1e-5)
    assert out.data_ptr() == x2.data_ptr() and new_res.data_ptr() == res2.data_ptr()  # in place
    assert torch.equal(res2, x + res)
    _assert_matches(x2, _hf_rms_norm(x + res, w, 1e-5))


def test_rms_norm_keeps_leading_dims_and_strided_heads(ops):
    """Qwen3's per-head norm: a [tokens, heads, head_dim] view into the qkv output."""
    qkv = torch.randn(5, 6 * 24).bfloat16()
    q = qkv[:, : 4 * 24].view(5, 4, 24)
    w = torch.rand(24).bfloat16() + 0.5
    out = ops.rms_norm(q, w, 1e-6)
    assert out.shape == (5, 4, 24)
    _assert_matches(out, _hf_rms_norm(q, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("rows,d", [(1, 1536), (64, 1536), (3, 100)])
def test_silu_and_mul_matches_torch(ops, dtype, rows, d):
    x = (torch.randn(rows, 2 * d, generator=torch.Generator().manual_seed(d)) * 4).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's range ends and zero
    _assert_matches(ops.silu_and_mul(x), F.silu(x[:, :d]) * x[:, d:])


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (64, 32), (128, 128), (24, 24)])
def test_rotary_in_place_matches_rotate(ops, dtype, head_dim, rotary_dim):
    rope = RotaryEmbedding(head_dim, rotary_dim, 4096, _inv_freq(10000.0, rotary_dim))
    tokens = 37
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(head_dim))
    qkv = torch.randn(tokens, 15 * head_dim).to(dtype)  # 9 q + 3 k + 3 v heads
    qk = qkv[:, : 12 * head_dim].view(tokens, 12, head_dim)  # strided rows, as the model passes it
    v_before = qkv[:, 12 * head_dim:].clone()
    cos, sin = rope.lookup(positions, dtype)
    ref = rope.rotate(qk, cos, sin)
    out = ops.rotary_(qk, cos.squeeze(1), sin.squeeze(1))
    assert out.data_ptr() == qkv.data_ptr() and torch.equal(qkv[:, 12 * head_dim:], v_before)
    if dtype == torch.bfloat16:
        assert torch.equal(out, ref)
    else:  # fused multiply-adds may round once where torch rounds twice
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)


def test_ops_check_shapes_and_dtypes(ops):
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="weight do not match"):
        ops.rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="float32 and bfloat16"):
        ops.silu_and_mul(x.half())
    with pytest.raises(RuntimeError, match="rotary_dim"):
        ops.rotary_(x.view(4, 2, 4), torch.ones(4, 3), torch.ones(4, 3))


# ---- skinny_linear: the decode GEMM ---------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9])
def test_skinny_linear_is_the_fp32_product_rounded_once(ops, dtype, rows):
    """Features not a multiple of the 4-feature block, inputs not a multiple of the vector
    width, leading dims kept, with and without bias: the fp32 sum of the exact products,
    rounded once into the dtype (so bf16 is within half an ulp of the fp32 reference, up to
    the order of the sum)."""
    gen = torch.Generator().manual_seed(rows)
    n, k = 203, 77
    w = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    x = torch.randn(rows, 1, k, generator=gen).to(dtype)
    packed = ops.skinny_pack(w)
    ref = x.double() @ w.double().T
    got = ops.skinny_linear(x, packed, None, n)
    assert got.shape == (rows, 1, n) and got.dtype == dtype
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-3, rtol=2 ** -8)
    torch.testing.assert_close(got.double(), ref, **tol)
    with_bias = ops.skinny_linear(x, packed, bias, n)
    torch.testing.assert_close(with_bias.double(), ref + bias.double(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_skinny_row_comes_out_the_same_whatever_rows_share_its_call(ops, dtype):
    """Rows go through in passes of a few (two to four, by build and dtype) over each block of
    the weight: a row's result is its own sum in the same order whichever pass it falls in, so
    a sequence's logits do not depend on how many others its decode step had."""
    gen = torch.Generator().manual_seed(11)
    n, k = 130, 200
    w = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(10, k, generator=gen).to(dtype)
    packed = ops.skinny_pack(w)
    alone = torch.cat([ops.skinny_linear(x[i:i + 1], packed, None, n) for i in range(10)])
    for rows in range(2, 11):
        assert torch.equal(ops.skinny_linear(x[:rows], packed, None, n), alone[:rows]), rows


def test_skinny_linear_refuses_a_mismatched_weight(ops):
    packed = ops.skinny_pack(torch.randn(8, 32))
    with pytest.raises(RuntimeError, match="not skinny_pack of a"):
        ops.skinny_linear(torch.randn(1, 32), packed, None, 16)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.skinny_linear(torch.randn(1, 32).bfloat16(), packed, None, 8)
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.skinny_linear(torch.randn(1, 32), packed, torch.randn(7), 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4, 13, 130])
def test_fma_linear_is_the_fp32_product_rounded_once(ops, dtype, rows):
    """Features not a multiple of the 32-feature panel, rows past one pass (12) and one chunk
    (96), leading dims kept, with and without bias: the fp32 sum of the products, rounded once
    into x's dtype. Only the AVX-512 build has it; the others refuse the call."""
    gen = torch.Generator().manual_seed(rows)
    n, k = 203, 77
    w = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).to(dtype)
    x = torch.randn(rows, 1, k, generator=gen).to(dtype)
    packed = ops.fma_pack(w)
    assert packed.shape == (7, k, 32)
    if not ops.has_fma_gemm:
        with pytest.raises(RuntimeError, match="AVX-512 build"):
            ops.fma_linear(x, packed, None, n)
        return
    ref = x.double() @ w.double().T
    got = ops.fma_linear(x, packed, None, n)
    assert got.shape == (rows, 1, n) and got.dtype == dtype
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-3, rtol=2 ** -8)
    torch.testing.assert_close(got.double(), ref, **tol)
    torch.testing.assert_close(ops.fma_linear(x, packed, bias, n).double(), ref + bias.double(), **tol)
    with pytest.raises(RuntimeError, match="not fma_pack of a"):
        ops.fma_linear(x, packed, None, 230)
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.fma_linear(x, packed, bias[:7], n)


@pytest.mark.parametrize("gemm", ["onednn", "fma", "aten"])
@pytest.mark.parametrize("onednn_bf16", ["host", "avx2-host"])
def test_packed_weight_takes_the_skinny_path_for_a_few_rows_or_where_bf16_has_no_fast_gemm(ops, gemm, onednn_bf16,
                                                                                             monkeypatch):
    """Up to SKINNY_MAX_ROWS rows the kernel library's skinny GEMM (same products, another order),
    past them the many-rows GEMM this process uses: oneDNN's or ATen's F.linear on the plain
    weight (bit-identical to F.linear), or fma_linear (same products, in input order), whichever
    LLM_CLUSTER_CPU_GEMM names and this CPU runs. "avx2-host": a CPU on which oneDNN cannot pack
    bf16 (no AVX-512 BW/VL/DQ): oneDNN's layout is never asked for there, and where the many-rows
    GEMM would be ATen's (slow) bf16 path the skinny layout alone takes every row count."""
    monkeypatch.setenv(GEMM_ENV, gemm)
    if onednn_bf16 == "avx2-host":
        monkeypatch.setattr(cpu_gemm, "onednn_packs_bf16", lambda: False)
        monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", lambda *a: pytest.fail("oneDNN asked to pack"))
    onednn_here = cpu_gemm.onednn_packs_bf16()
    chosen = {"fma": "fma" if ops.has_fma_gemm else ("onednn" if onednn_here else "aten"),
              "onednn": "onednn" if onednn_here else "aten", "aten": "aten"}[gemm]
    assert cpu_gemm.many_rows_gemm(ops) == chosen
    every_row = chosen == "aten" and not onednn_here
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 96, generator=gen).bfloat16()
    bias = torch.randn(300, generator=gen).bfloat16()
    assert can_pack(w, ops) and can_pack(w) == onednn_here
    packed = PackedWeight.of(w, ops)
    layouts = {"fma": packed.fma, "onednn": packed.onednn, "aten": packed.plain}
    assert [name for name, t in layouts.items() if t is not None] == ([] if every_row else [chosen])
    assert packed.skinny_rows == (SKINNY_EVERY_ROW if every_row else SKINNY_MAX_ROWS)
    many_rows_bytes = 0 if every_row else 2 * (packed.fma.numel() if chosen == "fma" else w.numel())
    assert packed.nbytes == 2 * packed.skinny.numel() + many_rows_bytes
    for rows in (1, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1, 40):
        x = torch.randn(rows, 96, generator=gen).bfloat16()
        got, ref = packed.linear(x, bias), F.linear(x, w, bias)
        if rows <= SKINNY_MAX_ROWS or every_row:
            assert torch.equal(got, ops.skinny_linear(x, packed.skinny, bias, 300))
        elif chosen == "fma":
            assert torch.equal(got, ops.fma_linear(x, packed.fma, bias, 300))
        else:
            assert torch.equal(got, ref)
        torch.testing.assert_close(got.float(), ref.float(), atol=0.05, rtol=2 ** -7)


def test_many_rows_gemm_is_timed_once_or_named(ops, monkeypatch, caplog):
    """auto times both GEMMs once per process and keeps the answer; a bad name is an error that
    names the variable."""
    monkeypatch.setattr(cpu_gemm, "_chosen", None)
    monkeypatch.setenv(GEMM_ENV, "auto")
    with caplog.at_level("INFO", logger="cluster.model.layers.cpu_gemm"):
        first = cpu_gemm.many_rows_gemm(ops)
    onednn = "onednn" if cpu_gemm.onednn_packs_bf16() else "aten"
    assert first in ("fma", onednn) if ops.has_fma_gemm else first == onednn
    if ops.has_fma_gemm:
        assert "fma_linear" in caplog.text and "oneDNN" in caplog.text
        monkeypatch.setattr(cpu_gemm, "_time_gemms", lambda kernels: pytest.fail("timed twice"))
        assert cpu_gemm.many_rows_gemm(ops) == first
    monkeypatch.setenv(GEMM_ENV, "mkl")
    with pytest.raises(ValueError, match="LLM_CLUSTER_CPU_GEMM must be one of auto, onednn, fma, aten, got 'mkl'"):
        cpu_gemm.many_rows_gemm(ops)


def test_gemm_timings_take_turns():
    """The two GEMMs of a timing alternate round by round (a warm-up call, then the timed calls),
    so load from a neighbour falls on both; the answer is each one's median ms per call."""
    order = []
    medians = cpu_gemm._alternate({"a": lambda: order.append("a"), "b": lambda: order.append("b")},
                                  rounds=3, calls=2)
    assert order == (["a"] * 3 + ["b"] * 3) * 3
    assert set(medians) == {"a", "b"} and all(0 <= m < 1 for m in medians.values())


# ---- packed linear weights ----------------------------------------------------------------


def _four_layers() -> torch.nn.Module:
    """Two linears, an LM head tied to an embedding and an untied one, bf16."""
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Module()
    model.up = ColumnParallelLinear(96, 200, bias=True)
    model.down = RowParallelLinear(200, 96)
    model.embed = VocabParallelEmbedding(300, 96)
    model.head = ParallelLMHead(300, 96)
    model.head.weight = model.embed.weight  # tied
    model.untied = ParallelLMHead(300, 96)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model.to(torch.bfloat16)


def _outputs(model: torch.nn.Module) -> list[torch.Tensor]:
    x = torch.randn(3, 5, 96, generator=torch.Generator().manual_seed(1)).bfloat16()  # leading dims kept
    return [model.down(model.up(x)), model.head(x[0]), model.untied(x[0])]


def test_packed_linears_are_bit_identical_and_release_the_plain_weight():
    """Where oneDNN runs bf16 on this CPU (AVX-512-BF16 / AMX) the four layers are packed;
    elsewhere none is (without the kernel library), and the layers keep F.linear. Either way the
    outputs do not change."""
    bf16_gemm = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert can_pack(torch.empty(2, 2, dtype=torch.bfloat16)) == bf16_gemm
    model = _four_layers()
    before = _outputs(model)
    assert pack_linears(model) == (4 if bf16_gemm else 0)
    for a, b in zip(before, _outputs(model)):
        assert torch.equal(a, b)
    if bf16_gemm:
        assert model.up.weight is None and model.down.weight is None and model.untied.weight is None
        assert model.head.weight is model.embed.weight and model.head.packed is not None  # tied: kept


def test_an_avx2_cpu_serves_bf16_weights_from_the_skinny_layout_alone(monkeypatch):
    """Where oneDNN cannot pack bf16 (an AVX2-only CPU) the kernel library gives each layer its
    skinny layout (what the fused decode layers read) and it takes every row count: F.linear's
    bf16 path there is the slow one. The plain weights are released (a tied head's stays with its
    embedding); outputs are F.linear's but for the summation order."""
    from cluster.kernels import cpu_kernels

    monkeypatch.setattr(cpu_gemm, "onednn_packs_bf16", lambda: False)
    monkeypatch.setenv(GEMM_ENV, "auto")
    kernels = cpu_kernels.load("avx2")
    model = _four_layers()
    before = _outputs(model)
    x40 = torch.randn(40, 96, generator=torch.Generator().manual_seed(3)).bfloat16()
    assert pack_linears(model, kernels) == 4
    for a, b in zip(before, _outputs(model)):
        torch.testing.assert_close(a.float(), b.float(), atol=0.1, rtol=2 ** -7)
    for layer in (model.up, model.down, model.head, model.untied):
        assert layer.packed.onednn is None and layer.packed.plain is None and layer.packed.fma is None
        assert layer.packed.skinny is not None and layer.packed.skinny_rows == SKINNY_EVERY_ROW
    assert torch.equal(model.up(x40), kernels.skinny_linear(x40, model.up.packed.skinny, model.up.bias, 200))
    assert model.up.weight is None and model.untied.weight is None and model.head.weight is model.embed.weight
    assert model.untied.packed.nbytes == 2 * 300 * 96  # the skinny copy alone


@pytest.mark.parametrize("asked", ["onednn", "aten", "auto-onednn-faster", "auto-a-tie"])
def test_fp32_weights_take_onednn_where_it_wins(asked, monkeypatch, caplog):
    """fp32 weights: LLM_CLUSTER_CPU_GEMM=onednn packs them in oneDNN's layout (no skinny form,
    the plain weight released, a tied head's kept), aten leaves them on F.linear, auto times both
    once per process and keeps oneDNN only if it took under 0.9x the time. Packed outputs are
    F.linear's but for the summation order; a quantizing pass (floats=False) packs none."""
    monkeypatch.setenv(GEMM_ENV, asked.split("-")[0])
    monkeypatch.setattr(cpu_gemm, "_chosen_fp32", None)
    timings = {"auto-onednn-faster": (2.0, 1.0), "auto-a-tie": (1.0, 0.95)}.get(asked)
    calls = []
    monkeypatch.setattr(cpu_gemm, "_time_fp32_gemms", lambda: calls.append(1) or timings)
    want = "onednn" if asked in ("onednn", "auto-onednn-faster") else "aten"
    with caplog.at_level("INFO", logger="cluster.model.layers.cpu_gemm"):
        assert cpu_gemm.fp32_gemm() == want and cpu_gemm.fp32_gemm() == want
    assert len(calls) == (1 if timings else 0)  # timed once, only when asked to choose
    if timings:
        assert f"fp32 GEMMs: {want}" in caplog.text
    assert can_pack(torch.empty(2, 2)) == (want == "onednn")
    model = _four_layers().float()
    before = _outputs_fp32(model)
    assert pack_linears(model, floats=False) == 0
    assert pack_linears(model) == (4 if want == "onednn" else 0)
    for a, b in zip(before, _outputs_fp32(model)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)
    if want == "onednn":
        for layer in (model.up, model.down, model.head, model.untied):
            assert layer.packed.onednn is not None and layer.packed.skinny is None and layer.packed.skinny_rows == 0
        assert model.up.weight is None and model.head.weight is model.embed.weight  # tied: kept
        assert model.untied.packed.nbytes == 4 * 300 * 96


@pytest.mark.parametrize("gemm", ["onednn", "aten"])
def test_fp32_weights_with_the_kernel_library_get_the_skinny_layout_too(gemm, monkeypatch):
    """With the kernel library an fp32 weight gets the skinny layout whichever GEMM the start-up
    timing gave its many rows (oneDNN's on its reordered copy, or F.linear on the weight as
    loaded: a close timing must not take the skinny layout away): up to
    `fp32_skinny_rows` rows (64 with the AVX2 build, 8 with others) `linear` runs skinny_linear
    (what the fused decode layers read, and so a speculative step's k + 1 rows), past them that GEMM (F.linear's bits on ATen's path);
    all F.linear's values but for the summation order. Every weight's skinny form moves to the
    huge-page arena."""
    from cluster.kernels import cpu_kernels

    monkeypatch.setenv(GEMM_ENV, "auto")
    monkeypatch.setattr(cpu_gemm, "_chosen_fp32", gemm)  # what the timing chose
    kernels = cpu_kernels.load()
    skinny_rows = cpu_gemm.fp32_skinny_rows(kernels)
    model = _four_layers().float()
    gen = torch.Generator().manual_seed(2)
    xs = {rows: torch.randn(rows, 96, generator=gen)
          for rows in (1, SKINNY_MAX_ROWS, 5, skinny_rows, skinny_rows + 1, 100)}
    want = {rows: F.linear(x, model.up.weight, model.up.bias) for rows, x in xs.items()}
    assert can_pack(model.up.weight, kernels) and pack_linears(model, kernels) == 4
    for layer in (model.up, model.down, model.head, model.untied):
        assert (layer.packed.onednn is not None) == (gemm == "onednn") and layer.packed.skinny is not None
        assert (layer.packed.plain is not None) == (gemm == "aten")
        assert layer.packed.skinny_rows == skinny_rows
    assert model.untied.packed.nbytes == 2 * 4 * 300 * 96  # the many-rows GEMM's copy and the skinny one
    for rows, x in xs.items():
        got = model.up(x)
        torch.testing.assert_close(got, want[rows], atol=1e-5, rtol=1e-5)
        if rows <= skinny_rows:
            assert torch.equal(got, kernels.skinny_linear(x, model.up.packed.skinny, model.up.bias, 200))
        elif gemm == "aten":
            assert torch.equal(got, want[rows])
    assert cpu_gemm.move_to_huge_pages(model) >= 4 * (200 * 96 + 96 * 200 + 2 * 300 * 96)  # fp32 bytes


def _outputs_fp32(model: torch.nn.Module) -> list[torch.Tensor]:
    x = torch.randn(3, 5, 96, generator=torch.Generator().manual_seed(1))  # leading dims kept
    return [model.down(model.up(x)), model.head(x[0]), model.untied(x[0])]
