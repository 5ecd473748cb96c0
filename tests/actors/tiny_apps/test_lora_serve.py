"""LoRA adapters through `serve run` and the OpenAI SDK, the deploy file in Ray Serve LLM's form:
the `lora` application of the package's `serve run` (apps.py `lora_app`), one tiny llama with
`engine_kwargs.lora_modules` (sql) and `lora_config.dynamic_lora_loading_path` (chat, mlp, read on
first use), two slots for three adapters. Tokens are held to HF transformers + peft
(tests/lora_cases.py) for requests naming `<model>:<adapter>` (Ray Serve LLM's form) and
`<adapter>` (vLLM's), sent together with base-model requests; vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter, turned on with one allowed folder (`allowed_local_lora_paths`; folders
elsewhere are refused: tests/actors/test_lora_updates.py has the rest, runtime loading off
included); bad names and folders."""
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import requests

from lora_cases import NUM_TOKENS, PROMPTS

from .apps import LORA_MODEL as MODEL
from .apps import LORA_PREFIX


@pytest.fixture(scope="module")
def folders(lora_folders) -> dict[str, Path]:
    return lora_folders


@pytest.fixture(scope="module")
def app(served) -> str:
    return served["base"] + LORA_PREFIX


@pytest.fixture(scope="module")
def client(app):
    return openai.OpenAI(base_url=app + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def expected(tiny_llama_dir, lora_adapters, lora_reference) -> dict[str | None, list[str]]:
    """The text of each reference: the offline engine's text for the same tokens, once its tokens
    are checked against HF + peft (the served text is compared with this)."""
    from cluster import LLM, SamplingParams
    from cluster.lora import LoRARequest

    llm = LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=64, block_size=4, max_model_len=256,
              enable_lora=True, max_loras=3, lora_modules=lora_adapters)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    texts = {}
    for adapter in (None, *lora_adapters):
        lora = None if adapter is None else LoRARequest(adapter)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False, lora_request=lora)
        assert [o.outputs[0].token_ids for o in outs] == lora_reference[adapter]
        texts[adapter] = [o.outputs[0].text for o in outs]
    return texts


def _text(client, model: str, prompt: list[int]) -> str:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=NUM_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.model == model and out.usage.completion_tokens == NUM_TOKENS
    return out.choices[0].text


def _stats(app: str) -> dict:
    r = requests.get(app + "/engine/stats", params={"model": MODEL}, timeout=30)
    r.raise_for_status()
    return r.json()


def _load(app: str, name: str, path: Path | str) -> requests.Response:
    return requests.post(app + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}, timeout=60)


def test_models_lists_the_adapters_with_their_parent(client, folders):
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == [MODEL, "sql", "chat", "mlp"]
    for name in ("sql", "chat", "mlp"):
        assert cards[name].parent == MODEL
    assert cards["sql"].root == str(folders["sql"]) and cards["chat"].root == str(folders["dynamic"] / "chat")
    assert client.models.retrieve(f"{MODEL}:mlp").parent == MODEL


def test_adapters_and_the_base_in_one_batch_match_peft(app, client, expected):
    # Both naming forms, all three adapters (two slots) and the base, sent at once.
    cases = [(model, adapter, i) for i in range(len(PROMPTS))
             for model, adapter in ((MODEL, None), (f"{MODEL}:sql", "sql"), ("chat", "chat"), (f"{MODEL}:mlp", "mlp"))]
    with ThreadPoolExecutor(len(cases)) as pool:
        got = list(pool.map(lambda c: _text(client, c[0], PROMPTS[c[2]]), cases))
    assert got == [expected[adapter][i] for _, adapter, i in cases]
    assert len({expected[a][0] for a in expected}) == len(expected)  # the text tells which adapter ran
    stats = _stats(app)
    assert stats["lora_requests"] == {"sql": 3, "chat": 3, "mlp": 3}
    assert len(stats["lora_resident"]) == 2 and stats["lora_slot_loads"] >= 3
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_unfinished"] == 0


def test_unknown_adapters_are_404_model_not_found(client):
    for name in (f"{MODEL}:nope", "nope", "nope:sql"):
        with pytest.raises(openai.NotFoundError) as err:
            client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=2)
        assert err.value.code == "model_not_found" and name in err.value.message


def test_load_and_unload_lora_adapter(app, client, folders, expected):
    root = folders["runtime"]  # the allowed folder
    copy = root / "sql-copy"
    shutil.copytree(folders["sql"], copy)
    r = requests.post(app + "/v1/load_lora_adapter", json={"lora_name": "sql2", "lora_path": str(copy)}, timeout=60)
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'sql2' added successfully.")
    assert _text(client, "sql2", PROMPTS[1]) == expected["sql"][1]
    again = requests.post(app + "/v1/load_lora_adapter", json={"lora_name": "sql2", "lora_path": str(copy)}, timeout=60)
    assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]

    corrupt = root / "corrupt"
    shutil.copytree(folders["sql"], corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\0" * 32)
    bad = requests.post(app + "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(corrupt)}, timeout=60)
    assert bad.status_code == 400 and "cannot be read" in bad.json()["error"]["message"]
    assert "bad" not in {m.id for m in client.models.list().data}

    r = requests.post(app + "/v1/unload_lora_adapter", json={"lora_name": "sql2"}, timeout=60)
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'sql2' removed successfully.")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="sql2", prompt=PROMPTS[0], max_tokens=2)
    gone = requests.post(app + "/v1/unload_lora_adapter", json={"lora_name": "sql2"}, timeout=60)
    assert gone.status_code == 404 and "cannot be found" in gone.json()["error"]["message"]
    # The rest kept serving throughout.
    assert _text(client, f"{MODEL}:chat", PROMPTS[2]) == expected["chat"][2]
    stats = _stats(app)
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_unfinished"] == 0


def test_load_lora_adapter_refuses_folders_outside_the_allowed_one(app, client, folders):
    """A real adapter outside allowed_local_lora_paths, reached directly, by `..` from inside it, or
    through a symlink inside it: a 400 naming the allowed folder and nothing of the path."""
    root = folders["runtime"]
    link = root / "link-to-sql"
    link.symlink_to(folders["sql"])
    allowed = str(root.resolve())
    for name, path in (("direct", folders["sql"]), ("dotdot", f"{root}/{os.path.relpath(folders['sql'], root)}"),
                       ("link", link), ("missing", folders["sql"].parent / "no-such-folder")):
        r = _load(app, name, path)
        assert r.status_code == 400, (name, r.text)
        error = r.json()["error"]
        assert error["param"] == "lora_path" and allowed in error["message"], error
        assert "allowed_local_lora_paths" in error["message"] and str(folders["sql"]) not in error["message"]
        assert "no-such-folder" not in error["message"] and "link-to-sql" not in error["message"]
    assert {m.id for m in client.models.list().data} == {MODEL, "sql", "chat", "mlp"}
    # Inside the folder, a symlink to another folder inside it works as the folder itself.
    shutil.copytree(folders["sql"], root / "sql-inside")
    (root / "alias").symlink_to(root / "sql-inside")
    r = _load(app, "aliased", root / "alias")
    assert r.status_code == 200, r.text
    cards = {m.id: m for m in client.models.list().data}
    assert cards["aliased"].root == str((root / "sql-inside").resolve())  # the folder checked is the one read
    assert requests.post(app + "/v1/unload_lora_adapter", json={"lora_name": "aliased"}, timeout=60).status_code == 200
