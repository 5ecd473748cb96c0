"""What a chat choice's text becomes in the answer: reasoning split off first, then tool calls.

`ChatParsing` holds a request's options (the server's reasoning markers, the request's tools
and the server's tool-call parser); `ChatParsing.choice(prompt_token_ids)` makes the parser of
one choice. Its `delta(text, final)` gives the streamed delta's fields and `message(text)` the
non-streamed message's: both run the same incremental parsers, so streamed pieces always add
up to the non-streamed answer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from actors.http.reasoning_parser import ReasoningSplitter
from actors.http.tool_parser import ToolCallParser, ToolRequest, complete_calls, merge_tool_calls
from cluster.reasoning import Phase, ReasoningMarkers, count_reasoning_tokens


@dataclass(frozen=True)
class ChatParsing:
    reasoning_strings: tuple[str, str] | None = None  # (start, end) marker text
    markers: ReasoningMarkers | None = None  # the same markers as token ids
    include_reasoning: bool = True
    tools: ToolRequest | None = None
    tool_call_parser: str | None = None

    @classmethod
    def for_request(cls, config: Any, tools: ToolRequest | None, tool_call_parser: str | None,
                    include_reasoning: bool = True) -> "ChatParsing | None":
        """None when there is nothing to parse (no reasoning config, no tools)."""
        rc = config.reasoning_config
        if rc is None and tools is None:
            return None
        strings = (rc["reasoning_start_str"], rc["reasoning_end_str"]) if rc else None
        return cls(strings, ReasoningMarkers.from_config(config), include_reasoning, tools, tool_call_parser)

    def choice(self, prompt_token_ids: list[int]) -> "ChoiceParser":
        splitter = None
        if self.reasoning_strings is not None:
            thinking = self.markers.tracker(prompt_token_ids).phase is Phase.THINKING
            splitter = ReasoningSplitter(*self.reasoning_strings, thinking=thinking)
        tools = self.tools.parser(self.tool_call_parser) if self.tools is not None else None
        return ChoiceParser(splitter, tools, self.include_reasoning)

    def reasoning_tokens(self, prompt_token_ids: list[int], output_token_ids: list[int]) -> int:
        if self.markers is None:
            return 0
        return count_reasoning_tokens(self.markers, prompt_token_ids, output_token_ids)


class ChoiceParser:
    def __init__(self, splitter: ReasoningSplitter | None, tools: ToolCallParser | None,
                 include_reasoning: bool) -> None:
        self.splitter, self.tools, self.include_reasoning = splitter, tools, include_reasoning

    def _feed(self, text: str, final: bool) -> tuple[str, str, list[dict[str, Any]]]:
        reasoning, content = self.splitter.feed(text, final) if self.splitter else ("", text)
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content, final)
        return reasoning, content, calls

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """A stream chunk's delta fields (only the non-empty ones)."""
        reasoning, content, calls = self._feed(text, final)
        out: dict[str, Any] = {}
        if reasoning and self.include_reasoning:
            out["reasoning_content"] = out["reasoning"] = reasoning
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = calls
        return out

    def message(self, text: str) -> dict[str, Any]:
        """The non-streamed message's fields (role aside). A call the token limit cut is left
        out (finish_reason `length` says the answer was cut): every returned call parses."""
        reasoning, content, calls = self._feed(text, True)
        saw = self.splitter is not None and self.splitter.saw_reasoning and self.include_reasoning
        out: dict[str, Any] = {"content": content}
        if self.splitter is not None:
            out["reasoning_content"] = out["reasoning"] = reasoning if saw else None
        if self.tools is not None and self.tools.made_calls:
            out["content"] = content or None
            calls = complete_calls(merge_tool_calls(calls))
            if calls:
                out["tool_calls"] = calls
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """A stopped request that made tool calls finishes with `tool_calls` (a named choice
        keeps OpenAI's `stop`)."""
        if reason == "stop" and self.tools is not None:
            return self.tools.finish_reason
        return reason
