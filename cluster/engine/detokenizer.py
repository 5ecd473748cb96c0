"""Token ids -> text, incrementally, and stop strings in that text.

`IncrementalDetokenizer` turns a growing list of token ids into text deltas that never split
a character; `StopStringChecker` finds stop strings in that text and tells a streaming
consumer how much of the tail to withhold. The offline engine and the HTTP ingress use the
same two objects (through `OutputProcessor`), so streamed chunks add up to the final text.
`partial_suffix` is that withholding rule for one marker, shared with the ingress's chat
parsers (reasoning markers, tool-call tags).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cluster.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# A pending (incomplete) UTF-8 sequence is at most 3 bytes, so at most 3 tokens (4 for
# tokenizers that spell bytes as single tokens, e.g. SentencePiece byte fallback).
_MAX_PENDING_TOKENS = 4
# Prompt tokens decoded ahead of the output so the first output token decodes in context
# (SentencePiece drops a leading space at the start of a decode).
_MIN_CONTEXT, _MAX_CONTEXT = 4, 24


class IncrementalDetokenizer:
    """Token ids in, text deltas out; `.text` is the output text so far.

    Keeps vLLM's two offsets into the id list: [prefix, read) is the window already turned
    into text (decoded again only as context), [read, end) the ids not yet emitted. Each
    step decodes just those two windows, so its cost follows the new tokens, not the
    output length. Text ending in U+FFFD is an incomplete byte sequence (byte-level BPE
    splits emoji and CJK across tokens): it is held until the character completes.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._ids = _clean_context(self._decode, list(prompt_token_ids))
        self._num_context = len(self._ids)
        self._prefix, self._read = 0, len(self._ids)
        self._prefix_text: str | None = None  # decode of [prefix, read), computed when needed
        self.text = ""

    @property
    def token_ids(self) -> list[int]:
        """The output ids stepped so far (prompt context excluded)."""
        return self._ids[self._num_context:]

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Append ids; return the text they complete (may be "" while a character is pending)."""
        self._ids.extend(new_token_ids)
        if self._read == len(self._ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        # Longest clean cut first; cutting a few ids early emits the text before a pending
        # character now instead of holding a whole multi-token chunk back.
        lowest = max(self._read + 1, len(self._ids) - _MAX_PENDING_TOKENS)
        for end in range(len(self._ids), lowest - 1, -1):
            window = self._decode(self._ids[self._prefix:end])
            if not window.endswith(_REPLACEMENT):
                return self._advance(window, end)
        return ""

    def flush(self) -> str:
        """Emit whatever is held (a trailing U+FFFD when the output ends mid-character), so
        that `.text` equals decoding all output ids at once. Call once the request finishes."""
        if self._read == len(self._ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        return self._advance(self._decode(self._ids[self._prefix:]), len(self._ids))

    def _advance(self, window: str, end: int) -> str:
        delta = window[len(self._prefix_text):]
        self._prefix, self._read, self._prefix_text = self._read, end, None
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, self.skip_special_tokens, self.spaces_between_special_tokens)


def _clean_context(decode: Callable[[list[int]], str], prompt: list[int]) -> list[int]:
    """The shortest prompt suffix (>= 4 ids) that decodes without U+FFFD; [] if none does,
    e.g. a prompt given as ids that ends mid-character: then the output decodes standalone."""
    if len(prompt) <= _MIN_CONTEXT:
        return prompt if _REPLACEMENT not in decode(prompt) else []
    for n in range(_MIN_CONTEXT, min(len(prompt), _MAX_CONTEXT) + 1):
        if _REPLACEMENT not in decode(prompt[-n:]):
            return prompt[-n:]
    return []


@dataclass(frozen=True, slots=True)
class StopCheck:
    text: str  # the output text, cut at the stop string when one matched
    stop: str | None  # the stop string that matched; None while generation goes on
    hold_back: int  # trailing chars of `text` a stream must not send yet (0 once stopped)

    @property
    def stopped(self) -> bool:
        return self.stop is not None


class StopStringChecker:
    """Finds stop strings in growing output text.

    Call `check(text, delta)` after each detokenizer step, with `text` the output so far
    (ending with `delta`). Only the last len(delta) + max_len - 1 characters can hold a
    match that was not there before, so only they are searched. The stop string that
    completes first wins (on a tie, the longer one): that is the one a character-by-character
    stream would see, so the result does not depend on how the text was chunked.

    Streaming: keep `sent`; after each check send `r.text[sent:len(r.text) - r.hold_back]`.
    Once `r.stopped`, or when generation ends for another reason, send `r.text[sent:]`.
    """

    def __init__(self, stops: Sequence[str] | None, include_stop_str_in_output: bool = False) -> None:
        self.stops = list(dict.fromkeys(stops or ()))
        if any(not isinstance(s, str) or not s for s in self.stops):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stops!r}")
        self.include_stop_str_in_output = include_stop_str_in_output
        self.max_len = max(map(len, self.stops), default=0)

    def __bool__(self) -> bool:
        return bool(self.stops)

    def check(self, text: str, delta: str) -> StopCheck:
        if not text.endswith(delta):
            raise ValueError(f"delta must be the end of text, got delta {delta[-40:]!r} for text ending "
                             f"{text[-40:]!r}")
        matches = []  # (end, -len, stop): the earliest end wins, then the longest
        for stop in self.stops:
            start = text.find(stop, max(0, len(text) - len(delta) - len(stop) + 1))
            if start >= 0:
                matches.append((start + len(stop), -len(stop), stop))
        if matches:
            end, neg_len, stop = min(matches)
            cut = end if self.include_stop_str_in_output else end + neg_len
            return StopCheck(text[:cut], stop, 0)
        return StopCheck(text, None, self.hold_back(text))

    def hold_back(self, text: str) -> int:
        """How many trailing chars of `text` could begin a stop string. Zero when the stop
        string is kept in the output: whatever matches later, the text so far stays."""
        if self.include_stop_str_in_output:
            return 0
        return max((partial_suffix(text, stop) for stop in self.stops), default=0)


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`: the tail a
    stream must hold back, since the text that comes next may complete the marker there."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
