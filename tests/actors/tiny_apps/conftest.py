"""The package's one `serve run` (actors.serve_cli) of apps.py's three applications, started by
the first test that asks for it and stopped after the package's last test (scope "package")."""
import shutil
from pathlib import Path

import pytest

from embedding_reference import tiny_qwen3
from fleet_helpers import close_probes, gcs_address, healthy, start_serve, write_deploy
from ray_helpers import free_port, stop_process, wait_for

from .apps import EMBED_PREFIX, LORA_PREFIX, embed_app, lora_app, openai_app


@pytest.fixture(scope="package")
def qwen3_dir(tmp_path_factory, tiny_llama_dir) -> str:
    """A qwen3-shaped config (no weights: served with load_format: dummy) and SmolLM2's tokenizer."""
    from transformers import AutoTokenizer, Qwen3Config

    out = tmp_path_factory.mktemp("tiny-qwen3")
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="package")
def embed_dir(tmp_path_factory, tiny_llama_dir) -> str:
    return tiny_qwen3(tmp_path_factory.mktemp("embed-qwen3"), tiny_llama_dir)


@pytest.fixture(scope="package")
def lora_folders(tmp_path_factory, lora_adapters) -> dict[str, Path]:
    """sql stays where it is (lora_modules); chat and mlp go under the dynamic path."""
    dynamic = tmp_path_factory.mktemp("dynamic-loras")
    for name in ("chat", "mlp"):
        shutil.copytree(lora_adapters[name], dynamic / name)
    # The one folder /v1/load_lora_adapter may load adapters from (allowed_local_lora_paths).
    runtime = tmp_path_factory.mktemp("runtime-loras")
    return {"dynamic": dynamic, "sql": Path(lora_adapters["sql"]), "runtime": runtime}


@pytest.fixture(scope="package")
def served(tmp_path_factory, tiny_llama_dir, qwen3_dir, embed_dir, lora_folders) -> dict:
    """{"base": the endpoint (the `llm` application at its root), "metrics": Ray's Prometheus
    endpoint, "gcs": the cluster's address}; the other applications answer under their prefixes."""
    tmp = tmp_path_factory.mktemp("tiny-apps")
    http_port, metrics_port = free_port(), free_port()
    deploy = write_deploy(tmp / "deploy.yaml", http_port, [
        openai_app(tmp, tiny_llama_dir, qwen3_dir), lora_app(tiny_llama_dir, lora_folders), embed_app(embed_dir)])
    log = tmp / "serve.log"
    proc = start_serve(deploy, log, LLM_CLUSTER_METRICS_PORT=str(metrics_port), RAY_metrics_report_interval_ms="1000")
    base = f"http://127.0.0.1:{http_port}"
    try:
        for prefix in ("", LORA_PREFIX, EMBED_PREFIX):
            wait_for(lambda: healthy(f"{base}{prefix}/health"), 600, f"the application at {prefix or '/'} to be healthy",
                     proc, log)
        yield {"base": base, "metrics": f"http://127.0.0.1:{metrics_port}/metrics", "gcs": gcs_address(log)}
    finally:
        close_probes()
        stop_process(proc)
