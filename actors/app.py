"""The application builder `deploy.yaml` names: `import_path: actors.app:build_app`.

Typed args (validated by Serve with pydantic): an engine preset from `configs/` plus
overrides, the API key, how many replicas / CPUs each part gets, and how engine replicas
scale (fixed or autoscaled), are routed to (actors/fleet/router.py) and drained. The engine config
is resolved and checked here, so a bad deploy file fails at `serve run` with a clear message.
"""
# No `from __future__ import annotations`: Serve reads build_app's annotation as a class
# to validate the args dict into AppArgs.
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from actors.engine.deployment import EngineDeployment, EngineOptions
from actors.engine.executor import worker_bundle
from actors.fleet.router import PowerOfTwoRouter, PrefixAwareRouter
from actors.http.ingress import Ingress

# Engine options an app may override directly (anything else: `engine_overrides`).
ENGINE_FIELDS = ("model", "served_model_name", "tokenizer", "dtype", "device", "tensor_parallel_size",
                 "max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_kv_blocks",
                 "kv_cache_memory", "block_size", "enable_prefix_caching", "max_waiting",
                 "logits_processors", "reasoning_config", "reasoning_parser", "attention_backend", "seed",
                 "enforce_eager", "gpu_memory_utilization", "load_format", "scheduling_policy", "max_n",
                 "max_logprobs", "max_request_body_bytes", "speculative_config", "async_scheduling")


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    preset: str = "smollm2-cpu"  # configs/<preset>.yaml, or a path to such a file
    model: str | None = None
    served_model_name: str | None = None
    tokenizer: str | None = None
    dtype: str | None = None
    device: str | None = None
    tensor_parallel_size: int | None = Field(default=None, ge=1)
    max_num_seqs: int | None = Field(default=None, ge=1)
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    max_model_len: int | None = Field(default=None, ge=1)
    num_kv_blocks: int | None = Field(default=None, ge=1)
    kv_cache_memory: int | None = Field(default=None, ge=1)
    block_size: int | None = Field(default=None, ge=1)
    enable_prefix_caching: bool | None = None
    max_waiting: int | None = Field(default=None, ge=1)
    logits_processors: list[str] | None = None
    reasoning_config: dict[str, str] | None = None
    reasoning_parser: str | None = None  # vLLM's names: qwen3, deepseek_r1 (preset reasoning_config)
    attention_backend: str | None = None
    seed: int | None = None
    # vLLM's shape: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n, ...}
    speculative_config: dict[str, Any] | None = None
    enforce_eager: bool | None = None  # CUDA: no graphs, every step eager
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    load_format: str | None = None  # "dummy": random weights (speed tests)
    scheduling_policy: Literal["fcfs", "priority"] | None = None
    async_scheduling: bool | None = None  # plan step N + 1 while step N runs (vLLM's)
    # Per-request limits (HTTP 400 past them): completions per request, logprobs per
    # position, request body size.
    max_n: int | None = Field(default=None, ge=1)
    max_logprobs: int | None = Field(default=None, ge=0)
    max_request_body_bytes: int | None = Field(default=None, ge=1)
    engine_overrides: dict[str, Any] = {}
    # Serving: key (else $LLM_CLUSTER_API_KEY on the ingress), replicas, logical CPUs.
    api_key: str | None = None
    # vLLM's --tool-call-parser: reads tool calls out of tool_choice="auto" answers.
    tool_call_parser: str | None = "hermes"
    ingress_replicas: int = Field(default=1, ge=1)
    engine_replicas: int | None = Field(default=None, ge=1)  # model copies; 1 unless autoscaled
    # Ray Serve autoscaling of the engine deployment, Serve's keys: min_replicas, max_replicas,
    # target_ongoing_requests, upscale_delay_s, downscale_delay_s, ... (not with engine_replicas).
    engine_autoscaling_config: dict[str, Any] | None = None
    # How the ingress picks an engine replica (default: prefix_affinity when there can be more
    # than one replica and prefix caching is on, else power_of_two).
    request_router: Literal["prefix_affinity", "power_of_two"] | None = None
    routing_imbalance_threshold: int = Field(default=16, ge=0)  # requests in flight
    routing_min_match_blocks: int = Field(default=2, ge=1)
    routing_stats_period_s: float = Field(default=1.0, gt=0)  # how often replicas report their cache
    # A replica being scaled down (or replaced by a redeploy) finishes its requests first, for
    # up to this long.
    engine_drain_timeout_s: float = Field(default=600.0, gt=0)
    # Custom Ray resources each engine replica (its bundle 0) / ingress replica requires: pin them
    # to nodes that offer them (`ray start --resources`), e.g. one engine per node.
    engine_resources: dict[str, float] = {}
    ingress_resources: dict[str, float] = {}
    ingress_num_cpus: float = Field(default=0.1, ge=0)
    engine_num_cpus: float = Field(default=0.25, gt=0)
    worker_num_cpus: float = Field(default=0.5, gt=0)
    worker_torch_threads: int | None = Field(default=None, ge=1)
    worker_env: dict[str, str] = {}  # extra environment variables for the worker processes
    max_ongoing_requests: int = Field(default=1024, ge=1)
    stream_interval: int = Field(default=1, ge=1)  # tokens per SSE chunk after the first (the ingress)

    @field_validator("tool_call_parser")
    @classmethod
    def _known_parser(cls, name: str | None) -> str | None:
        from actors.http.tool_parser import check_tool_call_parser

        return check_tool_call_parser(name)

    @model_validator(mode="after")
    def _check_scaling(self) -> "AppArgs":
        if self.engine_autoscaling_config is not None:
            from ray.serve.config import AutoscalingConfig

            if self.engine_replicas is not None:
                raise ValueError("give engine_replicas or engine_autoscaling_config, not both")
            AutoscalingConfig(**self.engine_autoscaling_config)  # Serve's own checks, named fields
        return self

    @property
    def max_engine_replicas(self) -> int:
        if self.engine_autoscaling_config is not None:
            return self.engine_autoscaling_config.get("max_replicas", 1)
        return self.engine_replicas or 1

    def engine_config(self):
        from cluster.config import EngineConfig

        overrides = {k: getattr(self, k) for k in ENGINE_FIELDS if getattr(self, k) is not None}
        return EngineConfig.from_preset(self.preset, **overrides, **self.engine_overrides)


def placement_bundles(config, args: AppArgs) -> list[dict[str, float]]:
    """Bundle 0 hosts the engine replica (and the grammar compiler), 1 + r hosts rank r."""
    tp = config.parallel_config.tensor_parallel_size
    engine = {"CPU": args.engine_num_cpus, **args.engine_resources}
    return [engine] + [worker_bundle(config.device, args.worker_num_cpus)] * tp


def request_router_config(config, args: AppArgs) -> dict[str, Any]:
    """Serve's `request_router_config` for the engine deployment (actors/fleet/router.py)."""
    caching = config.cache_config.enable_prefix_caching
    router = args.request_router or ("prefix_affinity" if args.max_engine_replicas > 1 and caching
                                     else "power_of_two")
    if router == "power_of_two":
        cls, kwargs = PowerOfTwoRouter, {}
    elif not caching:
        raise ValueError("request_router: prefix_affinity needs enable_prefix_caching: true")
    else:
        cls, kwargs = PrefixAwareRouter, {
            "block_size": config.cache_config.block_size, "model_name": config.model_config.name,
            "imbalance_threshold": args.routing_imbalance_threshold,
            "min_match_blocks": args.routing_min_match_blocks}
    return {"request_router_class": cls, "request_router_kwargs": kwargs,
            "request_routing_stats_period_s": args.routing_stats_period_s}


def _actor_options(num_cpus: float, resources: dict[str, float]) -> dict[str, Any]:
    return {"num_cpus": num_cpus, **({"resources": dict(resources)} if resources else {})}


def build_app(args: AppArgs):  # -> ray.serve.Application
    config = args.engine_config().finalize()
    scaling = ({"autoscaling_config": args.engine_autoscaling_config} if args.engine_autoscaling_config
               else {"num_replicas": args.engine_replicas or 1})
    engine = EngineDeployment.options(
        **scaling, max_ongoing_requests=args.max_ongoing_requests,
        placement_group_bundles=placement_bundles(config, args), placement_group_strategy="STRICT_PACK",
        ray_actor_options=_actor_options(args.engine_num_cpus, args.engine_resources), health_check_period_s=5,
        graceful_shutdown_timeout_s=args.engine_drain_timeout_s,
        request_router_config=request_router_config(config, args),
    ).bind(config, EngineOptions(worker_num_cpus=args.worker_num_cpus, torch_threads=args.worker_torch_threads,
                                 worker_env=args.worker_env))
    return Ingress.options(
        num_replicas=args.ingress_replicas, max_ongoing_requests=args.max_ongoing_requests,
        ray_actor_options=_actor_options(args.ingress_num_cpus, args.ingress_resources),
    ).bind(engine, config, args.api_key, args.tool_call_parser, args.stream_interval)
