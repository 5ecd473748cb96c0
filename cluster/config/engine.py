"""The engine's whole configuration, and its one resolution (`finalize`).

`EngineConfig.create(**kwargs)` takes the flat keyword arguments the offline `LLM` and the
deploy file accept (vLLM's names); `EngineConfig.from_preset(name_or_path, **overrides)`
loads one of `configs/*.yaml`. Unknown keys raise ValueError naming them. `finalize` checks
every option (each sub-config its own), then resolves the model: path, device, dtype, context
window, and what later stages need from the files and the tokenizer.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cluster.config.cache import CacheConfig, resolve_kv_cache_dtype
from cluster.config.limits import LimitsConfig
from cluster.config.lora import LoRAConfig
from cluster.config.model import ModelConfig, resolve_dtype, resolve_model_path
from cluster.config.options import Bounds, check_options, option
from cluster.config.parallel import ParallelConfig
from cluster.config.reasoning import reasoning_parser_config, reasoning_token_ids
from cluster.config.scheduler import SchedulerConfig
from cluster.config.speculative import SpeculativeConfig

CONFIGS_DIR = Path(__file__).resolve().parent.parent.parent / "configs"


@dataclass
class EngineConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    limits_config: LimitsConfig = field(default_factory=LimitsConfig)
    lora_config: LoRAConfig = field(default_factory=LoRAConfig)
    device: str = option("auto", doc="auto: CUDA when present, else CPU")
    logits_processors: list[Any] = field(default_factory=list, metadata={"option": Bounds(
        doc="custom logits processors: classes or 'module:Class' names (docs/logits_processors.md)")})
    reasoning_config: dict[str, str] | None = option(None, nullable=True,
                                                     doc="{reasoning_start_str, reasoning_end_str} of a reasoning model")
    reasoning_parser: str | None = option(None, nullable=True, doc="vLLM's names (qwen3, deepseek_r1): a preset "
                                                                   "reasoning_config")
    attention_backend: str = option("auto", doc="auto, torch, cpu_paged, flash_attn or triton (layers/attention.py)")
    # Pure-decode steps replay CUDA graphs captured at start-up (CUDA), or run each decoder layer
    # as one kernel call at a few rows (CPU); True runs every step eagerly (vLLM's enforce_eager).
    enforce_eager: bool = option(False, boolean=True)
    speculative_config: SpeculativeConfig | None = option(None, nullable=True, doc="vLLM's shape: {method: ngram, "
                                                          "num_speculative_tokens, prompt_lookup_max, ...}")
    # (start, end) token ids of reasoning_config's strings; set by finalize.
    reasoning_token_ids: tuple[list[int], list[int]] | None = None

    @classmethod
    def create(cls, **kwargs: Any) -> "EngineConfig":
        cfg = cls()
        cfg.update(**kwargs)
        return cfg

    @classmethod
    def from_preset(cls, preset: str, **overrides: Any) -> "EngineConfig":
        import yaml

        path = Path(preset)
        if not path.is_file():
            path = CONFIGS_DIR / f"{preset}.yaml"
        if not path.is_file():
            known = sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))
            raise ValueError(f"engine preset {preset!r} not found; known presets: {known}")
        values = yaml.safe_load(path.read_text()) or {}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls.create(**values)

    def sub_configs(self) -> list[Any]:
        return [self.model_config, self.cache_config, self.scheduler_config, self.parallel_config,
                self.limits_config, self.lora_config]

    def update(self, **kwargs: Any) -> None:
        subs = self.sub_configs()
        parser = kwargs.get("reasoning_parser")
        if parser is not None:
            preset = reasoning_parser_config(parser)
            given = kwargs.get("reasoning_config")
            if given is not None and given != preset:
                raise ValueError(f"reasoning_parser={parser!r} sets reasoning_config={preset}; "
                                 f"the reasoning_config given ({given}) differs: give one of them")
            kwargs = {**kwargs, "reasoning_config": preset}
        for key, value in kwargs.items():
            if key in _TOP_LEVEL_OPTIONS:
                setattr(self, key, value)
                continue
            if key == "speculative_config":
                self.speculative_config = SpeculativeConfig.create(value)
                continue
            owners = [s for s in subs if key in {f.name for f in dataclasses.fields(s)}]
            if not owners or key in ("path", "torch_dtype", "hf_config", "eos_token_id", "quant_plan",
                                        "kv_torch_dtype"):
                raise ValueError(f"unknown engine option {key!r}")
            for owner in owners:
                setattr(owner, key, value)

    def finalize(self) -> "EngineConfig":
        """Check every option (each sub-config its own: ValueError naming the option), then
        resolve the model path, device, dtype and max_model_len, and record what later stages
        need from the files and the tokenizer (eos id, reasoning token ids, the quantization
        plan). Idempotent: a finalized config (e.g. one received by an actor) is returned as is."""
        from cluster.model.layers.quantization import quant_plan
        from cluster.model.loader import load_hf_config

        mc, sc = self.model_config, self.scheduler_config
        if mc.hf_config is not None:
            return self
        for sub in self.sub_configs():
            sub.validate()
        check_options(self)
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        path = resolve_model_path(mc.model)
        dtype = resolve_dtype(mc.dtype, self.device)
        hf_config = load_hf_config(path)
        limit = getattr(hf_config, "max_position_embeddings", None) or 2048
        max_len = limit if mc.max_model_len is None else mc.max_model_len
        if not 1 <= max_len <= limit:
            raise ValueError(f"max_model_len must be in [1, {limit}] for this model, got {max_len}")
        if self.speculative_config is not None:
            self.speculative_config.finalize()
            if sc.async_scheduling:
                raise ValueError("async_scheduling=True cannot be combined with speculative_config: a "
                                 "step's drafts depend on the tokens of the step before it")
        mc.quant_plan = quant_plan(mc.quantization, path, self.device)
        self.cache_config.kv_torch_dtype = resolve_kv_cache_dtype(self.cache_config.kv_cache_dtype, dtype)
        if mc.dtype == "auto" and mc.quant_plan is not None and mc.quant_plan.layers and self.device == "cpu":
            # llama.cpp's mix (docs/quantization.md): fp32 activations over the cache "auto" chose
            # (bf16 where the CPU has it). Quantized layers read int8 activations or their own
            # blocks whatever the model's dtype, so fp32 cost no speed where measured; it spares
            # the residual stream bf16's roundings (a Q8_0 file's KL to its bf16 source 0.0072 -> 0.0051).
            dtype = torch.float32
        mc.path, mc.torch_dtype, mc.max_model_len = path, dtype, max_len
        tokenizer = mc.get_tokenizer()
        self.reasoning_token_ids = reasoning_token_ids(self.reasoning_config, tokenizer.token_ids_for)
        mc.eos_token_id = tokenizer.eos_token_id
        mc.hf_config = hf_config  # last: its presence marks the config finalized
        return self


# EngineConfig's own options (the rest belong to its sub-configs; reasoning_token_ids is learned).
_TOP_LEVEL_OPTIONS = {f.name for f in dataclasses.fields(EngineConfig)
                      if not f.name.endswith("_config") and f.name != "reasoning_token_ids"} | {"reasoning_config"}
