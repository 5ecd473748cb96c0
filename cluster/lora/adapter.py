"""A LoRA adapter in PEFT's format: `adapter_config.json` + `adapter_model.safetensors`.

`read_adapter(name, path, hf_config, max_lora_rank)` reads and checks a folder against the base
model (every tensor's shape, the rank, the target modules) and returns an `LoRAAdapter`, the
frozen description the engine keeps; `adapter_weights(adapter)` returns its tensors, keyed by
(layer, module), for the workers to copy into a slot. Anything we cannot serve is a
`LoRAAdapterError` (a ValueError) naming the adapter and what is wrong, raised before any slot
is touched.

Supported: LoRA on any of the attention and MLP projections of a Llama-family model, rank up to
`max_lora_rank`, `lora_alpha` scaling (alpha / r) and rsLoRA (alpha / sqrt(r)). Not supported
(refused by name): DoRA, trained biases, `modules_to_save`, per-module `rank_pattern` /
`alpha_pattern`, adapters on the embeddings or the LM head.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import msgspec
import torch
import xxhash

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Our projections (vLLM's and PEFT's names for the Llama family).
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (an optional adapter name
# before .weight when saved from a model holding several).
_KEY = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


class LoRAAdapterError(ValueError):
    """The adapter cannot be served (bad folder, rank, module, shape): the message names it."""


class LoRARequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """vLLM's `LoRARequest`: the adapter a request runs under. `lora_name` identifies it;
    `lora_path` is its PEFT folder (None: one the engine knows by name: `lora_modules` or the
    dynamic loading path). `lora_int_id` is accepted for vLLM's signature and not used."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str | None = None


class LoRAAdapter(msgspec.Struct, frozen=True, array_like=True):
    """A checked adapter (it rides in step plans to the workers). `scaling` multiplies B·A·x
    (alpha / r, or alpha / sqrt(r) with rsLoRA); `modules` are the projections it changes.
    `cache_salt` (`lora_cache_salt`) starts the chain of its prompt blocks' hashes in the prefix
    cache, so a block computed under it is never a hit for the base model or another adapter."""

    name: str
    path: str
    rank: int
    scaling: float
    modules: tuple[str, ...]
    cache_salt: int


def module_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every projection, unsharded."""
    hidden = hf_config.hidden_size
    head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
    q, kv = hf_config.num_attention_heads * head_dim, hf_config.num_key_value_heads * head_dim
    inter = hf_config.intermediate_size
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def read_adapter(name: str, path: str | Path, hf_config: Any, max_lora_rank: int) -> LoRAAdapter:
    """Read and check the PEFT folder at `path` (its config and every tensor's shape)."""
    folder = Path(adapter_folder(path))
    config = _read_config(name, folder)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAAdapterError(f"adapter {name!r}: adapter_config.json r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise LoRAAdapterError(f"adapter {name!r} has rank {rank}, above max_lora_rank={max_lora_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAAdapterError(f"adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    _refuse_unsupported(name, config)
    weights = _load_tensors(name, folder)
    modules = _check_tensors(name, weights, rank, hf_config)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return LoRAAdapter(name, str(folder), rank, float(scaling), modules, lora_cache_salt(name, folder))


def adapter_folder(path: str | Path) -> str:
    """The one spelling of an adapter's folder that the engine and a router both use."""
    return str(Path(path).expanduser())


def lora_cache_salt(name: str, path: str | Path) -> int:
    """An adapter's prefix-cache salt, from its name and folder: what the engine keys its blocks
    by and a router computes from a request (cluster/routing.py) to find the copy holding them.
    New weights must come under a new name or folder to be told apart from cached blocks."""
    return xxhash.xxh3_64_intdigest(f"{name}\0{adapter_folder(path)}".encode())


def adapter_weights(adapter: LoRAAdapter) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, module) -> (A [rank, in], B [out, rank]), full (unsharded) fp32 tensors."""
    out: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in _load_tensors(adapter.name, Path(adapter.path)).items():
        layer, module, which = _parse_key(adapter.name, key)
        out.setdefault((layer, module), {})[which] = tensor.float()
    return {k: (v["A"], v["B"]) for k, v in out.items()}


def _read_config(name: str, folder: Path) -> dict:
    file = folder / CONFIG_FILE
    if not file.is_file():
        raise LoRAAdapterError(f"adapter {name!r}: no {CONFIG_FILE} in {str(folder)!r}")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAAdapterError(f"adapter {name!r}: {CONFIG_FILE} is not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"adapter {name!r}: {CONFIG_FILE} must hold a JSON object")
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise LoRAAdapterError(f"adapter {name!r}: peft_type {kind!r} is not supported (only 'LORA')")
    return config


def _refuse_unsupported(name: str, config: dict) -> None:
    checks = {"use_dora": "DoRA", "rank_pattern": "per-module ranks (rank_pattern)",
              "alpha_pattern": "per-module alphas (alpha_pattern)", "modules_to_save": "modules_to_save",
              "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)"}
    for key, what in checks.items():
        if config.get(key):
            raise LoRAAdapterError(f"adapter {name!r}: {what} is not supported ({key}={config[key]!r})")
    bias = config.get("bias", "none")
    if bias != "none":
        raise LoRAAdapterError(f"adapter {name!r}: trained biases are not supported (bias={bias!r})")


def _load_tensors(name: str, folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    file = folder / WEIGHTS_FILE
    if not file.is_file():
        raise LoRAAdapterError(f"adapter {name!r}: no {WEIGHTS_FILE} in {str(folder)!r}")
    try:
        return load_file(str(file))
    except Exception as exc:  # safetensors raises its own error types for a corrupt file
        raise LoRAAdapterError(f"adapter {name!r}: {WEIGHTS_FILE} cannot be read ({exc})") from exc


def _parse_key(name: str, key: str) -> tuple[int, str, str]:
    m = _KEY.search(key)
    if m is None:
        raise LoRAAdapterError(f"adapter {name!r}: tensor {key!r} is not a LoRA weight of a supported "
                               f"module ({', '.join(SUPPORTED_MODULES)})")
    layer, module, which = int(m.group(1)), m.group(2), m.group(3)
    if module not in SUPPORTED_MODULES:
        raise LoRAAdapterError(f"adapter {name!r}: target module {module!r} is not supported; "
                               f"supported: {', '.join(SUPPORTED_MODULES)}")
    return layer, module, which


def _check_tensors(name: str, weights: dict[str, torch.Tensor], rank: int, hf_config: Any) -> tuple[str, ...]:
    shapes, layers = module_shapes(hf_config), hf_config.num_hidden_layers
    seen: dict[tuple[int, str], set[str]] = {}
    for key, tensor in weights.items():
        layer, module, which = _parse_key(name, key)
        if layer >= layers:
            raise LoRAAdapterError(f"adapter {name!r}: tensor {key!r} is for layer {layer}; the model has {layers}")
        fan_in, fan_out = shapes[module]
        want = (rank, fan_in) if which == "A" else (fan_out, rank)
        if tuple(tensor.shape) != want:
            raise LoRAAdapterError(f"adapter {name!r}: tensor {key!r} has shape {tuple(tensor.shape)}, "
                                   f"expected {want} (rank {rank}, this model's {module})")
        if not tensor.is_floating_point() or not torch.isfinite(tensor).all():
            raise LoRAAdapterError(f"adapter {name!r}: tensor {key!r} holds non-finite or non-float values")
        seen.setdefault((layer, module), set()).add(which)
    if not seen:
        raise LoRAAdapterError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    half = sorted(f"layers.{l}.{m}" for (l, m), ab in seen.items() if ab != {"A", "B"})
    if half:
        raise LoRAAdapterError(f"adapter {name!r}: lora_A without lora_B (or the reverse) for {half[:4]}")
    return tuple(m for m in SUPPORTED_MODULES if any(mod == m for _, mod in seen))
