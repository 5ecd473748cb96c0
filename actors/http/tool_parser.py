"""Tool calling for chat: request checks, the constraint for forced calls, and output parsers.

`tool_request(tools, tool_choice, parallel_tool_calls)` checks a request's tools (each a
function with a valid JSON-schema `parameters`) and its choice, raising `ToolSpecError`
(a ValueError naming the field) for a bad spec. Then, per `ToolRequest.choice`:

- a named function: decoding is constrained to that function's `parameters` schema; the whole
  answer is the call's arguments (OpenAI ends it with finish_reason `stop`);
- `required`: decoding is constrained to a JSON array of `{"name": ..., "parameters": ...}`,
  one item per call: at most `MAX_PARALLEL_TOOL_CALLS` (a model that keeps repeating a call
  must still end), one with `parallel_tool_calls=false`;
- `auto`: the model writes calls itself and a parser (vLLM's `tool_call_parser`; `hermes`:
  `<tool_call>{"name": ..., "arguments": ...}</tool_call>`) finds them in the text;
- `none`: no parsing.

Every parser is incremental: `feed(delta, final)` returns the content text it releases and
OpenAI tool-call deltas. A non-streamed answer is one `feed(text, final=True)` whose deltas are
merged (`merge_tool_calls`), so the streamed argument fragments always concatenate to the
non-streamed arguments. A call cut by the token limit is the exception: its fragments were
sent before the cut, and the non-streamed answer leaves it out (`complete_calls`): a returned
call's arguments always parse.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from cluster.engine.detokenizer import partial_suffix
from cluster.sampling_params import StructuredOutputsParams
from cluster.structured_output import validate_structured_outputs

TOOL_CALL_PARSERS = ("hermes",)
# The most calls one forced `required` answer holds (parallel_tool_calls true): the grammar ends
# the list there even when the model would go on repeating a call until max_tokens.
MAX_PARALLEL_TOOL_CALLS = 8
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_NO_PARAMETERS = {"type": "object", "properties": {}}


class ToolSpecError(ValueError):
    """A bad `tools` / `tool_choice`: HTTP 400 naming `param`."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def check_tool_call_parser(name: str | None) -> str | None:
    if name is not None and name not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {list(TOOL_CALL_PARSERS)}, got {name!r}")
    return name


@dataclass(frozen=True)
class ToolRequest:
    functions: dict[str, dict[str, Any]]  # name -> parameters schema
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None = None
    parallel: bool = True

    def constraint(self) -> StructuredOutputsParams | None:
        """The structured output that forces the calls (named and required only)."""
        if self.choice == "named":
            return StructuredOutputsParams(json=self.functions[self.named], disable_any_whitespace=True)
        if self.choice != "required":
            return None
        items = [{"type": "object", "properties": {"name": {"const": name}, "parameters": params},
                  "required": ["name", "parameters"]} for name, params in self.functions.items()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items},
                                  "maxItems": MAX_PARALLEL_TOOL_CALLS if self.parallel else 1}
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True)

    def parser(self, tool_call_parser: str | None) -> "ToolCallParser | None":
        if self.choice == "named":
            return NamedCallParser(self.named)
        if self.choice == "required":
            return RequiredCallsParser()
        if self.choice == "auto" and tool_call_parser == "hermes":
            return HermesParser(set(self.functions), self.parallel)
        return None


def tool_request(tools: Any, tool_choice: Any, parallel_tool_calls: bool | None = None) -> ToolRequest | None:
    """Check tools and tool_choice; None when the request uses no tools."""
    functions = _check_tools(tools) if tools else {}
    choice, named = _check_choice(tool_choice, functions)
    if not functions:
        return None
    return ToolRequest(functions, choice, named, parallel_tool_calls is not False)


def _check_tools(tools: Any) -> dict[str, dict[str, Any]]:
    if not isinstance(tools, list):
        raise ToolSpecError("tools", f"must be a list of function tools, got {type(tools).__name__}")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ToolSpecError(f"{where}.type", "only tools of type 'function' are supported")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolSpecError(f"{where}.function", "must be an object with name and parameters")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolSpecError(f"{where}.function.name", f"must match {_NAME.pattern}, got {name!r}")
        if name in functions:
            raise ToolSpecError(f"{where}.function.name", f"{name!r} is defined twice")
        params = fn.get("parameters", _NO_PARAMETERS)
        functions[name] = _check_parameters(f"{where}.function.parameters", params)
    return functions


def _check_parameters(where: str, params: Any) -> dict[str, Any]:
    import jsonschema

    if not isinstance(params, dict):
        raise ToolSpecError(where, f"must be a JSON schema object, got {type(params).__name__}")
    try:
        jsonschema.validators.validator_for(params).check_schema(params)
    except jsonschema.SchemaError as exc:
        raise ToolSpecError(where, f"is not a valid JSON schema: {exc.message}") from None
    try:  # what we compile it with: also catches schemas xgrammar cannot build
        validate_structured_outputs(StructuredOutputsParams(json=params))
    except ValueError as exc:
        raise ToolSpecError(where, str(exc).replace("structured_outputs.json ", "")) from None
    return params


def _check_choice(choice: Any, functions: dict[str, Any]) -> tuple[str, str | None]:
    if choice is None:
        return ("auto" if functions else "none"), None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ToolSpecError("tool_choice", f"must be 'none', 'auto', 'required' or a named function, got {choice!r}")
        if choice != "none" and not functions:
            raise ToolSpecError("tool_choice", f"{choice!r} needs a non-empty 'tools' list")
        return choice, None
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise ToolSpecError("tool_choice", "a named choice is {'type': 'function', 'function': {'name': ...}}, "
                            f"got {choice!r:.200}")
    if name not in functions:
        raise ToolSpecError("tool_choice", f"function {name!r} is not among tools ({sorted(functions)})")
    return "named", name


# ---- output parsers ----------------------------------------------------------------------------
def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def is_complete_json(text: str) -> bool:
    """True when `text` is one whole JSON value (a call's arguments the token limit did not cut)."""
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def complete_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The merged calls whose arguments are complete: a call cut by the token limit is not a call."""
    return [c for c in calls if is_complete_json(c["function"]["arguments"])]


def merge_tool_calls(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI tool-call deltas -> complete tool calls (arguments concatenated by index)."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"id": None, "type": "function", "function": {"name": None, "arguments": ""}})
        call["id"] = d.get("id", call["id"])
        fn = d.get("function", {})
        call["function"]["name"] = fn.get("name", call["function"]["name"])
        call["function"]["arguments"] += fn.get("arguments", "")
    return [calls[i] for i in sorted(calls)]


@dataclass
class ToolCallParser:
    """Base: content passes through. `made_calls` once any call has been emitted."""

    made_calls: bool = field(default=False, init=False)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        return delta, []

    @property
    def finish_reason(self) -> str:
        """What a stopped request's finish_reason becomes."""
        return "tool_calls" if self.made_calls else "stop"


@dataclass
class NamedCallParser(ToolCallParser):
    """The whole answer is the arguments of the named function (constrained to its schema)."""

    name: str = ""

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        if self.made_calls:
            return "", [{"index": 0, "function": {"arguments": delta}}] if delta else []
        if not delta and not final:
            return "", []
        self.made_calls = True
        return "", [{"index": 0, "id": new_call_id(), "type": "function",
                     "function": {"name": self.name, "arguments": delta}}]

    @property
    def finish_reason(self) -> str:
        return "stop"  # OpenAI's answer for a forced named call


@dataclass
class RequiredCallsParser(ToolCallParser):
    """`[{"name": "f", "parameters": {...}}, ...]` (constrained): each item is one call; the
    `parameters` value's raw text is the call's arguments, streamed as it is written."""

    text: str = ""
    scan: "_ArrayScanner" = field(default_factory=lambda: _ArrayScanner("parameters"))
    sent: dict[int, int] = field(default_factory=dict)  # call index -> argument chars sent

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta
        self.scan.advance(self.text)
        out = []
        for i, item in enumerate(self.scan.items):
            if item.name is None or item.args_start is None:
                continue
            done = item.args_end is not None
            if not done and self.text[item.args_start] not in "{[":
                continue  # a scalar's end is only known once it is complete
            args = self.text[item.args_start: item.args_end if done else len(self.text)]
            if i not in self.sent:
                out.append({"index": i, "id": new_call_id(), "type": "function",
                            "function": {"name": item.name, "arguments": args}})
            elif len(args) > self.sent[i]:
                out.append({"index": i, "function": {"arguments": args[self.sent[i]:]}})
            self.sent[i] = len(args)
        self.made_calls = self.made_calls or bool(self.sent)
        return "", out


@dataclass
class _Item:
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None


class _ArrayScanner:
    """Incremental character scan of a JSON array of objects: each object's "name" string
    and the span of its `args_key` value. Tolerates any whitespace and key order."""

    def __init__(self, args_key: str) -> None:
        self.args_key = args_key
        self.items: list[_Item] = []
        self.pos = self.depth = 0
        self.in_str = self.esc = False
        self.str_start = 0
        self.key: str | None = None
        self.expect_value = False
        self.value_start: int | None = None

    def advance(self, text: str) -> None:
        for i in range(self.pos, len(text)):
            self._char(text, i, text[i])
        self.pos = len(text)

    def _char(self, text: str, i: int, c: str) -> None:
        if self.in_str:
            if self.esc:
                self.esc = False
            elif c == "\\":
                self.esc = True
            elif c == '"':
                self.in_str = False
                if self.depth == 2 and not self.expect_value:
                    self.key = _loads(text[self.str_start: i + 1])
                elif self.depth == 2 and self.value_start == self.str_start:
                    self._value_end(text, i + 1)
            return
        if c.isspace():
            return
        at_value = self.depth == 2 and self.expect_value and self.value_start is None
        if at_value:
            self.value_start = i
            if self.key == self.args_key:  # streamed from here on
                self.items[-1].args_start = i
        if c == '"':
            self.in_str, self.str_start = True, i
        elif c in "{[":
            self.depth += 1
            if self.depth == 2:
                self.items.append(_Item())
                self.expect_value, self.key = False, None
        elif c in "}]":
            if self.depth == 2 and self.value_start is not None and c == "}":  # scalar ended by '}'
                self._value_end(text, _rstrip_end(text, i))
            self.depth -= 1
            if self.depth == 2 and self.value_start is not None:
                self._value_end(text, i + 1)
        elif c == ":" and self.depth == 2:
            self.expect_value = True
        elif c == "," and self.depth == 2:
            if self.value_start is not None:
                self._value_end(text, _rstrip_end(text, i))
            self.expect_value = False

    def _value_end(self, text: str, end: int) -> None:
        item, start = self.items[-1], self.value_start
        if self.key == "name":
            name = _loads(text[start:end])
            item.name = name if isinstance(name, str) else None
        elif self.key == self.args_key:
            item.args_start, item.args_end = start, end
        self.value_start, self.expect_value = None, False


def _rstrip_end(text: str, i: int) -> int:
    while i > 0 and text[i - 1].isspace():
        i -= 1
    return i


def _loads(s: str) -> Any:
    try:
        return json.loads(s)
    except ValueError:
        return None


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class HermesParser(ToolCallParser):
    """Hermes / Qwen calls in free text: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

    Text outside blocks is content (whitespace around calls is dropped). A block whose JSON
    does not parse, or that names a function not among the tools, stays content as written.
    A call's arguments are sent whole when its block closes: `json.dumps` of the parsed value.
    """

    names: set[str] = field(default_factory=set)
    parallel: bool = True
    held: str = ""
    in_block: bool = False
    count: int = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        text, self.held = self.held + delta, ""
        content, calls = [], []
        while text:
            if self.in_block:
                at = text.find(_CLOSE)
                if at < 0:
                    self.held = text
                    break
                block, text = text[: at + len(_CLOSE)], text[at + len(_CLOSE):]
                self.in_block = False
                call = self._call(block[len(_OPEN): -len(_CLOSE)])
                if call is None:
                    content.append(block)
                else:
                    calls.append(call)
                continue
            at = text.find(_OPEN)
            if at >= 0:  # whitespace right before a call is layout, not content
                content.append(text[:at].rstrip())
                text, self.in_block = text[at:], True
                continue
            # Hold back a partial opening tag and the whitespace before it.
            cut = len(text) - partial_suffix(text, _OPEN)
            while cut > 0 and text[cut - 1].isspace():
                cut -= 1
            content.append(text[:cut])
            self.held = text[cut:]
            break
        if final and self.held:  # an unclosed block or a partial tag: text after all
            rest, self.held, self.in_block = self.held, "", False
            content.append("" if self.made_calls and not rest.strip() else rest)
        return "".join(content), calls

    def _call(self, body: str) -> dict[str, Any] | None:
        obj = _loads(body.strip())
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            return None
        if self.made_calls and not self.parallel:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        self.made_calls = True
        self.count += 1
        return {"index": self.count - 1, "id": new_call_id(), "type": "function",
                "function": {"name": obj["name"], "arguments": args}}
