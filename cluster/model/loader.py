"""Model config and weight loading: HF-style directories (config.json + *.safetensors) and
single GGUF files, their configs and tokenizers read through transformers' GGUF support.

Dequantizing a GGUF (and even parsing its metadata, which includes the tokenizer) takes
seconds, so the first load writes the HF config and the dequantized fp32 tensors to
`~/.cache/llm-cluster/<name>-<key>/` (override with $LLM_CLUSTER_CACHE), keyed by the
file's path, size and mtime; later loads read that with safetensors.

With `quantization: gguf` (a plan naming GGUF tensors) the weights are read straight from the
file instead, tensor by tensor (gguf_file.py): the served tensors' blocks as they are, the rest
dequantized one at a time; no fp32 copy of the model is made or cached.
"""
from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from cluster.cache import cache_key, cache_root, record_source, write_atomically
from cluster.kernels import cpu_kernels
from cluster.model.gguf_file import iter_gguf_tensors, rope_freq_factors
from cluster.model.hf_config import HFConfig
from cluster.model.layers.attention import Attention, BACKENDS
from cluster.model.layers import fused_layer
from cluster.model.layers.cpu_gemm import move_to_huge_pages, pack_linears
from cluster.model.layers.embedding import read_rows_from_blocks
from cluster.model.models.registry import MODEL_TYPE_TO_ARCH, get_model_class
from cluster.model.parallel import ParallelContext

logger = logging.getLogger(__name__)

_WEIGHTS_FILE = "model.safetensors"


def gguf_cache_dir(gguf_path: str | Path) -> Path:
    path = Path(gguf_path)
    return cache_root() / f"{path.stem}-{cache_key(path)}"


def _is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf")


def _check_path(path: str | Path) -> Path:
    p = Path(path)
    if _is_gguf(p):
        if not p.is_file():
            raise ValueError(f"GGUF file {str(p)!r} does not exist")
    elif not (p / "config.json").is_file():
        raise ValueError(f"model path {str(p)!r} is neither a .gguf file nor a directory with config.json")
    return p


def _finish_config(config: Any) -> Any:
    if not getattr(config, "architectures", None) and config.model_type in MODEL_TYPE_TO_ARCH:
        config.architectures = [MODEL_TYPE_TO_ARCH[config.model_type]]
    return config


def load_hf_config(path: str) -> Any:
    """The transformers config of an HF directory or a .gguf file (cached for GGUF)."""
    from transformers import AutoConfig

    p = _check_path(path)
    if not _is_gguf(p):
        return _finish_config(AutoConfig.from_pretrained(p))
    cached = gguf_cache_dir(p) / "config.json"
    if cached.is_file():
        return _finish_config(AutoConfig.from_pretrained(cached.parent))
    config = _finish_config(AutoConfig.from_pretrained(p.parent, gguf_file=p.name))
    factors = rope_freq_factors(str(p))  # Llama 3's rope scaling, which transformers' GGUF config drops
    if factors is not None:
        config.rope_freq_factors = factors

    def write(tmp: Path) -> None:
        with tempfile.TemporaryDirectory() as d:
            config.save_pretrained(d)
            shutil.copyfile(Path(d) / "config.json", tmp)

    write_atomically(cached, write)
    record_source(cached.parent, p)
    return config


def resolved_hf_config(path: str) -> HFConfig:
    """`HFConfig.of(load_hf_config(path))`, kept in the cache beside the model's other entries
    (keyed by its config.json or .gguf file and transformers' version): transformers' config
    classes import its model packages (torch.distributed.tensor, sympy: ~1.5 CPU-s), which every
    process that resolves an engine config (each `serve run` app build, each `LLM`) paid again."""
    p = _check_path(path)
    source = p if _is_gguf(p) else p / "config.json"
    entry = cache_root() / "hf-config" / f"{p.stem}-{cache_key(source, version('transformers'))}.json"
    with contextlib.suppress(OSError, ValueError):
        cached = HFConfig.from_json(entry.read_text())
        if isinstance(cached, HFConfig):
            return cached
    config = HFConfig.of(load_hf_config(path))
    try:
        text = config.to_json()
    except TypeError as exc:  # a value with no JSON form: served uncached
        logger.info("the config of %s is not cached: %s", path, exc)
        return config
    write_atomically(entry, lambda tmp: tmp.write_text(text))
    record_source(entry, source)
    return config


def dequantize_gguf(path: str | Path, config: Any | None = None) -> dict[str, torch.Tensor]:
    """All tensors of a GGUF file, dequantized to fp32 under HF names, q / k rows in HF's order.
    The architectures the engine serves are read tensor by tensor (gguf_file.py: gguf-py's
    dequantize, as transformers does, without parsing the metadata's vocabulary again);
    any other goes through transformers' GGUF loader, which also names its tensors."""
    from transformers import AutoConfig

    p = Path(path)
    config = config or AutoConfig.from_pretrained(p.parent, gguf_file=p.name)
    if config.model_type in MODEL_TYPE_TO_ARCH:
        return dict(iter_gguf_tensors(str(p), config, {}))
    from transformers import AutoModelForCausalLM  # transformers' model code: only where it names the tensors
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    if isinstance(config, HFConfig):  # a resolved config's: transformers' model code needs its own
        config = config.to_transformers()
    # The name mapping walks an HF model's state dict: a meta-device one costs nothing.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    return load_gguf_checkpoint(str(p), return_tensors=True, model_to_load=skeleton)["tensors"]


def _gguf_weights(path: Path, config: Any, use_cache: bool) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file, save_file

    cached = gguf_cache_dir(path) / _WEIGHTS_FILE
    if use_cache and cached.is_file():
        yield from load_file(cached).items()
        return
    tensors = dequantize_gguf(path, config)
    if use_cache:
        write_atomically(cached, lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp)))
        record_source(cached.parent, path)
    yield from tensors.items()


def _safetensors_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights file in {str(path)!r}")
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                yield name, sf.get_tensor(name)


def iter_weights(path: str, config: Any, use_cache: bool = True, plan: Any = None) -> Iterator[tuple[str, Any]]:
    """(HF name, full tensor) pairs of a checkpoint; with a quantization plan naming GGUF tensors
    (QuantPlan.gguf_tensors), those come as their blocks (gguf_file.GGUFBlocks)."""
    p = _check_path(path)
    if _is_gguf(p) and plan is not None and plan.gguf_tensors:
        return iter_gguf_tensors(str(p), config, dict(plan.gguf_tensors))
    return _gguf_weights(p, config, use_cache) if _is_gguf(p) else _safetensors_weights(p)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights for speed runs: N(0, 0.02) (HF's initializer range), norm scales 1,
    generated on the parameters' device (an 8B model fills in a second on a GPU)."""
    gens: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
                continue
            if param.device not in gens:
                gens[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            param.normal_(0.0, 0.02, generator=gens[param.device])


def load_model(model_config: Any, parallel: ParallelContext, device: torch.device | str,
               attention_backend: str = "auto", use_cache: bool = True, fuse_layers: bool = True) -> nn.Module:
    """Build `hf_config`'s model in `torch_dtype` on `device` and load this rank's weights
    from `model_config.path`. `attention_backend` ("auto" | "torch" | "cpu_paged" | "flash_attn" |
    "triton") is resolved when the KV cache is bound (it depends on the block size). With
    `model_config.load_format == "dummy"` no weights are read: see `init_dummy_weights`.
    On CPU the model is then prepared for it: see `_prepare_for_cpu` (`fuse_layers` False keeps
    every step on the modular layers, as `enforce_eager` asks)."""
    if attention_backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {attention_backend!r}")
    config = model_config.hf_config
    if config is None:
        config = load_hf_config(model_config.path)
    cls = get_model_class(config)
    dtype = model_config.torch_dtype or torch.float32
    plan = getattr(model_config, "quant_plan", None)
    _check_path(model_config.path)
    # Parameters are created directly in the serving dtype (in fp32 when some are quantized: they
    # are quantized from the checkpoint's own values, and the rest cast after); rotary tables stay fp32.
    with _default_dtype(torch.float32 if plan is not None else dtype), torch.device(device):
        model = cls(config, parallel)
    if model_config.load_format == "dummy":
        init_dummy_weights(model, model_config.seed)
    else:
        model.load_weights(iter_weights(model_config.path, config, use_cache, plan))
    for module in model.modules():
        if isinstance(module, Attention):
            module.backend_name = attention_backend
    if torch.device(device).type == "cpu":
        _prepare_for_cpu(model, dtype, plan, fuse_layers)
    return model.eval()


def _prepare_for_cpu(model: nn.Module, dtype: torch.dtype, plan: Any = None, fuse_layers: bool = True) -> None:
    """Pack bf16 linear weights for oneDNN and the kernel library's decode GEMM (those the
    quantization plan names: int8 for its int8 GEMMs instead), and hand the layers with a
    `kernels` slot (norms, SiLU-and-mul, rotary) the library; where it cannot be built they keep
    oneDNN alone and torch ops, and a quantization falls back to float weights with a warning.
    With a plan the model was built in fp32: what stays in floats is cast to `dtype` last."""
    kernels = cpu_kernels.load() if dtype in cpu_kernels.DTYPES else None
    if plan is not None and kernels is None:
        logger.warning("quantized weights need the CPU kernel library, which is unavailable here: serving %s weights", dtype)
    for module in model.modules():
        if hasattr(module, "kernels"):
            module.kernels = kernels
    if plan is not None:
        pack_linears(model, kernels, plan, floats=False)  # quantizes from fp32; the rest is packed once cast
        read_rows_from_blocks(model, kernels, dtype)  # before the cast: a table in blocks is not kept in floats
        with torch.no_grad():
            for param in model.parameters():
                param.data = param.data.to(dtype)
    pack_linears(model, kernels)  # the float weights left, now in dtype
    move_to_huge_pages(model)  # what decode streams, off 4 KB pages
    if fuse_layers:
        fused_layer.attach(model, kernels)  # decode steps' layers in one kernel call each
