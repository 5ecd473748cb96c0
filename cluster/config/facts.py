"""What `EngineConfig.finalize` learns once, from the model's files, its tokenizer and the
options (never an option itself): one frozen value, `ModelFacts`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from cluster.model.hf_config import HFConfig  # plain values: imports neither torch nor transformers

if TYPE_CHECKING:  # nothing else of the model's: its code is loaded where it runs
    from cluster.model.layers.quant_plan import QuantPlan


@dataclass(frozen=True)
class ModelFacts:
    """The facts a resolved config carries (`model_config.facts`, the same object as
    `cache_config.facts`). ModelConfig, CacheConfig and EngineConfig read them under their
    old names (`model_config.hf_config`, `cache_config.kv_torch_dtype`,
    `config.reasoning_token_ids`, ...). The defaults only serve stand-ins (`with_facts`):
    resolution sets every field."""

    path: str = ""  # the weights: an HF-style folder or a .gguf file
    torch_dtype: torch.dtype | None = None  # the model's activations
    hf_config: HFConfig | None = None  # the model's transformers config, as plain values
    eos_token_id: int | None = None  # the tokenizer's
    quant_plan: QuantPlan | None = None  # which weights are served quantized (a GGUF: which tensors in their blocks)
    kv_torch_dtype: torch.dtype | None = None  # the KV cache's (kv_cache_dtype resolved)
    reasoning_token_ids: tuple[list[int], list[int]] | None = None  # (start, end) ids of reasoning_config's strings

