"""The Responses API's request (`POST /v1/responses`) and its translation onto the chat path.

A Responses request is answered by the same machinery as a chat completion: its input items
become chat messages, its tools OpenAI chat tools, `text.format` a `response_format`,
`reasoning.effort` a thinking budget, and the result is one `ChatCompletionRequest`
(`ChatTranslation.chat`) that the ingress runs through the chat template, the tool prompt, the
forced-call grammars and the engine's entry checks exactly as `/v1/chat/completions` would.

Input items are also normalized (`normalize_input`): every item gets its OpenAI shape and an id,
because the store keeps them and `GET /v1/responses/{id}/input_items` lists them. The same
conversion (`items_to_messages`) renders a stored conversation and a client's re-sent one, so
both give the model the same prompt.

Pure functions and pydantic models: no Ray, no engine. Every bad field is an `OpenAIError` 400
naming it in the Responses vocabulary (`input[2].content[0].type`, `tools[0].parameters`,
`text.format`), raised before anything is stored or queued.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from actors.http.openai_protocol import ChatCompletionRequest, OpenAIError

# reasoning.effort -> thinking_token_budget (tokens of thinking before the end marker is forced).
EFFORT_BUDGETS = {"none": 0, "minimal": 128, "low": 512, "medium": 2048, "high": 8192, "xhigh": 16384,
                  "max": 32768}
# `include` values accepted. Reasoning items come back as plain `content` text, so a client that
# asks for encrypted reasoning (to pass it back with store=false) can pass that back instead.
SUPPORTED_INCLUDES = ("reasoning.encrypted_content",)
# Fields of the chat request the Responses request sets itself (a same-named extra is not forwarded).
_OWN_CHAT_FIELDS = {"messages", "max_tokens", "max_completion_tokens", "n", "stream", "stream_options", "logprobs",
                    "top_logprobs", "response_format", "tools", "tool_choice", "parallel_tool_calls", "user",
                    "include_reasoning", "add_generation_prompt", "continue_final_message", "echo", "model"}
# Responses fields this server does not implement, with their "unused" values.
_UNSUPPORTED = {"background": (None, False), "conversation": (None,), "prompt": (None,),
                "truncation": (None, "disabled")}
_TEXT_PARTS = {"input_text", "output_text"}
_ROLES = {"user", "system", "developer", "assistant"}


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class TextConfig(_Body):
    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Body):
    """`POST /v1/responses`. Unknown fields are ignored (SDKs send new ones); vLLM's extra
    sampling fields (`top_k`, `min_p`, `repetition_penalty`, `seed`, `stop`, ...) are passed on
    to the chat path; the fields in `_UNSUPPORTED` are refused unless unused."""

    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = None  # OpenAI's default: true
    previous_response_id: str | None = None
    include: list[str] | None = None
    stream: bool = False
    max_tool_calls: int | None = Field(default=None, ge=1)  # built-in tools only: nothing to bound here


@dataclass
class ChatTranslation:
    """A Responses request on the chat path."""

    chat: ChatCompletionRequest
    input_items: list[dict[str, Any]]  # this request's input, normalized, with ids
    tools: list[dict[str, Any]]  # the Responses tools, normalized (echoed in the response object)
    tool_choice: str | dict[str, Any]
    text_format: dict[str, Any]
    effort: str | None


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def check_request(req: ResponsesRequest) -> None:
    """Fields refused outright (before any store or engine call)."""
    extra = req.model_extra or {}
    for name, unused in _UNSUPPORTED.items():
        if extra.get(name) not in unused:
            raise OpenAIError(400, f"{name}={extra[name]!r} is not supported by this server", name)
    for i, value in enumerate(req.include or []):
        if value not in SUPPORTED_INCLUDES:
            raise OpenAIError(400, f"include[{i}] {value!r} is not supported (supported: {list(SUPPORTED_INCLUDES)})",
                              f"include[{i}]")
    if req.top_logprobs:
        raise OpenAIError(400, "top_logprobs is not supported on /v1/responses (use /v1/chat/completions)",
                          "top_logprobs")
    _check_metadata(req.metadata)
    if req.input is None and req.previous_response_id is None:
        raise OpenAIError(400, "input is required", "input")


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > 16:
        raise OpenAIError(400, f"metadata has {len(metadata)} keys; at most 16 are allowed", "metadata")
    for key, value in metadata.items():
        if len(key) > 64 or len(value) > 512:
            raise OpenAIError(400, f"metadata[{key[:64]!r}]: keys are at most 64 characters, values at most 512",
                              "metadata")


# ---- input items -----------------------------------------------------------------------------
def normalize_input(value: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The request's input as OpenAI items, each with an id (kept when the client gave one)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [_message_item({"role": "user", "content": value}, "input[0]")]
    return [_item(item, f"input[{i}]") for i, item in enumerate(value)]


def _item(item: dict[str, Any], where: str) -> dict[str, Any]:
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        return _message_item(item, where)
    if kind == "function_call":
        call_id, name, args = (_string(item, key, where) for key in ("call_id", "name", "arguments"))
        return {"type": "function_call", "id": item.get("id") or new_id("fc"), "call_id": call_id, "name": name,
                "arguments": args, "status": "completed"}
    if kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else _join_parts(output, f"{where}.output", {"input_text"})
        return {"type": "function_call_output", "id": item.get("id") or new_id("fco"),
                "call_id": _string(item, "call_id", where), "output": text, "status": "completed"}
    if kind == "reasoning":  # an earlier turn's thinking, passed back: kept, not shown to the model
        return {"type": "reasoning", "id": item.get("id") or new_id("rs"), "summary": item.get("summary") or [],
                "content": item.get("content") or [], "status": "completed"}
    raise OpenAIError(400, f"{where}.type: input items of type {kind!r} are not supported (supported: message, "
                           "function_call, function_call_output, reasoning)", f"{where}.type")


def _message_item(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise OpenAIError(400, f"{where}.role must be one of {sorted(_ROLES)}, got {role!r}", f"{where}.role")
    content = item.get("content")
    text = content if isinstance(content, str) else _join_parts(content, f"{where}.content", _TEXT_PARTS)
    if role == "assistant":
        part = {"type": "output_text", "text": text, "annotations": []}
        return {"type": "message", "id": item.get("id") or new_id("msg"), "role": "assistant", "content": [part],
                "status": "completed"}
    return {"type": "message", "id": item.get("id") or new_id("msg"), "role": role,
            "content": [{"type": "input_text", "text": text}], "status": "completed"}


def _join_parts(parts: Any, where: str, allowed: set[str]) -> str:
    if not isinstance(parts, list):
        raise OpenAIError(400, f"{where} must be a string or a list of content parts", where)
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed or not isinstance(part.get("text"), str):
            raise OpenAIError(400, f"{where}[{j}].type: content parts of type {kind!r} are not supported here "
                                   f"(supported: {sorted(allowed)} with a text)", f"{where}[{j}].type")
        texts.append(part["text"])
    return "\n".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise OpenAIError(400, f"{where}.{key} must be a string, got {type(value).__name__}", f"{where}.{key}")
    return value


def items_to_messages(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """Normalized items -> chat messages: `instructions` first as a system message, developer
    as system, a run of function calls as one assistant turn's `tool_calls` (joined to the
    assistant text just before them), each call's output as a `tool` message. Reasoning items
    are left out: chat templates drop earlier turns' thinking."""
    out: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        kind = item["type"]
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            out.append({"role": role, "content": "\n".join(p["text"] for p in item["content"])})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("joinable"):
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call], "joinable": True})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        if kind == "message" and item["role"] == "assistant":
            out[-1]["joinable"] = True
    return [{k: v for k, v in m.items() if k != "joinable"} for m in out]


# ---- tools, tool_choice, text.format -------------------------------------------------------
def normalize_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Responses function tools (`name`, `parameters`, `strict` at the top level), checked for
    shape; their schemas are checked by the chat path."""
    out = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise OpenAIError(400, f"tools[{i}].type: only tools of type 'function' are supported, got {kind!r}",
                              f"tools[{i}].type")
        out.append({"type": "function", "name": tool.get("name"), "description": tool.get("description"),
                    "parameters": tool.get("parameters"), "strict": tool.get("strict")})
    return out


def chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    fn = {"name": tool["name"], "parameters": tool["parameters"] if tool["parameters"] is not None else
          {"type": "object", "properties": {}}}
    if tool["description"]:
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise OpenAIError(400, "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}, "
                           f"got {choice!r:.200}", "tool_choice")


def chat_response_format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` -> chat's `response_format` (None: plain text)."""
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise OpenAIError(400, "text.format.schema must be a JSON schema object", "text.format.schema")
        spec = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": spec}
    raise OpenAIError(400, f"text.format.type must be text, json_object or json_schema, got {kind!r}",
                      "text.format.type")


def thinking_budget(req: ResponsesRequest, reasoning_enabled: bool) -> int | None:
    effort = req.reasoning.effort if req.reasoning else None
    if effort is None:
        return None
    if not reasoning_enabled:
        raise OpenAIError(400, "reasoning.effort needs a model served with a reasoning parser "
                               "(reasoning_parser / reasoning_config)", "reasoning.effort")
    return EFFORT_BUDGETS[effort]


# ---- the chat request ----------------------------------------------------------------------
def to_chat(req: ResponsesRequest, context: list[dict[str, Any]], reasoning_enabled: bool) -> ChatTranslation:
    """The chat request that answers `req`, given the earlier conversation's items (`context`,
    from `previous_response_id`)."""
    check_request(req)
    input_items = normalize_input(req.input)
    tools = normalize_tools(req.tools)
    text_format = (req.text.format if req.text and req.text.format else None) or {"type": "text"}
    body: dict[str, Any] = {
        "messages": items_to_messages([*context, *input_items], req.instructions),
        "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "tools": [chat_tool(t) for t in tools] or None, "tool_choice": chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls, "response_format": chat_response_format(text_format),
        "user": req.user}
    budget = thinking_budget(req, reasoning_enabled)
    extra = {k: v for k, v in (req.model_extra or {}).items()
             if k in ChatCompletionRequest.model_fields and k not in _OWN_CHAT_FIELDS}
    if budget is not None:
        extra.setdefault("thinking_token_budget", budget)
    try:
        chat = ChatCompletionRequest.model_validate({**extra, **{k: v for k, v in body.items() if v is not None}})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = responses_param(".".join(str(p) for p in first.get("loc", ())))
        raise OpenAIError(400, f"{where}: {first.get('msg', 'invalid value')}", where) from None
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    effort = req.reasoning.effort if req.reasoning else None
    return ChatTranslation(chat, input_items, tools, choice, text_format, effort)


def responses_param(param: str | None) -> str | None:
    """A chat field's name (in an error from the chat path) -> the Responses field it came from."""
    if not param:
        return param
    if param.startswith("tools[") and ".function." in param:
        return param.replace(".function.", ".", 1)
    if param.startswith("tools[") and param.endswith(".function"):
        return param[: -len(".function")]
    if param.startswith("messages"):
        return "input"
    renames = {"response_format": "text.format", "max_completion_tokens": "max_output_tokens",
               "max_tokens": "max_output_tokens"}
    return renames.get(param, param)


def translate_error(exc: OpenAIError) -> OpenAIError:
    """An OpenAIError of the chat path, its field named as on /v1/responses."""
    param = responses_param(exc.param)
    if param != exc.param and exc.param:
        exc.message = exc.message.replace(exc.param, param)
        exc.param = param
    return exc
