"""Several models in one app, the deploy file written as Ray Serve LLM's docs write it, end to end.

One `serve run` (actors.serve_cli) of `import_path: actors.app:build_openai_app` with
`args.llm_configs` (the only change from a Ray Serve LLM file is the import path): two models
behind one OpenAI endpoint, each with its own engine deployment, router and placement, driven
by the `openai` SDK.

- `tiny-llama`: the random-weight llama of tests/conftest.py in fp32; its LLMConfig is a YAML
  file of its own (an `llm_configs` entry may be a path), with `accelerator_type`, which means
  nothing on CPU.
- `tiny-qwen3`: a qwen3-shaped model with random weights (`load_format: dummy`) in bf16, Serve
  autoscaled (`num_replicas: auto`, up to two copies: the prefix-aware router).
"""
import time

import openai
import pytest
import requests
import yaml

from fleet_helpers import close_probes, gcs_address, healthy, metric_sum, probe, scrape, start_serve, write_deploy
from ray_helpers import free_port, stop_process, wait_for

LLAMA, QWEN = "tiny-llama", "tiny-qwen3"
PROMPT = "The capital of France is"
# Logical CPUs are a budget, not cores: small reservations let both models fit a 2-core machine.
ACTOR = {"ray_actor_options": {"num_cpus": 0.05}}
ENGINE = {"max_model_len": 512, "num_kv_blocks": 64, "max_num_seqs": 16}


@pytest.fixture(scope="module")
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


@pytest.fixture(scope="module")
def app(tmp_path_factory, tiny_llama_dir, qwen3_dir):
    tmp = tmp_path_factory.mktemp("openai-app")
    http_port, metrics_port = free_port(), free_port()
    llama_file = tmp / "tiny-llama.yaml"
    llama_file.write_text(yaml.safe_dump({
        "model_loading_config": {"model_id": LLAMA, "model_source": tiny_llama_dir},
        "engine_kwargs": {"dtype": "float32", "tensor_parallel_size": 1, **ENGINE},
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
    deploy = write_deploy(tmp / "deploy.yaml", http_port, [{
        "name": "llm", "route_prefix": "/", "import_path": "actors.app:build_openai_app",
        "args": {"llm_configs": [str(llama_file), qwen], "ingress_deployment_config": ACTOR}}])
    log = tmp / "serve.log"
    proc = start_serve(deploy, log, LLM_CLUSTER_METRICS_PORT=str(metrics_port), RAY_metrics_report_interval_ms="1000")
    base = f"http://127.0.0.1:{http_port}"
    try:
        wait_for(lambda: healthy(f"{base}/health"), 600, "both models to be healthy", proc, log)
        yield {"base": base, "metrics": f"http://127.0.0.1:{metrics_port}/metrics", "gcs": gcs_address(log)}
    finally:
        close_probes()
        stop_process(proc)


@pytest.fixture(scope="module")
def client(app):
    return openai.OpenAI(base_url=app["base"] + "/v1", api_key="unused", max_retries=0, timeout=120)


def _stats(app, model: str) -> dict:
    r = requests.get(app["base"] + "/engine/stats", params={"model": model}, timeout=30)
    r.raise_for_status()
    return r.json()


def _offline_text(model_dir: str, **engine) -> str:
    from cluster import LLM, SamplingParams

    llm = LLM(model_dir, num_kv_blocks=64, max_model_len=512, **engine)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text


def test_models_lists_both_and_each_model_answers_from_its_own_engine(app, client, tiny_llama_dir, qwen3_dir):
    assert [m.id for m in client.models.list().data] == [LLAMA, QWEN]
    assert client.models.retrieve(QWEN).id == QWEN
    expected = {LLAMA: _offline_text(tiny_llama_dir, dtype="float32"),
                QWEN: _offline_text(qwen3_dir, dtype="bfloat16", load_format="dummy")}
    assert expected[LLAMA] != expected[QWEN]  # different weights: the text tells which model answered
    for model, other in ((LLAMA, QWEN), (QWEN, LLAMA)):
        before = {m: _stats(app, m)["prompt_tokens"] for m in (model, other)}
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert (out.model, out.choices[0].text, out.usage.completion_tokens) == (model, expected[model], 8)
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
        assert chat.model == model and chat.usage.completion_tokens == 4
        # Both requests were prefilled by this model's engine, none by the other's.
        assert _stats(app, model)["prompt_tokens"] >= before[model] + out.usage.prompt_tokens
        assert _stats(app, other)["prompt_tokens"] == before[other]


def test_a_model_nobody_serves_is_openais_404_model_not_found(app, client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "Hi"}])
    assert err.value.status_code == 404 and err.value.code == "model_not_found" and LLAMA in err.value.message
    r = requests.get(app["base"] + "/v1/models/no-such-model", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = requests.post(app["base"] + "/v1/completions", json={"model": "no-such-model", "prompt": "x"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_every_series_carries_its_models_label(app, client):
    for model in (LLAMA, QWEN):
        client.completions.create(model=model, prompt="metrics", max_tokens=2, extra_body={"ignore_eos": True})

    def labelled():
        text = scrape(app["metrics"])
        return all(metric_sum(text, name, model=m) > 0 for m in (LLAMA, QWEN)
                   for name in ("ray_llm_generation_tokens_total", "ray_llm_time_to_first_token_seconds_count"))

    wait_for(labelled, 60, "engine and ingress series of both models, labelled `model`")


def test_killing_one_models_worker_leaves_the_other_model_answering(app, client):
    gcs, deployment = app["gcs"], f"engine:{LLAMA}"
    (victim,) = probe(gcs, "replicas", "llm", deployment)
    assert probe(gcs, "kill-worker", f"engine-{victim}", "0") == "dead"
    for i in range(4):  # right after the kill, while tiny-llama's copy is failing or being replaced
        start = time.monotonic()
        out = client.completions.create(model=QWEN, prompt=f"still here {i}", max_tokens=4,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4 and time.monotonic() - start < 30
    # Serve replaces the broken copy (a fresh one, fresh workers) and tiny-llama answers again.
    wait_for(lambda: victim not in probe(gcs, "replicas", "llm", deployment), 120, "the broken copy to go")

    def llama_answers():
        r = requests.post(app["base"] + "/v1/completions", json={"model": LLAMA, "prompt": PROMPT, "max_tokens": 2},
                          timeout=60)
        return r.status_code == 200

    wait_for(llama_answers, 180, "tiny-llama to answer again")
    assert healthy(app["base"] + "/health")
