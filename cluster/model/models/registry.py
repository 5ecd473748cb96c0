"""HF `architectures[0]` -> model class."""
from __future__ import annotations

from typing import Any

from torch import nn

from cluster.model.models.llama import LlamaForCausalLM
from cluster.model.models.qwen2 import Qwen2ForCausalLM
from cluster.model.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}
# GGUF-derived configs carry model_type but no architectures.
MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def architecture_of(hf_config: Any) -> str:
    archs = getattr(hf_config, "architectures", None) or []
    if archs:
        return archs[0]
    model_type = getattr(hf_config, "model_type", None)
    if model_type in MODEL_TYPE_TO_ARCH:
        return MODEL_TYPE_TO_ARCH[model_type]
    raise ValueError(f"model config names no architecture (architectures={archs!r}, model_type={model_type!r}); "
                     f"supported: {', '.join(MODEL_REGISTRY)}")


def get_model_class(hf_config: Any) -> type[nn.Module]:
    arch = architecture_of(hf_config)
    if arch not in MODEL_REGISTRY:
        raise ValueError(f"unsupported model architecture {arch!r}; supported: {', '.join(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[arch]
