"""GGUF k-quants (Q4_K, Q5_K, Q6_K) served in their own super-blocks (cluster/kernels/csrc/
kquant_gemm_cpu.cpp, cluster/model/gguf_file.py, cluster/model/layers/quantization.py): blocks
dequantized bit for bit as gguf-py dequantizes them, for every instruction set this CPU runs; the
kernel's product against the documented math in fp64 (dequantized weights times x quantized to
int8 per row and super-block, as llama.cpp's Q8_K) at 1, 3, 16 and 64 rows; a Q4_K_M-style file
(Q4_K, Q6_K and a Q5_K tensor, F32 norms) read straight from its blocks: the weights it serves are
the dequantized file's, bit for bit, at one rank and TP=3, and it generates what the dequantized
file generates up to int8 activations' rounding."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from gguf_kquants import BLOCK_BYTES, random_blocks, write_llama_gguf

from cluster.model.layers.quant_plan import gguf_plan, quant_plan
from cluster.model.layers.quantization import KQUANT_FUSED_MAX_ROWS, QuantizedWeight, StackedWeight

KQUANTS = ["Q4_K", "Q5_K", "Q6_K"]


def _gguf_dequantize(raw: np.ndarray, gguf_type: str) -> torch.Tensor:
    from gguf import GGMLQuantizationType, quants

    return torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[gguf_type]).astype(np.float32))


def _edge_blocks(gguf_type: str, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of 5 features x 512 inputs, the first block all 0xFF but d (largest scales,
    mins and quants; Q6_K's scales -1) and the second all zero (w = 0)."""
    raw = random_blocks(gguf_type, 5, 512, rng)
    first = raw[0, :BLOCK_BYTES[gguf_type]]
    keep = first[208:210].copy() if gguf_type == "Q6_K" else first[0:4].copy()
    first[:] = 0xFF
    if gguf_type == "Q6_K":
        first[208:210] = keep
    else:
        first[0:4] = keep
    raw[1, :BLOCK_BYTES[gguf_type]] = 0
    return raw


# ---- the kernels ---------------------------------------------------------------------------------


@pytest.mark.parametrize("gguf_type", KQUANTS)
def test_kquant_blocks_dequantize_as_gguf_py(ops, gguf_type):
    """Every bit of the super-block read as llama.cpp lays it out: fp32 equal to gguf-py's
    dequantize bit for bit (the products are exact, one rounding of the subtraction), bf16 its
    rounding; the 4-feature interleave keeps each block's bytes."""
    raw = _edge_blocks(gguf_type, np.random.default_rng(1))
    want = _gguf_dequantize(raw, gguf_type)
    packed = ops.kquant_pack(torch.from_numpy(raw), BLOCK_BYTES[gguf_type])
    assert packed.shape == (2, 2, 4, BLOCK_BYTES[gguf_type])
    assert torch.equal(packed[0, 1, 3], torch.from_numpy(raw[3, BLOCK_BYTES[gguf_type]:]))  # feature 3's second block
    assert torch.equal(ops.kquant_dequant_(torch.empty(5, 512), packed), want)
    assert torch.equal(ops.kquant_dequant_(torch.empty(5, 512, dtype=torch.bfloat16), packed), want.bfloat16())


def _q8k_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The documented product in fp64: x quantized per row and super-block of 256 (fp32 127 /
    absmax, round half to even; s = absmax / 127, 0 for an all-zero block) times the dequantized
    weight (exact in fp64, so every super-block's integer sums are too)."""
    x = x.float().reshape(-1, x.shape[-1])
    blocks = x.view(x.shape[0], -1, 256)
    absmax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.full_like(absmax, 127.0) / absmax  # a division, as the kernel's
    xq = torch.round(blocks * torch.where(absmax > 0, inv, torch.zeros_like(absmax)))
    s = torch.where(absmax > 0, absmax / 127.0, torch.zeros_like(absmax)).double()
    out = (xq.double() * s).view(x.shape) @ w.double().T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("rows", [1, 3, 13, 16, 64, 200])
@pytest.mark.parametrize("gguf_type", KQUANTS)
def test_kquant_linear_is_the_int8_activation_product(ops, gguf_type, rows):
    """37 features (a last block of 4 with three missing), 512 inputs (2 super-blocks), bias; a
    row whose first super-block is zero and one with an outlier block. fp32 within ~1e-7 of the
    sum of |x w| of the exact math (4e-8 seen: the fp32 scaling of exact integer sums); bf16 x
    and out within bf16's rounding. On the SIMD builds (VNNI or AVX2 kernels) the plain loops
    (the scalar build's) compute it too."""
    gen = torch.Generator().manual_seed(rows)
    raw = random_blocks(gguf_type, 37, 512, np.random.default_rng(rows))
    w = _gguf_dequantize(raw, gguf_type)
    packed = ops.kquant_pack(torch.from_numpy(raw), BLOCK_BYTES[gguf_type])
    x, bias = torch.randn(rows, 512, generator=gen), torch.randn(37, generator=gen)
    x[0, :256] = 0.0
    if rows > 1:
        x[1, 256:] *= 100
    bound = x.abs().double() @ w.abs().double().T + bias.abs().double()
    want = _q8k_reference(x, w, bias)
    runs = [ops.kquant_linear] + ([ops.kquant_linear_plain] if ops.isa != "scalar" else [])
    for run in runs:
        got = run(x.view(rows, 1, 512), packed, bias, 37)
        assert got.shape == (rows, 1, 37) and got.dtype == torch.float32
        assert ((got.view(rows, 37).double() - want).abs() <= 2e-7 * bound).all()
        bf16 = run(x.bfloat16(), packed, bias.bfloat16(), 37)
        assert bf16.dtype == torch.bfloat16
        torch.testing.assert_close(bf16.double(), _q8k_reference(x.bfloat16(), w, bias.bfloat16()), atol=1e-2, rtol=2 ** -7)
    exact = x.double() @ w.double().T + bias.double()  # int8 activations: ~1% of the product
    assert (got.view(rows, 37).double() - exact).norm() <= 0.03 * exact.norm()


def test_kquant_ops_refuse_mismatched_weights(ops):
    raw = torch.from_numpy(random_blocks("Q4_K", 4, 256, np.random.default_rng(0)))
    packed = ops.kquant_pack(raw, 144)
    with pytest.raises(RuntimeError, match="not kquant_pack of a \\[4, 512\\] weight"):
        ops.kquant_linear(torch.randn(1, 512), packed, None, 4)
    with pytest.raises(RuntimeError, match="not a k-quant's"):
        ops.kquant_linear(torch.randn(1, 256), packed[..., :100].contiguous(), None, 4)
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16"):
        ops.kquant_linear(torch.randn(1, 256).half(), packed, None, 4)
    with pytest.raises(ValueError, match="kquant_pack: raw must be uint8"):
        ops.kquant_pack(raw[:, :100], 144)


# ---- served weights ------------------------------------------------------------------------------


def _blocks(gguf_type: str, rows: int, inputs: int, rng: np.random.Generator):
    """GGUFBlocks of random valid blocks: the k-quants' random bytes, gguf-py's own quantizer
    for Q8_0 / Q4_0 / Q4_1."""
    from gguf import GGMLQuantizationType, quants

    from cluster.model.gguf_file import GGUFBlocks

    if gguf_type in KQUANTS:
        raw = random_blocks(gguf_type, rows, inputs, rng)
    else:
        raw = quants.quantize(rng.standard_normal((rows, inputs)).astype(np.float32), GGMLQuantizationType[gguf_type])
    return GGUFBlocks(torch.from_numpy(raw), gguf_type, inputs)


@pytest.mark.parametrize("gguf_type", ["Q8_0", "Q4_0", "Q4_1", *KQUANTS])
def test_served_gguf_weights_are_the_files_blocks(gguf_type):
    """Each served GGUF type from its raw blocks (QuantizedWeight.from_gguf): dequantizes to
    gguf-py's values bit for bit, at the file's bytes a weight (Q8_0 W8A8 adds its offsets;
    4-bit formats keep an fp16 d and m per 32)."""
    from cluster.kernels import cpu_kernels

    kernels = cpu_kernels.load()
    blocks = _blocks(gguf_type, 67, 512, np.random.default_rng(2))
    weight = QuantizedWeight.from_gguf(blocks, kernels)
    assert (weight.kind, weight.out_features, weight.in_features) == (gguf_type.lower(), 67, 512)
    assert torch.equal(weight.dequantize(torch.float32), blocks.dequantize())
    per_block = {"Q8_0": 32 + 2 + 4 * (weight.offsets is not None) + 2, "Q4_0": 20, "Q4_1": 20}
    bytes_per_row = 512 // blocks.block_inputs * per_block.get(gguf_type, blocks.block_bytes)
    assert weight.nbytes == 68 * bytes_per_row  # 67 features padded to 68


@pytest.mark.parametrize("gguf_type", ["Q4_K", "Q6_K"])
def test_many_rows_take_the_products_of_few(gguf_type):
    """x [2, 300, K]: 600 rows, past INT8_X_ROW_TILE (QuantizedWeight.linear runs the kernel on
    tiles of rows) with a last tile short of it: each row's output, bias included, is bit for bit
    the one a call of 12 rows gives it, in x's leading shape, and within fp32 rounding of a call of
    6. (From 8 rows the AVX512-VNNI build runs its panel kernel, the same integers with their fp32
    sums in another order than its few-row kernel's; the AVX2 and plain builds keep one order.)"""
    from cluster.kernels import cpu_kernels
    from cluster.model.layers.quantization import INT8_X_ROW_TILE

    kernels = cpu_kernels.load()
    rng = np.random.default_rng(4)
    weight = QuantizedWeight.from_gguf(_blocks(gguf_type, 40, 512, rng), kernels)
    x, bias = torch.randn(2, 300, 512), torch.randn(40)
    assert 600 > INT8_X_ROW_TILE and 600 % INT8_X_ROW_TILE
    got = weight.linear(x, bias)
    rows = x.view(600, 512)

    def in_calls_of(n: int) -> torch.Tensor:
        return torch.cat([kernels.kquant_linear(rows[i:i + n], weight.tensors[0], bias, 40) for i in range(0, 600, n)])

    assert got.shape == (2, 300, 40) and torch.equal(got.view(600, 40), in_calls_of(12))
    torch.testing.assert_close(got.view(600, 40), in_calls_of(6), rtol=1e-5, atol=1e-4)


def test_stacked_weights_compute_each_part():
    """A merged projection of a Q4_K, a Q6_K and a Q8_0 tensor: each part computes its features,
    the same bits through packed_linear (what the one-call layers run) as part by part, bias too.
    On this CPU's own build, the one QuantizedWeight runs."""
    from cluster.kernels import cpu_kernels
    from cluster.model.layers.quantization import gguf_weight

    ops = cpu_kernels.load()
    rng = np.random.default_rng(3)
    parts = [_blocks("Q4_K", 12, 256, rng), _blocks("Q4_K", 8, 256, rng), _blocks("Q6_K", 8, 256, rng),
             _blocks("Q8_0", 6, 256, rng)]
    weight = gguf_weight(parts, ops)
    assert isinstance(weight, StackedWeight) and weight.kind == "q4_k+q6_k+q8_0"
    assert (weight.out_features, weight.header.tolist()) == (34, [[1, 20], [1, 8], [len(weight.parts[2].skinny_tensors), 6]])
    assert torch.equal(weight.dequantize(torch.float32), torch.cat([b.dequantize() for b in parts]))
    x, bias = torch.randn(5, 256), torch.randn(34)
    for rows in (1, 5):
        want = torch.cat([p.linear(x[:rows], bias[a:b]) for p, a, b in zip(weight.parts, (0, 20, 28), (20, 28, 34))], -1)
        assert torch.equal(weight.linear(x[:rows], bias), want)
        assert torch.equal(ops.packed_linear(x[:rows], weight.skinny_tensors, bias, 34), want)


# ---- a Q4_K_M-style file ---------------------------------------------------------------------------

# llama.cpp's Q4_K_M: Q4_K, with Q6_K for the head and for attn_v / ffn_down in some layers (here
# layer 0); one Q5_K tensor beside a Q4_K one (layer 1's ffn_up) covers Q5_K and a stacked gate_up.
MIX = {"output.weight": "Q6_K", "blk.0.attn_v.weight": "Q6_K", "blk.0.ffn_down.weight": "Q6_K",
       "blk.1.ffn_up.weight": "Q5_K"}


def _mix(name: str) -> str:
    return MIX.get(name, "Q4_K")


def _tiny_llama(config, seed: int) -> dict[str, np.ndarray]:
    """Random weights of `config`'s llama (norms near 1, weights ~N(0, 0.05)) as numpy, HF names."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.05 * noise)
    return {k: v.float().numpy() for k, v in model.state_dict().items() if "rotary" not in k}


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory, smollm2_path) -> str:
    """A 2-layer llama (hidden 256, SmolLM2's tokenizer and vocabulary, untied head) as a
    Q4_K_M-style GGUF."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    out = tmp_path_factory.mktemp("kquant-gguf") / "tiny-llama.Q4_K_M.gguf"
    write_llama_gguf(out, config, _tiny_llama(config, seed=5), _mix, tokenizer_gguf=smollm2_path)
    return str(out)


def test_the_tensor_table_is_read_without_the_metadata(kquant_gguf, smollm2_path, tmp_path):
    """read_gguf gives what gguf-py's reader gives (SmolLM2's file and a Q4_K_M-style one, both
    with a vocabulary in their metadata): each tensor's name, type, shape and data (the same
    bytes, shaped and typed alike), the architecture; a file that is not GGUF is a ValueError
    naming it."""
    from gguf import GGUFReader

    from cluster.model.gguf_file import read_gguf, tensor_types

    for path in (kquant_gguf, smollm2_path):
        want, got = GGUFReader(path), read_gguf(path)
        assert [t.name for t in got.tensors] == [t.name for t in want.tensors] and len(got.tensors) > 20
        for a, b in zip(want.tensors, got.tensors):
            assert (a.tensor_type, tuple(int(n) for n in a.shape)) == (b.tensor_type, b.shape), a.name
            assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name
        assert got.fields["general.architecture"] == str(want.fields["general.architecture"].contents())
        assert tensor_types(path) == {t.name: t.tensor_type.name for t in want.tensors}
    bad = tmp_path / "not.gguf"
    bad.write_bytes(b"GGML" + bytes(40))
    with pytest.raises(ValueError, match="not.gguf: not a little-endian GGUF v2 / v3 file"):
        read_gguf(str(bad))


def test_a_file_served_in_floats_is_dequantized_as_transformers_loader_does(tp_kquant_gguf):
    """Without `quantization: gguf` a file's tensors are all dequantized by gguf_file's reader
    (dequantize_gguf): the same names and the same fp32 bits as transformers' GGUF loader, q / k
    rows back in HF's order (a llama file, whose converter permutes them), the untied head
    included."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from cluster.model.gguf_file import read_gguf, unpermute_rows
    from cluster.model.loader import dequantize_gguf, load_hf_config

    config = load_hf_config(tp_kquant_gguf)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    want = load_gguf_checkpoint(tp_kquant_gguf, return_tensors=True, model_to_load=skeleton)["tensors"]
    got = dequantize_gguf(tp_kquant_gguf, config)
    assert sorted(got) == sorted(want) and "lm_head.weight" in got and len(got) == 2 + 2 * 9 + 1
    for name, values in want.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], values), name
    in_file = next(t for t in read_gguf(tp_kquant_gguf).tensors if t.name == "blk.0.attn_q.weight")
    q = got["model.layers.0.self_attn.q_proj.weight"]
    as_in_file = _gguf_dequantize(in_file.data, in_file.tensor_type.name).view(q.shape)
    assert not torch.equal(q, as_in_file)
    assert torch.equal(q, unpermute_rows(as_in_file, config.num_attention_heads))


def test_plan_takes_each_tensor_as_its_type(kquant_gguf, smollm2_path):
    """"gguf" on a Q4_K_M-style file: every linear layer, the head and the (untied, Q4_K)
    embedding in their blocks, per tensor; the norms in floats. SmolLM2's (Q4_1 layers, tied Q8_0
    head) keeps its plan."""
    plan = quant_plan("gguf", kquant_gguf, "cpu")
    assert (plan.layers, plan.head) == ("q4_k+q5_k+q6_k", "q6_k")
    served = dict(plan.gguf_tensors)
    assert len(served) == 2 * 7 + 2 and served["token_embd.weight"] == "q4_k" and served["output.weight"] == "q6_k"
    assert served["blk.0.attn_v.weight"] == "q6_k" and served["blk.1.attn_v.weight"] == "q4_k"
    smollm2 = gguf_plan(smollm2_path)
    assert (smollm2.layers, smollm2.head) == ("q4_1", "q8_0") and "token_embd.weight" in dict(smollm2.gguf_tensors)


def test_q_and_k_rows_stay_views_of_the_file_until_packed(kquant_gguf):
    """llama.cpp's converter permutes q / k rows; their blocks come out of the file as views of
    the mapped file with HF's row order beside them, not reordered copies (an 8B held ~0.4 GB of
    such copies until packing), and gathered in that order they are the permutation undone."""
    from cluster.model.gguf_file import iter_gguf_tensors, unpermute_rows
    from cluster.model.loader import load_hf_config

    config = load_hf_config(kquant_gguf)
    seen = set()
    for name, blocks in iter_gguf_tensors(kquant_gguf, config, dict(quant_plan("gguf", kquant_gguf, "cpu").gguf_tensors)):
        if not hasattr(blocks, "raw"):
            continue
        start = blocks.mapped.ctypes.data  # the mapped file: its bytes, not a copy
        assert start <= blocks.raw.data_ptr() < start + blocks.mapped.nbytes, name
        part = name.split(".")[-2]
        if part in ("q_proj", "k_proj"):
            heads = config.num_attention_heads if part == "q_proj" else config.num_key_value_heads
            assert torch.equal(blocks.in_order().raw, unpermute_rows(blocks.raw, heads)), name
            assert blocks.shape == blocks.in_order().shape
            seen.add(part)
        else:
            assert blocks.order is None and blocks.in_order() is blocks, name
    assert seen == {"q_proj", "k_proj"}


def _load(path: str, plan, parallel=None) -> torch.nn.Module:
    """fp32, with the weights left in floats kept as loaded (F.linear's, not oneDNN's layout), so
    a layer's `weight` can be compared."""
    from unittest import mock

    from test_model import _model_config

    from cluster.model.layers.cpu_gemm import GEMM_ENV
    from cluster.model.loader import load_hf_config, load_model
    from cluster.model.parallel import SINGLE

    mc = _model_config(path, torch.float32, load_hf_config(path))
    mc = mc.with_facts(quant_plan=plan)
    with mock.patch.dict(os.environ, {GEMM_ENV: "aten"}):
        return load_model(mc, parallel or SINGLE, torch.device("cpu"), use_cache=False)


def _served(model) -> dict[str, object]:
    return {name: m.packed for name, m in model.named_modules() if hasattr(m, "pack_weight")}


def test_kquant_file_serves_its_own_blocks(kquant_gguf):
    """Loaded with "gguf": every projection and the head in their blocks (a StackedWeight for
    layer 0's qkv, Q6_K v beside Q4_K q / k, and layer 1's gate_up, Q4_K and Q5_K), no float
    weight left but the embedding and norms, at the file's bytes; dequantized, each is the
    weight transformers' GGUF loader gives (names, q / k rows, merging), bit for bit. The
    one-call decoder layers take them."""
    plan = quant_plan("gguf", kquant_gguf, "cpu")
    model, floats = _load(kquant_gguf, plan), _load(kquant_gguf, None)
    served, reference = _served(model), dict(floats.named_modules())
    kinds = {name: w.kind for name, w in served.items()}
    assert kinds["model.layers.0.self_attn.qkv_proj"] == "q4_k+q6_k"
    assert kinds["model.layers.1.mlp.gate_up_proj"] == "q4_k+q5_k"
    assert kinds["model.layers.0.mlp.down_proj"] == "q6_k" and kinds["lm_head"] == "q6_k"
    assert {k for name, k in kinds.items() if name not in ("model.layers.0.self_attn.qkv_proj",
                                                            "model.layers.1.mlp.gate_up_proj")} <= {"q4_k", "q6_k"}
    assert all(getattr(m, "weight", None) is None for m in model.modules() if hasattr(m, "pack_weight"))
    for name, weight in served.items():
        want = reference[name].weight.detach()
        assert torch.equal(weight.dequantize(torch.float32), want), name
    q4k = served["model.layers.0.self_attn.o_proj"]
    assert q4k.nbytes == 256 * 256 * 144 // 256  # 4.5 bits a weight, as in the file
    assert model.model.fused_decode is not None and model.model.fused_decode.max_rows == KQUANT_FUSED_MAX_ROWS


def test_kquant_file_generates_what_its_floats_generate(kquant_gguf):
    """The engine with quantization "gguf" against the same file dequantized (both fp32). The
    k-quant layers round activations to int8 per 256 inputs (llama.cpp's Q8_K), which moves this
    random model's logits by ~2.5% (by norm): its next-token distributions are nearly flat (KL
    ~2e-4), so free-running greedy sequences part after a few tokens (7-22 of 32 seen) and
    equality is not expected. What is checked: both generate, and fed the dequantized model's
    greedy tokens (teacher forcing, prompt_logprobs), the served model's argmax is that token at
    most positions (94% seen), the dequantized model's own at (nearly) all (100% seen)."""
    from cluster import LLM, SamplingParams

    prompts = [[1, 5, 9, 200, 31, 7], [4, 4, 4, 4], list(range(100, 160))]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    forced = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    agreement = {}
    reference = None
    for quantization in (None, "gguf"):
        llm = LLM(model=kquant_gguf, dtype="float32", quantization=quantization, max_num_seqs=4)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
        reference = reference or [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)]
        scored = llm.generate([{"prompt_token_ids": seq} for seq in reference], forced, use_tqdm=False)
        hits = [_top_token(o.prompt_logprobs[i]) == seq[i]  # position i: token i given those before
                for p, seq, o in zip(prompts, reference, scored) for i in range(len(p), len(seq))]
        agreement[quantization] = sum(hits) / len(hits)
    assert agreement[None] >= 0.95 and agreement["gguf"] >= 0.75, agreement


def _top_token(position) -> int:
    """The rank-1 token of a prompt_logprobs position."""
    return next(token for token, logprob in position.items() if logprob.rank == 1)


def test_kquant_prefill_logits_track_the_dequantized_file(kquant_gguf):
    """A prefill of several prompts at once (59 rows): the logits within a few % of the dequantized
    model's by norm (2.5% seen), the argmax mostly the same (~95% seen)."""
    from test_model import PROMPTS, BLOCK, Pager, _prefill_all

    from cluster.model.kv_cache import bind_kv_cache

    logits = {}
    for key, plan in (("gguf", quant_plan("gguf", kquant_gguf, "cpu")), ("floats", None)):
        model = _load(kquant_gguf, plan)
        bind_kv_cache(model, 96, BLOCK, torch.float32, "cpu")
        logits[key] = torch.cat(_prefill_all(model, PROMPTS, Pager(96)))
    got, want = logits["gguf"], logits["floats"]
    assert (got - want).norm() < 0.05 * want.norm()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8


def test_a_tensor_of_an_unserved_type_leaves_its_layer_in_floats(tmp_path, caplog):
    """Layer 0's attn_v in Q5_1 (not served in blocks): the plan says so in the log; that layer's
    qkv (Q4_K q and k beside it) is served dequantized, with a warning, as the file's floats; the
    other projections stay in their blocks."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, rms_norm_eps=1e-5)
    path = tmp_path / "q5_1-v.gguf"
    write_llama_gguf(path, config, _tiny_llama(config, seed=8), lambda name: "Q5_1" if name == "blk.0.attn_v.weight" else "Q4_K")
    caplog.set_level(logging.INFO, logger="cluster.model.layers.quant_plan")
    plan = quant_plan("gguf", str(path), "cpu")
    assert "layer weights of type Q5_1 are served dequantized" in caplog.text
    assert "blk.0.attn_v.weight" not in dict(plan.gguf_tensors) and plan.layers == "q4_k"
    model, floats = _load(str(path), plan), _load(str(path), None)
    served = _served(model)
    assert served["model.layers.0.self_attn.qkv_proj"] is None
    assert "part of its rows are GGUF tensors of a type served in floats" in caplog.text
    assert torch.equal(model.model.layers[0].self_attn.qkv_proj.weight, floats.model.layers[0].self_attn.qkv_proj.weight)
    assert all(w is not None for name, w in served.items() if name != "model.layers.0.self_attn.qkv_proj")


def test_q5_0_tensors_are_served_as_the_q8_0_blocks_of_the_same_weights(tmp_path):
    """llama-quantize's Q4_K_M writes Q5_0 where a row is not a multiple of 256 (most of
    SmolLM2's tensors): they are served as Q8_0 blocks holding every weight unchanged (d the
    same, q = q5 - 16), so a layer of Q5_0 q / k beside a Q8_0 v is one stacked Q8_0 weight in
    blocks, bit for bit the file's floats, each packed as a Q8_0 tensor of the file is; the
    blocks' rewrite is exact on random blocks of any scale (gguf-py's dequantization of both)."""
    from gguf import GGMLQuantizationType, quants
    from transformers import LlamaConfig

    from cluster.model.gguf_file import q5_0_as_q8_0

    rng = np.random.default_rng(4)
    w = (rng.standard_normal((8, 192)) * rng.choice([1e-4, 0.02, 1.0, 300.0], (8, 1))).astype(np.float32)
    raw = quants.quantize(w, GGMLQuantizationType.Q5_0)
    rewritten = q5_0_as_q8_0(raw)
    assert rewritten.shape == (8, 192 // 32 * 34)
    assert np.array_equal(quants.dequantize(rewritten, GGMLQuantizationType.Q8_0),
                          quants.dequantize(raw, GGMLQuantizationType.Q5_0))

    config = LlamaConfig(vocab_size=256, hidden_size=192, intermediate_size=384, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, rms_norm_eps=1e-5)
    path = tmp_path / "q5_0.gguf"
    write_llama_gguf(path, config, _tiny_llama(config, seed=9), lambda name: "Q8_0" if "attn_v" in name or "ffn_down" in name else "Q5_0")
    plan = quant_plan("gguf", str(path), "cpu")
    assert dict(plan.gguf_tensors)["blk.0.attn_q.weight"] == "q8_0" and plan.layers == "q8_0"
    model, floats = _load(str(path), plan), _load(str(path), None)
    served, reference = _served(model), dict(floats.named_modules())
    assert all(w is not None and w.kind == "q8_0" for w in served.values()), served
    for name, weight in served.items():
        assert torch.equal(weight.dequantize(torch.float32), reference[name].weight.detach()), name
    o_proj, down = served["model.layers.0.self_attn.o_proj"], served["model.layers.0.mlp.down_proj"]
    assert o_proj.nbytes / (192 * 192) == down.nbytes / (192 * 384) < 2  # down_proj: Q8_0 in the file


def test_a_tied_table_in_blocks_is_looked_up_in_them(tmp_path):
    """A tied head (no output.weight; token_embd Q6_K, as Llama-3.2-1B's Q4_K_M) serves the
    embedding too: the lookup dequantizes the rows it reads from the head's blocks, bit for bit
    the table the file's floats give, and no float table is kept; also a TP rank's own shard."""
    from transformers import LlamaConfig

    from cluster.model.parallel import ParallelContext

    config = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, rms_norm_eps=1e-5)
    tensors = {k: v for k, v in _tiny_llama(config, seed=7).items() if k != "lm_head.weight"}
    path = tmp_path / "tied.Q4_K_M.gguf"
    write_llama_gguf(path, config, tensors, lambda name: "Q6_K" if name == "token_embd.weight" else "Q4_K")
    plan = quant_plan("gguf", str(path), "cpu")
    ids = torch.tensor([[0, 5, 999], [998, 3, 3]])
    for parallel in (None, ParallelContext(1, 2)):
        model, floats = _load(str(path), plan, parallel), _load(str(path), None, parallel)
        embed = model.model.embed_tokens
        assert embed.weight is None and model.lm_head.weight is None and model.lm_head.packed.kind == "q6_k"
        assert not any(p.numel() >= 1000 * 256 for p in model.parameters())
        table = floats.model.embed_tokens.weight
        local = ids % table.shape[0]  # rank 1 of 2 holds ids 500-999 as 0-499
        got = embed.rows_of(local)
        assert got.shape == (2, 3, 256) and got.dtype == torch.float32
        assert torch.equal(got, table[local])
        if parallel is None:
            assert torch.equal(embed(ids), table[ids])


def test_an_untied_kquant_table_is_looked_up_in_its_own_blocks(tp_kquant_gguf):
    """An untied head (output.weight Q6_K, token_embd Q4_K, as Llama-3.1-8B's Q4_K_M): the
    embedding keeps its own blocks and dequantizes the rows it reads, bit for bit the table the
    file's floats give; no float table is made, the blocks are the file's bytes (4.5 bits a
    weight, rows packed four by four); also each TP rank's shard, the last padded (vocab 1000 = 334 + 334 + 332)."""
    from cluster.model.parallel import ParallelContext

    plan = quant_plan("gguf", tp_kquant_gguf, "cpu")
    assert dict(plan.gguf_tensors)["token_embd.weight"] == "q4_k"
    ids = torch.tensor([[0, 5, 333], [331, 3, 3]])
    for parallel in (None, ParallelContext(0, 3), ParallelContext(2, 3)):
        model, floats = _load(tp_kquant_gguf, plan, parallel), _load(tp_kquant_gguf, None, parallel)
        embed, table = model.model.embed_tokens, floats.model.embed_tokens.weight
        assert embed.weight is None and embed.gguf_segments is None and model.lm_head.packed.kind == "q6_k"
        assert embed.row_blocks.kind == "q4_k" and embed.row_blocks.nbytes == -(-table.shape[0] // 4) * 4 * 768 * 144 // 256
        assert not any(p.numel() >= 334 * 768 for p in model.parameters())
        got = embed.rows_of(ids)
        assert got.shape == (2, 3, 768) and got.dtype == torch.float32
        assert torch.equal(got, table[ids])
        if parallel is None:
            assert torch.equal(embed(ids), table[ids])
    last = _load(tp_kquant_gguf, plan, ParallelContext(2, 3)).model.embed_tokens
    assert torch.equal(last.rows_of(torch.tensor([332, 333])), torch.zeros(2, 768))  # the padding rows


# ---- tensor parallel -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tp_kquant_gguf(tmp_path_factory) -> str:
    """A llama whose row-parallel inputs split into whole super-blocks at TP=3 (768 = 3 x 256)
    and not at TP=2 (384): 6 q heads of 128, 3 KV heads, a vocab of 1000 (padded shards), no
    tokenizer."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=1000, hidden_size=768, intermediate_size=768, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=256,
                         tie_word_embeddings=False, rms_norm_eps=1e-5)
    out = tmp_path_factory.mktemp("tp-kquant-gguf") / "tp-llama.Q4_K_M.gguf"
    write_llama_gguf(out, config, _tiny_llama(config, seed=6), _mix)
    return str(out)


def test_tp_shards_keep_whole_super_blocks(tp_kquant_gguf, caplog):
    """At TP=3 every rank serves every projection in its blocks (row-parallel shards of 256
    inputs); at TP=2 a row-parallel shard of 384 inputs would cut a super-block, so o_proj and
    down_proj load dequantized, with a warning, and the rest stays in blocks."""
    from cluster.model.parallel import ParallelContext

    plan = quant_plan("gguf", tp_kquant_gguf, "cpu")

    def kinds(rank: int, world_size: int) -> dict[str, str | None]:
        model = _load(tp_kquant_gguf, plan, ParallelContext(rank, world_size))
        return {name: getattr(w, "kind", None) for name, w in _served(model).items()}

    for rank in range(3):
        assert None not in kinds(rank, 3).values(), rank
    tp2 = kinds(1, 2)
    row_parallel = {name for name in tp2 if name.endswith(("o_proj", "down_proj"))}
    assert all(tp2[name] is None for name in row_parallel)
    assert None not in {kind for name, kind in tp2.items() if name not in row_parallel}
    assert "not whole 256-input blocks (a TP shard)" in caplog.text


def test_kquant_blocks_at_tp3_match_a_single_rank(tp_kquant_gguf, tmp_path):
    """Served in their blocks, TP=3's ranks compute what one rank computes (row-parallel partial
    sums differ in fp32 rounding only: each shard quantizes its own whole super-blocks of x)."""
    from rank_processes import run_ranks
    from test_model import _tp_logits, _tp_worker

    from cluster.model.loader import load_hf_config
    from cluster.model.parallel import SINGLE

    plan = quant_plan("gguf", tp_kquant_gguf, "cpu")
    config = load_hf_config(tp_kquant_gguf)
    run_ranks(_tp_worker, (3, tp_kquant_gguf, config, str(tmp_path), plan), 3)
    expected = _tp_logits(tp_kquant_gguf, config, SINGLE, plan)
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, atol=1e-4, rtol=1e-4)


# ---- memory ------------------------------------------------------------------------------------------

_PEAK_SCRIPT = textwrap.dedent("""
    import resource, sys, torch
    sys.path.insert(0, {tests!r})
    from test_model import _model_config
    from cluster.kernels import cpu_kernels
    from cluster.model.layers.quant_plan import quant_plan
    from cluster.model.loader import load_hf_config, load_model
    from cluster.model.parallel import SINGLE

    cpu_kernels.load()
    config = load_hf_config({path!r})
    mc = _model_config({path!r}, torch.float32, config)
    mc = mc.with_facts(quant_plan=quant_plan("gguf", {path!r}, "cpu"))
    with open("/proc/self/status") as fh:
        before = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS"))
    model = load_model(mc, SINGLE, torch.device("cpu"), use_cache=False, fuse_layers=False)
    with open("/proc/self/status") as fh:
        peak = next(int(line.split()[1]) for line in fh if line.startswith("VmHWM"))
    print((peak - before) * 1024)
""")


def test_loading_peaks_near_the_file_size(tmp_path):
    """A 4-layer model of 1024 x 2048 layers (42M weights: 168 MB in fp32, a 24 MB Q4_K file): the
    resident memory a "gguf" load adds peaks under 4x the file's size (2.8-3.2x seen: on a model
    this small the packed blocks, one weight's copy onto huge pages and the kernels' fixed
    buffers dominate; benchmarks/real_sizes.py measures the real sizes), under fp32's size, which
    the dequantizing load holds at least once."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=256, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256,
                         tie_word_embeddings=False, rms_norm_eps=1e-5)
    path = tmp_path / "mem.Q4_K.gguf"
    write_llama_gguf(path, config, _tiny_llama(config, seed=7), lambda name: "Q4_K")
    script = _PEAK_SCRIPT.format(tests=str(Path(__file__).parent), path=str(path))
    added = int(subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True).stdout.split()[-1])
    fp32 = 4 * 4 * (4 * 1024 * 1024 + 3 * 1024 * 2048)
    assert added < 4 * path.stat().st_size and added < 0.6 * fp32, (added, path.stat().st_size, fp32)


def _rss_file() -> int:
    """This process's resident file-backed bytes, counted from its page tables (smaps_rollup:
    /proc/self/status's RssFile is a lazily synced counter)."""
    with open("/proc/self/smaps_rollup") as fh:
        fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in fh if line.endswith("kB\n")}
    return fields["Rss"] - fields["Anonymous"]


def test_packed_blocks_release_the_files_pages_and_nothing_else(tmp_path):
    """Once copied out, a view of the mapped file gives its pages back (the process's file-backed
    resident memory falls by the view's size) and still reads the same bytes (mapped again from
    the page cache); a copy of the blocks elsewhere in memory is left as it is."""
    from cluster.model.gguf_file import GGUFBlocks

    rows, row_bytes = 16384, 16 * 144  # 36 MiB of Q4_K rows of 4096 inputs
    path = tmp_path / "blocks.bin"
    np.random.default_rng(3).integers(0, 256, rows * row_bytes, dtype=np.uint8).tofile(path)
    mapped = np.memmap(path, mode="r")
    view = torch.from_numpy(np.asarray(mapped).reshape(rows, row_bytes))
    blocks = GGUFBlocks(view[:, :], "Q4_K", 4096, mapped=mapped)
    copy = blocks.with_rows(torch.from_numpy(np.fromfile(path, dtype=np.uint8).reshape(rows, row_bytes)))  # read(), not mapped
    before = _rss_file()
    total = int(view.sum(dtype=torch.int64))  # every page of the file mapped in
    touched = _rss_file()
    assert touched - before > 0.9 * rows * row_bytes
    copy.release_pages()  # not the file: nothing happens
    assert _rss_file() > touched - 0.1 * rows * row_bytes and torch.equal(copy.raw, view)
    blocks.release_pages()
    assert _rss_file() < before + 0.1 * rows * row_bytes
    assert int(view.sum(dtype=torch.int64)) == total


def test_llama3_rope_freqs_rotate_as_the_checkpoints_scaling(tmp_path):
    """A Llama 3 GGUF carries its "llama3" rope scaling as rope_freqs.weight, one divisor per
    frequency (llama.cpp's converter writes it and no scaling keys), which transformers' GGUF config
    drops (rope_type "default"): the loader reads it into the config and the rotary table is the
    one the HF checkpoint's llama3 scaling gives (issue 44: Llama-3.2-1B / 3.1-8B files)."""
    import math

    from transformers import LlamaConfig

    from cluster.model.layers.rotary import RotaryEmbedding, compute_inv_freq, get_rope
    from cluster.model.loader import load_hf_config

    scaling = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    head_dim = 64
    inv = 1.0 / scaling["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factors = []  # the divisors as llama.cpp documents them for llama3 scaling, per wavelength band
    for wavelen in 2 * math.pi / inv:
        old, low, high, f = (scaling[k] for k in ("original_max_position_embeddings", "low_freq_factor",
                                                  "high_freq_factor", "factor"))
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(f)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / f + smooth))
    assert 1.0 in factors and 8.0 in factors and any(1 < x < 8 for x in factors)  # every band
    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=500000.0)
    path = tmp_path / "llama3-rope.gguf"
    write_llama_gguf(path, config, _tiny_llama(config, seed=3), lambda name: "F32",
                     extra={"rope_freqs.weight": np.array(factors, dtype=np.float32)})
    loaded = load_hf_config(str(path))
    assert loaded.rope_freq_factors == pytest.approx(factors, rel=1e-6)
    assert load_hf_config(str(path)).rope_freq_factors == loaded.rope_freq_factors  # from the cached config
    ours = get_rope(loaded, head_dim).cos_sin
    want_inv, _ = compute_inv_freq(dict(scaling), head_dim, 8192)
    want = RotaryEmbedding(head_dim, head_dim, 8192, want_inv).cos_sin
    torch.testing.assert_close(ours, want, atol=1e-3, rtol=0)  # angles up to 8191 x inv_freq in fp32
    del loaded.rope_freq_factors  # what the file rotated with before: far from the checkpoint's
    assert (get_rope(loaded, head_dim).cos_sin - want).abs().max() > 0.5
