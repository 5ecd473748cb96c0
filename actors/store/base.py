"""What the response store keeps, how it is configured, and the interface a backend implements.

A stored response is one JSON document (`StoredResponse`): the response object as it was
answered, this request's input items, and the conversation that came before them (`context`:
every earlier turn's input and output items of the `previous_response_id` chain). Each record
is self-contained, so continuing a chain reads one record, and retention may drop any record
without breaking the chains that go on from a later one.

A backend stores and finds records by id and applies the retention limits; it knows nothing of
the Responses API beyond that. To add one (a server database, say), implement `ResponseStore`
in a module of this package and name it in `BACKENDS` (docs/responses.md, "Another database").
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

# backend name -> "module:factory"; the factory takes the ResponseStoreConfig.
BACKENDS = {"sqlite": "actors.store.sqlite:SQLiteResponseStore"}


class ResponseStoreConfig(BaseModel):
    """`response_store` in the deploy file's args (docs/responses.md, docs/deploying.md)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True  # false: nothing is stored; previous_response_id is refused
    backend: Literal["sqlite"] = "sqlite"
    # Default: $LLM_CLUSTER_CACHE/responses, else ~/.cache/llm-cluster/responses, on the node
    # that hosts the store's replica (pin it with `resources` on a multi-node cluster).
    directory: str | None = None
    max_age_s: float | None = Field(default=30 * 24 * 3600.0, gt=0)  # None: kept whatever their age
    max_responses: int | None = Field(default=100_000, ge=1)  # None: no count limit
    num_cpus: float = Field(default=0.05, ge=0)
    resources: dict[str, float] = {}

    def resolved_directory(self) -> Path:
        if self.directory:
            return Path(self.directory).expanduser()
        return Path(os.environ.get("LLM_CLUSTER_CACHE", "~/.cache/llm-cluster")).expanduser() / "responses"


@dataclass
class StoredResponse:
    """One stored response (JSON-able fields only)."""

    id: str
    created_at: float
    response: dict[str, Any]  # the response object as answered
    input_items: list[dict[str, Any]] = field(default_factory=list)  # this request's input, with item ids
    context: list[dict[str, Any]] = field(default_factory=list)  # the chain's earlier items, oldest first

    def conversation(self) -> list[dict[str, Any]]:
        """The items a response continuing this one starts from: everything so far, its output last."""
        return [*self.context, *self.input_items, *self.response.get("output", [])]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "created_at": self.created_at, "response": self.response,
                "input_items": self.input_items, "context": self.context}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "StoredResponse":
        return cls(data["id"], data["created_at"], data["response"], data.get("input_items", []),
                   data.get("context", []))


class ResponseStore(Protocol):
    """A backend. Calls come from one owner (the `response-store` replica), possibly from
    several threads; a backend serializes what it must."""

    def put(self, record: StoredResponse) -> None:
        """Store (or replace) the record, then apply the retention limits."""

    def get(self, response_id: str) -> StoredResponse | None:
        """The record, or None when it is unknown, deleted or past retention."""

    def delete(self, response_id: str) -> bool:
        """True if it was there."""

    def prune(self) -> int:
        """Apply the retention limits now; the number of records dropped."""

    def close(self) -> None: ...


def open_store(config: ResponseStoreConfig) -> ResponseStore:
    """The configured backend, opened."""
    import importlib

    module, _, name = BACKENDS[config.backend].partition(":")
    return getattr(importlib.import_module(module), name)(config)
