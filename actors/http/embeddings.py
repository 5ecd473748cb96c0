"""`POST /v1/embeddings` (OpenAI's shape, as vLLM serves it for embedding models).

`input` is a string, a list of strings, a list of token ids or a list of such lists; each is one
engine request (the prompts of one call share one scheduling group), pooled on rank 0 as the
model's `pooler_config` says and finished here (cluster/pooling.py: `dimensions`, then
normalization). `encoding_format: base64` packs each vector as little-endian float32, as
OpenAI's SDK expects. Only a model served with `task: embed` answers; any other gets a 400
naming `model`, as an embedding model does for generation (actors/http/served.py).
"""
from __future__ import annotations

import base64
import struct
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from actors.http.openai_protocol import OpenAIError
from actors.http.served import Target
from cluster.pooling import PoolingParams, check_pooling_params, embedding
from cluster.sampling_params import SamplingParams


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # as OpenAI and vLLM: fields SDKs send and we do not use

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    priority: int = 0  # vLLM's


def inputs(body: EmbeddingRequest) -> list[str | list[int]]:
    """The request's prompts: each a string or a list of token ids."""
    x = body.input
    if isinstance(x, str):
        return [x]
    if not x:
        raise OpenAIError(400, "input must not be empty", "input")
    if all(isinstance(t, int) for t in x):
        return [list(x)]
    return list(x)


async def create(body: EmbeddingRequest, target: Target, arrival: float) -> dict:
    """The whole `/v1/embeddings` answer (OpenAIError 400 for a model or input it cannot serve)."""
    m = target.model
    mc = m.config.model_config
    if mc.task != "embed":
        raise OpenAIError(400, f"model `{target.name}` does not serve embeddings (its task is {mc.task!r}; "
                               "serve an embedding model with task: embed)", "model")
    params = PoolingParams(dimensions=body.dimensions)
    try:
        check_pooling_params(params, mc.hf_config.hidden_size)
    except ValueError as exc:
        raise OpenAIError(400, str(exc), "dimensions") from exc
    rid = f"embd-{uuid.uuid4().hex}"
    prompts = []
    for i, x in enumerate(inputs(body)):
        ids = m.encode(x, True) if isinstance(x, str) else x
        prompts.append(m.prepare(f"{rid}-{i}", None, ids, SamplingParams(max_tokens=1, detokenize=False),
                                 body.priority, arrival, target.lora, task="embed"))
    await m.streams.start(prompts, body.priority, rid if len(prompts) > 1 else None)
    pooled = await m.streams.pooled(prompts)
    vectors = [embedding(v, params, mc.pooler_config) for v in pooled]
    tokens = sum(len(p.token_ids) for p in prompts)
    return {"object": "list", "model": target.name, "created": int(time.time()),
            "data": [{"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encode(vec: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return vec
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
