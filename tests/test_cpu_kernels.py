"""The CPU paged attention kernel (cluster/kernels) against a plain reference on random caches,
its build / fallback, and its selection as the attention backend."""
from __future__ import annotations

import logging
import random

import pytest
import torch

from cluster.kernels import cpu_kernels
from cluster.model.context import build_attention_metadata
from cluster.model.layers.attention import select_backend


def _reference(q, k_cache, v_cache, tables, specs, scale):
    """Per query and head: softmax(q . K[:visible] * scale) @ V[:visible], in fp32, with K/V
    looked up slot by slot through the block table."""
    heads_width, (_, block, kv_heads, hd) = q.shape[1], k_cache.shape
    group = heads_width // hd // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32)
    for table, (start, q_len, ctx) in zip(tables, specs):
        slots = [table[t // block] * block + t % block for t in range(ctx)]
        keys = k_cache.reshape(-1, kv_heads, hd)[slots].float()
        values = v_cache.reshape(-1, kv_heads, hd)[slots].float()
        for i in range(q_len):
            visible = ctx - q_len + i + 1
            for h in range(heads_width // hd):
                qh = q[start + i, h * hd:(h + 1) * hd].float()
                probs = torch.softmax(keys[:visible, h // group] @ qh * scale, dim=0)
                out[start + i, h * hd:(h + 1) * hd] = probs @ values[:visible, h // group]
    return out


def _case(rng: random.Random, dtype, heads, kv_heads, hd, block, q_ctx):
    """Random caches with randomly placed blocks, and sequences of (query_len, context_len)."""
    num_blocks = sum(-(-c // block) for _, c in q_ctx) + 3
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    k_cache = torch.randn(num_blocks, block, kv_heads, hd, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block, kv_heads, hd, generator=gen).to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, specs, start = [], [], 0
    for q_len, ctx in q_ctx:
        tables.append([free.pop() for _ in range(-(-ctx // block))])
        specs.append((start, q_len, ctx))
        start += q_len
    q = (torch.randn(start, heads * hd, generator=gen) * 2).to(dtype)
    return q, k_cache, v_cache, tables, specs


def _run(kernel, q, k_cache, v_cache, tables, specs, scale, tile=cpu_kernels.TILE_QUERIES):
    width = max(map(len, tables))
    as_int = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    kernel.paged_attention(out, q, k_cache, v_cache, as_int([t + [0] * (width - len(t)) for t in tables]),
                           as_int([c for _, _, c in specs]), as_int([s for s, _, _ in specs]),
                           as_int([n for _, n, _ in specs]), scale, tile)
    return out


def _ragged(rng: random.Random, decodes: int, chunks: list[int]) -> list[tuple[int, int]]:
    """Decodes over contexts of 1-150 tokens, then prefill chunks over prefixes of 0-90."""
    return ([(1, rng.randint(1, 150)) for _ in range(decodes)]
            + [(n, n + rng.choice([0, rng.randint(1, 90)])) for n in chunks])


@pytest.fixture(scope="module")
def kernel():
    k = cpu_kernels.load()
    assert k is not None, "the CPU attention kernel must build where the tests run (g++ is there)"
    return k


# (heads, kv_heads, head_dim, block_size): GQA ratios 3, 1, 4 and 2; vector head dims 64 / 128
# / 32 and an odd 40 (scalar path in any build); block sizes 16 and others.
SHAPES = [(9, 3, 64, 16), (4, 4, 32, 5), (8, 2, 128, 16), (6, 3, 40, 7), (8, 1, 64, 32)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-kv{}-d{}-b{}".format(*s))
def test_kernel_matches_reference(kernel, dtype, shape):
    heads, kv_heads, hd, block = shape
    rng = random.Random(hash(shape) % 1000)
    q, kc, vc, tables, specs = _case(rng, dtype, heads, kv_heads, hd, block, _ragged(rng, 7, [2, 19, 40]))
    scale = hd ** -0.5
    got = _run(kernel, q, kc, vc, tables, specs, scale)
    ref = _reference(q, kc, vc, tables, specs, scale)
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)
    else:  # fp32 math; the only rounding is the bf16 output's
        torch.testing.assert_close(got.float(), ref.to(torch.bfloat16).float(), atol=1e-2, rtol=1e-2)
        assert (got.float() - ref).abs().max() <= ref.abs().max() * 2 ** -8


@pytest.mark.parametrize("tile", [1, 3, 64])
def test_query_tiles_do_not_change_results(kernel, tile):
    """Tiling only groups the work: every tile size gives the reference rows (GQA 3)."""
    rng = random.Random(tile)
    q, kc, vc, tables, specs = _case(rng, torch.float32, 6, 2, 64, 16, _ragged(rng, 3, [3, 33, 70]))
    got = _run(kernel, q, kc, vc, tables, specs, 0.2, tile=tile)
    torch.testing.assert_close(got, _reference(q, kc, vc, tables, specs, 0.2), atol=2e-6, rtol=1e-5)


def test_kernel_leaves_unlisted_rows_and_checks_inputs(kernel):
    rng = random.Random(3)
    q, kc, vc, tables, specs = _case(rng, torch.float32, 4, 2, 64, 16, [(1, 20), (5, 30)])
    out = _run(kernel, q, kc, vc, tables[:1], specs[:1], 0.125)  # only the first sequence listed
    assert not out[0].isnan().any() and out[1:].isnan().all()
    bad = [[t[0] + 10_000] + t[1:] for t in tables]  # a block id past the cache
    with pytest.raises(RuntimeError, match="out of range"):
        _run(kernel, q, kc, vc, bad, specs, 0.125)
    with pytest.raises(RuntimeError, match="dtype"):
        _run(kernel, q.bfloat16(), kc, vc, tables, specs, 0.125)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16)], ids=["fp32", "bf16", "fp32-bf16-cache"])
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_qkv_attention_is_rotary_cache_write_and_attention(kernel, dtype, cache_dtype, rotary_dim):
    """qkv_attention (one call per layer) gives the same bits as rotary_ on q and k, index_copy_
    of k and v into the caches and paged_attention, in turn: output, caches and the rotated qkv.
    Under a cache of another dtype, the modular Attention.forward's rounding: k, v and q rounded
    to the cache's dtype after the rotation, the attention's output widened back."""
    rng = random.Random(rotary_dim)
    heads, kv_heads, hd, block = 9, 3, 64, 16
    _, kc, vc, tables, specs = _case(rng, cache_dtype, heads, kv_heads, hd, block, _ragged(rng, 3, [5]))
    tokens = sum(n for _, n, _ in specs)
    gen = torch.Generator().manual_seed(rotary_dim)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * hd, generator=gen).to(dtype)
    cos, sin = torch.randn(2, tokens, rotary_dim // 2, generator=gen).to(dtype)
    slots = torch.tensor([table[p // block] * block + p % block for table, (_, n, ctx) in zip(tables, specs)
                          for p in range(ctx - n, ctx)])  # each query's own position
    width = max(map(len, tables))
    meta = [torch.tensor(x, dtype=torch.int32) for x in ([t + [0] * (width - len(t)) for t in tables],
                                                         [c for _, _, c in specs], [s for s, _, _ in specs],
                                                         [n for _, n, _ in specs])]
    fused = qkv.clone(), kc.clone(), vc.clone()
    out = kernel.qkv_attention(fused[0], cos, sin, fused[1], fused[2], slots, *meta, hd ** -0.5)

    ref_qkv, ref_k, ref_v = qkv.clone(), kc.clone(), vc.clone()
    kernel.rotary_(ref_qkv[:, : (heads + kv_heads) * hd].view(tokens, heads + kv_heads, hd), cos, sin)
    for cache, col in ((ref_k, heads), (ref_v, heads + kv_heads)):
        rows = ref_qkv[:, col * hd:(col + kv_heads) * hd].reshape(tokens, kv_heads, hd)
        cache.view(-1, kv_heads, hd).index_copy_(0, slots, rows.to(cache_dtype))
    ref = torch.empty(tokens, heads * hd, dtype=cache_dtype)
    kernel.paged_attention(ref, ref_qkv[:, : heads * hd].to(cache_dtype), ref_k, ref_v, *meta, hd ** -0.5)
    assert out.dtype == dtype and torch.equal(out, ref.to(dtype))
    assert all(torch.equal(a, b) for a, b in zip(fused, (ref_qkv, ref_k, ref_v)))
    if dtype != cache_dtype:  # the rounding is real, and only a rounding: against an fp32 cache
        out32 = kernel.qkv_attention(qkv.clone(), cos, sin, kc.float(), vc.float(), slots, *meta, hd ** -0.5)
        assert not torch.equal(out, out32)
        torch.testing.assert_close(out, out32, atol=3e-2, rtol=3e-2)
        with pytest.raises(RuntimeError, match="share a dtype"):  # bf16 over fp32 is not a mix it takes
            kernel.qkv_attention(qkv.bfloat16(), cos.bfloat16(), sin.bfloat16(), kc.float(), vc.float(), slots,
                                 *meta, 0.1)
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.qkv_attention(qkv.clone(), cos, sin, kc, vc, slots + kc.shape[0] * block, *meta, 0.1)
    with pytest.raises(RuntimeError, match=r"is not \(heads"):
        kernel.qkv_attention(qkv[:, 1:].clone(), cos, sin, kc, vc, slots, *meta, 0.1)


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_other_instruction_sets_match_reference(isa):
    """The AVX2 and plain C++ builds (what CPUs without AVX-512 get) on this CPU."""
    if isa == "avx2" and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.fail("this test machine has no AVX2")  # never expected: x86-64 CI machines have it
    kernel = cpu_kernels.load(isa)
    assert kernel is not None and kernel.simd_width() == {"avx2": 8, "scalar": 1}[isa]
    rng = random.Random(11)
    for dtype, (heads, kv_heads, hd, block) in [(torch.bfloat16, SHAPES[0]), (torch.float32, SHAPES[3])]:
        q, kc, vc, tables, specs = _case(rng, dtype, heads, kv_heads, hd, block, _ragged(rng, 4, [9, 30]))
        got = _run(kernel, q, kc, vc, tables, specs, 0.1).float()
        ref = _reference(q, kc, vc, tables, specs, 0.1)
        assert (got - ref).abs().max() <= ref.abs().max() * (2 ** -8 if dtype == torch.bfloat16 else 1e-5)


def _attention_reference(q, k, v, scale):
    """fp64 causal attention: query i sees keys [0, Lk - Lq + i]; head h reads kv head h // group."""
    (lq, heads, hd), (lk, kv_heads, _) = q.shape, k.shape
    group = heads // kv_heads
    qq = q.double().transpose(0, 1)
    kk, vv = (t.double().repeat_interleave(group, 1).transpose(0, 1) for t in (k, v))
    scores = qq @ kk.transpose(1, 2) * scale
    visible = torch.arange(lk) <= (lk - lq + torch.arange(lq)).view(-1, 1)
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return (probs @ vv).transpose(0, 1).reshape(lq, heads * hd)


# (Lq, Lk, heads, kv_heads, head_dim): SmolLM2's heads over a chunk alone and after a cached
# prefix, tiles and key blocks cut short (Lq % 16, Lk % 64), no GQA, head dims of 128 and 80
# (64 dims a pass, then the rest), a single query.
PREFILL_SHAPES = [(100, 100, 9, 3, 64), (33, 290, 9, 3, 64), (64, 64, 16, 8, 128), (21, 70, 4, 4, 80),
                  (1, 1, 2, 1, 16)]


@pytest.mark.parametrize("shape", PREFILL_SHAPES, ids=lambda s: "q{}-k{}-h{}-kv{}-d{}".format(*s))
def test_prefill_attention_is_causal_attention(kernel, shape):
    """The bf16 prefill kernel (csrc/prefill_attention_cpu.cpp) against fp64 attention of the same
    bf16 inputs: q, k and v as strided views of one fused projection output, as the model hands
    them over. Its error is bf16's: P rounded for the P V products and one rounding of out."""
    lq, lk, heads, kv_heads, hd = shape
    gen = torch.Generator().manual_seed(lq * 1000 + lk)
    if not kernel.has_prefill_attention:  # a CPU without AVX512-BF16: the op refuses, SDPA runs
        with pytest.raises(RuntimeError, match="AVX512-BF16"):
            kernel.prefill_attention(*(torch.zeros(4, 2, 16, dtype=torch.bfloat16),) * 3, 0.25)
        return
    width = (heads + 2 * kv_heads) * hd
    qkv = (torch.randn(lk, width, generator=gen) * 2).bfloat16()
    q = qkv[lk - lq:, : heads * hd].view(lq, heads, hd)
    k = qkv[:, heads * hd: (heads + kv_heads) * hd].view(lk, kv_heads, hd)
    v = qkv[:, (heads + kv_heads) * hd:].view(lk, kv_heads, hd)
    got = kernel.prefill_attention(q, k, v, hd ** -0.5)
    ref = _attention_reference(q, k, v, hd ** -0.5)
    assert got.shape == (lq, heads * hd) and got.dtype == torch.bfloat16
    err = (got.double() - ref).abs()
    assert err.max() <= ref.abs().max() * 2 ** -6 and err.mean() <= ref.abs().mean() * 2 ** -7, (err.max(), err.mean())


def test_prefill_attention_refuses_what_it_cannot_compute(kernel):
    x = torch.zeros(8, 4, 16, dtype=torch.bfloat16)
    if not kernel.has_prefill_attention:
        pytest.raises(RuntimeError, kernel.prefill_attention, x, x, x, 1.0)
        return
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernel.prefill_attention(x.float(), x.float(), x.float(), 1.0)
    with pytest.raises(RuntimeError, match="at least Lq"):
        kernel.prefill_attention(x, x[:4], x[:4], 1.0)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        kernel.prefill_attention(x, x[:, :3], x[:, :3], 1.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel.prefill_attention(x.transpose(0, 1).contiguous().transpose(0, 1), x, x, 1.0)
    assert not cpu_kernels.load("avx2").has_prefill_attention  # AVX-512 builds only


def test_kernel_loads_once_per_process(kernel, monkeypatch, tmp_path):
    """Another cache folder (or an edited source) must not load the op namespace a second time:
    that would abort the process."""
    monkeypatch.setenv("LLM_CLUSTER_CACHE", str(tmp_path))
    cpu_kernels.load.cache_clear()
    try:
        again = cpu_kernels.load()
        assert again is not None and again.library == kernel.library
        assert not list(tmp_path.glob("kernels/*"))  # nothing rebuilt there
    finally:
        cpu_kernels.load.cache_clear()


def test_auto_selects_the_kernel_on_cpu(kernel):
    assert select_backend("auto", "cpu", 16, torch.bfloat16) == "cpu_paged"
    assert select_backend("auto", "cpu", 16) == "cpu_paged"
    assert select_backend("torch", "cpu", 16, torch.float32) == "torch"
    assert select_backend("auto", "cpu", 16, torch.float16) == "torch"  # no fp16 path in the kernel
    with pytest.raises(ValueError, match="cpu_paged"):
        select_backend("cpu_paged", "cpu", 16, torch.float16)


def test_without_a_compiler_auto_falls_back_and_says_so_once(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("LLM_CLUSTER_CACHE", str(tmp_path))  # nothing built here yet
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setattr(cpu_kernels, "_LOADED", {})  # as in a process that has not loaded it
    cpu_kernels.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="cluster.kernels.cpu_kernels"):
            assert cpu_kernels.load() is None
            assert select_backend("auto", "cpu", 16, torch.bfloat16) == "torch"
            with pytest.raises(ValueError, match="could not be built"):
                select_backend("cpu_paged", "cpu", 16, torch.bfloat16)
        warnings = [r for r in caplog.records if "CPU kernels unavailable" in r.getMessage()]
        assert len(warnings) == 1 and "no-such-c++" in warnings[0].getMessage()
        assert not list(tmp_path.glob("kernels/*/*.so"))
    finally:
        cpu_kernels.load.cache_clear()


def test_metadata_routes_sequences_to_the_kernel(monkeypatch):
    """Decodes and chunks of at most KERNEL_PREFILL_MAX_QUERY queries go to the kernel (with a
    cached prefix or not), longer chunks to SDPA; no decode buckets are built."""
    from cluster.model import context as ctx_mod

    monkeypatch.setattr(ctx_mod, "KERNEL_PREFILL_MAX_QUERY", 8)
    seqs = [(1, 6, [7, 2]), (1, 3, [5]), (3, 9, [4, 9, 1]), (5, 5, [3, 6]), (9, 12, [0, 8, 10]), (9, 9, [11, 12, 13])]
    meta = build_attention_metadata(seqs, 4, "cpu", "cpu_paged")
    km = meta.kernel
    assert km.seq_lens.tolist() == [6, 3, 9, 5] and km.query_len.tolist() == [1, 1, 3, 5]
    assert km.query_start.tolist() == [0, 1, 2, 5]
    assert km.block_table.tolist() == [[7, 2, 0], [5, 0, 0], [4, 9, 1], [3, 6, 0]]
    assert [(c.start, c.query_len) for c in meta.prefills] == [(10, 9), (19, 9)]
    assert meta.prefills[0].context_index is not None and meta.prefills[1].context_index is None
    assert meta.decode_buckets == []
