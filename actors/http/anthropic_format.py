"""Anthropic's Messages API answer: the message object, its stream events, its errors.

`MessageBuilder` follows one generation. Each output delta goes through the chat path's parser
(`ChoiceParser`: reasoning split, then tool calls) and the pieces become content blocks in the
order they appear: `thinking` (with an empty `signature`: nothing here signs thinking), `text`,
`tool_use` (`toolu_...` ids). Every change is also an event: `content_block_start`,
`content_block_delta` (`thinking_delta`, `text_delta`, `input_json_delta`), `content_block_stop`,
between `message_start` (plus one `ping`) and `message_delta` + `message_stop`. The whole
(non-streamed) answer is the same builder fed the whole text at once, its events dropped.

A tool call cut by `max_tokens` is not a call: its `input_json_delta`s were streamed, but the
whole answer leaves its block out (every returned `input` is a complete JSON object) and the
stop reason is `max_tokens`.
"""
from __future__ import annotations

import uuid
from typing import Any

import msgspec

from actors.http.chat_parsers import ChatParsing, ChoiceParser
from actors.http.openai_protocol import OpenAIError
from actors.http.prompt import PromptState
from cluster.outputs import CompletionOutput

Event = dict[str, Any]
# HTTP status -> Anthropic's error type (its documented pairs; 408 is the engine's request deadline).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 529: "overloaded_error"}
OVERLOADED = 529  # Anthropic's status for "busy now, retry": the SDK's OverloadedError


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


# ---- errors ----------------------------------------------------------------------------------
def error_status(exc: OpenAIError) -> int:
    """A 503 that asks to retry later (a full queue, a queue deadline) is Anthropic's 529;
    one without Retry-After (no engine replica) stays 503."""
    return OVERLOADED if exc.status == 503 and (exc.headers or {}).get("Retry-After") else exc.status


def error_body(exc: OpenAIError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(exc.status, "api_error"), "message": exc.message}}


def sse(event: Event) -> bytes:
    """One event as Anthropic writes it: `event: <type>` then `data: <json>`."""
    return b"event: " + event["type"].encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"


# ---- the stop reason -------------------------------------------------------------------------
def stop_reason(c: CompletionOutput, made_calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished completion: a stop string is one of the
    request's `stop_sequences` (the engine adds none of its own)."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return ("tool_use" if made_calls else "end_turn"), None


def _tool_input(arguments: str) -> dict[str, Any] | None:
    """A call's arguments as its `input`, or None when they are not a whole JSON object (cut)."""
    try:
        value = msgspec.json.decode(arguments)
    except msgspec.DecodeError:
        return None
    return value if isinstance(value, dict) else None


class MessageBuilder:
    """One message's content blocks and events. `parser`: the choice's chat parser, or None when
    there is nothing to parse (the text is the answer)."""

    def __init__(self, message_id: str, model: str, parser: ChoiceParser | None, input_tokens: int) -> None:
        self.id, self.model, self.parser, self.input_tokens = message_id, model, parser, input_tokens
        self.blocks: list[dict[str, Any]] = []
        self.arguments: dict[int, str] = {}  # tool_use block index -> its arguments so far
        self.calls: dict[int, int] = {}  # the parser's call index -> block index
        self.open: int | None = None
        self.stop: tuple[str, str | None] | None = None
        self.output_tokens = 0

    # ---- the lifecycle ---------------------------------------------------------------------
    def start(self) -> list[Event]:
        return [{"type": "message_start", "message": self._message([], None)}, {"type": "ping"}]

    def feed(self, text: str, final: bool) -> list[Event]:
        """Events for one output delta (`final`: the generation has ended)."""
        if self.parser is None:
            return self._delta("text", text)
        delta = self.parser.delta(text, final)
        events = self._delta("thinking", delta.get("reasoning_content") or "")
        events += self._delta("text", delta.get("content") or "")
        for call in delta.get("tool_calls") or []:
            events += self._call(call)
        return events

    def finish(self, c: CompletionOutput) -> list[Event]:
        """Close the open block; the message's stop reason and usage. `c`: the final output."""
        if c.finish_reason not in ("stop", "length"):  # an abort or an engine error
            raise OpenAIError(500, f"the request ended with finish_reason {c.finish_reason!r}")
        events = self._close()
        made_calls = any(self._complete(i) for i, b in enumerate(self.blocks) if b["type"] == "tool_use")
        self.stop, self.output_tokens = stop_reason(c, made_calls), len(c.token_ids)
        delta = {"stop_reason": self.stop[0], "stop_sequence": self.stop[1]}
        return events + [{"type": "message_delta", "delta": delta, "usage": {"output_tokens": self.output_tokens}},
                         {"type": "message_stop"}]

    def message(self) -> dict[str, Any]:
        """The whole message, once finished: cut tool calls left out, each `input` parsed."""
        content = []
        for i, block in enumerate(self.blocks):
            if block["type"] == "tool_use":
                if not self._complete(i):
                    continue
                block = {**block, "input": _tool_input(self.arguments[i])}
            content.append(block)
        return self._message(content, self.stop)

    # ---- blocks ------------------------------------------------------------------------------
    def _message(self, content: list[dict[str, Any]], stop: tuple[str, str | None] | None) -> dict[str, Any]:
        reason, sequence = stop or (None, None)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": sequence,
                "usage": {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens}}

    def _complete(self, index: int) -> bool:
        return _tool_input(self.arguments[index]) is not None

    def _begin(self, block: dict[str, Any]) -> list[Event]:
        events = self._close()
        self.blocks.append(block)
        self.open = len(self.blocks) - 1
        return events + [{"type": "content_block_start", "index": self.open, "content_block": dict(block)}]

    def _close(self) -> list[Event]:
        if self.open is None:
            return []
        index, self.open = self.open, None
        return [{"type": "content_block_stop", "index": index}]

    def _delta(self, kind: str, text: str) -> list[Event]:
        """`kind` "text" or "thinking": append to the open block of that kind, or begin one."""
        if not text:
            return []
        events = []
        if self.open is None or self.blocks[self.open]["type"] != kind:
            empty = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
            events += self._begin(empty)
        self.blocks[self.open][kind] += text
        return events + [{"type": "content_block_delta", "index": self.open,
                          "delta": {"type": f"{kind}_delta", kind: text}}]

    def _call(self, delta: dict[str, Any]) -> list[Event]:
        """An OpenAI tool-call delta: a new call begins a `tool_use` block, arguments stream
        as `input_json_delta`s."""
        events = []
        if delta["index"] not in self.calls:
            events += self._begin({"type": "tool_use", "id": new_id("toolu"), "name": delta["function"]["name"],
                                   "input": {}})
            self.calls[delta["index"]] = self.open
            self.arguments[self.open] = ""
        index = self.calls[delta["index"]]
        args = delta.get("function", {}).get("arguments", "")
        if args:
            self.arguments[index] += args
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "input_json_delta", "partial_json": args}})
        return events


class MessageFormat:
    """The whole answer for `EngineStreams.collect` (which resends a prompt whose engine copy
    failed before answering): the builder fed the final text at once."""

    def __init__(self, message_id: str, model: str, parsing: ChatParsing | None) -> None:
        self.id, self.model, self.parsing = message_id, model, parsing

    def builder(self, p: PromptState) -> MessageBuilder:
        parser = self.parsing.choice(p.token_ids) if self.parsing is not None else None
        return MessageBuilder(self.id, self.model, parser, len(p.token_ids))

    def response(self, prompts: list[PromptState]) -> dict[str, Any]:
        p = prompts[0]
        c = p.final.outputs[0]
        builder = self.builder(p)
        builder.feed(c.text, final=True)
        builder.finish(c)
        return builder.message()
