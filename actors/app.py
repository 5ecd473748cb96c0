"""The application builder `deploy.yaml` names: `import_path: actors.app:build_app`.

Typed args (validated by Serve with pydantic): an engine preset from `configs/` plus
overrides, the API key, and how many replicas / CPUs each part gets. The engine config is
resolved and checked here, so a bad deploy file fails at `serve run` with a clear message.
"""
# No `from __future__ import annotations`: Serve reads build_app's annotation as a class
# to validate the args dict into AppArgs.
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from actors.engine import EngineDeployment, EngineOptions
from actors.executor import worker_bundle
from actors.ingress import Ingress

# Engine options an app may override directly (anything else: `engine_overrides`).
ENGINE_FIELDS = ("model", "served_model_name", "tokenizer", "dtype", "device", "tensor_parallel_size",
                 "max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_kv_blocks",
                 "kv_cache_memory", "block_size", "enable_prefix_caching", "max_waiting",
                 "logits_processors", "reasoning_config", "attention_backend", "seed",
                 "speculative_config")


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
    attention_backend: str | None = None
    seed: int | None = None
    # vLLM's shape: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n, ...}
    speculative_config: dict[str, Any] | None = None
    engine_overrides: dict[str, Any] = {}
    # Serving: key (else $LLM_CLUSTER_API_KEY on the ingress), replicas, logical CPUs.
    api_key: str | None = None
    ingress_replicas: int = Field(default=1, ge=1)
    engine_replicas: int = Field(default=1, ge=1)
    ingress_num_cpus: float = Field(default=0.1, ge=0)
    engine_num_cpus: float = Field(default=0.25, gt=0)
    worker_num_cpus: float = Field(default=0.5, gt=0)
    worker_torch_threads: int | None = Field(default=None, ge=1)
    worker_env: dict[str, str] = {}  # extra environment variables for the worker processes
    max_ongoing_requests: int = Field(default=1024, ge=1)
    stream_interval: int = Field(default=1, ge=1)  # tokens per streamed chunk after the first

    def engine_config(self):
        from cluster.config import EngineConfig

        overrides = {k: getattr(self, k) for k in ENGINE_FIELDS if getattr(self, k) is not None}
        return EngineConfig.from_preset(self.preset, **overrides, **self.engine_overrides)


def placement_bundles(config, args: AppArgs) -> list[dict[str, float]]:
    """Bundle 0 hosts the engine replica (and the grammar compiler), 1 + r hosts rank r."""
    tp = config.parallel_config.tensor_parallel_size
    return [{"CPU": args.engine_num_cpus}] + [worker_bundle(config.device, args.worker_num_cpus)] * tp


def build_app(args: AppArgs):  # -> ray.serve.Application
    config = args.engine_config().finalize()
    engine = EngineDeployment.options(
        num_replicas=args.engine_replicas, max_ongoing_requests=args.max_ongoing_requests,
        placement_group_bundles=placement_bundles(config, args), placement_group_strategy="STRICT_PACK",
        ray_actor_options={"num_cpus": args.engine_num_cpus}, health_check_period_s=5,
    ).bind(config, EngineOptions(worker_num_cpus=args.worker_num_cpus, torch_threads=args.worker_torch_threads,
                                 worker_env=args.worker_env, stream_interval=args.stream_interval))
    return Ingress.options(
        num_replicas=args.ingress_replicas, max_ongoing_requests=args.max_ongoing_requests,
        ray_actor_options={"num_cpus": args.ingress_num_cpus},
    ).bind(engine, config, args.api_key)
