"""The application builders a deploy file names, in two forms.

- `import_path: actors.app:build_app`, the short form (`deploy.yaml`): one model, typed args
  (`AppArgs`): an engine preset from `configs/` plus overrides, the API key, how many replicas /
  CPUs each part gets, and how engine replicas scale (fixed or autoscaled), are routed to
  (actors/fleet/router.py) and drained.
- `import_path: actors.app:build_openai_app`, Ray Serve LLM's form: `args: {llm_configs: [...]}`,
  one `LLMConfig` per model (actors/llm_config.py), several models behind one endpoint, each with
  its own engine deployment (copies, router, autoscaling, TP, placement). From Python:
  `serve.run(build_openai_app({"llm_configs": [LLMConfig(...)]}))`.

Both end in the same deployments (actors/deployments.py): one ingress and, per model, one
engine deployment; the short form is the one-model case (its engine deployment is `engine`).
Engine configs are resolved and checked here, so a bad deploy file fails at `serve run` with
a clear message.
"""
# No `from __future__ import annotations`: Serve reads build_app's annotation as a class
# to validate the args dict into AppArgs.
from typing import Any, Literal

from pydantic import Field, model_validator

from actors.deployments import (EngineServing, IngressServing, engine_deployment, ingress_deployment,
                                placement_bundles, request_router_config)
from cluster.routing import PrefixAffinityPolicy
from actors.engine_replica.deployment import EngineOptions
from actors.engine_args import EngineArgs
from actors.http.served import ModelSpec
from actors.llm_config import LLMConfig, LLMServingArgs
from actors.store.base import ResponseStoreConfig

__all__ = ["AppArgs", "LLMConfig", "LLMServingArgs", "build_app", "build_openai_app", "placement_bundles",
           "request_router_config"]


class AppArgs(EngineArgs):
    """`args` of the short form: the engine options of EngineArgs (overriding the preset's) and
    how the one model is served."""

    preset: str = "smollm2-cpu"  # configs/<preset>.yaml, or a path to such a file
    model: str | None = None
    served_model_name: str | None = None
    tokenizer: str | None = None
    engine_overrides: dict[str, Any] = {}  # any other EngineConfig option
    # Serving: key (else $LLM_CLUSTER_API_KEY on the ingress), replicas, logical CPUs.
    api_key: str | None = None
    # The Responses API's store (directory, retention, on/off): docs/responses.md.
    response_store: ResponseStoreConfig = Field(default_factory=ResponseStoreConfig)
    ingress_replicas: int = Field(default=1, ge=1)
    engine_replicas: int | None = Field(default=None, ge=1)  # model copies; 1 unless autoscaled
    # Ray Serve autoscaling of the engine deployment, Serve's keys: min_replicas, max_replicas,
    # target_ongoing_requests, upscale_delay_s, downscale_delay_s, ... (not with engine_replicas).
    engine_autoscaling_config: dict[str, Any] | None = None
    # How the ingress picks an engine replica (default: prefix_affinity when there can be more
    # than one replica and prefix caching is on, else power_of_two).
    request_router: Literal["prefix_affinity", "power_of_two"] | None = None
    routing_imbalance_threshold: int = Field(default=PrefixAffinityPolicy.imbalance_threshold, ge=0)  # requests
    routing_min_match_blocks: int = Field(default=PrefixAffinityPolicy.min_match_blocks, ge=1)
    routing_tier_hit_weight: float = Field(default=PrefixAffinityPolicy.tier_hit_weight, ge=0, le=1)
    routing_stats_period_s: float = Field(default=EngineServing.routing_stats_period_s, gt=0)
    # A replica being scaled down (or replaced by a redeploy) finishes its requests first, for
    # up to this long.
    engine_drain_timeout_s: float = Field(default=EngineServing.graceful_shutdown_timeout_s, gt=0)
    # How often Serve health-checks each engine replica (it pings the replica's workers); a
    # failed copy is replaced after 3 failed checks in a row.
    engine_health_check_period_s: float = Field(default=EngineServing.health_check_period_s, gt=0)
    # Custom Ray resources each engine replica (its bundle 0) / ingress replica requires: pin them
    # to nodes that offer them (`ray start --resources`), e.g. one engine per node.
    engine_resources: dict[str, float] = {}
    ingress_resources: dict[str, float] = {}
    ingress_num_cpus: float = Field(default=IngressServing.num_cpus, ge=0)
    engine_num_cpus: float = Field(default=EngineServing.engine_num_cpus, gt=0)
    worker_num_cpus: float = Field(default=EngineOptions.worker_num_cpus, gt=0)
    worker_torch_threads: int | None = Field(default=None, ge=1)
    worker_env: dict[str, str] = {}  # extra environment variables for the worker processes
    max_ongoing_requests: int = Field(default=EngineServing.max_ongoing_requests, ge=1)  # both deployments

    @model_validator(mode="after")
    def _check_scaling(self) -> "AppArgs":
        if self.engine_autoscaling_config is not None:
            from ray.serve.config import AutoscalingConfig

            if self.engine_replicas is not None:
                raise ValueError("give engine_replicas or engine_autoscaling_config, not both")
            AutoscalingConfig(**self.engine_autoscaling_config)  # Serve's own checks, named fields
        return self

    @classmethod
    def _engine_fields(cls) -> tuple[str, ...]:
        return ("model", "served_model_name", "tokenizer") + super()._engine_fields()

    def engine_config(self):  # -> cluster.config.EngineConfig (not finalized)
        from cluster.config import EngineConfig

        return EngineConfig.from_preset(self.preset, **self.engine_options(), **self.engine_overrides)

    def engine_serving(self) -> EngineServing:
        """How the model's engine deployment (`engine`) runs."""
        return EngineServing(
            num_replicas=self.engine_replicas or 1, autoscaling_config=self.engine_autoscaling_config,
            max_ongoing_requests=self.max_ongoing_requests, graceful_shutdown_timeout_s=self.engine_drain_timeout_s,
            health_check_period_s=self.engine_health_check_period_s,
            engine_num_cpus=self.engine_num_cpus, engine_resources=dict(self.engine_resources),
            router=self.request_router,
            router_kwargs={"imbalance_threshold": self.routing_imbalance_threshold,
                           "min_match_blocks": self.routing_min_match_blocks,
                           "tier_hit_weight": self.routing_tier_hit_weight},
            routing_stats_period_s=self.routing_stats_period_s,
            options=EngineOptions(worker_num_cpus=self.worker_num_cpus, torch_threads=self.worker_torch_threads,
                                  worker_env=self.worker_env, step_timeout_s=self.step_timeout_s))

    def ingress_serving(self) -> IngressServing:
        return IngressServing(num_replicas=self.ingress_replicas, max_ongoing_requests=self.max_ongoing_requests,
                              num_cpus=self.ingress_num_cpus, resources=dict(self.ingress_resources))


def build_app(args: AppArgs):  # -> ray.serve.Application
    """The short form: one model, its engine deployment named `engine`."""
    config = args.engine_config().finalize()
    lora_updates = args.runtime_lora_updates(config.lora_config.enable_lora)
    model = ModelSpec(engine_deployment(config, args.engine_serving()), config, args.tool_call_parser,
                      args.stream_interval, lora_updates=lora_updates)
    return ingress_deployment([model], args.ingress_serving(), args.api_key, args.response_store)


def build_openai_app(builder_config: dict):  # -> ray.serve.Application
    """Ray Serve LLM's form: `builder_config` is an `LLMServingArgs` or its dict
    (`{"llm_configs": [...]}`). Every model gets its own engine deployment behind one ingress;
    a model's bad option fails here, the message naming the model. The API key, if any, is
    `$LLM_CLUSTER_API_KEY` in the ingress's environment (its runtime_env)."""
    args = LLMServingArgs.model_validate(builder_config)
    return ingress_deployment([_model_spec(i, llm) for i, llm in enumerate(args.llm_configs)],
                              args.ingress_serving(), response_store=args.response_store)


def _model_spec(index: int, llm: LLMConfig) -> ModelSpec:
    """One model of the Ray Serve LLM form: its engine config resolved, its engine deployment."""
    try:
        config = llm.engine_config().finalize()
        lora_updates = llm.engine_kwargs.runtime_lora_updates(config.lora_config.enable_lora)
        engine = engine_deployment(config, llm.engine_serving(config))
    except ValueError as exc:
        raise ValueError(f"llm_configs[{index}] (model_id {llm.model_id!r}): {exc}") from exc
    return ModelSpec(engine, config, llm.engine_kwargs.tool_call_parser, llm.engine_kwargs.stream_interval,
                     lora_updates=lora_updates)
