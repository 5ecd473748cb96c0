"""The Responses API routes' work: `POST /v1/responses` on the chat path, and the stored
responses (`GET /v1/responses/{id}`, `GET .../input_items`, `DELETE`).

`create` turns the request into a chat request (actors/http/responses.py), continuing the
conversation stored under `previous_response_id` when one is given, and runs it exactly as the
chat route does: the model's chat template and tool prompt, the forced-call grammars, the
engine's entry checks (`ServedModel.prepare`), then `EngineStreams`, which aborts the request
in the engine (freeing its KV blocks) when the client goes away. The output becomes Responses
items and events (actors/http/responses_format.py); a `store`d response is written to the
`response-store` deployment (actors/store/) before its last event or its JSON is sent, so a
client that has the answer can always continue from it.

The continued prompt is the whole conversation through the chat template, as if the client
had sent it again: earlier turns render to the same tokens they had, so the blocks of the
earlier prompt (and of its answer, when the answer re-tokenizes to the tokens generated) are
prefix-cache hits, and the answer is the one a client re-sending the conversation would get.

Bad input is a 400 (an unknown `previous_response_id` a 404) before anything is queued or
stored; a store that cannot be reached is a 503, never the client's fault.
"""
from __future__ import annotations

import logging
from typing import Any, AsyncIterator

import msgspec
from fastapi.responses import Response, StreamingResponse

from actors.http.chat_parsers import ChatParsing
from actors.http.openai_protocol import OpenAIError, chat_params, chat_tools
from actors.http.responses import ResponsesRequest, new_id, to_chat, translate_error
from actors.http.responses_format import ResponseBuilder, request_echo, response_usage
from actors.http.prompt import PromptState
from actors.http.streams import engine_error
from actors.store.base import StoredResponse

logger = logging.getLogger("ray.serve")
REPLICA_HEADER = "x-llm-cluster-replica"


class ResponseStoreClient:
    """The ingress's side of the `response-store` deployment (None: the store is off)."""

    def __init__(self, handle: Any | None) -> None:
        self.handle = handle

    @property
    def enabled(self) -> bool:
        return self.handle is not None

    async def get(self, response_id: str) -> StoredResponse | None:
        if self.handle is None:
            return None
        data = await self._call(self.handle.get.remote(response_id))
        return None if data is None else StoredResponse.from_json(msgspec.json.decode(data))

    async def put(self, record: StoredResponse) -> None:
        await self._call(self.handle.put.remote(msgspec.json.encode(record.to_json())))

    async def delete(self, response_id: str) -> bool:
        return False if self.handle is None else await self._call(self.handle.delete.remote(response_id))

    @staticmethod
    async def _call(call: Any) -> Any:
        try:
            return await call
        except Exception as exc:
            logger.error("response store call failed: %r", exc)
            raise OpenAIError(503, f"the response store is unavailable: {engine_error(exc).message}") from exc


class ResponsesAPI:
    """The Responses routes of one ingress replica. Their answers name the replica in the
    `x-llm-cluster-replica` header (which replica stored or read a response)."""

    def __init__(self, store_handle: Any | None) -> None:
        self.store = ResponseStoreClient(store_handle)
        self.headers = {REPLICA_HEADER: _replica_id()}

    # ---- POST /v1/responses ------------------------------------------------------------------
    async def create(self, req: ResponsesRequest, target: Any, arrival: float) -> Response:
        """`target`: the served model (actors/http/served.py `Target`) the request names."""
        m = target.model
        previous = await self._previous(req.previous_response_id)
        context = previous.conversation() if previous is not None else []
        try:
            t = to_chat(req, context, m.config.reasoning_config is not None)
            tools = chat_tools(t.chat)
            params = chat_params(t.chat, tools)
            kwargs = dict(t.chat.chat_template_kwargs or {})
            if tools is not None and tools.choice != "none":
                kwargs["tools"] = t.chat.tools
            ids = m.chat_ids(t.chat.messages, True, kwargs)
            rid = new_id("resp")
            prompts = [m.prepare(rid, None, ids, params, t.chat.priority, arrival, target.lora)]
        except OpenAIError as exc:
            raise translate_error(exc) from None
        store = self.store.enabled and req.store is not False
        parsing = ChatParsing.for_request(m.config, tools, m.tool_call_parser)
        builder = ResponseBuilder(rid, request_echo(target.name, req, t, store),
                                  parsing.choice(ids) if parsing is not None else None)
        run = _Run(builder, prompts, parsing, StoredResponse(rid, builder.created_at, {}, t.input_items, context)
                   if store else None)
        await m.streams.start(prompts, t.chat.priority)
        if req.stream:
            return StreamingResponse(self._events(m, run), media_type="text/event-stream", headers=self.headers)
        return await self._collect(m, run)

    async def _previous(self, response_id: str | None) -> StoredResponse | None:
        if response_id is None:
            return None
        if not self.store.enabled:
            raise OpenAIError(400, "previous_response_id needs the response store, which this server has turned off "
                                   "(send the whole conversation as input instead)", "previous_response_id")
        record = await self.store.get(response_id)
        if record is None:
            raise OpenAIError(404, f"Previous response with id '{response_id}' not found.", "previous_response_id")
        return record

    async def _collect(self, m: Any, run: "_Run") -> Response:
        await m.streams.whole(run.prompts)  # sent again if its engine copy fails meanwhile
        run.feed_whole()
        run.finish()
        if run.response["status"] == "failed":
            raise OpenAIError(500, run.response["error"]["message"])
        await self._save(run)
        return Response(msgspec.json.encode(run.response), media_type="application/json", headers=self.headers)

    async def _events(self, m: Any, run: "_Run") -> AsyncIterator[bytes]:
        try:
            for event in run.builder.start():
                yield _sse(event)
            async for _, out in m.streams.follow(run.prompts):
                for event in run.feed(out):
                    yield _sse(event)
            for event in run.finish():
                yield _sse(event)
            if run.response["status"] != "failed":
                await self._save(run)
            yield _sse(run.builder.terminal(run.response))
        except Exception as exc:  # headers are sent: report in-band, as OpenAI does
            for event in run.builder.failed(engine_error(exc).message):
                yield _sse(event)
        finally:
            m.streams.cancel(run.prompts)  # the client gone (or done): abort what the engine still runs

    async def _save(self, run: "_Run") -> None:
        if run.record is not None:
            run.record.response = run.response
            await self.store.put(run.record)

    # ---- the stored responses ----------------------------------------------------------------
    async def retrieve(self, response_id: str) -> Response:
        record = await self._stored(response_id)
        return Response(msgspec.json.encode(record.response), media_type="application/json", headers=self.headers)

    async def input_items(self, response_id: str, limit: int = 20, order: str = "desc", after: str | None = None,
                          before: str | None = None) -> dict[str, Any]:
        """The items the response was generated from (earlier turns' too), paginated as OpenAI's lists."""
        if not 1 <= limit <= 100:
            raise OpenAIError(400, f"limit must be between 1 and 100, got {limit}", "limit")
        if order not in ("asc", "desc"):
            raise OpenAIError(400, f"order must be 'asc' or 'desc', got {order!r}", "order")
        record = await self._stored(response_id)
        items = [*record.context, *record.input_items]
        if order == "desc":
            items.reverse()
        items = _page(items, after, before)
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}

    async def delete(self, response_id: str) -> dict[str, Any]:
        if not await self.store.delete(response_id):
            raise _not_found(response_id, self.store.enabled)
        return {"id": response_id, "object": "response", "deleted": True}

    async def _stored(self, response_id: str) -> StoredResponse:
        record = await self.store.get(response_id)
        if record is None:
            raise _not_found(response_id, self.store.enabled)
        return record


class _Run:
    """One request in flight: its builder, its prompt, and the record to store (None: not stored)."""

    def __init__(self, builder: ResponseBuilder, prompts: list[PromptState], parsing: ChatParsing | None,
                 record: StoredResponse | None) -> None:
        self.builder, self.prompts, self.parsing, self.record = builder, prompts, parsing, record
        self.response: dict[str, Any] = {}

    def feed(self, out: Any) -> list[dict[str, Any]]:
        c = out.outputs[0]
        if out.error and c.finish_reason == "error":
            raise OpenAIError(500, out.error)
        return self.builder.feed(c.text_delta, final=c.finish_reason is not None)

    def feed_whole(self) -> None:
        """The finished answer's text at once (a whole response: no event was sent)."""
        out = self.prompts[0].final
        c = out.outputs[0]
        if out.error and c.finish_reason == "error":
            raise OpenAIError(500, out.error)
        self.builder.feed(c.text, final=True)

    def finish(self) -> list[dict[str, Any]]:
        """Close the output; `self.response` becomes the final object."""
        p = self.prompts[0]
        c = p.final.outputs[0]
        events = self.builder.finish(c.finish_reason)
        if c.finish_reason not in ("stop", "length"):  # an engine error or abort
            message = p.final.error or f"the request ended with finish_reason {c.finish_reason!r}"
            self.response = self.builder.response("failed", error={"code": "server_error", "message": message})
            return events
        reasoning = self.parsing.reasoning_tokens(p.token_ids, c.token_ids) if self.parsing is not None else 0
        self.response = self.builder.response(self.builder.final_status(c.finish_reason),
                                              response_usage(len(p.token_ids), len(c.token_ids),
                                                             p.final.num_cached_tokens, reasoning))
        return events


def _page(items: list[dict[str, Any]], after: str | None, before: str | None) -> list[dict[str, Any]]:
    ids = [item.get("id") for item in items]
    for cursor, name in ((after, "after"), (before, "before")):
        if cursor is not None and cursor not in ids:
            raise OpenAIError(400, f"{name}: no item {cursor!r} in this response's input items", name)
    start = ids.index(after) + 1 if after is not None else 0
    end = ids.index(before) if before is not None else len(items)
    return items[start:end]


def _not_found(response_id: str, enabled: bool) -> OpenAIError:
    why = "" if enabled else " (this server does not store responses)"
    return OpenAIError(404, f"Response with id '{response_id}' not found{why}.", "response_id")


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Serve replica (tests without Ray)
        return "local"


def _sse(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"
