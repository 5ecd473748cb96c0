"""The Responses API's answer: the response object and its streamed semantic events.

`ResponseBuilder` follows one generation. Each engine output's text goes through the chat
path's parser (`ChoiceParser`: reasoning split, then tool calls) and the pieces become output
items in the order they appear: a `reasoning` item, a `message` item (one `output_text` part),
`function_call` items. Every change is also an event (`response.output_item.added`,
`response.content_part.added`, `response.output_text.delta`, `response.reasoning_text.delta`,
`response.function_call_arguments.delta`, then the matching `.done` events), numbered by
`sequence_number` from `response.created` on. The non-streamed answer is the same builder's
final state with the events dropped, so both carry the same items.

A function call cut by the token limit is not returned as a call: its `response.output_item.done`
carries it with status `incomplete` (its argument deltas were already streamed) and the final
response leaves it out of `output`; the response is `incomplete` with reason
`max_output_tokens`. A call is complete when its arguments parse as JSON (a forced call's
grammar only lets the model end once they do).
"""
from __future__ import annotations

import json
import time
from typing import Any

from actors.http.chat_parsers import ChoiceParser
from actors.http.responses import ChatTranslation, ResponsesRequest, new_id
from actors.http.tool_parser import is_complete_json

Event = dict[str, Any]


class ResponseBuilder:
    """One response's output items and events. `base` holds the response object's request
    echo (model, instructions, tools, ...); `parser` is the choice's chat parser, or None when
    there is nothing to parse (the text is the message)."""

    def __init__(self, response_id: str, base: dict[str, Any], parser: ChoiceParser | None) -> None:
        self.id, self.base, self.parser = response_id, base, parser
        self.created_at = time.time()
        self.items: list[dict[str, Any]] = []
        self.dropped: set[int] = set()  # output indices of cut calls, left out of the final output
        self.open: int | None = None  # the output index of the item still being written
        self.calls: dict[int, int] = {}  # the parser's call index -> output index
        self.seq = 0

    # ---- the lifecycle ---------------------------------------------------------------------
    def start(self) -> list[Event]:
        snapshot = self.response("in_progress")
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def feed(self, text: str, final: bool) -> list[Event]:
        """Events for one output delta (`final`: the generation has ended)."""
        if self.parser is None:
            return self._content(text) if text else []
        delta = self.parser.delta(text, final)
        events = self._reasoning(delta.get("reasoning_content") or "")
        events += self._content(delta.get("content") or "")
        for call in delta.get("tool_calls") or []:
            events += self._call(call)
        return events

    def finish(self, finish_reason: str | None) -> list[Event]:
        """Close what is open (the text cut by the token limit is `incomplete`); ensure the
        output has an item. Then `response(...)` is the final object."""
        cut = finish_reason != "stop"
        events = [] if self.items else self._content("", force=True)
        return events + self._close(cut)

    def terminal(self, response: dict[str, Any]) -> Event:
        """`response.completed`, `.incomplete` or `.failed`, after the final object is stored."""
        return self._event(f"response.{response['status']}", response=response)

    def failed(self, message: str) -> list[Event]:
        events = self._close(cut=True)
        failed = self.response("failed", error={"code": "server_error", "message": message})
        return events + [self.terminal(failed)]

    # ---- the response object ---------------------------------------------------------------
    def response(self, status: str, usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        output = [] if status == "in_progress" else [
            item for i, item in enumerate(self.items) if i not in self.dropped]
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "completed_at": time.time() if status == "completed" else None, "error": error,
                "incomplete_details": incomplete, **self.base, "output": output, "usage": usage}

    def final_status(self, finish_reason: str | None) -> str:
        return "incomplete" if finish_reason == "length" else "completed"

    # ---- items -------------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def _begin(self, item: dict[str, Any]) -> list[Event]:
        self.items.append(item)
        self.open = len(self.items) - 1
        return [self._event("response.output_item.added", output_index=self.open, item=_copy(item))]

    def _reasoning(self, text: str) -> list[Event]:
        if not text:
            return []
        events = []
        if self.open is None or self.items[self.open]["type"] != "reasoning":
            events += self._close(cut=False)
            events += self._begin({"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [],
                                   "status": "in_progress"})
            events += self._part_added({"type": "reasoning_text", "text": ""})
        item = self.items[self.open]
        item["content"][0]["text"] += text
        return events + [self._event("response.reasoning_text.delta", item_id=item["id"], output_index=self.open,
                                     content_index=0, delta=text)]

    def _content(self, text: str, force: bool = False) -> list[Event]:
        if not text and not force:
            return []
        events = []
        if self.open is None or self.items[self.open]["type"] != "message":
            events += self._close(cut=False)
            events += self._begin({"id": new_id("msg"), "type": "message", "role": "assistant", "content": [],
                                   "status": "in_progress"})
            events += self._part_added({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        item = self.items[self.open]
        if not text:
            return events
        item["content"][0]["text"] += text
        return events + [self._event("response.output_text.delta", item_id=item["id"], output_index=self.open,
                                     content_index=0, delta=text, logprobs=[])]

    def _call(self, delta: dict[str, Any]) -> list[Event]:
        events = []
        args = delta.get("function", {}).get("arguments", "")
        if delta["index"] not in self.calls:
            events += self._close(cut=False)
            fn = delta["function"]
            events += self._begin({"id": new_id("fc"), "type": "function_call", "call_id": delta["id"],
                                   "name": fn["name"], "arguments": "", "status": "in_progress"})
            self.calls[delta["index"]] = self.open
        index = self.calls[delta["index"]]
        item = self.items[index]
        if args:
            item["arguments"] += args
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=index, delta=args))
        return events

    def _part_added(self, part: dict[str, Any]) -> list[Event]:
        item = self.items[self.open]
        item["content"].append(part)
        return [self._event("response.content_part.added", item_id=item["id"], output_index=self.open,
                            content_index=0, part=_copy(part))]

    def _close(self, cut: bool) -> list[Event]:
        """The `.done` events of the open item. `cut`: the generation stopped inside it."""
        if self.open is None:
            return []
        index, self.open = self.open, None
        item = self.items[index]
        events: list[Event] = []
        if item["type"] == "function_call":
            complete = is_complete_json(item["arguments"])
            if complete:
                events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                          output_index=index, name=item["name"], arguments=item["arguments"]))
            else:
                self.dropped.add(index)
            item["status"] = "completed" if complete else "incomplete"
        else:
            part = item["content"][0]
            kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
            done = {"text": part["text"]} if kind == "reasoning_text" else {"text": part["text"], "logprobs": []}
            events.append(self._event(f"response.{kind}.done", item_id=item["id"], output_index=index,
                                      content_index=0, **done))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=_copy(part)))
            item["status"] = "incomplete" if cut else "completed"
        events.append(self._event("response.output_item.done", output_index=index, item=_copy(item)))
        return events


def _copy(value: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(value))


def response_usage(prompt_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int) -> dict[str, Any]:
    """The Responses `usage` object (`cached_tokens`: the prompt's prefix-cache hit)."""
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens}


def request_echo(model: str, req: ResponsesRequest, translation: ChatTranslation, store: bool) -> dict[str, Any]:
    """The fields of the response object that repeat the request (as OpenAI's do)."""
    chat = translation.chat
    return {"model": model, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls, "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": translation.effort, "summary": None}, "store": store,
            "temperature": chat.temperature if chat.temperature is not None else 1.0,
            "text": {"format": translation.text_format,
                     "verbosity": (req.text.verbosity if req.text else None) or "medium"},
            "tool_choice": translation.tool_choice, "tools": translation.tools,
            "top_p": chat.top_p if chat.top_p is not None else 1.0, "top_logprobs": 0, "truncation": "disabled",
            "user": req.user, "background": False, "service_tier": "default"}
