"""deploy.yaml, configs/ presets and the typed app builder (no Ray cluster needed)."""
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve.schema import ServeDeploySchema

from actors.app import AppArgs, build_app, placement_bundles
from cluster.config import CONFIGS_DIR

pytestmark = pytest.mark.no_cluster  # starts no Ray (tests/actors/conftest.py)

ROOT = Path(__file__).resolve().parents[2]


def test_deploy_yaml_is_a_serve_config_for_smollm2_on_cpu():
    schema = ServeDeploySchema.model_validate(yaml.safe_load((ROOT / "deploy.yaml").read_text()))
    assert schema.http_options.host == "127.0.0.1"
    (app,) = schema.applications
    assert app.import_path == "actors.app:build_app"
    args = AppArgs.model_validate(app.args)
    cfg = args.engine_config()
    assert cfg.model_config.model == "smollm2-135m-instruct"
    assert cfg.parallel_config.tensor_parallel_size == 1
    assert cfg.device == "cpu"
    assert args.stream_interval == 1  # every token its own SSE chunk (the engine multiplexes)


def test_deploy_gpu_yaml_is_deploy_yaml_on_the_gpu_preset():
    """What `make serve` runs where nvidia-smi lists a GPU: deploy.yaml's server and app, the
    `gpu` preset's engine (bf16 on CUDA, graphs on) for the same model."""
    cpu, gpu = (yaml.safe_load((ROOT / name).read_text()) for name in ("deploy.yaml", "deploy-gpu.yaml"))
    schema = ServeDeploySchema.model_validate(gpu)
    assert schema.http_options.host == "127.0.0.1" and schema.http_options.port == cpu["http_options"]["port"]
    (app,), (cpu_app,) = gpu["applications"], cpu["applications"]
    assert {k: v for k, v in app.items() if k != "args"} == {k: v for k, v in cpu_app.items() if k != "args"}
    assert {k: v for k, v in app["args"].items() if k != "preset"} == \
        {k: v for k, v in cpu_app["args"].items() if k != "preset"}
    cfg = AppArgs.model_validate(app["args"]).engine_config()
    assert (cfg.device, cfg.model_config.dtype, cfg.enforce_eager) == ("cuda", "bfloat16", False)
    assert cfg.model_config.model == AppArgs.model_validate(cpu_app["args"]).engine_config().model_config.model


@pytest.mark.parametrize("preset", sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml")))
def test_every_preset_loads(preset):
    cfg = AppArgs(preset=preset).engine_config()
    assert cfg.parallel_config.tensor_parallel_size >= 1


def test_presets_include_tp3_cpu_and_gpu():
    tp3 = AppArgs(preset="smollm2-cpu-tp3").engine_config()
    assert (tp3.parallel_config.tensor_parallel_size, tp3.device, tp3.model_config.dtype) == (3, "cpu", "float32")
    assert AppArgs(preset="gpu").engine_config().device == "cuda"
    gpu = AppArgs(preset="gpu", enforce_eager=True, gpu_memory_utilization=0.5, load_format="dummy").engine_config()
    assert gpu.enforce_eager and gpu.cache_config.gpu_memory_utilization == 0.5
    assert gpu.model_config.load_format == "dummy"
    with pytest.raises(ValidationError, match="gpu_memory_utilization"):
        AppArgs(gpu_memory_utilization=1.5)


def test_overrides_beat_the_preset():
    args = AppArgs(preset="smollm2-cpu", max_num_seqs=8, dtype="float32", served_model_name="m",
                   logits_processors=["pkg.mod:Cls"], engine_overrides={"block_size": 32})
    cfg = args.engine_config()
    assert cfg.scheduler_config.max_num_seqs == 8 and cfg.model_config.dtype == "float32"
    assert cfg.cache_config.block_size == 32 and cfg.model_config.name == "m"
    assert cfg.logits_processors == ["pkg.mod:Cls"]
    limits = AppArgs(scheduling_policy="priority", max_n=4, max_logprobs=5, max_request_body_bytes=1000)
    cfg = limits.engine_config()
    assert cfg.scheduler_config.scheduling_policy == "priority"
    assert (cfg.limits_config.max_n, cfg.limits_config.max_logprobs,
            cfg.limits_config.max_request_body_bytes) == (4, 5, 1000)


def test_bad_args_are_rejected_with_the_name():
    with pytest.raises(ValidationError, match="not_an_option"):
        AppArgs.model_validate({"not_an_option": 1})
    with pytest.raises(ValidationError, match="ingress_replicas"):
        AppArgs(ingress_replicas=0)
    with pytest.raises(ValidationError, match="scheduling_policy"):
        AppArgs(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="no-such-preset"):
        AppArgs(preset="no-such-preset").engine_config()
    with pytest.raises(ValueError, match="bogus"):
        AppArgs(engine_overrides={"bogus": 1}).engine_config()


def test_placement_bundles_one_per_rank_plus_the_engine():
    args = AppArgs(engine_num_cpus=0.5, worker_num_cpus=0.25).engine_serving()
    cpu = placement_bundles(AppArgs(preset="smollm2-cpu-tp3").engine_config(), args)
    assert cpu == [{"CPU": 0.5}] + [{"CPU": 0.25}] * 3
    gpu = placement_bundles(AppArgs(preset="gpu", tensor_parallel_size=2).engine_config(), args)
    assert gpu == [{"CPU": 0.5}] + [{"CPU": 0.25, "GPU": 1.0}] * 2


def test_builder_through_serve_validates_args_and_wires_the_deployments():
    app = call_user_app_builder_with_args_if_necessary(
        build_app, {"preset": "smollm2-cpu-tp3", "ingress_replicas": 2, "max_num_seqs": 4})
    ingress = app._bound_deployment
    assert (ingress.name, ingress.num_replicas) == ("ingress", 2)
    (model,) = ingress.init_args[0]  # the short form serves one model
    engine = model.engine._bound_deployment
    assert engine.name == "engine" and model.config.model_config.name == "smollm2-135m-instruct"
    assert engine._replica_config.placement_group_strategy == "STRICT_PACK"
    assert len(engine._replica_config.placement_group_bundles) == 4
    config = engine.init_args[0]
    assert config.model_config.hf_config is not None  # finalized at build time
    assert config.scheduler_config.max_num_seqs == 4
    with pytest.raises(ValidationError):
        call_user_app_builder_with_args_if_necessary(build_app, {"tensor_parallel_size": "three"})


def _engine(args: dict):
    app = call_user_app_builder_with_args_if_necessary(build_app, {"preset": "smollm2-cpu-small", **args})
    ingress = app._bound_deployment
    return ingress, ingress.init_args[0][0].engine._bound_deployment


def test_several_replicas_get_the_prefix_aware_router_one_gets_power_of_two():
    from actors.fleet.router import PowerOfTwoRouter, PrefixAwareRouter

    _, fleet = _engine({"engine_replicas": 2, "routing_imbalance_threshold": 4})
    router = fleet._deployment_config.request_router_config
    assert router.get_request_router_class() is PrefixAwareRouter
    assert router.request_router_kwargs == {"block_size": 16, "model_name": "smollm2-135m-instruct",
                                            "imbalance_threshold": 4, "min_match_blocks": 2, "tier_hit_weight": 0.9}
    assert router.request_routing_stats_period_s == 1.0
    _, single = _engine({})
    assert single._deployment_config.request_router_config.get_request_router_class() is PowerOfTwoRouter
    _, chosen = _engine({"engine_replicas": 3, "request_router": "power_of_two"})
    assert chosen._deployment_config.request_router_config.get_request_router_class() is PowerOfTwoRouter
    _, uncached = _engine({"engine_replicas": 2, "enable_prefix_caching": False})
    assert uncached._deployment_config.request_router_config.get_request_router_class() is PowerOfTwoRouter
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        _engine({"engine_replicas": 2, "enable_prefix_caching": False, "request_router": "prefix_affinity"})
    with pytest.raises(ValidationError, match="request_router"):
        AppArgs(request_router="round_robin")


def test_autoscaling_drain_and_resource_pinning_reach_the_engine_deployment():
    from actors.fleet.router import PrefixAwareRouter

    ingress, engine = _engine({"engine_autoscaling_config": {"min_replicas": 1, "max_replicas": 3,
                                                             "target_ongoing_requests": 8, "downscale_delay_s": 60},
                               "engine_drain_timeout_s": 120, "engine_health_check_period_s": 1,
                               "engine_resources": {"gpu_node": 1},
                               "ingress_resources": {"head": 0.5}})
    config = engine._deployment_config
    auto = config.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas, auto.target_ongoing_requests, auto.downscale_delay_s) == (1, 3, 8, 60)
    assert config.request_router_config.get_request_router_class() is PrefixAwareRouter  # up to 3 copies
    assert config.graceful_shutdown_timeout_s == 120
    assert config.health_check_period_s == 1
    assert _engine({})[1]._deployment_config.health_check_period_s == 5.0
    assert engine._replica_config.placement_group_bundles[0] == {"CPU": 0.25, "gpu_node": 1}
    assert engine._replica_config.ray_actor_options["resources"] == {"gpu_node": 1}
    assert ingress._replica_config.ray_actor_options["resources"] == {"head": 0.5}
    with pytest.raises(ValidationError, match="engine_replicas or engine_autoscaling_config"):
        AppArgs(engine_replicas=2, engine_autoscaling_config={"max_replicas": 2})
    with pytest.raises(ValidationError, match="max_replicas"):
        AppArgs(engine_autoscaling_config={"min_replicas": 3, "max_replicas": 2})


def test_routers_send_a_pinned_call_to_its_replica_while_it_is_there():
    from types import SimpleNamespace

    from actors.channel.protocol import AVOID_REPLICAS, PIN_REPLICA
    from actors.fleet.router import PowerOfTwoRouter

    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=u), routing_stats={}) for u in "abc"]

    def candidates(**kwargs):
        pending = SimpleNamespace(kwargs=kwargs, routing_context=SimpleNamespace(should_backoff=False))
        return [r.replica_id.unique_id for r in PowerOfTwoRouter._candidates(None, replicas, pending)]

    assert candidates(**{PIN_REPLICA: "b"}) == ["b"]
    assert candidates(**{PIN_REPLICA: "gone", AVOID_REPLICAS: ("a",)}) == ["b", "c"]  # routed as usual
    assert candidates() == ["a", "b", "c"]


def test_worker_env_needs_worker_processes():
    """worker_env is the worker actors' environment: at one CPU rank the default executor runs the
    rank in the engine replica (`uni`), so the build says to ask for worker actors."""
    with pytest.raises(ValueError, match="worker_env .* distributed_executor_backend 'uni' there are none: use 'ray'"):
        _engine({"worker_env": {"OMP_WAIT_POLICY": "PASSIVE"}})
    _, engine = _engine({"worker_env": {"OMP_WAIT_POLICY": "PASSIVE"}, "distributed_executor_backend": "ray"})
    assert engine._replica_config.placement_group_bundles == [{"CPU": 0.25}, {"CPU": 0.5}]
