"""The ingress's request body limit, as ASGI middleware.

Routes keep their typed pydantic bodies (and so their OpenAPI schema) while a body past the
limit is refused before anything parses it: at once from its Content-Length, or, for a
chunked upload, as soon as that many bytes have arrived.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from actors.http.openai_protocol import OpenAIError

# Set once per process by the Ingress replica from its config. A module global, not app state:
# Serve copies the FastAPI app (and pickles the deployment class) before the replica starts.
_max_body_bytes: int | None = None


def set_max_body_bytes(limit: int | None) -> None:
    global _max_body_bytes
    _max_body_bytes = limit


def too_large(limit: int) -> OpenAIError:
    return OpenAIError(400, f"the request body is larger than this server accepts "
                            f"(max_request_body_bytes={limit})")


class BodyLimitMiddleware:
    """Refuses bodies past `set_max_body_bytes` (None: no limit), read per request."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        limit = _max_body_bytes if scope["type"] == "http" else None
        if limit is None:
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            return await answer(send, too_large(limit))
        received, refused = 0, False

        async def counted() -> dict:
            nonlocal received, refused
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit and not refused:
                # Answer now; the app sees the client leave and its own answer is dropped.
                refused = True
                await answer(send, too_large(limit))
            return {"type": "http.disconnect"} if refused else message

        async def guarded(message: dict) -> None:
            if not refused:
                await send(message)

        await self.app(scope, counted, guarded)


async def answer(send: Callable, error: OpenAIError, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    """Answer an ASGI request with the error's JSON (from a middleware, before the app runs)."""
    body = msgspec.json.encode(error.body())
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})
