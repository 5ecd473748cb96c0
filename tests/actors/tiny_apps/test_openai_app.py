"""Several models in one app, the deploy file written as Ray Serve LLM's docs write it, end to end.

The `llm` application of the package's `serve run` (apps.py `openai_app`): `import_path:
actors.app:build_openai_app` with `args.llm_configs` (the only change from a Ray Serve LLM file is
the import path): two models behind one OpenAI endpoint, each with its own engine deployment,
router and placement, driven by the `openai` SDK.

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

from fleet_helpers import healthy, metric_sum, probe, scrape
from ray_helpers import wait_for

from .apps import LLAMA, QWEN

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def app(served) -> dict:
    return served


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
