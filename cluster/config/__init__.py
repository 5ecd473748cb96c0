"""Engine configuration: one file per sub-config, each declaring its options once
(`options.option`: default, bounds or allowed values, meaning) and checking them itself, and
`EngineConfig`, which holds them and resolves them once (`finalize`: a frozen copy, the options
left as they are).

- `engine`: EngineConfig (create, from_preset, update, finalize), the presets folder.
- `facts`: ModelFacts, what resolution learns from the model (path, dtypes, hf_config, ...).
- `model`: ModelConfig, model presets and path resolution, dtype (and the CPU's bf16).
- `cache`, `scheduler`, `limits`, `parallel`, `lora`, `speculative`: the sub-configs.
- `reasoning`: reasoning_config, vLLM's reasoning_parser names, their token ids.
- `options`: how an option is declared and checked (actors/engine_args.py reads the same
  declarations to type the deploy file), and `Freezable`, which freezes a resolved config.
"""
from cluster.config.cache import KV_CACHE_DTYPES, CacheConfig, resolve_kv_cache_dtype
from cluster.config.engine import CONFIGS_DIR, EngineConfig
from cluster.config.facts import ModelFacts
from cluster.config.limits import LimitsConfig
from cluster.config.lora import LoRAConfig
from cluster.config.model import (LOAD_FORMATS, MODEL_PRESETS, POOLING_TYPES, TASKS, ModelConfig, cpu_supports_bf16, resolve_dtype,
                                  resolve_model_path, smollm2_gguf_path)
from cluster.config.parallel import DISTRIBUTED_BACKENDS, EXECUTOR_BACKENDS, ParallelConfig
from cluster.config.reasoning import (REASONING_PARSERS, check_reasoning_config, reasoning_parser_config,
                                      reasoning_token_ids)
from cluster.config.scheduler import SCHEDULING_POLICIES, SchedulerConfig
from cluster.config.speculative import SpeculativeConfig

__all__ = ["CONFIGS_DIR", "DISTRIBUTED_BACKENDS", "EXECUTOR_BACKENDS", "KV_CACHE_DTYPES", "LOAD_FORMATS", "MODEL_PRESETS", "POOLING_TYPES", "TASKS",
           "REASONING_PARSERS", "SCHEDULING_POLICIES", "CacheConfig", "EngineConfig", "LimitsConfig", "LoRAConfig",
           "ModelConfig", "ModelFacts", "ParallelConfig", "SchedulerConfig", "SpeculativeConfig",
           "check_reasoning_config", "cpu_supports_bf16", "reasoning_parser_config", "reasoning_token_ids", "resolve_dtype",
           "resolve_kv_cache_dtype", "resolve_model_path", "smollm2_gguf_path"]
