"""The GPU path, checked on CPU: the Triton paged-decode kernel under Triton's interpreter
(its arithmetic, splits, GQA, odd block sizes), the triton backend against the torch backend
on a model, the CUDA-graph bookkeeping with a seam that records captures and replays and runs
the model eagerly, the KV budget, dummy weights and backend selection. What needs a real GPU
(speed, NCCL, the graphs themselves) is benchmarks/gpu_check.py's job."""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cluster.config import EngineConfig, ModelConfig
from cluster.model import context as ctx_mod
from cluster.model.context import build_attention_metadata, set_forward_context
from cluster.model.kv_cache import bind_kv_cache
from cluster.model.layers import attention as attn_mod
from cluster.model.layers.attention import select_backend
from cluster.model.loader import load_hf_config, load_model
from cluster.model.parallel import SINGLE
from cluster.worker.cuda_graphs import DecodeGraphs, capture_sizes, padded_size
from cluster.worker.kv_budget import gpu_kv_budget, needs_profile, profile_lengths

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 4


# ---- fixtures and helpers ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def interp():
    """attention_triton with its kernels under Triton's CPU interpreter (tests/conftest.py
    sets TRITON_INTERPRET=1 before triton is first imported)."""
    import triton

    from cluster.model.layers import attention_triton

    assert triton.knobs.runtime.interpret, "TRITON_INTERPRET=1 must be set before triton is imported"
    return attention_triton


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1000, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=256,
                      tie_word_embeddings=False, rms_norm_eps=1e-5)
    torch.manual_seed(3)
    model = LlamaForCausalLM(cfg)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # make every weight matter (HF zero-inits biases, ones norms)
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.08
            p.copy_(1.0 + noise if "norm" in name else noise)
    out = tmp_path_factory.mktemp("gpu-path-llama")
    model.save_pretrained(out)
    return str(out)


def _model(path: str, num_blocks: int, backend=None):
    mc = ModelConfig(model=path).with_facts(path=path, torch_dtype=torch.float32, hf_config=load_hf_config(path))
    model = load_model(mc, SINGLE, torch.device("cpu"))
    bind_kv_cache(model, num_blocks, BLOCK, torch.float32, "cpu")
    if backend is not None:
        for layer in _attention_layers(model):
            layer.backend = backend
    return model


def _attention_layers(model):
    return [m for m in model.modules() if isinstance(m, attn_mod.Attention)]


def _tables(lengths: list[int], num_blocks: int, seed: int, block_size: int = BLOCK) -> list[list[int]]:
    """Random, non-contiguous block tables big enough for each length."""
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    return [[free.pop() for _ in range(-(-n // block_size))] for n in lengths]


def _step(model, items, paged: bool):
    """items: (tokens, start, end, table). One flat step; per-item hidden states."""
    ids = [t for tokens, a, b, _ in items for t in tokens[a:b]]
    pos = [p for _, a, b, _ in items for p in range(a, b)]
    seqs = [(b - a, b, table) for _, a, b, table in items]
    meta = build_attention_metadata(seqs, BLOCK, "cpu", "triton" if paged else "torch")
    if paged:  # what build_attention_metadata adds on CUDA
        meta.flash = ctx_mod._flash_metadata(seqs, meta.num_decodes, torch.device("cpu"))
    with torch.inference_mode(), set_forward_context(meta):
        hidden = model(torch.tensor(ids), torch.tensor(pos))
    return list(hidden.split([b - a for _, a, b, _ in items]))


def _reference_attention(q, k_cache, v_cache, table, lens, scale):
    out = []
    group = q.shape[1] // k_cache.shape[2]
    for b, length in enumerate(lens):
        blocks = table[b, : -(-length // k_cache.shape[1])].long()
        k = k_cache[blocks].flatten(0, 1)[:length].float().repeat_interleave(group, 1)
        v = v_cache[blocks].flatten(0, 1)[:length].float().repeat_interleave(group, 1)
        probs = (torch.einsum("hd,khd->hk", q[b].float(), k) * scale).softmax(-1)
        out.append(torch.einsum("hk,khd->hd", probs, v))
    return torch.stack(out)


# ---- the kernel ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim,block_size,splits", [
    (torch.float32, 9, 3, 64, 16, 1),   # SmolLM2's heads
    (torch.float32, 9, 3, 64, 16, 3),   # flash-decoding splits + combine
    (torch.float32, 4, 4, 16, 5, 2),    # no GQA, a block size that is not a power of 2
    (torch.bfloat16, 8, 2, 32, 256, 1),  # the GPU preset's block size, 16-bit cache
])
def test_paged_decode_kernel_matches_reference(interp, dtype, heads, kv_heads, head_dim, block_size, splits):
    torch.manual_seed(0)
    lens = [1, 17, 70, 130]
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    rows = _tables(lens, num_blocks, seed=1, block_size=block_size)
    width = max(map(len, rows)) + 2  # wider than needed: the kernel must stop at the length
    table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
    q = torch.randn(len(lens), heads, head_dim, dtype=dtype)
    scale = head_dim ** -0.5
    out = interp.paged_decode(q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32), scale,
                              num_splits=splits)
    expected = _reference_attention(q, k_cache, v_cache, table, lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def test_split_count_depends_on_batch_shape_only(interp):
    assert interp.num_splits_for(256, 8, 132) == 1  # 2048 programs fill an H100
    assert interp.num_splits_for(1, 8, 132) == interp.MAX_SPLITS
    assert interp.num_splits_for(4, 3, 132) == 16 and interp.num_splits_for(8, 3, 132) == 11


# ---- the backend on a model ---------------------------------------------------------------------
def test_triton_backend_matches_torch_backend(interp, model_dir):
    """Prefill, then a mixed step (decodes of different lengths + a chunk over a cached
    prefix), then a pure decode step: the triton backend against the torch backend."""
    rng = random.Random(5)
    seqs = [[rng.randrange(1000) for _ in range(n)] for n in (9, 33, 20, 26)]
    tables = _tables([len(s) + 1 for s in seqs], 40, seed=2)
    outputs = {}
    for name, backend in (("torch", attn_mod.TorchAttentionBackend()), ("triton", interp.TritonAttentionBackend())):
        model = _model(model_dir, 40, backend)
        paged = name == "triton"
        cut = [len(s) - 2 for s in seqs[:3]] + [10]
        hidden = _step(model, [(s, 0, c, t) for s, c, t in zip(seqs, cut, tables)], paged)
        mixed = [(s, c, c + 1, t) for s, c, t in zip(seqs[:3], cut, tables)] + [(seqs[3], 10, 26, tables[3])]
        hidden += _step(model, mixed, paged)
        hidden += _step(model, [(s, len(s) - 1, len(s), t) for s, t in zip(seqs, tables)], paged)
        outputs[name] = torch.cat(hidden)
    torch.testing.assert_close(outputs["triton"], outputs["torch"], atol=1e-5, rtol=1e-5)


# ---- CUDA graph bookkeeping ------------------------------------------------------------------------
def test_capture_ladder_and_padding():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100]
    sizes = capture_sizes(256)
    assert sizes[-1] == 256 and len(sizes) == 4 + 16
    assert [padded_size(n, sizes) for n in (1, 3, 5, 9, 16, 17, 255, 256)] == [1, 4, 8, 16, 16, 32, 256, 256]
    assert padded_size(257, sizes) is None
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


class RecordingSeam:
    """The graph seam without CUDA: a "graph" is the captured callable, replayed eagerly, so
    a replay computes from whatever the static buffers hold at that moment."""

    def __init__(self) -> None:
        self.pools: list[object] = []
        self.captures: list[tuple[object, object]] = []
        self.replays: list[object] = []

    def new_pool(self) -> object:
        self.pools.append(object())
        return self.pools[-1]

    def capture(self, fn, pool):
        fn()  # the warm-up run the CUDA seam does before capturing
        self.captures.append((fn, pool))
        return fn

    def replay(self, graph) -> None:
        self.replays.append(graph)
        graph()


def test_decode_graphs_replay_matches_full_forward(interp, model_dir):
    engine_blocks, scratch = 40, 40  # the runner allocates one block past the engine's
    model = _model(model_dir, engine_blocks + 1, interp.TritonAttentionBackend())
    seam = RecordingSeam()
    graphs = DecodeGraphs(max_num_seqs=20, max_model_len=64, block_size=BLOCK, scratch_block=scratch,
                          hidden_size=96, dtype=torch.float32, device=torch.device("cpu"), seam=seam)
    with torch.inference_mode():
        graphs.capture(model)
    assert list(graphs.graphs) == [20, 16, 8, 4, 2, 1]  # largest first
    assert len(seam.pools) == 1 and all(pool is seam.pools[0] for _, pool in seam.captures)

    rng = random.Random(9)
    seqs = [[rng.randrange(1000) for _ in range(n)] for n in (7, 12, 5, 18, 9)]
    steps = 2
    tables = _tables([len(s) for s in seqs], engine_blocks, seed=4)
    # Reference: every full sequence in one eager prefill (writes the same slots as below).
    refs = _step(model, [(s, 0, len(s), t) for s, t in zip(seqs, tables)], paged=True)
    _step(model, [(s, 0, len(s) - steps, t) for s, t in zip(seqs, tables)], paged=True)
    k0 = _attention_layers(model)[0].k_cache
    for j in range(steps, 0, -1):
        ends = [len(s) - j + 1 for s in seqs]
        before = k0.clone()
        with torch.inference_mode():
            hidden = graphs.run([s[e - 1] for s, e in zip(seqs, ends)], [e - 1 for e in ends],
                                [(1, e, t) for e, t in zip(ends, tables)])
        assert seam.replays[-1] is graphs.graphs[8]  # 5 sequences padded to 8
        for row, (ref, e) in enumerate(zip(refs, ends)):
            torch.testing.assert_close(hidden[row], ref[e - 1], atol=1e-5, rtol=1e-5)
        # Static buffers: real rows, then three padding rows aimed at the scratch block.
        assert graphs.context_lens[:8].tolist() == ends + [1, 1, 1]
        real_slots = [t[(e - 1) // BLOCK] * BLOCK + (e - 1) % BLOCK for t, e in zip(tables, ends)]
        assert graphs.slot_mapping[:8].tolist() == real_slots + [scratch * BLOCK] * 3
        assert graphs.block_tables[5:8, 0].tolist() == [scratch] * 3
        changed = (k0 != before).flatten(2).any(-1).flatten().nonzero().flatten().tolist()
        assert set(changed) <= set(real_slots) | {scratch * BLOCK}  # padding wrote only the scratch

    with pytest.raises(ValueError, match="1..20 single-token"):
        graphs.run([0] * 21, [0] * 21, [(1, 1, [0])] * 21)


def test_runner_graph_path_matches_eager_engine(interp, tiny_llama_dir):
    """The model runner's pure-decode detection and graph path inside a real engine: graphs
    (recording seam, the triton kernel interpreted) give the eager torch path's tokens."""
    from cluster import LLM, SamplingParams

    prompts = [[5, 17, 300, 2, 999, 41, 7], list(range(100, 121)), [8, 8, 8, 1, 640]]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0)
    opts = dict(dtype="float32", num_kv_blocks=48, block_size=BLOCK, max_num_seqs=4, max_model_len=64,
                enable_prefix_caching=False)
    eager = LLM(tiny_llama_dir, **opts)
    expected = eager.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm = LLM(tiny_llama_dir, **opts)
    runner = llm.engine.executor.worker.runner
    bind_kv_cache(runner.model, runner.num_blocks + 1, BLOCK, torch.float32, "cpu")
    for layer in _attention_layers(runner.model):
        layer.backend = interp.TritonAttentionBackend()
    runner.attention_backend, seam = "triton", RecordingSeam()
    runner.graphs = DecodeGraphs(4, 64, BLOCK, runner.num_blocks, 64, torch.float32, torch.device("cpu"), seam)
    with torch.inference_mode():
        runner.graphs.capture(runner.model)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    for ours, ref in zip(got, expected):  # the decode steps' logprobs, not just their argmax
        assert ours.outputs[0].cumulative_logprob == pytest.approx(ref.outputs[0].cumulative_logprob, abs=1e-4)
    assert len(seam.replays) == runner.graphs.num_replays == 4  # after the prefill step, 4 decode steps


# ---- KV budget, dummy weights, selection, config ---------------------------------------------------
def test_gpu_kv_budget_and_profile_shape():
    gib = 1 << 30
    # 80 GiB device at 0.9: 72 GiB, less 17 GiB in use (weights, context) and a 3 GiB peak
    assert gpu_kv_budget(80 * gib, 17 * gib, 3 * gib, 0.9) == 52 * gib
    assert gpu_kv_budget(10 * gib, 9 * gib, 1 * gib, 0.5) < 0  # nothing left: num_kv_blocks raises
    assert profile_lengths(8192, 4096, 256) == [4096, 4096]
    assert profile_lengths(8192, 3000, 256) == [3000, 3000, 2192]
    assert profile_lengths(8192, 100, 4) == [100] * 4  # never more sequences than the batch holds
    assert profile_lengths(512, 2048, 256) == [512]
    cpu = EngineConfig.create(device="cpu")
    gpu = EngineConfig.create(device="cuda")
    assert not needs_profile(cpu) and needs_profile(gpu)
    gpu.update(num_kv_blocks=100)
    assert not needs_profile(gpu)


def test_dummy_weights_need_no_checkpoint(tmp_path, monkeypatch):
    from transformers import LlamaConfig

    from cluster.model.layers.cpu_gemm import GEMM_ENV

    monkeypatch.setenv(GEMM_ENV, "aten")  # fp32 weights kept as loaded, to read them

    LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64).save_pretrained(tmp_path)
    mc = ModelConfig(model=str(tmp_path), load_format="dummy", seed=7).with_facts(
        path=str(tmp_path), torch_dtype=torch.float32, hf_config=load_hf_config(str(tmp_path)))
    model = load_model(mc, SINGLE, torch.device("cpu"))  # no *.safetensors in the folder
    params = dict(model.named_parameters())
    assert all(p.eq(1).all() for n, p in params.items() if "norm" in n)
    weight = params["model.layers.0.mlp.down_proj.weight"]
    assert 0.015 < weight.std().item() < 0.025 and weight.abs().sum() > 0
    again = load_model(mc, SINGLE, torch.device("cpu"))
    assert torch.equal(dict(again.named_parameters())["model.layers.0.mlp.down_proj.weight"], weight)
    bad = EngineConfig.create(model=str(tmp_path), load_format="random", device="cpu")
    with pytest.raises(ValueError, match="load_format"):
        bad.finalize()


def test_backend_selection_on_cuda_devices(monkeypatch):
    # Only the device type and the importable packages matter: no GPU needed here.
    assert select_backend("auto", "cuda", 16) == "triton"  # no flash-attn installed
    assert select_backend("auto", "cuda", 256) == "triton"
    with pytest.raises(ValueError, match="'triton' needs a CUDA device"):
        select_backend("triton", "cpu", 16)
    monkeypatch.setattr(attn_mod, "flash_attn_available", lambda: True)
    assert select_backend("auto", "cuda", 256) == "flash_attn"  # preferred when it imports...
    assert select_backend("auto", "cuda", 16) == "triton"  # ...and the block size allows its paged API
    with pytest.raises(ValueError, match="multiple of 256"):
        select_backend("flash_attn", "cuda", 16)
    monkeypatch.setattr(attn_mod, "_triton_available", lambda: False)
    assert select_backend("auto", "cuda", 16) == "torch"


def test_engine_options_for_the_gpu():
    cfg = EngineConfig.from_preset("gpu")
    assert cfg.device == "cuda" and cfg.enforce_eager is False and cfg.cache_config.block_size == 256
    cfg = EngineConfig.from_preset("gpu", enforce_eager=True, gpu_memory_utilization=0.5)
    assert cfg.enforce_eager is True and cfg.cache_config.gpu_memory_utilization == 0.5
    bad = EngineConfig.create(gpu_memory_utilization=1.5, device="cpu")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        bad.finalize()


def test_gpu_check_says_why_without_a_gpu(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr
    assert not list(tmp_path.iterdir())  # nothing written
