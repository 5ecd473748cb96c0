"""The published API's description of itself: OpenAI's error body on every error status.

Bad input is answered 400 (never FastAPI's 422), so the generated schema's 422 entries are
replaced by the statuses the routes really answer: 400 (bad input), 401 (API key), 404 (unknown
model), 500 (an engine bug) and 503 (engine unavailable or its queue full), each with OpenAI's
`{"error": {"message", "type", "param", "code"}}`. The request models carry the enforced
ranges (actors/http/openai_protocol.py), so they are published too.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str  # the HTTP status, or OpenAI's code where it has one ("model_not_found")


class ErrorResponse(BaseModel):
    error: ErrorInfo


class HealthError(ErrorResponse):
    status: str


_ERRORS = {400: "Bad input: a malformed body, a value out of range, an unsupported field (the message names it)",
           401: "Missing or wrong API key (Authorization: Bearer <key>)",
           404: "No model of that name is served (code `model_not_found`)",
           500: "An internal error of the engine (never the client's input)",
           503: "No engine replica can take the request now (starting, failed, or its queue is full)"}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text} for status, text in _ERRORS.items()}
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The answer as JSON, or with `stream: true` a text/event-stream of chunks ending "
                         "in `data: [DONE]`",
          "content": {"text/event-stream": {"schema": {"type": "string"}}}},
    **ERROR_RESPONSES}
HEALTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "Every served model has an engine replica answering: empty body"},
    503: {"model": HealthError, "description": "A model has no engine replica answering (the message names it)"}}


def install_openapi(app: FastAPI) -> None:
    """Serve `app`'s schema without FastAPI's 422 validation responses."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
