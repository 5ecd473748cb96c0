"""How an app's deployments are declared to Serve: one engine deployment per model and the one
ingress in front of all of them.

Both app builders (actors/app.py: `build_app`, the short form, and `build_openai_app`, Ray Serve
LLM's form) describe each model as a finalized `EngineConfig` plus an `EngineServing` (how its
engine deployment runs: copies, autoscaling, placement, router, health checks, draining), and
the ingress as an `IngressServing`; the Serve options are built here, the same way for both.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from actors.engine_replica.deployment import EngineDeployment, EngineOptions
from actors.engine_replica.executor import worker_bundle
from actors.fleet.router import PowerOfTwoRouter, PrefixAwareRouter
from actors.http.ingress import Ingress
from actors.http.served import ModelSpec, check_unique_names
from actors.store.base import ResponseStoreConfig
from actors.store.deployment import store_deployment

ROUTERS = ("prefix_affinity", "power_of_two")
# Serving defaults live in the dataclasses below (and the router's knobs in
# cluster.routing.PrefixAffinityPolicy, a worker's CPUs in EngineOptions): both deploy forms
# (actors/app.py, actors/llm_config.py) take theirs from there.
MAX_ONGOING_REQUESTS = 1024  # Serve's per-replica cap, engine and ingress deployments alike
PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK")  # one copy's TP ranks share a node


@dataclass
class EngineServing:
    """How one model's engine deployment runs on Serve (everything but its engine config).
    None leaves an option at Serve's default."""

    name: str = "engine"  # the Serve deployment name, unique in the app
    num_replicas: int = 1  # model copies (data parallel), unless autoscaled
    autoscaling_config: dict[str, Any] | None = None  # Serve's keys; replaces num_replicas
    max_ongoing_requests: int = MAX_ONGOING_REQUESTS
    max_queued_requests: int | None = None
    health_check_period_s: float = 5.0
    health_check_timeout_s: float | None = None
    # A copy being scaled down or replaced finishes its requests first, for up to this long.
    graceful_shutdown_timeout_s: float = 600.0
    graceful_shutdown_wait_loop_s: float | None = None
    logging_config: dict[str, Any] | None = None
    engine_num_cpus: float = 0.25  # bundle 0: the engine replica (and its grammar compiler)
    engine_resources: dict[str, float] = field(default_factory=dict)
    # One bundle per TP rank; None: {CPU: options.worker_num_cpus} (+ {GPU: 1} on CUDA).
    worker_bundles: list[dict[str, float]] | None = None
    placement_strategy: str = PLACEMENT_STRATEGIES[0]
    router: str | None = None  # ROUTERS; None: prefix_affinity with several copies and prefix caching
    router_kwargs: dict[str, Any] = field(default_factory=dict)  # the prefix-aware router's policy knobs
    router_options: dict[str, Any] = field(default_factory=dict)  # Serve's other request_router_config keys
    routing_stats_period_s: float = 1.0  # how often copies report their prefix cache to the routers
    runtime_env: dict[str, Any] | None = None  # the replica's; its workers inherit it
    options: EngineOptions = field(default_factory=EngineOptions)

    @property
    def max_replicas(self) -> int:
        if self.autoscaling_config is not None:
            return self.autoscaling_config.get("max_replicas", 1)
        return self.num_replicas


@dataclass
class IngressServing:
    """How the ingress deployment (every model's HTTP front end) runs on Serve."""

    num_replicas: int = 1
    autoscaling_config: dict[str, Any] | None = None
    max_ongoing_requests: int = MAX_ONGOING_REQUESTS
    max_queued_requests: int | None = None
    num_cpus: float = 0.1
    resources: dict[str, float] = field(default_factory=dict)
    runtime_env: dict[str, Any] | None = None


def default_router(config, max_replicas: int) -> str:
    """Prefix-aware routing pays only with several copies, and needs a prefix cache to follow."""
    return "prefix_affinity" if max_replicas > 1 and config.cache_config.enable_prefix_caching else "power_of_two"


def placement_bundles(config, serving: EngineServing) -> list[dict[str, float]]:
    """Bundle 0 hosts the engine replica (and the grammar compiler), 1 + r hosts rank r. With
    `distributed_executor_backend: uni` the one rank runs in the replica's process: its bundle
    still reserves what the rank computes with."""
    tp = config.parallel_config.tensor_parallel_size
    engine = {"CPU": serving.engine_num_cpus, **serving.engine_resources}
    workers = serving.worker_bundles or [worker_bundle(config.device, serving.options.worker_num_cpus)] * tp
    if len(workers) != tp:
        raise ValueError(f"{len(workers)} worker bundles for tensor_parallel_size={tp}: give one per rank")
    return [engine] + [dict(b) for b in workers]


def request_router_config(config, serving: EngineServing) -> dict[str, Any]:
    """Serve's `request_router_config` for the engine deployment (actors/fleet/router.py)."""
    caching = config.cache_config.enable_prefix_caching
    router = serving.router or default_router(config, serving.max_replicas)
    if router == "power_of_two":
        cls, kwargs = PowerOfTwoRouter, {}
    elif not caching:
        raise ValueError("request_router: prefix_affinity needs enable_prefix_caching: true")
    else:
        cls, kwargs = PrefixAwareRouter, {"block_size": config.cache_config.block_size,
                                          "model_name": config.model_config.name, **serving.router_kwargs}
    return {"request_router_class": cls, "request_router_kwargs": kwargs,
            "request_routing_stats_period_s": serving.routing_stats_period_s, **serving.router_options}


def engine_deployment(config, serving: EngineServing):  # -> ray.serve.Application
    """One model's engine deployment: `config` finalized, placed and routed as `serving` says."""
    if config.parallel_config.distributed_executor_backend == "uni" and serving.options.worker_env:
        raise ValueError("worker_env sets the worker processes' environment, and with "
                         "distributed_executor_backend 'uni' there are none: use 'ray'")
    scaling = ({"autoscaling_config": serving.autoscaling_config} if serving.autoscaling_config is not None
               else {"num_replicas": serving.num_replicas})
    optional = {"max_queued_requests": serving.max_queued_requests,
                "health_check_timeout_s": serving.health_check_timeout_s,
                "graceful_shutdown_wait_loop_s": serving.graceful_shutdown_wait_loop_s,
                "logging_config": serving.logging_config}
    return EngineDeployment.options(
        name=serving.name, **scaling, max_ongoing_requests=serving.max_ongoing_requests,
        placement_group_bundles=placement_bundles(config, serving),
        placement_group_strategy=serving.placement_strategy,
        ray_actor_options=actor_options(serving.engine_num_cpus, serving.engine_resources, serving.runtime_env),
        health_check_period_s=serving.health_check_period_s,
        graceful_shutdown_timeout_s=serving.graceful_shutdown_timeout_s,
        request_router_config=request_router_config(config, serving),
        **{k: v for k, v in optional.items() if v is not None},
    ).bind(config, serving.options)


def ingress_deployment(models: list[ModelSpec], serving: IngressServing, api_key: str | None = None,
                       response_store: ResponseStoreConfig | None = None):
    """The `ingress` deployment serving `models` (each with its engine deployment) on one endpoint,
    with the `response-store` deployment behind its Responses API unless `response_store` is
    off (None: the defaults, on)."""
    check_unique_names([m.config.model_config.name for m in models])  # at build time, not in a replica
    scaling = ({"autoscaling_config": serving.autoscaling_config} if serving.autoscaling_config is not None
               else {"num_replicas": serving.num_replicas})
    queued = {} if serving.max_queued_requests is None else {"max_queued_requests": serving.max_queued_requests}
    return Ingress.options(
        **scaling, **queued, max_ongoing_requests=serving.max_ongoing_requests,
        ray_actor_options=actor_options(serving.num_cpus, serving.resources, serving.runtime_env),
    ).bind(models, api_key, response_store=_store_app(response_store or ResponseStoreConfig()))


def _store_app(config: ResponseStoreConfig):
    return store_deployment(config) if config.enabled else None


def actor_options(num_cpus: float, resources: dict[str, float],
                  runtime_env: dict[str, Any] | None = None) -> dict[str, Any]:
    options: dict[str, Any] = {"num_cpus": num_cpus}
    if resources:
        options["resources"] = dict(resources)
    if runtime_env:
        options["runtime_env"] = dict(runtime_env)
    return options
