"""Chat output text -> (reasoning, content), whole or streamed, with the same result.

A server with a reasoning config (vLLM's `reasoning_parser`) answers chat requests with the
thinking text in `reasoning_content` (and `reasoning`, vLLM's newer name) and the rest in
`content`. The split is on the marker strings; the markers themselves are dropped.

- A prompt that ends inside a thinking block (decided on tokens, by the engine's own
  `cluster.reasoning` tracker) makes the output's text reasoning up to the end marker.
- Otherwise the output is reasoning only when it begins (after optional whitespace) with the
  start marker; else it is all content.
- After the end marker everything is content (a later start marker is plain text).

`ReasoningSplitter.feed(delta, final)` holds back text that may still turn into a marker,
so the streamed pieces concatenate to exactly the non-streamed split (one `feed(text, True)`).
"""
from __future__ import annotations

from cluster.engine.detokenizer import partial_suffix

_LEAD, _THINK, _CONTENT = "lead", "think", "content"


class ReasoningSplitter:
    def __init__(self, start: str, end: str, thinking: bool) -> None:
        if not start or not end:
            raise ValueError(f"reasoning markers must be non-empty, got {start!r} and {end!r}")
        self.start, self.end = start, end
        self.state = _THINK if thinking else _LEAD
        self.saw_reasoning = thinking
        self._held = ""

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) text released by this delta."""
        text, self._held = self._held + delta, ""
        reasoning = content = ""
        if self.state == _LEAD:
            body = text.lstrip()
            if body.startswith(self.start):
                self.state, self.saw_reasoning = _THINK, True
                text = body[len(self.start):]
            elif self.start.startswith(body) and not final:  # may still become the marker
                self._held = text
                return "", ""
            else:
                self.state = _CONTENT
        if self.state == _THINK:
            at = text.find(self.end)
            if at >= 0:
                reasoning, text = text[:at], text[at + len(self.end):]
                self.state = _CONTENT
            else:
                keep = 0 if final else partial_suffix(text, self.end)
                reasoning, self._held = text[:len(text) - keep], text[len(text) - keep:]
                return reasoning, ""
        content = text
        return reasoning, content

    def split(self, text: str) -> tuple[str | None, str]:
        """Non-streamed: (reasoning or None when there was none, content)."""
        reasoning, content = self.feed(text, final=True)
        return (reasoning if self.saw_reasoning else None), content
