"""The engine options a deploy file may set, typed: one set for both forms of deploy file.

`build_app` (the short form) takes them at the top of its `args`; `build_openai_app` (Ray Serve
LLM's form) takes them in each model's `engine_kwargs`. They are `EngineConfig` options under
vLLM's names (cluster/config.py), plus two the ingress applies per model (`tool_call_parser`,
`stream_interval`, vLLM's serving options) and two that say whether clients may load adapters
(`allow_runtime_lora_updating`, `allowed_local_lora_paths`: actors/http/lora_updates.py). Pydantic
checks each value's type here, so a bad deploy file fails when the app is built with an error
naming the field; `EngineConfig.finalize` then checks what needs the model (context length,
dtype, ...), and `runtime_lora_updates` what needs its LoRA settings.
"""
# No `from __future__ import annotations`: Serve and pydantic read these annotations as classes.
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from cluster.config import KV_CACHE_DTYPES, SCHEDULING_POLICIES
from cluster.model.layers.quantization import QUANTIZATIONS

if TYPE_CHECKING:
    from actors.http.lora_updates import RuntimeLoRAUpdates

# Options the ingress applies (per model), and one the engine replica applies around the core;
# every other field is an EngineConfig option.
FRONTEND_FIELDS = ("tool_call_parser", "stream_interval", "allow_runtime_lora_updating", "allowed_local_lora_paths")
REPLICA_FIELDS = ("step_timeout_s",)


class EngineArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dtype: str | None = None
    device: str | None = None
    tensor_parallel_size: int | None = Field(default=None, ge=1)
    max_num_seqs: int | None = Field(default=None, ge=1)
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    max_model_len: int | None = Field(default=None, ge=1)
    num_kv_blocks: int | None = Field(default=None, ge=1)
    kv_cache_memory: int | None = Field(default=None, ge=1)
    block_size: int | None = Field(default=None, ge=1)
    # vLLM's: "auto" (the model's dtype) or "bfloat16" (e.g. under dtype float32: llama.cpp's mix)
    kv_cache_dtype: Literal[KV_CACHE_DTYPES] | None = None
    enable_prefix_caching: bool | None = None
    max_waiting: int | None = Field(default=None, ge=1)
    logits_processors: list[str] | None = None
    reasoning_config: dict[str, str] | None = None
    reasoning_parser: str | None = None  # vLLM's names: qwen3, deepseek_r1 (preset reasoning_config)
    attention_backend: str | None = None
    seed: int | None = None
    # vLLM's shape: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n, ...}
    speculative_config: dict[str, Any] | None = None
    enforce_eager: bool | None = None  # every step eager: no CUDA graphs, no one-call CPU decoder layers
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    load_format: str | None = None  # "dummy": random weights (speed tests)
    # CPU: "int8" (any checkpoint; W8A8 from 3 rows with AVX512-VNNI) or "gguf" (a GGUF's Q8_0 / Q4
    # blocks); docs/quantization.md
    quantization: Literal[QUANTIZATIONS] | None = None
    scheduling_policy: Literal[SCHEDULING_POLICIES] | None = None
    async_scheduling: bool | None = None  # plan step N + 1 while step N runs (vLLM's)
    # Deadlines from admission (docs/deploying.md, "Deadlines"): still queued after this many
    # seconds -> 503 + Retry-After; not finished after this many -> 408 / an error event.
    max_queue_wait_s: float | None = Field(default=None, gt=0)
    request_timeout_s: float | None = Field(default=None, gt=0)
    # A step (or a collective between workers) that takes longer marks the copy failed: requests
    # with no token yet are retried on another copy, the rest end with an error, Serve replaces it.
    step_timeout_s: float | None = Field(default=None, gt=0)
    # Per-request limits (HTTP 400 past them): completions per request, logprobs per
    # position, request body size.
    max_n: int | None = Field(default=None, ge=1)
    max_logprobs: int | None = Field(default=None, ge=0)
    max_request_body_bytes: int | None = Field(default=None, ge=1)
    # LoRA adapters (docs/lora.md), vLLM's options: lora_modules is {name: PEFT folder} (or
    # vLLM's list of "name=path" / {"name", "path"}); max_loras adapters share a batch at once.
    enable_lora: bool | None = None
    max_loras: int | None = Field(default=None, ge=1)
    max_lora_rank: int | None = Field(default=None, ge=1)
    lora_modules: dict[str, str] | list[Any] | None = None
    # /v1/load_lora_adapter and /v1/unload_lora_adapter (the ingress; docs/lora.md): off unless this
    # is true (not given: vLLM's $VLLM_ALLOW_RUNTIME_LORA_UPDATING where the app is built decides),
    # and then only for folders under allowed_local_lora_paths (required when on).
    allow_runtime_lora_updating: bool | None = None
    allowed_local_lora_paths: list[str] = []
    # vLLM's --tool-call-parser: reads tool calls out of tool_choice="auto" answers.
    tool_call_parser: str | None = "hermes"
    stream_interval: int = Field(default=1, ge=1)  # tokens per SSE chunk after the first (the ingress)

    @field_validator("tool_call_parser")
    @classmethod
    def _known_parser(cls, name: str | None) -> str | None:
        from actors.http.tool_parser import check_tool_call_parser

        return check_tool_call_parser(name)

    @field_validator("allowed_local_lora_paths", mode="before")
    @classmethod
    def _local_folders(cls, value: Any) -> Any:
        if value is None:
            return []
        paths = [value] if isinstance(value, str) else value  # one folder, as vLLM's allowed_local_media_path
        for path in paths if isinstance(paths, list) else ():
            if path == "":
                raise ValueError("an empty path is not a folder")
            if isinstance(path, str) and "://" in path:
                raise ValueError(f"{path!r}: only local or mounted folders are supported (no remote URIs)")
        return paths

    def runtime_lora_updates(self, enable_lora: bool) -> "RuntimeLoRAUpdates":
        """Whether clients may load and unload this model's adapters, and from which folders;
        `enable_lora` is the finalized config's. ValueError naming the option otherwise."""
        from actors.http.lora_updates import RuntimeLoRAUpdates

        return RuntimeLoRAUpdates.create(self.allow_runtime_lora_updating, self.allowed_local_lora_paths, enable_lora)

    def engine_options(self) -> dict[str, Any]:
        """The EngineConfig options given (None means: the preset's or the engine's default)."""
        return {name: getattr(self, name) for name in self._engine_fields() if getattr(self, name) is not None}

    @classmethod
    def _engine_fields(cls) -> tuple[str, ...]:
        return tuple(name for name in EngineArgs.model_fields if name not in FRONTEND_FIELDS + REPLICA_FIELDS)
