"""The engine's whole configuration, and its one resolution (`finalize`).

`EngineConfig.create(**kwargs)` takes the flat keyword arguments the offline `LLM` and the
deploy file accept (vLLM's names); `EngineConfig.from_preset(name_or_path, **overrides)`
loads one of `configs/*.yaml`. Unknown keys raise ValueError naming them. These are options:
mutable until resolved. `finalize` leaves them as they are and returns a resolved copy: every
option checked (each sub-config its own), "auto" and missing values resolved (device,
max_model_len, the speculative config's defaults), and what later stages need from the model's
files and tokenizer recorded in one frozen `ModelFacts`. The copy is frozen, sub-configs
included (`is_resolved`): a different config is built from options and resolved again.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cluster.config.cache import CacheConfig, resolve_kv_cache_dtype
from cluster.config.facts import ModelFacts
from cluster.config.limits import LimitsConfig
from cluster.config.lora import LoRAConfig
from cluster.config.model import ModelConfig, resolve_dtype, resolve_model_path
from cluster.config.options import Bounds, Freezable, check_options, option
from cluster.config.parallel import ParallelConfig
from cluster.config.reasoning import reasoning_parser_config, reasoning_token_ids
from cluster.config.scheduler import SchedulerConfig
from cluster.config.speculative import SpeculativeConfig

CONFIGS_DIR = Path(__file__).resolve().parent.parent.parent / "configs"


@dataclass
class EngineConfig(Freezable):
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

    @property
    def facts(self) -> ModelFacts | None:
        """What resolution learned (None before): model_config's, shared with cache_config."""
        return self.model_config.facts

    @property
    def reasoning_token_ids(self) -> tuple[list[int], list[int]] | None:
        """(start, end) token ids of reasoning_config's strings; None without one or before resolution."""
        return self.facts.reasoning_token_ids if self.facts else None

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
        """Set options by their flat names (ValueError naming an unknown one). Options only:
        a resolved config refuses (FrozenInstanceError)."""
        if self.is_resolved:
            raise dataclasses.FrozenInstanceError("cannot update a resolved EngineConfig: update its options "
                                                  "before finalize(), or build new ones and resolve them")
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
            if not owners or key == "facts":  # learned by finalize, never given
                raise ValueError(f"unknown engine option {key!r}")
            for owner in owners:
                setattr(owner, key, value)

    def with_facts(self, **facts: Any) -> "EngineConfig":
        """A copy carrying these facts (ModelFacts' field names, over any it has) as if
        resolution had learned them: a stand-in for tests and tools that run one part of the
        engine without model files. Nothing is checked or learned; the copy is not resolved."""
        model_config = self.model_config.with_facts(**facts)
        cache_config = dataclasses.replace(self.cache_config, facts=model_config.facts)
        return dataclasses.replace(self, model_config=model_config, cache_config=cache_config)

    def finalize(self) -> "EngineConfig":
        """The resolved config: a deep copy of these options, every option checked (each
        sub-config its own: ValueError naming the option), the model path, device, dtype and
        max_model_len resolved, and what later stages need from the files and the tokenizer
        (eos id, reasoning token ids, the quantization plan, the KV dtype) in `facts`.

        Guarantees: this object is left untouched; the result is frozen, sub-configs included
        (assignment raises FrozenInstanceError naming the field), and `is_resolved`. Idempotent:
        a resolved config (e.g. one an actor received) is returned as is."""
        if self.is_resolved:
            return self
        resolved = copy.deepcopy(self)
        resolved._check()
        resolved._resolve_model()
        resolved._freeze()
        return resolved

    def _check(self) -> None:
        """Every option checked (sub-configs normalize theirs: call on finalize's copy only)."""
        for sub in self.sub_configs():
            sub.validate()
        check_options(self)

    def _resolve_model(self) -> None:
        """Fill in the device, max_model_len and speculative defaults, and learn the facts (on
        finalize's copy, before it is frozen)."""
        from cluster.model.layers.quant_plan import quant_plan
        from cluster.model.loader import resolved_hf_config
        from cluster.tokenizer import load_tokenizer

        mc = self.model_config
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.parallel_config.resolve_executor(self.device)
        path = resolve_model_path(mc.model)
        dtype = resolve_dtype(mc.dtype, self.device)
        hf_config = resolved_hf_config(path)
        mc.max_model_len = _max_model_len(mc.max_model_len, hf_config)
        self._resolve_speculative()
        plan = quant_plan(mc.quantization, path, self.device)
        kv_dtype = resolve_kv_cache_dtype(self.cache_config.kv_cache_dtype, dtype)
        if mc.dtype == "auto" and plan is not None and plan.layers and self.device == "cpu":
            # llama.cpp's mix (docs/quantization.md): fp32 activations over the cache "auto" chose
            # (bf16 where the CPU has it). Quantized layers read int8 activations or their own
            # blocks whatever the model's dtype, so fp32 cost no speed where measured; it spares
            # the residual stream bf16's roundings (a Q8_0 file's KL to its bf16 source 0.0072 -> 0.0051).
            dtype = torch.float32
        tokenizer = load_tokenizer(mc.tokenizer or path)
        facts = ModelFacts(path=path, torch_dtype=dtype, hf_config=hf_config, eos_token_id=tokenizer.eos_token_id,
                           quant_plan=plan, kv_torch_dtype=kv_dtype,
                           reasoning_token_ids=reasoning_token_ids(self.reasoning_config, tokenizer.token_ids_for))
        mc.facts = self.cache_config.facts = facts

    def _resolve_speculative(self) -> None:
        if self.speculative_config is None:
            return
        self.speculative_config = self.speculative_config.finalize()
        if self.scheduler_config.async_scheduling:
            raise ValueError("async_scheduling=True cannot be combined with speculative_config: a "
                             "step's drafts depend on the tokens of the step before it")

    def _freeze(self) -> None:
        for sub in [*self.sub_configs(), self.speculative_config]:
            if sub is not None:
                sub._freeze()
        super()._freeze()


def _max_model_len(given: int | None, hf_config: Any) -> int:
    """The context window: the model's (max_position_embeddings, else 2048) unless given, and
    never past it (ValueError)."""
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    max_len = limit if given is None else given
    if not 1 <= max_len <= limit:
        raise ValueError(f"max_model_len must be in [1, {limit}] for this model, got {max_len}")
    return max_len


# EngineConfig's own options (the rest belong to its sub-configs).
_TOP_LEVEL_OPTIONS = {f.name for f in dataclasses.fields(EngineConfig) if not f.name.endswith("_config")} | {
    "reasoning_config"}
