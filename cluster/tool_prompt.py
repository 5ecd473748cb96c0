"""Tools in a conversation: hand them to the chat template, or spell them out for a template
that knows nothing of tools.

A template that mentions `tools` (Qwen2.5/3, Hermes, Llama 3.1, ...) gets the OpenAI tool list
as `tools=` and the messages with each call's `arguments` parsed into a dict (what those
templates expect; OpenAI sends a JSON string). Any other template (SmolLM2's, for one) renders
messages rewritten into plain turns, in the Hermes format the `hermes` parser reads back:

- the tool list goes at the end of the system message (one is added when there is none):
  the signatures inside `<tools></tools>`, then how to call: `<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`, one block per call;
- an assistant turn with `tool_calls` gets one such block per call after its text;
- consecutive `tool` messages become one `user` turn of `<tool_response>...</tool_response>`
  blocks (templates that only know system / user / assistant accept it).
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

TOOLS_HEADER = ("# Tools\n\nYou may call the functions below to help with the user's request. Their "
                "signatures, one JSON object per line:\n<tools>\n{tools}\n</tools>\n\n"
                "To call functions, answer with one block per call, each a JSON object with the "
                "function's name and its arguments:\n<tool_call>\n{{\"name\": \"<function name>\", "
                "\"arguments\": {{<arguments as JSON>}}}}\n</tool_call>")


def template_supports_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def check_tools(tools: Any) -> list[Mapping[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)) or \
            not all(isinstance(t, Mapping) for t in tools):
        raise ValueError(f"tools must be a list of objects, got {tools!r:.200}")
    return list(tools)


def for_tool_template(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a tools-aware template: call arguments as dicts."""
    out = []
    for i, msg in enumerate(messages):
        calls = _calls(i, msg)
        if calls:
            msg = {**msg, "tool_calls": [_parsed_call(c) for c in calls]}
        out.append(msg)
    return out


def _calls(i: int, msg: Any) -> list[Any] | None:
    calls = msg.get("tool_calls") if isinstance(msg, Mapping) else None
    if calls is not None and not isinstance(calls, list):
        raise ValueError(f"messages[{i}].tool_calls must be a list, got {type(calls).__name__}")
    return calls


def inline_tools(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> list[Any]:
    """Messages rewritten as plain turns (the default rendering, see the module doc)."""
    out: list[Any] = []
    tool_turn = False  # the last turn collects tool responses
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            out.append(msg)  # the tokenizer's own checks report it
            tool_turn = False
            continue
        if msg.get("role") == "tool":
            block = f"<tool_response>\n{_text(msg.get('content'))}\n</tool_response>"
            if tool_turn:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            tool_turn = True
            continue
        tool_turn = False
        plain = {k: v for k, v in msg.items() if k not in ("tool_calls", "tool_call_id")}
        calls = _calls(i, msg)
        if msg.get("role") == "assistant" and calls:
            blocks = [f"<tool_call>\n{json.dumps(_parsed_call(c)['function'], ensure_ascii=False)}\n</tool_call>"
                      for c in calls]
            plain["content"] = "\n".join(([_text(msg.get("content"))] if msg.get("content") else []) + blocks)
        out.append(plain)
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        header = TOOLS_HEADER.format(tools=listing)
        first = out[0] if out else None
        if isinstance(first, Mapping) and first.get("role") == "system":
            out[0] = {**first, "content": f"{_text(first.get('content'))}\n\n{header}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": header})
    return out


def _parsed_call(call: Any) -> Any:
    """{"function": {"name", "arguments": "<json>"}} -> arguments as a dict when they parse."""
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        raise ValueError(f"tool_calls entries must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}, "
                         f"got {call!r:.200}")
    fn = dict(call["function"])
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args) if args.strip() else {}
        except ValueError:
            raise ValueError(f"tool_calls arguments must be a JSON object string, got {args!r:.200}") from None
    return {**call, "function": {"name": fn.get("name"), "arguments": fn.get("arguments", {})}}


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):  # OpenAI content parts
        return "\n".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return str(content)
