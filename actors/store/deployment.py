"""`response-store`: the one owner of the response store, a Serve deployment of one replica.

Every ingress replica, on whatever node, holds a handle to it, so a response stored through
one replica is read through any other. Records cross the handle as JSON bytes. The backend's
calls run on a thread (SQLite blocks), one at a time inside the backend; Serve restarts the
replica if its health check fails, and the database file outlives it (and `serve run`).
"""
from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from ray import serve

from actors.store.base import ResponseStoreConfig, StoredResponse, open_store


@serve.deployment(name="response-store", num_replicas=1, max_ongoing_requests=256, health_check_period_s=10.0)
class ResponseStoreDeployment:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = ResponseStoreConfig.model_validate(config)
        self.store = open_store(self.config)

    async def put(self, record: bytes) -> None:
        data = msgspec.json.decode(record)
        await asyncio.to_thread(self.store.put, StoredResponse.from_json(data))

    async def get(self, response_id: str) -> bytes | None:
        record = await asyncio.to_thread(self.store.get, response_id)
        return None if record is None else msgspec.json.encode(record.to_json())

    async def delete(self, response_id: str) -> bool:
        return await asyncio.to_thread(self.store.delete, response_id)

    async def prune(self) -> int:
        return await asyncio.to_thread(self.store.prune)

    async def check_health(self) -> None:
        await asyncio.to_thread(self.store.get, "")  # raises if the database is gone

    def __del__(self) -> None:
        store = getattr(self, "store", None)
        if store is not None:
            store.close()


def store_deployment(config: ResponseStoreConfig):  # -> ray.serve.Application
    """The bound `response-store` deployment for `config` (enabled), placed as it says."""
    options: dict[str, Any] = {"num_cpus": config.num_cpus}
    if config.resources:
        options["resources"] = dict(config.resources)
    return ResponseStoreDeployment.options(ray_actor_options=options).bind(config.model_dump())
