"""Ray Serve LLM's config form (`actors.app:build_openai_app`) built the way `serve run` builds
it, without a Ray cluster: what each key becomes, and a clear error for every key that cannot
be honoured. tests/actors/test_openai_app.py serves such a config end to end."""
import pytest
import yaml
from pydantic import ValidationError
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve.deployment import Application

from actors.app import build_openai_app
from actors.fleet.router import PowerOfTwoRouter, PrefixAwareRouter

pytestmark = pytest.mark.no_cluster  # starts no Ray (tests/actors/conftest.py)


def _llm(model_dir: str, model_id: str = "m", **keys) -> dict:
    return {"model_loading_config": {"model_id": model_id, "model_source": model_dir},
            "engine_kwargs": {"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 32}, **keys}


def _build(args: dict):
    """As `serve run` does: Serve calls the builder named by import_path with the args dict."""
    app = call_user_app_builder_with_args_if_necessary(build_openai_app, args)
    ingress = app._bound_deployment
    return ingress, {m.config.model_config.name: (m, m.engine._bound_deployment) for m in ingress.init_args[0]}


def test_each_model_gets_its_own_engine_deployment_with_its_keys(tiny_llama_dir):
    first = _llm(tiny_llama_dir, "llama-tp2", deployment_config={
        "num_replicas": "auto", "autoscaling_config": {"max_replicas": 3, "target_ongoing_requests": 8},
        "max_ongoing_requests": 48, "max_queued_requests": 100, "health_check_period_s": 3,
        "health_check_timeout_s": 20, "graceful_shutdown_timeout_s": 90, "graceful_shutdown_wait_loop_s": 1,
        "ray_actor_options": {"num_cpus": 0.5, "resources": {"head": 0.1}},
        "request_router_config": {"request_router_class": "ray.serve.llm.request_router:PrefixCacheAffinityRouter",
                                  "request_router_kwargs": {"imbalanced_threshold": 4},
                                  "request_routing_stats_period_s": 2}},
        placement_group_config={"bundle_per_worker": {"CPU": 0.2}}, runtime_env={"env_vars": {"A": "1"}})
    first["engine_kwargs"].update(tensor_parallel_size=2, enable_chunked_prefill=True, tool_call_parser=None,
                                  stream_interval=4)
    second = _llm(tiny_llama_dir, "org/llama.fp32", accelerator_type="A10G", log_engine_metrics=False,
                  placement_group_config={"bundles": [{"CPU": 0.3}], "strategy": "PACK"}, lora_config={},
                  runtime_env={"env_vars": {"B": "2"}})
    ingress, models = _build({"llm_configs": [first, second],
                              "ingress_deployment_config": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0}}})
    assert (ingress.name, ingress.num_replicas) == ("ingress", 2)
    assert list(models) == ["llama-tp2", "org/llama.fp32"]  # the order of llm_configs: /v1/models lists them so

    spec, engine = models["llama-tp2"]
    assert engine.name == "engine:llama-tp2"
    assert (spec.tool_call_parser, spec.stream_interval) == (None, 4)
    assert spec.config.parallel_config.tensor_parallel_size == 2 and spec.config.model_config.hf_config is not None
    dc, rc = engine._deployment_config, engine._replica_config
    auto = dc.autoscaling_config  # num_replicas: auto = Serve's default autoscaling, with the keys given on top
    assert (auto.min_replicas, auto.max_replicas, auto.target_ongoing_requests) == (1, 3, 8)
    assert (dc.max_ongoing_requests, dc.max_queued_requests, dc.health_check_period_s, dc.health_check_timeout_s,
            dc.graceful_shutdown_timeout_s, dc.graceful_shutdown_wait_loop_s) == (48, 100, 3, 20, 90, 1)
    assert rc.placement_group_bundles == [{"CPU": 0.5, "head": 0.1}, {"CPU": 0.2}, {"CPU": 0.2}]
    assert rc.placement_group_strategy == "STRICT_PACK"
    assert rc.ray_actor_options["runtime_env"]["env_vars"] == {"A": "1"}
    router = dc.request_router_config  # Ray's prefix-cache router stands for ours
    assert router.get_request_router_class() is PrefixAwareRouter and router.request_routing_stats_period_s == 2
    assert router.request_router_kwargs == {"block_size": 16, "model_name": "llama-tp2", "imbalance_threshold": 4}
    assert engine.init_args[1].worker_num_cpus == 0.2 and engine.init_args[1].record_metrics

    spec, engine = models["org/llama.fp32"]
    assert engine.name == "engine:org-llama.fp32"
    dc, rc = engine._deployment_config, engine._replica_config
    assert dc.num_replicas == 1 and dc.autoscaling_config is None
    assert dc.request_router_config.get_request_router_class() is PowerOfTwoRouter  # one copy
    # accelerator_type means nothing to CPU workers: their bundles are as given.
    assert rc.placement_group_bundles == [{"CPU": 0.25}, {"CPU": 0.3}] and rc.placement_group_strategy == "PACK"
    assert not engine.init_args[1].record_metrics  # log_engine_metrics: false
    # The ingress loads every model's tokenizer and processors: it gets every model's environment.
    assert ingress._replica_config.ray_actor_options["runtime_env"]["env_vars"] == {"A": "1", "B": "2"}
    assert ingress._replica_config.ray_actor_options["num_cpus"] == 0


def test_llm_configs_entries_may_be_yaml_files(tiny_llama_dir, tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(_llm(tiny_llama_dir, "from-file")))
    _, models = _build({"llm_configs": [str(path), _llm(tiny_llama_dir, "inline")]})
    assert list(models) == ["from-file", "inline"]
    with pytest.raises(ValidationError, match="no-such.yaml"):
        _build({"llm_configs": [str(tmp_path / "no-such.yaml")]})


def test_the_typed_python_api(tiny_llama_dir):
    from actors import LLMConfig, LLMServingArgs
    from actors import build_openai_app as exported

    cfg = LLMConfig(model_loading_config={"model_id": "typed", "model_source": tiny_llama_dir},
                    engine_kwargs={"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 32})
    assert cfg.engine_kwargs.max_model_len == 256 and cfg.model_id == "typed"
    for args in ({"llm_configs": [cfg]}, LLMServingArgs(llm_configs=[cfg])):
        app = exported(args)
        assert isinstance(app, Application)
        assert [m.config.model_config.name for m in app._bound_deployment.init_args[0]] == ["typed"]
    with pytest.raises(ValidationError, match=r"engine_kwargs\.max_num_seqs"):
        LLMConfig(model_loading_config={"model_id": "x"}, engine_kwargs={"max_num_seqs": 0})


BAD_CONFIGS = {
    # unknown keys, at every level
    "unknown LLMConfig key": ({"bogus_key": 1}, r"bogus_key\s+Extra inputs are not permitted"),
    "unknown engine kwarg": ({"engine_kwargs": {"max_num_seq": 4}}, r"engine_kwargs\.max_num_seq\s+Extra inputs"),
    "unknown deployment key": ({"deployment_config": {"replicas": 2}}, r"deployment_config\.replicas"),
    "unknown lora key": ({"lora_config": {"rank": 8}}, r"lora_config\.rank"),
    # bad types
    "bad engine kwarg type": ({"engine_kwargs": {"max_num_seqs": "many"}}, r"engine_kwargs\.max_num_seqs"),
    "kv cache dtype": ({"engine_kwargs": {"kv_cache_dtype": "fp8"}}, r"engine_kwargs\.kv_cache_dtype\s+Input should be 'auto' or 'bfloat16'"),
    "bad num_replicas": ({"deployment_config": {"num_replicas": "three"}}, r"deployment_config\.num_replicas"),
    "bad model_source": ({"model_loading_config": {"model_id": "m", "model_source": {"bucket_uri": "s3://b"}}},
                         r"model_loading_config\.model_source"),
    "bad autoscaling": ({"deployment_config": {"autoscaling_config": {"min_replicas": 3, "max_replicas": 2}}},
                        r"(?s)deployment_config\.autoscaling_config.*max_replicas"),
    # Ray Serve LLM keys this project cannot honour
    "lora uri": ({"lora_config": {"dynamic_lora_loading_path": "s3://bucket/loras"}}, "only local or mounted folders"),
    "lora download": ({"lora_config": {"max_download_tries": 5}}, "never downloaded"),
    "user_config": ({"deployment_config": {"user_config": {"a": 1}}}, "`user_config` is not supported"),
    "accelerator_config": ({"accelerator_config": {"kind": "gpu"}}, "`accelerator_config` is not supported"),
    "num_gpus": ({"deployment_config": {"ray_actor_options": {"num_gpus": 1}}}, "`num_gpus` is not supported"),
    "engine model": ({"engine_kwargs": {"model": "x"}}, "give model_loading_config.model_source"),
    "pipeline parallel": ({"engine_kwargs": {"pipeline_parallel_size": 2}}, r"engine_kwargs\.pipeline_parallel_size"),
    "spread": ({"placement_group_config": {"bundles": [{"CPU": 1}], "strategy": "SPREAD"}}, "STRICT_PACK"),
    "router class": ({"deployment_config": {"request_router_config": {"request_router_class": "my.mod:Router"}}},
                     "request_router_class 'my.mod:Router' is not supported"),
    "router kwargs": ({"deployment_config": {"request_router_config": {"request_router_kwargs": {"do_eviction": True}}}},
                      r"request_router_kwargs\.do_eviction is not supported"),
    "router weight": ({"deployment_config": {"request_router_config": {"request_router_kwargs": {"tier_hit_weight": 1.5}}}},
                      r"request_router_kwargs\.tier_hit_weight must be a number between 0 and 1, got 1\.5"),
    "accelerator type": ({"accelerator_type": "Z80"}, "accelerator_type 'Z80'"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_a_key_that_cannot_be_honoured_is_a_build_error_naming_it(case, tiny_llama_dir):
    keys, message = BAD_CONFIGS[case]
    llm = _llm(tiny_llama_dir)
    for key, value in keys.items():
        llm[key] = {**llm[key], **value} if key == "engine_kwargs" else value
    with pytest.raises(ValidationError, match=message):
        _build({"llm_configs": [llm]})


def test_args_errors_name_the_key_or_the_model(tiny_llama_dir):
    one = _llm(tiny_llama_dir)
    with pytest.raises(ValidationError, match=r"bogus\s+Extra inputs"):
        _build({"llm_configs": [one], "bogus": 1})
    with pytest.raises(ValidationError, match="`ingress_cls_config` is not supported"):
        _build({"llm_configs": [one], "ingress_cls_config": {"ingress_cls": "x:Y"}})
    with pytest.raises(ValidationError, match=r"repeated: \['m'\]"):
        _build({"llm_configs": [one, one]})
    with pytest.raises(ValidationError, match="llm_configs"):
        _build({"llm_configs": []})
    with pytest.raises(ValidationError, match=r"\['ingress'\] is taken by the app's own deployments"):
        _build({"llm_configs": [{**one, "deployment_config": {"name": "ingress"}}]})
    # Checks that need the model (its files, context length, TP) fail the build naming the model.
    cases = [({"placement_group_config": {"bundles": [{"CPU": 1}, {"CPU": 1}]}}, "has 2 bundles for tensor_parallel_size=1"),
             ({"engine_kwargs": {"max_model_len": 100000}}, "max_model_len must be in"),
             ({"model_loading_config": {"model_id": "m", "model_source": "/no/such/model"}}, "neither a known preset"),
             ({"deployment_config": {"request_router_config": {"request_router_kwargs": {"min_match_blocks": 4}}}},
              "power-of-two router")]
    for keys, message in cases:
        with pytest.raises(ValueError, match=rf"llm_configs\[0\] \(model_id 'm'\): .*{message}"):
            _build({"llm_configs": [{**one, **keys}]})


def test_an_embedding_model_beside_a_generation_model(tiny_llama_dir):
    """task / pooler_config are engine options like any other: in Ray Serve LLM's form they ride
    in engine_kwargs, and a bad pooler_config fails the build naming the model."""
    embed = _llm(tiny_llama_dir, "embedder")
    embed["engine_kwargs"].update(task="embed", pooler_config={"pooling_type": "mean", "normalize": False})
    _, models = _build({"llm_configs": [_llm(tiny_llama_dir, "chat"), embed]})
    assert models["chat"][0].config.model_config.task == "generate"
    mc = models["embedder"][0].config.model_config
    assert (mc.task, mc.pooler_config) == ("embed", {"pooling_type": "MEAN", "normalize": False})
    embed["engine_kwargs"]["pooler_config"] = {"pooling_type": "CLS"}
    with pytest.raises(ValueError, match=r"llm_configs\[0\] \(model_id 'embedder'\): pooler_config.pooling_type"):
        _build({"llm_configs": [embed]})
