"""`/v1/embeddings` through `serve run` (issue 42): an embedding model served with the short deploy
form (`task: embed`, mean pooling; the `embed` application of the package's `serve run`, apps.py
`embed_app`), driven by the OpenAI SDK and LangChain's OpenAIEmbeddings; the vectors equal
transformers' (tests/embedding_reference.py). The model refuses generation with a 400 naming
`model`, and its bad inputs are 400s that leave the engine as it was."""
import base64
import struct

import openai
import pytest
import requests
from embedding_reference import max_diff, reference

from .apps import EMBED_MODEL as MODEL
from .apps import EMBED_PREFIX

TEXTS = ["Paris is the capital of France.", "Vectors for retrieval.", "A third, slightly longer sentence here."]


@pytest.fixture(scope="module")
def model_dir(embed_dir) -> str:
    return embed_dir


@pytest.fixture(scope="module")
def server(served) -> str:
    return served["base"] + EMBED_PREFIX


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def want(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return reference(model_dir, [tok.encode(t) for t in TEXTS], "MEAN")


def test_the_openai_sdk_gets_transformers_vectors_as_floats_and_base64(client, want):
    out = client.embeddings.create(model=MODEL, input=TEXTS)
    assert [d.index for d in out.data] == [0, 1, 2] and out.model == MODEL
    assert max_diff([d.embedding for d in out.data], want) < 1e-5
    assert out.usage.prompt_tokens == out.usage.total_tokens > 0
    # Asked for explicitly, base64 comes back as the string: little-endian float32.
    packed = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="base64")
    blobs = [base64.b64decode(d.embedding) for d in packed.data]
    assert max_diff([list(struct.unpack(f"<{len(b) // 4}f", b)) for b in blobs], want) < 1e-5


def test_token_ids_dimensions_and_one_by_one_alike(client, model_dir, want):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir).encode(TEXTS[1])
    by_ids = client.embeddings.create(model=MODEL, input=ids).data[0].embedding
    assert max_diff([by_ids], want[1:2]) < 1e-5
    cut = client.embeddings.create(model=MODEL, input=TEXTS, dimensions=16).data
    assert max_diff([d.embedding for d in cut], reference(model_dir, [AutoTokenizer.from_pretrained(model_dir).encode(t)
                                                                      for t in TEXTS], "MEAN", dimensions=16)) < 1e-5


def test_langchain_openai_embeddings(server, want):
    from langchain_openai import OpenAIEmbeddings

    # check_embedding_ctx_length=False: send the texts (its default tokenizes with tiktoken's
    # OpenAI vocabularies, a download, and sends their ids).
    emb = OpenAIEmbeddings(model=MODEL, base_url=server + "/v1", api_key="unused", check_embedding_ctx_length=False)
    assert max_diff(emb.embed_documents(TEXTS), want) < 1e-5
    assert max_diff([emb.embed_query(TEXTS[2])], want[2:]) < 1e-5


def test_generation_and_bad_input_are_400s_that_change_nothing(client, server):
    before = requests.get(server + "/engine/stats", timeout=30).json()
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.value.body["param"] == "model" and "task: embed" in chat.value.body["message"]
    for bad, param in (({"input": []}, "input"), ({"input": "x", "dimensions": 65}, "dimensions"),
                       ({"input": "x", "encoding_format": "int8"}, None)):
        r = requests.post(server + "/v1/embeddings", json={"model": MODEL, **bad}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["message"], r.text
        if param:
            assert r.json()["error"]["param"] == param
    after = requests.get(server + "/engine/stats", timeout=30).json()
    assert after["num_unfinished"] == 0 and after["num_free_blocks"] == after["num_blocks"]
    assert after["prompt_tokens"] == before["prompt_tokens"]
