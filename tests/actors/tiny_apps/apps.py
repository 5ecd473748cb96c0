"""The package's three applications, one per test module, each at its own route prefix:

- `llm` at `/`: Ray Serve LLM's form (`build_openai_app`), two models behind one endpoint
  (test_openai_app);
- `lora` at `/lora`: the same form, one tiny llama with LoRA adapters (test_lora_serve);
- `embed` at `/embed`: the short form (`build_app`), an embedding model (test_embeddings_serve).
"""
from pathlib import Path

import yaml

from fleet_helpers import SMALL

LLAMA, QWEN = "tiny-llama", "tiny-qwen3"  # the `llm` application's two models
LORA_MODEL = "tiny-llama"  # the `lora` application's base model
EMBED_MODEL = "tiny-embed"
LORA_PREFIX, EMBED_PREFIX = "/lora", "/embed"
# Logical CPUs are a budget, not cores: small reservations let every model fit a 2-core machine.
ACTOR = {"ray_actor_options": {"num_cpus": 0.05}}
ENGINE = {"max_model_len": 512, "num_kv_blocks": 64, "max_num_seqs": 16}


def openai_app(tmp: Path, tiny_llama_dir: str, qwen3_dir: str) -> dict:
    """`tiny-llama`: the random-weight llama of tests/conftest.py in fp32; its LLMConfig is a YAML
    file of its own (an `llm_configs` entry may be a path), with `accelerator_type`, which means
    nothing on CPU. `tiny-qwen3`: a qwen3-shaped model with random weights (`load_format: dummy`)
    in bf16, Serve autoscaled (`num_replicas: auto`, up to two copies: the prefix-aware router)."""
    llama_file = tmp / "tiny-llama.yaml"
    llama_file.write_text(yaml.safe_dump({
        "model_loading_config": {"model_id": LLAMA, "model_source": tiny_llama_dir},
        # A worker actor of its own: test_openai_app kills it.
        "engine_kwargs": {"dtype": "float32", "tensor_parallel_size": 1, "distributed_executor_backend": "ray", **ENGINE},
        "deployment_config": {"num_replicas": 1, "max_ongoing_requests": 64, "health_check_period_s": 1, **ACTOR},
        "placement_group_config": {"bundles": [{"CPU": 0.1}], "strategy": "STRICT_PACK"},
        "accelerator_type": "A10G",
    }))
    qwen = {
        "model_loading_config": {"model_id": QWEN, "model_source": qwen3_dir},
        "engine_kwargs": {"load_format": "dummy", "dtype": "bfloat16", "enable_prefix_caching": True, **ENGINE},
        "deployment_config": {"num_replicas": "auto", "health_check_period_s": 1,
                              "autoscaling_config": {"min_replicas": 1, "max_replicas": 2,
                                                     "target_ongoing_requests": 16}, **ACTOR},
        "placement_group_config": {"bundle_per_worker": {"CPU": 0.1}},
    }
    return {"name": "llm", "route_prefix": "/", "import_path": "actors.app:build_openai_app",
            "args": {"llm_configs": [str(llama_file), qwen], "ingress_deployment_config": ACTOR}}


def lora_app(tiny_llama_dir: str, folders: dict[str, Path]) -> dict:
    """The tiny llama with `engine_kwargs.lora_modules` (sql) and
    `lora_config.dynamic_lora_loading_path` (chat, mlp), two slots, runtime loading from one
    allowed folder."""
    llm = {
        "model_loading_config": {"model_id": LORA_MODEL, "model_source": tiny_llama_dir},
        "engine_kwargs": {"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 128, "block_size": 4,
                          "enable_lora": True, "max_loras": 2, "max_lora_rank": 16,
                          "lora_modules": [{"name": "sql", "path": str(folders["sql"])}],
                          "allow_runtime_lora_updating": True, "allowed_local_lora_paths": [str(folders["runtime"])]},
        "lora_config": {"dynamic_lora_loading_path": str(folders["dynamic"]), "max_num_adapters_per_replica": 8},
        "deployment_config": {"num_replicas": 1, "health_check_period_s": 2, **ACTOR},
        "placement_group_config": {"bundles": [{"CPU": 0.1}]},
    }
    return {"name": "lora", "route_prefix": LORA_PREFIX, "import_path": "actors.app:build_openai_app",
            "args": {"llm_configs": [llm], "ingress_deployment_config": ACTOR}}


def embed_app(model_dir: str) -> dict:
    """A qwen3-shaped embedding model (`task: embed`, mean pooling)."""
    return {"name": "embed", "route_prefix": EMBED_PREFIX, "import_path": "actors.app:build_app",
            "args": {"model": model_dir, "served_model_name": EMBED_MODEL, "task": "embed", "dtype": "float32",
                     "pooler_config": {"pooling_type": "MEAN"}, "max_model_len": 512, "num_kv_blocks": 64,
                     "response_store": {"enabled": False}, **SMALL}}
