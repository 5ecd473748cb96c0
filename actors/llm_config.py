"""Ray Serve LLM's deploy-file form, typed: `import_path: actors.app:build_openai_app` with
`args: {llm_configs: [...]}`, one `LLMConfig` per model (or a path to a YAML file holding one).

The keys are Ray Serve LLM's (`model_loading_config`, `engine_kwargs`, `deployment_config`,
`placement_group_config`, `accelerator_type`, `lora_config`, `runtime_env`,
`log_engine_metrics`), so a Ray Serve LLM config runs here by changing its `import_path`. What
each maps to is in docs/deploying.md ("Ray Serve LLM's form"). Every model is checked when the
app is built: a key this project does not know, or cannot honour, is an error naming it (never
dropped), and so is a value of the wrong type. `accelerator_type` only means something on GPUs
and is accepted (and unused) on CPU.

Each `LLMConfig` becomes an `EngineConfig` (`engine_config`) and an `EngineServing`
(`engine_serving`): the same two things the short form (`actors.app:build_app`) produces for
its one model, so both forms get the same deployments (actors/deployments.py).
"""
# No `from __future__ import annotations`: pydantic reads these annotations as classes.
import re
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveFloat, PositiveInt, field_validator,
                      model_validator)

from actors.deployments import PLACEMENT_STRATEGIES, EngineServing, IngressServing, default_router
from actors.engine_replica.deployment import EngineOptions
from actors.engine_replica.executor import worker_bundle
from actors.engine_args import EngineArgs
from actors.store.base import ResponseStoreConfig

# Defaults, as in the short form: an engine replica's own bundle (ray_actor_options.num_cpus), a
# worker's bundle (placement_group_config), an ingress replica.
ENGINE_NUM_CPUS = EngineServing.engine_num_cpus
WORKER_NUM_CPUS = EngineOptions.worker_num_cpus
INGRESS_NUM_CPUS = IngressServing.num_cpus
# request_router_class values (import paths, Ray's or ours) -> the router they stand for here.
ROUTER_CLASSES = {
    "actors.fleet.router:PrefixAwareRouter": "prefix_affinity",
    "ray.serve.llm.request_router:PrefixCacheAffinityRouter": "prefix_affinity",
    "actors.fleet.router:PowerOfTwoRouter": "power_of_two",
    "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter": "power_of_two",
    "ray.serve._private.request_router.pow_2_router:PowerOfTwoChoicesRequestRouter": "power_of_two",
    "prefix_affinity": "prefix_affinity",
    "power_of_two": "power_of_two",
}
# The prefix-aware router's request_router_kwargs (Ray's PrefixCacheAffinityRouter's name first).
PREFIX_ROUTER_KWARGS = {"imbalanced_threshold": "imbalance_threshold", "imbalance_threshold": "imbalance_threshold",
                        "min_match_blocks": "min_match_blocks", "tier_hit_weight": "tier_hit_weight"}
_ROUTER_KWARG_BOUNDS = {"min_match_blocks": (1, None), "tier_hit_weight": (0, 1)}  # others: >= 0


class _Strict(BaseModel):
    """Unknown keys are errors; keys Ray Serve LLM knows but this project cannot honour are
    errors saying why (`UNSUPPORTED`)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())
    UNSUPPORTED: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, why in cls.UNSUPPORTED.items():
                if key in data:
                    raise ValueError(f"`{key}` is not supported: {why}")
        return data


class ModelLoadingConfig(_Strict):
    model_id: str = Field(min_length=1)  # the name clients send as `model`
    model_source: str | None = None  # a preset name, an HF-style folder or a .gguf file; default: model_id
    tokenizer_source: str | None = None  # a folder or .gguf holding the tokenizer; default: the model's


class LoraConfig(_Strict):
    """Ray Serve LLM's LoRA settings (docs/lora.md): a request for `<model_id>:<adapter>` (or
    `<adapter>`) runs adapter `<dynamic_lora_loading_path>/<adapter>/`, read on first use; each
    copy remembers `max_num_adapters_per_replica` of them. Giving a lora_config turns LoRA on
    (engine_kwargs.enable_lora); the path is a local (or mounted) folder: adapters are not
    downloaded, so the download options are refused."""

    dynamic_lora_loading_path: str | None = None
    max_num_adapters_per_replica: PositiveInt = 16
    download_timeout_s: PositiveFloat | None = None
    max_download_tries: PositiveInt = 3

    @model_validator(mode="after")
    def _local_only(self) -> "LoraConfig":
        given = sorted({"download_timeout_s", "max_download_tries"} & self.model_fields_set)
        if given:
            raise ValueError(f"{', '.join(given)}: adapters are read from a local or mounted folder here, "
                             "never downloaded; remove them")
        path = self.dynamic_lora_loading_path
        if path is not None and "://" in path:
            raise ValueError(f"dynamic_lora_loading_path {path!r}: only local or mounted folders are supported "
                             "(no remote URIs)")
        return self

    def engine_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"enable_lora": True,
                                   "max_num_adapters_per_replica": self.max_num_adapters_per_replica}
        if self.dynamic_lora_loading_path is not None:
            options["dynamic_lora_loading_path"] = self.dynamic_lora_loading_path
        return options


class PlacementGroupConfig(_Strict):
    """The TP workers' bundles of one model copy: `bundles` (one per rank) or `bundle_per_worker`.
    The engine replica itself gets one more bundle in front of them (its ray_actor_options)."""

    bundles: list[dict[str, NonNegativeFloat]] | None = None
    bundle_per_worker: dict[str, NonNegativeFloat] | None = None
    strategy: str = EngineServing.placement_strategy

    @field_validator("strategy")
    @classmethod
    def _packed(cls, strategy: str) -> str:
        if strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"strategy {strategy!r} is not supported: the TP ranks of one model copy share a "
                             "node, so it must be STRICT_PACK (the default) or PACK")
        return strategy

    @model_validator(mode="after")
    def _one_form(self) -> "PlacementGroupConfig":
        if (self.bundles is None) == (self.bundle_per_worker is None):
            raise ValueError("give exactly one of bundles (one per TP rank) or bundle_per_worker")
        return self

    def worker_bundles(self, tp: int) -> list[dict[str, float]]:
        if self.bundle_per_worker is not None:
            return [dict(self.bundle_per_worker) for _ in range(tp)]
        if len(self.bundles) != tp:
            raise ValueError(f"placement_group_config.bundles has {len(self.bundles)} bundles for "
                             f"tensor_parallel_size={tp}: give one per TP rank")
        return [dict(b) for b in self.bundles]


class RayActorOptions(_Strict):
    num_cpus: NonNegativeFloat | None = None
    resources: dict[str, NonNegativeFloat] = Field(default_factory=dict)
    runtime_env: dict[str, Any] | None = None
    UNSUPPORTED = {"num_gpus": "a replica itself uses no GPU; each TP worker gets one through the "
                               "bundles of placement_group_config"}


class RequestRouterConfig(_Strict):
    """How the ingress picks a model copy. `request_router_class` is Ray's prefix-cache-affinity
    router or Serve's power-of-two router (or this project's, or `prefix_affinity` /
    `power_of_two`); each stands for this project's router of the same policy, which also routes
    around failed copies (actors/fleet/router.py). Unset: prefix affinity when there can be
    several copies and prefix caching is on."""

    request_router_class: Any = None  # normalized to "prefix_affinity" / "power_of_two" / None
    request_router_kwargs: dict[str, Any] = Field(default_factory=dict)
    request_routing_stats_period_s: PositiveFloat = EngineServing.routing_stats_period_s
    request_routing_stats_timeout_s: PositiveFloat | None = None
    initial_backoff_s: PositiveFloat | None = None
    backoff_multiplier: PositiveFloat | None = None
    max_backoff_s: PositiveFloat | None = None

    @field_validator("request_router_class")
    @classmethod
    def _known_router(cls, value: Any) -> str | None:
        if value is None:
            return None
        path = value if isinstance(value, str) else f"{value.__module__}:{value.__qualname__}"
        if ":" not in path and "." in path:
            path = ":".join(path.rsplit(".", 1))
        if path not in ROUTER_CLASSES:
            raise ValueError(f"request_router_class {path!r} is not supported; use one of {sorted(ROUTER_CLASSES)}")
        return ROUTER_CLASSES[path]

    @field_validator("request_router_kwargs")
    @classmethod
    def _prefix_policy_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        for key, value in kwargs.items():
            if key not in PREFIX_ROUTER_KWARGS:
                raise ValueError(f"request_router_kwargs.{key} is not supported; the prefix-aware router takes "
                                 f"{sorted(PREFIX_ROUTER_KWARGS)} (it follows the copies' own reports of their "
                                 "prefix caches, so Ray's tree and eviction settings have no counterpart)")
            low, high = _ROUTER_KWARG_BOUNDS.get(key, (0, None))
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low or (high and value > high):
                bounds = f">= {low}" if high is None else f"between {low} and {high}"
                raise ValueError(f"request_router_kwargs.{key} must be a number {bounds}, got {value!r}")
        return kwargs

    @model_validator(mode="after")
    def _kwargs_need_the_prefix_router(self) -> "RequestRouterConfig":
        if self.request_router_class == "power_of_two" and self.request_router_kwargs:
            raise ValueError("request_router_kwargs are for the prefix-aware router; the power-of-two router "
                             "takes none")
        return self

    def policy_kwargs(self) -> dict[str, Any]:
        """The prefix-aware router's kwargs under this project's names."""
        return {PREFIX_ROUTER_KWARGS[k]: v for k, v in self.request_router_kwargs.items()}

    def serve_options(self) -> dict[str, Any]:
        """Serve's own request_router_config keys (stats period, backoff), passed through."""
        names = ("request_routing_stats_timeout_s", "initial_backoff_s",
                 "backoff_multiplier", "max_backoff_s")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


class _Scaling(_Strict):
    """Serve's scaling keys, shared by a model's engine deployment and the ingress."""

    num_replicas: PositiveInt | Literal["auto"] | None = None
    autoscaling_config: dict[str, Any] | None = None  # Serve's keys, checked by Serve's AutoscalingConfig
    max_ongoing_requests: PositiveInt = EngineServing.max_ongoing_requests
    max_queued_requests: int | None = Field(default=None, ge=-1)
    ray_actor_options: RayActorOptions = Field(default_factory=RayActorOptions)

    @field_validator("autoscaling_config")
    @classmethod
    def _serve_autoscaling(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            from ray.serve.config import AutoscalingConfig

            AutoscalingConfig(**value)  # Serve's own checks; its errors name the key
        return value

    @model_validator(mode="after")
    def _replicas_or_autoscaling(self) -> "_Scaling":
        if isinstance(self.num_replicas, int) and self.autoscaling_config is not None:
            raise ValueError("give num_replicas or autoscaling_config, not both (or num_replicas: auto)")
        return self

    def scaling(self) -> tuple[int, dict[str, Any] | None]:
        """(num_replicas, autoscaling_config or None). `num_replicas: auto` is Serve's default
        autoscaling with any autoscaling_config keys given on top, as in Serve."""
        if self.num_replicas == "auto":
            from ray.serve.config import AutoscalingConfig

            merged = {**AutoscalingConfig.default().model_dump(exclude_unset=True), **(self.autoscaling_config or {})}
            AutoscalingConfig(**merged)
            return 1, merged
        return self.num_replicas or 1, self.autoscaling_config


class DeploymentConfig(_Scaling):
    """Serve options of one model's engine deployment (its copies)."""

    name: str | None = Field(default=None, min_length=1)  # default: engine:<model_id>
    health_check_period_s: PositiveFloat = EngineServing.health_check_period_s
    health_check_timeout_s: PositiveFloat | None = None
    # A copy scaled down finishes its requests first, for up to this long.
    graceful_shutdown_timeout_s: NonNegativeFloat = EngineServing.graceful_shutdown_timeout_s
    graceful_shutdown_wait_loop_s: PositiveFloat | None = None
    logging_config: dict[str, Any] | None = None  # Serve's LoggingConfig keys
    request_router_config: RequestRouterConfig = Field(default_factory=RequestRouterConfig)
    UNSUPPORTED = {
        "user_config": "the engine deployment has no reconfigure step; set engine options in engine_kwargs",
        "placement_group_bundles": "give placement_group_config (next to deployment_config) instead",
        "placement_group_strategy": "give placement_group_config (next to deployment_config) instead",
    }

    @field_validator("logging_config")
    @classmethod
    def _serve_logging(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            from ray.serve.schema import LoggingConfig

            LoggingConfig(**value)
        return value

    @field_validator("ray_actor_options")
    @classmethod
    def _engine_needs_cpu(cls, options: RayActorOptions) -> RayActorOptions:
        if options.num_cpus == 0 and not options.resources:
            raise ValueError("num_cpus must be > 0 (or resources given): it sizes the engine replica's own "
                             "bundle of its placement group")
        return options


class EngineKwargs(EngineArgs, _Strict):
    """`engine_kwargs`: this engine's options, under vLLM's names where vLLM has them."""

    # vLLM options accepted only at the value this engine always has.
    pipeline_parallel_size: Literal[1] | None = None
    enable_chunked_prefill: Literal[True] | None = None
    trust_remote_code: Literal[False] | None = None
    enable_auto_tool_choice: Literal[True] | None = None
    UNSUPPORTED = {
        "model": "give model_loading_config.model_source",
        "served_model_name": "model_loading_config.model_id is the served name",
        "tokenizer": "give model_loading_config.tokenizer_source",
    }


class LLMConfig(_Strict):
    """One served model: Ray Serve LLM's `LLMConfig` keys, checked here (docs/deploying.md)."""

    model_loading_config: ModelLoadingConfig
    engine_kwargs: EngineKwargs = Field(default_factory=EngineKwargs)
    deployment_config: DeploymentConfig = Field(default_factory=DeploymentConfig)
    accelerator_type: str | None = None  # GPU only: each worker bundle asks for a node of this type
    placement_group_config: PlacementGroupConfig | None = None
    lora_config: LoraConfig | None = None
    runtime_env: dict[str, Any] | None = None  # the engine replica's and its workers'; the ingress's too
    log_engine_metrics: bool = True  # the engine's ray_llm_* series (docs/metrics.md)
    llm_engine: Literal["vLLM", "VLLM"] = "vLLM"  # this engine, under vLLM's option names
    UNSUPPORTED = {
        "accelerator_config": "the device comes from engine_kwargs.device (auto: CUDA when present, else CPU)",
        "server_cls": "the engine deployment is llm-cluster's own",
        "callback_config": "there are no model-initialization callbacks",
        "experimental_configs": "none of Ray Serve LLM's experimental settings has a counterpart",
    }

    @classmethod
    def from_file(cls, path: str | Path) -> "LLMConfig":
        """An LLMConfig from a YAML file (its keys at the top level)."""
        return cls.model_validate(_read_yaml(path))

    @field_validator("accelerator_type")
    @classmethod
    def _ray_accelerator(cls, value: str | None) -> str | None:
        if value is not None and value not in _accelerator_types():
            raise ValueError(f"accelerator_type {value!r} is not one of Ray's accelerator types "
                             "(ray.util.accelerators), e.g. A10G, L4, A100, H100")
        return value

    @property
    def model_id(self) -> str:
        return self.model_loading_config.model_id

    @property
    def deployment_name(self) -> str:
        """The engine deployment's Serve name: deployment_config.name, else engine:<model_id>
        (characters other than letters, digits, `.`, `_`, `-` become `-`)."""
        return self.deployment_config.name or "engine:" + re.sub(r"[^A-Za-z0-9._-]+", "-", self.model_id)

    def engine_config(self):  # -> cluster.config.EngineConfig (not finalized)
        from cluster.config import EngineConfig

        mlc = self.model_loading_config
        lora = self.lora_config.engine_options() if self.lora_config is not None else {}
        return EngineConfig.create(model=mlc.model_source or mlc.model_id, served_model_name=mlc.model_id,
                                   tokenizer=mlc.tokenizer_source, **{**self.engine_kwargs.engine_options(), **lora})

    def engine_serving(self, config) -> EngineServing:
        """How this model's engine deployment runs; `config` is its finalized EngineConfig."""
        dc = self.deployment_config
        num_replicas, autoscaling = dc.scaling()
        bundles = self._worker_bundles(config)
        serving = EngineServing(
            name=self.deployment_name, num_replicas=num_replicas, autoscaling_config=autoscaling,
            max_ongoing_requests=dc.max_ongoing_requests, max_queued_requests=dc.max_queued_requests,
            health_check_period_s=dc.health_check_period_s, health_check_timeout_s=dc.health_check_timeout_s,
            graceful_shutdown_timeout_s=dc.graceful_shutdown_timeout_s,
            graceful_shutdown_wait_loop_s=dc.graceful_shutdown_wait_loop_s, logging_config=dc.logging_config,
            engine_num_cpus=ENGINE_NUM_CPUS if dc.ray_actor_options.num_cpus is None else dc.ray_actor_options.num_cpus,
            engine_resources=dict(dc.ray_actor_options.resources), worker_bundles=bundles,
            placement_strategy=self.placement_group_config.strategy if self.placement_group_config
            else EngineServing.placement_strategy, routing_stats_period_s=dc.request_router_config.request_routing_stats_period_s,
            router_kwargs=dc.request_router_config.policy_kwargs(),
            router_options=dc.request_router_config.serve_options(), runtime_env=self.engine_runtime_env(),
            options=EngineOptions(worker_num_cpus=min(b.get("CPU", 0.0) for b in bundles),
                                  record_metrics=self.log_engine_metrics,
                                  step_timeout_s=self.engine_kwargs.step_timeout_s))
        serving.router = dc.request_router_config.request_router_class or default_router(config, serving.max_replicas)
        if serving.router == "power_of_two" and serving.router_kwargs:
            raise ValueError("deployment_config.request_router_config.request_router_kwargs are for the prefix-aware "
                             "router, and this model is served by the power-of-two router (one copy, or no prefix "
                             "caching): remove them or set request_router_class")
        return serving

    def engine_runtime_env(self) -> dict[str, Any] | None:
        """ray_actor_options.runtime_env with this config's runtime_env on top (as Ray Serve LLM)."""
        return overlay_runtime_env(self.deployment_config.ray_actor_options.runtime_env, self.runtime_env)

    def _worker_bundles(self, config) -> list[dict[str, float]]:
        tp, device = config.parallel_config.tensor_parallel_size, config.device
        pg = self.placement_group_config
        bundles = pg.worker_bundles(tp) if pg else [worker_bundle(device, WORKER_NUM_CPUS) for _ in range(tp)]
        if device != "cuda":  # accelerator_type means nothing to CPU workers
            return bundles
        for i, bundle in enumerate(bundles):
            if bundle.get("GPU", 0) < 1:
                raise ValueError(f"placement_group_config bundle {i} has no GPU: each TP rank on CUDA needs GPU: 1")
            if self.accelerator_type:
                bundle.setdefault(f"accelerator_type:{self.accelerator_type}", 0.001)
        return bundles


class IngressDeploymentConfig(_Scaling):
    """Serve options of the ingress (every model's HTTP front end)."""


class LLMServingArgs(_Strict):
    """`args` of `actors.app:build_openai_app`: the models, and optionally the ingress's options."""

    llm_configs: list[LLMConfig] = Field(min_length=1)
    ingress_deployment_config: IngressDeploymentConfig = Field(default_factory=IngressDeploymentConfig)
    response_store: ResponseStoreConfig = Field(default_factory=ResponseStoreConfig)  # docs/responses.md
    UNSUPPORTED = {"ingress_cls_config": "the ingress is llm-cluster's own (actors/http/ingress.py)"}

    @field_validator("llm_configs", mode="before")
    @classmethod
    def _read_files(cls, entries: Any) -> Any:
        """Entries may be paths to YAML files, each holding one LLMConfig (a relative path starts
        in the working directory of the process building the app)."""
        if not isinstance(entries, list):
            return entries
        return [_read_yaml(e) if isinstance(e, (str, Path)) else e for e in entries]

    @model_validator(mode="after")
    def _unique(self) -> "LLMServingArgs":
        ids = [c.model_id for c in self.llm_configs]
        names = [c.deployment_name for c in self.llm_configs]
        for what, values in (("model_loading_config.model_id", ids), ("engine deployment name", names)):
            repeated = sorted({v for v in values if values.count(v) > 1})
            if repeated:
                raise ValueError(f"each model needs its own {what}; repeated: {repeated}")
        taken = sorted({"ingress", "response-store"} & set(names))
        if taken:
            raise ValueError(f"deployment_config.name {taken} is taken by the app's own deployments "
                             "(`ingress`, `response-store`)")
        return self

    def ingress_serving(self) -> IngressServing:
        ic = self.ingress_deployment_config
        num_replicas, autoscaling = ic.scaling()
        opts = ic.ray_actor_options
        models_env = union_runtime_envs({c.model_id: c.engine_runtime_env() for c in self.llm_configs})
        return IngressServing(
            num_replicas=num_replicas, autoscaling_config=autoscaling, max_ongoing_requests=ic.max_ongoing_requests,
            max_queued_requests=ic.max_queued_requests,
            num_cpus=INGRESS_NUM_CPUS if opts.num_cpus is None else opts.num_cpus, resources=dict(opts.resources),
            runtime_env=overlay_runtime_env(models_env, opts.runtime_env))


def overlay_runtime_env(base: dict[str, Any] | None, top: dict[str, Any] | None) -> dict[str, Any] | None:
    """`top` over `base`: its keys win, env_vars are merged (top's win)."""
    if not base or not top:
        return dict(top or base or {}) or None
    env_vars = {**base.get("env_vars", {}), **top.get("env_vars", {})}
    return {**base, **top, **({"env_vars": env_vars} if env_vars else {})}


def union_runtime_envs(envs: dict[str, dict[str, Any] | None]) -> dict[str, Any] | None:
    """One runtime_env holding every model's (the ingress loads each model's tokenizer and
    custom logits processors): env_vars merged, other keys equal where given. A conflict is an
    error naming the models; set it in ingress_deployment_config.ray_actor_options.runtime_env."""
    flat: dict[str, tuple[str, Any]] = {}  # "working_dir", "env_vars.NAME", ... -> (model, value)
    for model, env in envs.items():
        for label, value in _flatten(env or {}).items():
            if label in flat and flat[label][1] != value:
                raise ValueError(f"runtime_env.{label} differs between models `{flat[label][0]}` and `{model}`, "
                                 "and the ingress serves both: give it in ingress_deployment_config."
                                 "ray_actor_options.runtime_env")
            flat.setdefault(label, (model, value))
    merged: dict[str, Any] = {}
    for label, (_, value) in flat.items():
        if label.startswith("env_vars."):
            merged.setdefault("env_vars", {})[label.removeprefix("env_vars.")] = value
        else:
            merged[label] = value
    return merged or None


def _flatten(env: dict[str, Any]) -> dict[str, Any]:
    flat = {k: v for k, v in env.items() if k != "env_vars"}
    flat.update({f"env_vars.{name}": v for name, v in (env.get("env_vars") or {}).items()})
    return flat


def _read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"LLMConfig file {str(path)!r} not found (relative paths start at {Path.cwd()})")
    data = yaml.safe_load(p.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"LLMConfig file {str(path)!r} must hold a mapping of LLMConfig keys")
    return data


def _accelerator_types() -> set[str]:
    from ray.util.accelerators import accelerators

    return {v for k, v in vars(accelerators).items() if k.isupper() and isinstance(v, str)}
