"""Anthropic's Messages API request (`POST /v1/messages`, `/v1/messages/count_tokens`) and its
translation onto the chat path.

A Messages request is answered by the chat machinery: `to_chat` turns it into one
`ChatCompletionRequest` (system + turns as chat messages, `tool_use` as assistant `tool_calls`,
`tool_result` as `tool` messages, tools as OpenAI functions, `tool_choice` any -> required,
tool -> a named function, `thinking` -> `thinking_token_budget`), which the ingress then runs
through the model's chat template, the tool prompt, the forced-call grammars and the engine's
entry checks exactly as `/v1/chat/completions` would.

Assumptions: the models are text-only (image / document blocks are refused); earlier turns'
thinking blocks are dropped (chat templates drop earlier thinking); a conversation that ends
with an assistant turn is a prefill: the answer continues its text (`continue_final_message`).

Pure functions and pydantic models: no Ray, no engine. Every bad field is an `OpenAIError` 400
naming it in Anthropic's vocabulary (`messages.1.content.0.type`, `tools.0.input_schema`), raised
before anything is queued; the route answers it in Anthropic's error shape.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from actors.http.openai_protocol import ChatCompletionRequest, OpenAIError

# Anthropic fields for features this server does not have: refused unless null.
UNSUPPORTED_FIELDS = ("container", "mcp_servers", "context_management")
# Fields of the chat request the translation sets itself (a same-named extra is not forwarded).
_OWN_CHAT_FIELDS = {"messages", "max_tokens", "max_completion_tokens", "n", "stream", "stream_options", "logprobs",
                    "top_logprobs", "response_format", "tools", "tool_choice", "parallel_tool_calls", "user", "stop",
                    "include_reasoning", "add_generation_prompt", "continue_final_message", "echo", "model",
                    "temperature", "top_p", "top_k"}
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
Message = dict[str, Any]


class _Body(BaseModel):
    # Flat on purpose (blocks are plain dicts, checked by hand): the published schema needs no
    # $defs, and every bad block gets a message naming its place.
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    model: str | None = None
    system: str | list[dict[str, Any]] | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None

    def sampling(self) -> dict[str, Any]:
        """The chat request's sampling fields (none: a count is about the prompt alone)."""
        return {}


class CountTokensRequest(_Body):
    """`POST /v1/messages/count_tokens`: the prompt part of a Messages request."""


class MessagesRequest(_Body):
    """`POST /v1/messages`. Unknown fields are ignored (SDKs send new ones), except the ones in
    `UNSUPPORTED_FIELDS`; vLLM's extra sampling fields (`min_p`, `seed`, `ignore_eos`, ...) are
    passed on to the chat path. The ranges are Anthropic's."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None
    stream: bool = False

    def sampling(self) -> dict[str, Any]:
        user = (self.metadata or {}).get("user_id")
        if user is not None and not isinstance(user, str):
            raise _bad("metadata.user_id", "must be a string")
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "stop": self.stop_sequences, "user": user}


def _bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param)


# ---- messages ---------------------------------------------------------------------------------
def system_messages(system: str | list[dict[str, Any]] | None) -> list[Message]:
    """`system` (a string or text blocks) -> at most one chat system message."""
    if system is None:
        return []
    text = system if isinstance(system, str) else "\n".join(_text(b, f"system.{j}") for j, b in enumerate(system))
    return [{"role": "system", "content": text}] if text else []


def _text(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        raise _bad(f"{where}.type", f"expected a text block with a string `text`, got {kind!r}")
    return block["text"]


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    """A turn's content as blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise _bad(where, "must be a string or a list of content blocks")
    return content


def _refuse_block(kind: Any, where: str, role: str) -> OpenAIError:
    if kind in ("image", "document", "file"):
        return _bad(f"{where}.type", f"{kind} blocks are not supported: this server serves text-only models")
    allowed = "text, tool_result" if role == "user" else "text, tool_use, thinking, redacted_thinking"
    return _bad(f"{where}.type", f"{kind!r} blocks are not supported in a {role} turn (supported: {allowed})")


def user_messages(content: Any, where: str) -> list[Message]:
    """A user turn -> chat messages in block order: each `tool_result` a `tool` message, each
    run of text blocks one `user` message."""
    out: list[Message] = []
    texts: list[str] = []
    for j, block in enumerate(_blocks(content, where)):
        kind = block.get("type")
        if kind == "text":
            texts.append(_text(block, f"{where}.{j}"))
        elif kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            out.append(_tool_result(block, f"{where}.{j}"))
        else:
            raise _refuse_block(kind, f"{where}.{j}", "user")
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _tool_result(block: dict[str, Any], where: str) -> Message:
    """A `tool_result` -> a chat `tool` message. An error result (`is_error`) is shown to the
    model as `Error: <content>` (chat has no error flag)."""
    if not isinstance(block.get("tool_use_id"), str):
        raise _bad(f"{where}.tool_use_id", "must be a string")
    content = block.get("content", "")
    if isinstance(content, list):
        content = "\n".join(_text(b, f"{where}.content.{k}") for k, b in enumerate(content))
    elif not isinstance(content, str):
        raise _bad(f"{where}.content", "must be a string or a list of text blocks")
    if block.get("is_error"):
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def assistant_message(content: Any, where: str) -> Message:
    """An assistant turn -> one chat message: its text joined, its `tool_use` blocks as
    `tool_calls` (input as JSON arguments). Thinking blocks are dropped."""
    texts, calls = [], []
    for j, block in enumerate(_blocks(content, where)):
        kind = block.get("type")
        if kind == "text":
            texts.append(_text(block, f"{where}.{j}"))
        elif kind == "tool_use":
            calls.append(_tool_call(block, f"{where}.{j}"))
        elif kind not in ("thinking", "redacted_thinking"):
            raise _refuse_block(kind, f"{where}.{j}", "assistant")
    message: Message = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    for key in ("id", "name"):
        if not isinstance(block.get(key), str):
            raise _bad(f"{where}.{key}", "must be a string")
    if not isinstance(block.get("input"), dict):
        raise _bad(f"{where}.input", "must be an object")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}}


def chat_messages(system: Any, messages: list[dict[str, Any]]) -> tuple[list[Message], bool]:
    """(the chat messages, whether the last turn is an assistant prefill to continue)."""
    out = system_messages(system)
    for i, turn in enumerate(messages):
        role = turn.get("role")
        if role == "user":
            out += user_messages(turn.get("content"), f"messages.{i}.content")
        elif role == "assistant":
            out.append(assistant_message(turn.get("content"), f"messages.{i}.content"))
        else:
            raise _bad(f"messages.{i}.role", f"must be 'user' or 'assistant', got {role!r}")
    prefill = messages[-1].get("role") == "assistant"
    if prefill and out[-1].get("tool_calls"):
        raise _bad(f"messages.{len(messages) - 1}.content", "a final assistant turn is continued as text (prefill); "
                                                            "it cannot hold tool_use blocks")
    return out, prefill


# ---- tools, tool_choice, thinking, output_config -----------------------------------------------
def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Anthropic client tools (`name`, `description`, `input_schema`) -> OpenAI function tools;
    the chat path then checks names and schemas. Server tools (web search, ...) are refused."""
    out = []
    for i, tool in enumerate(tools or []):
        if tool.get("type") not in (None, "custom"):
            raise _bad(f"tools.{i}.type", "only client tools ({name, description, input_schema}) are supported, "
                                          f"got {tool.get('type')!r}")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict) or schema.get("type") != "object":
            raise _bad(f"tools.{i}.input_schema", "must be a JSON schema of type 'object'")
        fn = {"name": tool.get("name"), "parameters": schema}
        if tool.get("description"):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out or None


def chat_tool_choice(choice: dict[str, Any] | None, has_tools: bool) -> tuple[Any, bool | None]:
    """(chat's tool_choice, parallel_tool_calls). `auto` / `none` without tools mean nothing."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none") and not has_tools:
        return None, None
    if kind in ("any", "tool") and not has_tools:
        raise _bad("tool_choice", f"{kind!r} needs a non-empty tools list")
    if kind in _TOOL_CHOICES:
        return _TOOL_CHOICES[kind], parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise _bad("tool_choice", "must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}, "
                              f"got {choice!r:.200}")


def thinking_fields(thinking: dict[str, Any] | None, reasoning_enabled: bool) -> dict[str, Any]:
    """`thinking` -> the chat request's `thinking_token_budget` / `include_reasoning`.
    `enabled` needs a model served with a reasoning parser; `disabled` there is a budget of 0
    (the end marker is forced at once); `adaptive` lets the model think as it would.
    `display: omitted` leaves the thinking out of the answer."""
    if thinking is None:
        return {}
    kind = thinking.get("type")
    fields: dict[str, Any] = {"include_reasoning": False} if thinking.get("display") == "omitted" else {}
    if kind == "enabled":
        if not reasoning_enabled:
            raise _bad("thinking", "this model cannot think: it is served without a reasoning parser "
                                   "(reasoning_parser / reasoning_config)")
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise _bad("thinking.budget_tokens", f"must be an integer >= 1, got {budget!r}")
        return fields | {"thinking_token_budget": budget}
    if kind == "disabled":
        return {"thinking_token_budget": 0} if reasoning_enabled else {}
    if kind == "adaptive":
        return fields
    raise _bad("thinking.type", f"must be 'enabled', 'disabled' or 'adaptive', got {kind!r}")


def chat_response_format(output_config: dict[str, Any] | None) -> dict[str, Any] | None:
    """`output_config.format` (`json_schema`) -> chat's response_format; `effort` is accepted
    and has no effect."""
    fmt = (output_config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise _bad("output_config.format", "must be {'type': 'json_schema', 'schema': {...}}")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


# ---- the chat request ----------------------------------------------------------------------
@dataclass(frozen=True)
class ChatTranslation:
    """A Messages request on the chat path; `prefill`: the answer continues the last turn."""

    chat: ChatCompletionRequest
    prefill: bool


def check_request(req: _Body) -> None:
    extra = req.model_extra or {}
    for name in UNSUPPORTED_FIELDS:
        if extra.get(name) is not None:
            raise _bad(name, "is not supported by this server")


def to_chat(req: _Body, reasoning_enabled: bool) -> ChatTranslation:
    """The chat request that answers `req` (`reasoning_enabled`: the model has a reasoning config)."""
    check_request(req)
    messages, prefill = chat_messages(req.system, req.messages)
    tools = chat_tools(req.tools)
    choice, parallel = chat_tool_choice(req.tool_choice, tools is not None)
    body: dict[str, Any] = {
        **req.sampling(), "messages": messages, "tools": tools, "tool_choice": choice,
        "parallel_tool_calls": parallel, "response_format": chat_response_format(req.output_config),
        "continue_final_message": prefill, "add_generation_prompt": not prefill,
        **thinking_fields(req.thinking, reasoning_enabled)}
    extra = {k: v for k, v in (req.model_extra or {}).items()
             if k in ChatCompletionRequest.model_fields and k not in _OWN_CHAT_FIELDS}
    try:
        chat = ChatCompletionRequest.model_validate({**extra, **{k: v for k, v in body.items() if v is not None}})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = anthropic_param(".".join(str(p) for p in first.get("loc", ())))
        raise _bad(where, first.get("msg", "invalid value")) from None
    return ChatTranslation(chat, prefill)


# ---- errors of the chat path, in Anthropic's vocabulary -----------------------------------------
_RENAMES = {"response_format": "output_config.format", "max_completion_tokens": "max_tokens",
            "stop": "stop_sequences", "thinking_token_budget": "thinking.budget_tokens",
            "parallel_tool_calls": "tool_choice.disable_parallel_tool_use"}
_TOOL_PARAM = re.compile(r"tools\[(\d+)\](?:\.function)?(?:\.(parameters|name|type))?")


def anthropic_param(param: str | None) -> str | None:
    """A chat field's name (in an error from the chat path) -> the Messages field it came from."""
    if not param:
        return param
    match = _TOOL_PARAM.fullmatch(param)
    if match:
        leaf = {"parameters": ".input_schema", "name": ".name", "type": ".type"}.get(match.group(2) or "", "")
        return f"tools.{match.group(1)}{leaf}"
    return _RENAMES.get(param, param)


def translate_error(exc: OpenAIError) -> OpenAIError:
    """An OpenAIError of the chat path, its field named as on /v1/messages."""
    param = anthropic_param(exc.param)
    if param != exc.param and exc.param:
        exc.message = exc.message.replace(exc.param, param)
        exc.param = param
    return exc
