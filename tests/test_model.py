"""The model package: our layers/models vs HF transformers' forward, paged KV correctness
(chunked prefill, decodes, mixed steps), tensor parallelism over gloo, and bad inputs."""
from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import time
from pathlib import Path

import pytest
import torch

from cluster.config import ModelConfig
from cluster.model import context as ctx_mod
from cluster.model.context import build_attention_metadata, set_forward_context
from cluster.model.hf_config import HFConfig
from cluster.model.kv_cache import attention_backend, bind_kv_cache, kv_cache_bytes_per_block
from cluster.model.layers.attention import select_backend
from cluster.model.layers.rotary import compute_inv_freq, rope_parameters
from cluster.model.loader import gguf_cache_dir, load_hf_config, load_model
from cluster.model.models.registry import get_model_class
from cluster.model.parallel import SINGLE, ParallelContext, init_distributed, local_kv_heads

BLOCK = 4


# ---- helpers ------------------------------------------------------------------------------
def _model_config(path: str, dtype: torch.dtype = torch.float32, hf_config=None) -> ModelConfig:
    """The model's config as a resolved engine config carries it (plain values, HFConfig)."""
    hf_config = hf_config or load_hf_config(path)
    plain = hf_config if isinstance(hf_config, HFConfig) else HFConfig.of(hf_config)
    return ModelConfig(model=path).with_facts(path=path, torch_dtype=dtype, hf_config=plain)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """HF initialises biases to 0 and norms to 1; make every weight matter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.08
            p.copy_(1.0 + noise if "norm" in name else noise)


def _save_hf(tmp: Path, config, seed: int = 0) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    _randomize(model, seed)
    model.save_pretrained(tmp)
    return str(tmp)


def _hf_logits(path: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0] for p in prompts]


def _assert_fused_step_is_modular(model, items, caches) -> None:
    """The step `items` through the model's one-call layers, then again through its modular
    layers: the same hidden states and the same K/V written to `caches` ((k, v) per layer)."""
    fused = model.model.fused_decode
    got, _ = _step(model, items)
    written = [(k.clone(), v.clone()) for k, v in caches]
    model.model.fused_decode = None
    try:
        want, _ = _step(model, items)
    finally:
        model.model.fused_decode = fused
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(k, kk) and torch.equal(v, vv) for (k, v), (kk, vv) in zip(written, caches))


class Pager:
    """Hands out random, non-contiguous block ids, like a block manager."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def blocks_for(self, table: list[int], length: int) -> list[int]:
        while len(table) * BLOCK < length:
            table.append(self.free.pop())
        return table


def _step(model, items, device="cpu"):
    """items: (all_tokens, start, end, block_table): compute tokens [start, end) of each
    sequence in one flat batch. Returns the hidden states split per item."""
    ids, pos, seqs = [], [], []
    for tokens, start, end, table in items:
        ids += tokens[start:end]
        pos += range(start, end)
        seqs.append((end - start, end, table))
    meta = build_attention_metadata(seqs, BLOCK, device, attention_backend(model))
    with torch.inference_mode(), set_forward_context(meta):
        hidden = model(torch.tensor(ids), torch.tensor(pos))
    return list(hidden.split([end - start for _, start, end, _ in items])), meta


def _logits(model, hidden: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model.compute_logits(hidden)


def _prefill_hidden(model, prompts, pager):
    """One flat step prefilling every prompt from scratch; returns per-prompt hidden states."""
    hidden, _ = _step(model, [(p, 0, len(p), pager.blocks_for([], len(p))) for p in prompts])
    return hidden


def _prefill_all(model, prompts, pager):
    """One flat step prefilling every prompt from scratch; returns per-prompt logits."""
    return [_logits(model, h) for h in _prefill_hidden(model, prompts, pager)]


def _tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    base = dict(vocab_size=1000, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=256,
                tie_word_embeddings=False, rms_norm_eps=1e-5)
    base.update(overrides)
    return LlamaConfig(**base)


PROMPTS = [[5, 17, 300, 2, 999, 41, 7], list(range(100, 141)), [8, 8, 8, 1, 640, 12, 13, 77, 501, 3, 90]]


# ---- fixtures -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf_cache(tmp_path_factory):
    """A private converted-weights cache, so this module always exercises the GGUF path. The
    kernels' folder is the usual one, linked: the TP tests' spawned ranks load the kernels from
    the cache and would otherwise build them again (a minute on two cores)."""
    from cluster.cache import cache_root

    old = os.environ.get("LLM_CLUSTER_CACHE")
    kernels = cache_root() / "kernels"
    private = tmp_path_factory.mktemp("llm-cluster-cache")
    kernels.mkdir(parents=True, exist_ok=True)
    (private / "kernels").symlink_to(kernels, target_is_directory=True)
    os.environ["LLM_CLUSTER_CACHE"] = str(private)
    yield Path(os.environ["LLM_CLUSTER_CACHE"])
    if old is None:
        os.environ.pop("LLM_CLUSTER_CACHE")
    else:
        os.environ["LLM_CLUSTER_CACHE"] = old


@pytest.fixture(scope="module")
def smollm2(gguf_cache, smollm2_path):
    """SmolLM2 loaded straight from the GGUF (dequantized, fp32); the cache is written."""
    assert not gguf_cache_dir(smollm2_path).exists()
    model = load_model(_model_config(smollm2_path), SINGLE, torch.device("cpu"))
    bind_kv_cache(model, 96, BLOCK, torch.float32, "cpu")
    return model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    cfg = _tiny_llama_config(rope_parameters={
        "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    return _save_hf(tmp_path_factory.mktemp("llama3"), cfg)


@pytest.fixture(scope="module")
def llama(llama_dir):
    model = load_model(_model_config(llama_dir), SINGLE, torch.device("cpu"))
    bind_kv_cache(model, 128, BLOCK, torch.float32, "cpu")
    return model


# ---- HF parity ------------------------------------------------------------------------------
def test_smollm2_gguf_matches_hf(smollm2, smollm2_path, gguf_cache, tiny_llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)  # SmolLM2's tokenizer, already converted
    texts = ["The capital of France is", "def fibonacci(n):\n    if n <", "Once upon a time, in a land far"]
    prompts = [tok(t).input_ids for t in texts]
    ours = _prefill_all(smollm2, prompts, Pager(96, seed=1))

    # The cache our loader wrote is an HF checkpoint dir (config.json + dequantized
    # safetensors): HF's own Llama over the same tensors is the reference.
    hf = AutoModelForCausalLM.from_pretrained(gguf_cache_dir(smollm2_path), dtype=torch.float32).eval()
    with torch.no_grad():
        for ids, logits in zip(prompts, ours):
            ref = hf(torch.tensor([ids])).logits[0]
            torch.testing.assert_close(logits, ref, atol=2e-3, rtol=1e-4)
            assert torch.equal(logits.argmax(-1), ref.argmax(-1))
    # An independent check of the q/k un-permutation: a wrong layout produces garbage.
    assert tok.decode(ours[0][-1].argmax()).strip() == "Paris"


def test_gguf_cache_reload_matches(smollm2, smollm2_path, gguf_cache):
    cached = gguf_cache_dir(smollm2_path)
    assert (cached / "config.json").is_file() and (cached / "model.safetensors").is_file()
    config = load_hf_config(smollm2_path)
    assert config.architectures == ["LlamaForCausalLM"] and config.num_key_value_heads == 3
    again = load_model(_model_config(smollm2_path), SINGLE, torch.device("cpu"))
    for (name, a), (_, b) in zip(smollm2.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def _qwen2_config():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=1000, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                       num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
                       tie_word_embeddings=True, rope_parameters={
                           "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                           "original_max_position_embeddings": 64})


def _qwen3_config():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                       max_position_embeddings=256, tie_word_embeddings=False, attention_bias=True)


def _llama_biases_config():
    return _tiny_llama_config(attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                              rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})


@pytest.mark.parametrize("make_config", [_tiny_llama_config, _llama_biases_config, _qwen2_config, _qwen3_config],
                         ids=["llama3-rope", "llama-biases-tied", "qwen2-yarn", "qwen3-qknorm"])
def test_random_models_match_hf(make_config, tmp_path, llama_dir):
    path = llama_dir if make_config is _tiny_llama_config else _save_hf(tmp_path, make_config(), seed=3)
    model = load_model(_model_config(path), SINGLE, torch.device("cpu"))
    bind_kv_cache(model, 64, BLOCK, torch.float32, "cpu")
    ours = _prefill_all(model, PROMPTS, Pager(64))
    for logits, ref in zip(ours, _hf_logits(path, PROMPTS)):
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
        assert torch.equal(logits.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("params", [
    {"rope_type": "default", "rope_theta": 500000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.5},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32768,
     "beta_fast": 16.0},
])
def test_rope_frequencies_match_transformers(params):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = _tiny_llama_config(hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                             max_position_embeddings=131072, rope_parameters=dict(params))
    ours, our_scale = compute_inv_freq(rope_parameters(HFConfig.of(cfg)), 128, cfg.max_position_embeddings)
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    init = ROPE_INIT_FUNCTIONS.get(params["rope_type"], LlamaRotaryEmbedding.compute_default_rope_parameters)
    ref, ref_scale = init(cfg, device="cpu")
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
    assert our_scale == pytest.approx(ref_scale)


def test_legacy_rope_scaling_form_is_read():
    cfg = type("Cfg", (), {"rope_theta": 1234.0, "max_position_embeddings": 64,
                           "rope_scaling": {"type": "linear", "factor": 4.0}})()
    params = rope_parameters(cfg)
    assert params["rope_type"] == "linear" and params["rope_theta"] == 1234.0
    inv, _ = compute_inv_freq(params, 8, 64)
    torch.testing.assert_close(inv, 1.0 / (1234.0 ** (torch.arange(0, 8, 2).float() / 8)) / 4.0)


# ---- paged KV correctness ----------------------------------------------------------------------
def _reference(model, tokens: list[int]) -> torch.Tensor:
    """Full-sequence forward (one prefill, nothing cached) in a scratch region of the cache."""
    hidden, _ = _step(model, [(tokens, 0, len(tokens), Pager(128, seed=99).blocks_for([], len(tokens)))])
    return hidden[0]


def test_chunked_prefill_then_decodes_equals_full_forward(llama):
    tokens = list(range(3, 40))  # 37 tokens
    full = _reference(llama, tokens)
    pager, table = Pager(100, seed=5), []
    got = []
    for start, end in [(0, 10), (10, 23)] + [(i, i + 1) for i in range(23, 37)]:
        hidden, _ = _step(llama, [(tokens, start, end, pager.blocks_for(table, end))])
        got.append(hidden[0])
    assert table != sorted(table)  # really non-contiguous
    torch.testing.assert_close(torch.cat(got), full, atol=1e-5, rtol=1e-5)


@contextlib.contextmanager
def _backend(model, name: str):
    """Run `model`'s attention through backend `name` for a while (fixtures bind "auto")."""
    from cluster.model.layers.attention import Attention, make_backend

    layers = [m for m in model.modules() if isinstance(m, Attention)]
    saved = [(m.backend_name, m.backend) for m in layers]
    impl = make_backend(name)
    for m in layers:
        m.backend_name, m.backend = name, impl
    try:
        yield
    finally:
        for m, (n, b) in zip(layers, saved):
            m.backend_name, m.backend = n, b


def _mixed_step(llama):
    """Prefill three sequences' prompts (all but their last token) and the first 12 tokens of a
    fourth, then one mixed step: three decodes of different context lengths and a chunk over
    the fourth's cached prefix. Checks every row against a full forward; returns the metadata."""
    rng = random.Random(7)
    seqs = [[rng.randrange(1000) for _ in range(n)] for n in (5, 61, 23, 30)]
    refs = [_reference(llama, s) for s in seqs]
    pager = Pager(100, seed=11)
    tables = [[] for _ in seqs]
    cut = [len(s) - 1 for s in seqs[:3]] + [12]
    _step(llama, [(s, 0, c, pager.blocks_for(t, c)) for s, c, t in zip(seqs, cut, tables)])
    items = [(s, len(s) - 1, len(s), pager.blocks_for(t, len(s))) for s, t in zip(seqs[:3], tables)]
    items.append((seqs[3], 12, 30, pager.blocks_for(tables[3], 30)))
    hidden, meta = _step(llama, items)
    assert meta.num_decodes == 3
    for h, ref, (_, start, end, _) in zip(hidden, refs, items):
        torch.testing.assert_close(h, ref[start:end], atol=1e-5, rtol=1e-5)
    return meta


@pytest.mark.parametrize("kernel", ["blockdiag", "per_head"])
@pytest.mark.parametrize("one_bucket", [True, False])
def test_mixed_step_equals_reference(llama, monkeypatch, one_bucket, kernel):
    from cluster.model.layers import attention as attn_mod

    monkeypatch.setattr(attn_mod, "BLOCKDIAG_MAX_KV_HEADS", 99 if kernel == "blockdiag" else 0)
    if not one_bucket:  # force one bucket per distinct length: exercises the row gather/scatter
        monkeypatch.setattr(ctx_mod, "_BUCKET_OVERHEAD_TOKENS", 0)
    with _backend(llama, "torch"):
        meta = _mixed_step(llama)
    assert len(meta.prefills) == 1 and (len(meta.decode_buckets) == 1) == one_bucket


@pytest.mark.parametrize("chunk_to", ["kernel", "sdpa"])
def test_mixed_step_equals_reference_cpu_kernel(llama, monkeypatch, chunk_to):
    """The CPU kernel backend ("auto" on CPU): decodes and, unless the chunk is longer than
    KERNEL_PREFILL_MAX_QUERY, the chunk over a cached prefix in the kernel; SDPA otherwise."""
    monkeypatch.setattr(ctx_mod, "KERNEL_PREFILL_MAX_QUERY", 17 if chunk_to == "sdpa" else 18)  # the chunk: 18
    assert attention_backend(llama) == "cpu_paged"
    meta = _mixed_step(llama)
    assert meta.kernel.num_seqs == (3 if chunk_to == "sdpa" else 4) and not meta.decode_buckets
    assert len(meta.prefills) == (1 if chunk_to == "sdpa" else 0)


@pytest.mark.parametrize("make_config", [_tiny_llama_config, _llama_biases_config, _qwen2_config, _qwen3_config],
                         ids=["llama3-rope", "llama-biases-tied", "qwen2-yarn", "qwen3-qknorm"])
def test_cpu_prepared_bf16_model_tracks_hf_bf16(make_config, tmp_path, monkeypatch):
    """On CPU a bf16 model runs packed oneDNN linears and the kernel library's fused norms,
    SiLU-and-mul and rotary (loader._prepare_for_cpu). They round where HF's bf16 modelling code
    rounds, so the logits stay as close to transformers' own bf16 forward as bf16 allows, with
    the same argmax everywhere. The 41-token prompt's attention runs the kernel library's
    prefill_attention where the CPU has AVX512-BF16 and the head size is a multiple of 16 (not
    qwen3's 24: SDPA), the others the paged kernel."""
    from transformers import AutoModelForCausalLM

    from cluster.kernels.cpu_kernels import CpuKernels, load

    monkeypatch.setattr(ctx_mod, "KERNEL_PREFILL_MAX_QUERY", 16)
    chunks, run = [], CpuKernels.prefill_attention
    monkeypatch.setattr(CpuKernels, "prefill_attention", lambda self, q, *a: chunks.append(len(q)) or run(self, q, *a))

    config = make_config()
    path = _save_hf(tmp_path, config, seed=3)
    model = load_model(_model_config(path, torch.bfloat16), SINGLE, torch.device("cpu"))
    linears = [m for m in model.modules() if hasattr(m, "pack_weight")]
    assert all(m.kernels is not None for m in model.modules() if hasattr(m, "kernels"))
    # With the kernel library every bf16 linear gets its skinny layout (and, for more rows,
    # oneDNN's blocked one where oneDNN packs bf16 here, else fma_pack's or the plain weight).
    assert linears and all(m.packed is not None and m.packed.skinny is not None for m in linears)
    bind_kv_cache(model, 64, BLOCK, torch.bfloat16, "cpu")
    ours = _prefill_all(model, PROMPTS, Pager(64))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        refs = [hf(torch.tensor([p])).logits[0] for p in PROMPTS]
    for logits, ref in zip(ours, refs):
        assert (logits.float() - ref.float()).abs().max() < 0.05  # logits ~1: a few bf16 ulps
        assert torch.equal(logits.argmax(-1), ref.argmax(-1))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert set(chunks) == ({41} if load().has_prefill_attention and head_dim % 16 == 0 else set())


@pytest.mark.parametrize("make_config,quantization", [(_tiny_llama_config, None), (_llama_biases_config, None),
                                                      (_qwen2_config, None), (_qwen3_config, None),
                                                      (_tiny_llama_config, "int8")],
                         ids=["llama3-rope", "llama-biases-tied", "qwen2-yarn", "qwen3-qknorm", "llama-int8"])
def test_fused_decode_layers_equal_the_modular_layers(make_config, quantization, tmp_path, monkeypatch):
    """bf16 on CPU: decode steps of a few rows run each decoder layer as one kernel call
    (layers/fused_layer.py). The same steps through the modular layers give the same bits:
    hidden states and the K/V written to the cache. Past max_rows the modular layers run."""
    from cluster.model.layers.attention import Attention
    from cluster.model.layers.fused_layer import FusedDecode
    from cluster.model.layers.quant_plan import quant_plan

    path = _save_hf(tmp_path, make_config(), seed=3)
    mc = _model_config(path, torch.bfloat16)
    mc = mc.with_facts(quant_plan=quant_plan(quantization, path, "cpu"))
    model = load_model(mc, SINGLE, torch.device("cpu"))
    fused = model.model.fused_decode
    if quantization:  # the quantized weights' few-rows kernel: int8 activations on the AVX2 build
        from cluster.model.layers.quantization import INT8_X_MAX_ROWS, SKINNY_MAX_ROWS

        kernels = next(m.packed.kernels for m in model.modules() if hasattr(m, "pack_weight"))
        assert fused is not None and fused.max_rows == (INT8_X_MAX_ROWS if kernels.int8_int8_activations else SKINNY_MAX_ROWS)
    else:  # bf16: a few rows beside a fast bf16 GEMM, every row count where oneDNN cannot pack bf16
        from cluster.model.layers.cpu_gemm import SKINNY_EVERY_ROW, onednn_packs_bf16

        assert fused is not None and fused.max_rows == (3 if onednn_packs_bf16() else SKINNY_EVERY_ROW)
    calls = []
    run = FusedDecode.__call__
    monkeypatch.setattr(FusedDecode, "__call__", lambda self, *a: calls.append(a[0].shape[0]) or run(self, *a))
    bind_kv_cache(model, 64, BLOCK, torch.bfloat16, "cpu")
    caches = [(m.k_cache, m.v_cache) for m in model.modules() if isinstance(m, Attention)]
    pager, tables = Pager(64), [[] for _ in PROMPTS]
    cut = [len(p) - 3 for p in PROMPTS]
    prefill_items = [(p, 0, c, pager.blocks_for(t, c)) for p, c, t in zip(PROMPTS, cut, tables)]
    if sum(cut) <= fused.max_rows:  # int8 on the AVX2 build: the prefill runs fused too
        _assert_fused_step_is_modular(model, prefill_items, caches)
        prefill = [sum(cut)]
    else:
        _step(model, prefill_items)
        prefill = []
    assert calls == prefill
    for rows in (1, 2, 3):  # the first `rows` sequences decode their next token
        items = [(p, cut[i], cut[i] + 1, pager.blocks_for(tables[i], cut[i] + 1)) for i, p in enumerate(PROMPTS[:rows])]
        _assert_fused_step_is_modular(model, items, caches)
        cut[:rows] = [c + 1 for c in cut[:rows]]
    assert calls == prefill + [1, 2, 3]
    four = [(p, 0, 1, pager.blocks_for([], 1)) for p in PROMPTS] + [([5], 0, 1, pager.blocks_for([], 1))]
    _step(model, four)
    fused_four = [4] if fused.max_rows >= 4 else []  # 4 rows: fused only where every GEMM is skinny
    assert calls == prefill + [1, 2, 3] + fused_four
    if fused.max_rows < 40:  # one prompt of max_rows + 1 tokens: the modular layers
        past = list(range(7, 8 + fused.max_rows))
        _step(model, [(past, 0, len(past), pager.blocks_for([], len(past)))])
        assert calls == prefill + [1, 2, 3] + fused_four


def test_fused_decode_layers_only_where_they_apply(tmp_path, monkeypatch):
    """fp32 weights have the skinny layout and fuse whichever GEMM the start-up timing gave their
    many rows (F.linear on the weight as loaded, or oneDNN on its reordered copy: a close timing
    must not take the fused layers away); LLM_CLUSTER_CPU_GEMM=aten (fp32 weights left as loaded)
    and enforce_eager keep the modular layers."""
    from cluster.model.layers import cpu_gemm

    llama = _save_hf(tmp_path / "llama", _tiny_llama_config(), seed=3)
    cpu = torch.device("cpu")
    monkeypatch.setenv("LLM_CLUSTER_CPU_GEMM", "auto")
    for chosen in ("aten", "onednn"):
        monkeypatch.setattr(cpu_gemm, "_chosen_fp32", chosen)
        model = load_model(_model_config(llama, torch.float32), SINGLE, cpu).model
        qkv = model.layers[0].self_attn.qkv_proj.packed
        assert model.fused_decode is not None and (qkv.plain is not None) == (chosen == "aten")
    monkeypatch.setenv("LLM_CLUSTER_CPU_GEMM", "aten")
    assert load_model(_model_config(llama, torch.float32), SINGLE, cpu).model.fused_decode is None
    monkeypatch.delenv("LLM_CLUSTER_CPU_GEMM")
    assert load_model(_model_config(llama, torch.bfloat16), SINGLE, cpu, fuse_layers=False).model.fused_decode is None
    assert load_model(_model_config(llama, torch.bfloat16), SINGLE, cpu).model.fused_decode is not None


def test_decoder_layers_refuses_lists_that_disagree(tmp_path):
    """The one-call stack checks its per-layer lists before it runs a layer: a k cache short of
    the layers is a RuntimeError naming the counts, and the embeddings are left as they were."""
    path = _save_hf(tmp_path, _tiny_llama_config(), seed=3)
    model = load_model(_model_config(path, torch.bfloat16), SINGLE, torch.device("cpu"))
    bind_kv_cache(model, 64, BLOCK, torch.bfloat16, "cpu")
    fused = model.model.fused_decode
    hidden = torch.randn(1, model.config.hidden_size, dtype=torch.bfloat16)
    before, none = hidden.clone(), torch.empty(0)
    layers = len(fused.attns)
    with pytest.raises(RuntimeError, match=f"got {layers - 1} caches, {2 * layers} norms"):
        fused.kernels.decoder_layers(hidden, *fused.weights, none, none, [a.k_cache for a in fused.attns[1:]],
                                     [a.v_cache for a in fused.attns[1:]], none, none, none, none, none, 1.0, 16)
    norms, qk, eps, qk_eps, proj, counts, *rest = fused.weights
    with pytest.raises(RuntimeError, match=f"proj_tensors add up to {len(proj)} tensors, proj has {len(proj) - 1}"):
        fused.kernels.decoder_layers(hidden, norms, qk, eps, qk_eps, proj[:-1], counts, *rest, none, none,
                                     [a.k_cache for a in fused.attns], [a.v_cache for a in fused.attns],
                                     none, none, none, none, none, 1.0, 16)
    assert torch.equal(hidden, before)


def test_bf16_decode_tracks_fp32(llama_dir):
    """The serving dtype runs the same paged path; bf16 stays close to fp32."""
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(_model_config(llama_dir, dtype), SINGLE, torch.device("cpu"))
        bind_kv_cache(model, 64, BLOCK, dtype, "cpu")
        pager, tables = Pager(64), [[], []]
        seqs = [PROMPTS[1], PROMPTS[2]]
        _step(model, [(s, 0, len(s) - 1, pager.blocks_for(t, len(s) - 1)) for s, t in zip(seqs, tables)])
        hidden, _ = _step(model, [(s, len(s) - 1, len(s), pager.blocks_for(t, len(s)))
                                  for s, t in zip(seqs, tables)])
        logits[dtype] = _logits(model, torch.cat(hidden)).float()
    cos = torch.nn.functional.cosine_similarity(logits[torch.float32], logits[torch.bfloat16], dim=-1)
    assert cos.min() > 0.99


def test_decode_buckets_minimise_padded_cost():
    """The DP split against brute force over every contiguous split of the sorted rows."""
    import itertools

    rng = random.Random(3)
    overhead = ctx_mod._BUCKET_OVERHEAD_TOKENS

    def cost(lengths, bounds):
        return sum((e - s) * lengths[s] + overhead for s, e in bounds)

    for _ in range(40):
        count = rng.randrange(1, 8)
        lengths = sorted((rng.choice([rng.randrange(1, 200), rng.randrange(2000, 6000)]) for _ in range(count)),
                         reverse=True)
        bounds = ctx_mod._bucket_bounds(lengths)
        assert bounds[0][0] == 0 and bounds[-1][1] == len(lengths)
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        n = len(lengths)
        brute = min(cost(lengths, list(zip((0,) + cut, cut + (n,))))
                    for k in range(n) for cut in itertools.combinations(range(1, n), k))
        assert cost(lengths, bounds) == brute


def test_metadata_slots_and_validation():
    meta = build_attention_metadata([(1, 6, [7, 2]), (3, 5, [4, 9])], BLOCK, "cpu")
    # decode at position 5 -> block 2, offset 1; prefill positions 2..4 -> blocks 4, 4, 9
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, 4 * 4 + 2, 4 * 4 + 3, 9 * 4 + 0]
    assert meta.num_decodes == 1 and meta.prefills[0].start == 1
    assert meta.prefills[0].mask.shape == (3, 5) and meta.prefills[0].mask.sum().item() == 3 + 4 + 5
    with pytest.raises(ValueError, match="decodes must come first"):
        build_attention_metadata([(3, 3, [0]), (1, 4, [1])], BLOCK, "cpu")
    with pytest.raises(ValueError, match="context_len=9"):
        build_attention_metadata([(1, 9, [0, 1])], BLOCK, "cpu")


class _FakeFlashAttn:
    """flash-attn 2.8's two paged entry points, written from their documented contracts in
    plain torch (signatures, int32 metadata, page size multiple of 256, bottom-right causal
    alignment), so the flash backend's plumbing runs on CPU."""

    @staticmethod
    def _attend(q, k_cache, v_cache, table, seqlen_k, scale):
        blocks = k_cache.shape[1]
        assert blocks % 256 == 0 and table.dtype == torch.int32
        k = k_cache[table.long()].flatten(0, 1)[:seqlen_k]
        v = v_cache[table.long()].flatten(0, 1)[:seqlen_k]
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
        shift = seqlen_k - q.shape[0]  # causal mask aligned to the bottom right
        allowed = torch.arange(seqlen_k)[None, :] <= torch.arange(q.shape[0])[:, None] + shift
        scores = scores.masked_fill(~allowed, float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(q.dtype)

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                                return_softmax_lse=False):
        assert k is None and v is None and causal and cache_seqlens.dtype == torch.int32
        return torch.stack([self._attend(q[b], k_cache, v_cache, block_table[b], int(cache_seqlens[b]),
                                         softmax_scale) for b in range(q.shape[0])])

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                               softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                               block_table=None):
        assert causal and cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        assert max_seqlen_q == max(b - a for a, b in zip(cq, cq[1:]))
        return torch.cat([self._attend(q[cq[b]:cq[b + 1]], k, v, block_table[b], ck[b + 1] - ck[b], softmax_scale)
                          for b in range(len(cq) - 1)])


def test_flash_backend_plumbing_matches_torch_backend(tmp_path, monkeypatch):
    import sys
    import types

    from cluster.model.layers import attention as attn_mod

    block = 256
    path = _save_hf(tmp_path, _tiny_llama_config(max_position_embeddings=1024), seed=6)
    model = load_model(_model_config(path), SINGLE, torch.device("cpu"))
    bind_kv_cache(model, 6, block, torch.float32, "cpu")
    fake = _FakeFlashAttn()
    with monkeypatch.context() as patch:  # only while the backend imports it
        patch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(
            flash_attn_with_kvcache=fake.flash_attn_with_kvcache,
            flash_attn_varlen_func=fake.flash_attn_varlen_func))
        flash = attn_mod.FlashAttentionBackend()
    layers = [m for m in model.modules() if isinstance(m, attn_mod.Attention)]
    rng = random.Random(5)
    seqs = [[rng.randrange(1000) for _ in range(n)] for n in (300, 40, 90)]
    tables = [[4, 1], [0], [5]]
    outputs = {}
    for name, backend in (("torch", attn_mod.TorchAttentionBackend()), ("flash", flash)):
        for layer in layers:
            layer.backend = backend
        # prefill the prompts but 1, 1 and 50 tokens; then two decodes and a chunk over a prefix
        steps = [[(s, 0, len(s) - c) for s, c in zip(seqs, (1, 1, 50))],
                 [(s, len(s) - c, len(s)) for s, c in zip(seqs, (1, 1, 50))]]
        for items in steps:
            flat = [(tokens, a, b, t) for (tokens, a, b), t in zip(items, tables)]
            ids = [x for tokens, a, b, _ in flat for x in tokens[a:b]]
            pos = [p for _, a, b, _ in flat for p in range(a, b)]
            seq_meta = [(b - a, b, t) for _, a, b, t in flat]
            meta = build_attention_metadata(seq_meta, block, "cpu")
            meta.flash = ctx_mod._flash_metadata(seq_meta, meta.num_decodes, torch.device("cpu"))
            with torch.inference_mode(), set_forward_context(meta):
                hidden = model(torch.tensor(ids), torch.tensor(pos))
        outputs[name] = hidden
    torch.testing.assert_close(outputs["flash"], outputs["torch"], atol=1e-5, rtol=1e-5)


# ---- tensor parallel ---------------------------------------------------------------------------
def _tp_worker(rank: int, world_size: int, model_dir: str, hf_config, out_dir: str, plan=None) -> None:
    torch.set_num_threads(1)
    # A file store, not TCP (rank 0 would host it). Any rank that loses a peer or the store
    # while gloo still runs aborts in a background thread ("terminate called without an active
    # exception", seen in CI at TP=3), so no rank exits before every rank has torn gloo down.
    parallel = init_distributed(rank, world_size, f"file://{out_dir}/store", "gloo")
    logits = _tp_logits(model_dir, hf_config, parallel, plan)
    if rank == 0:
        torch.save(logits, Path(out_dir) / "logits.pt")
    else:
        assert logits is None
    # Ranks 1.. only send in the logits gather; tearing gloo down before rank 0 has received
    # aborts the process ("terminate called without an active exception").
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    Path(out_dir, f"done-{rank}").touch()
    deadline = time.monotonic() + 60
    while not all(Path(out_dir, f"done-{r}").exists() for r in range(world_size)):
        assert time.monotonic() < deadline, "a rank never finished tearing down gloo"
        time.sleep(0.01)
    # Leave without the interpreter's shutdown: gloo's static objects still own threads, and
    # destroying them at exit aborts the rank now and then ("terminate called without an
    # active exception", SIGABRT at TP=3 in CI even after the barrier). Everything is saved.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _tp_logits(model_dir: str, hf_config, parallel: ParallelContext, plan=None):
    """A prefill step for two prompts, then one mixed decode step; logits of every token."""
    mc = _model_config(model_dir, hf_config=hf_config)
    mc = mc.with_facts(quant_plan=plan)
    model = load_model(mc, parallel, torch.device("cpu"))
    bind_kv_cache(model, 64, BLOCK, torch.float32, "cpu")
    pager, tables = Pager(64), [[], []]
    seqs = [PROMPTS[0], PROMPTS[2]]
    first, _ = _step(model, [(s, 0, len(s) - 1, pager.blocks_for(t, len(s) - 1)) for s, t in zip(seqs, tables)])
    second, _ = _step(model, [(s, len(s) - 1, len(s), pager.blocks_for(t, len(s))) for s, t in zip(seqs, tables)])
    return _logits(model, torch.cat(first + second))


@pytest.fixture(scope="module")
def tp_model_dir(tmp_path_factory):
    # 6 q heads, 3 KV heads: TP=3 splits the KV heads, TP=2 must replicate them. A vocab of
    # 1000 does not split in 3 (padded shards); the untied head is loaded separately.
    return _save_hf(tmp_path_factory.mktemp("tp-llama"), _tiny_llama_config(vocab_size=1000), seed=4)


@pytest.mark.parametrize("world_size", [2, 3])
def test_tensor_parallel_matches_single_rank(world_size, tp_model_dir, tmp_path):
    from rank_processes import run_ranks

    config = load_hf_config(tp_model_dir)  # passed along: spares each rank importing AutoConfig
    run_ranks(_tp_worker, (world_size, tp_model_dir, config, str(tmp_path)), world_size)
    expected = _tp_logits(tp_model_dir, config, SINGLE)
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def tp_q8_0_model_dir(tp_model_dir, tmp_path_factory):
    """tp_model_dir with every linear weight replaced by Q8_0 values (fp16 scale per 32 inputs,
    as llama.cpp rounds them), so a Q8_0 plan serves them in blocks, exactly."""
    import shutil

    from safetensors.torch import load_file, save_file

    from cluster.model.layers.quantization import quantize_int8

    out = tmp_path_factory.mktemp("tp-llama-q8_0")
    for f in Path(tp_model_dir).iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    tensors = {}
    for f in Path(tp_model_dir).glob("*.safetensors"):
        for name, w in load_file(f).items():
            if w.dim() == 2 and "embed" not in name:
                n, k = w.shape
                q, scales = quantize_int8(w, 32)
                scales = scales.half().float()
                q = torch.round(w.float().view(n, k // 32, 32) / scales.unsqueeze(-1)).clamp(-127, 127)
                w = (q * scales.unsqueeze(-1)).view(n, k).to(w.dtype)
            tensors[name] = w.contiguous()
    save_file(tensors, out / "model.safetensors")
    return str(out)


def test_q8_0_blocks_at_tp3_match_a_single_rank(tp_q8_0_model_dir, tmp_path):
    """Served in Q8_0 blocks, each rank's shard keeps whole blocks (row-parallel layers split
    the inputs on block boundaries), so TP=3 computes what one rank computes."""
    from rank_processes import run_ranks

    from cluster.model.layers.quant_plan import QuantPlan

    plan = QuantPlan(layers="q8_0", head="q8_0")
    config = load_hf_config(tp_q8_0_model_dir)
    mc = _model_config(tp_q8_0_model_dir, hf_config=config)
    mc = mc.with_facts(quant_plan=plan)
    kinds = {getattr(m.packed, "kind", None) for m in load_model(mc, ParallelContext(2, 3), torch.device("cpu")).modules()
             if hasattr(m, "pack_weight")}
    assert kinds == {"q8_0"}  # rank 2's shards all in blocks, none fell back to floats
    run_ranks(_tp_worker, (3, tp_q8_0_model_dir, config, str(tmp_path), plan), 3)
    expected = _tp_logits(tp_q8_0_model_dir, config, SINGLE, plan)
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, atol=1e-4, rtol=1e-4)


def test_local_kv_heads_cover_each_ranks_q_heads():
    for num_heads, num_kv, world in [(6, 3, 2), (6, 3, 3), (6, 3, 6), (8, 2, 4), (8, 8, 2), (9, 3, 3), (12, 4, 3)]:
        group = num_heads // num_kv
        for rank in range(world):
            kv = local_kv_heads(num_heads, num_kv, ParallelContext(rank, world))
            q_local = num_heads // world
            local_group = q_local // len(kv)
            assert q_local % len(kv) == 0
            for j in range(q_local):  # local q head j uses local kv head j // local_group
                assert kv[j // local_group] == (rank * q_local + j) // group
    with pytest.raises(ValueError, match="num_attention_heads=9"):
        local_kv_heads(9, 3, ParallelContext(0, 2))


def test_kv_cache_sizes_and_binding(llama_dir):
    cfg = load_hf_config(llama_dir)
    # 2 layers * (K + V) * block 16 * heads * head_dim 16 * 2 bytes
    assert kv_cache_bytes_per_block(cfg, SINGLE, 16, torch.bfloat16) == 2 * 2 * 16 * 3 * 16 * 2
    assert kv_cache_bytes_per_block(cfg, ParallelContext(1, 3), 16, torch.bfloat16) == 2 * 2 * 16 * 1 * 16 * 2
    # 3 KV heads on 2 ranks: each rank's 3 q heads need 2 distinct KV heads, kept as 3 slots
    # (one per q head) so the local grouping stays uniform.
    assert kv_cache_bytes_per_block(cfg, ParallelContext(0, 2), 16, torch.float32) == 2 * 2 * 16 * 3 * 16 * 4
    model = load_model(_model_config(llama_dir), SINGLE, torch.device("cpu"))
    caches = bind_kv_cache(model, 10, 16, torch.bfloat16, "cpu")
    assert len(caches) == 2 and all(k.shape == (10, 16, 3, 16) and v.dtype == torch.bfloat16 for k, v in caches)


def test_backend_selection():  # "auto" on CPU: tests/test_cpu_kernels.py
    assert select_backend("torch", "cpu", 16) == "torch"
    with pytest.raises(ValueError, match="cpu_paged"):
        select_backend("cpu_paged", "cuda", 16, torch.bfloat16)
    with pytest.raises(ValueError, match="flash_attn"):
        select_backend("flash_attn", "cpu", 256)
    with pytest.raises(ValueError, match="'sdpa'"):
        select_backend("sdpa", "cpu", 16)


# ---- bad input --------------------------------------------------------------------------------
def test_unknown_architecture_names_it(tmp_path):
    from transformers import GPT2Config

    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, architectures=["GPT2LMHeadModel"])
    config.save_pretrained(tmp_path)
    cfg = load_hf_config(str(tmp_path))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        get_model_class(cfg)
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model(_model_config(str(tmp_path)), SINGLE, torch.device("cpu"))


def test_missing_weights_file_names_it(tmp_path, llama_dir):
    (tmp_path / "config.json").write_text((Path(llama_dir) / "config.json").read_text())
    with pytest.raises(ValueError, match=r"no \*\.safetensors weights file in .*" + tmp_path.name):
        load_model(_model_config(str(tmp_path)), SINGLE, torch.device("cpu"))
    with pytest.raises(ValueError, match="missing.gguf"):
        load_hf_config(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="neither a .gguf file nor a directory"):
        load_hf_config(str(tmp_path / "nowhere"))


def test_missing_tensor_names_the_parameter(tmp_path, llama_dir):
    from safetensors.torch import load_file, save_file

    (tmp_path / "config.json").write_text(json.dumps(json.loads((Path(llama_dir) / "config.json").read_text())))
    tensors = load_file(Path(llama_dir) / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight\[k\]"):
        load_model(_model_config(str(tmp_path)), SINGLE, torch.device("cpu"))
