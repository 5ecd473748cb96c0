"""Where a request's token stream stands relative to its reasoning ("thinking") block.

One state machine, a pure function of prompt + output tokens, used by everything on rank 0
that cares: the thinking budget (when to force the end sequence) and the structured-output
matchers (which tokens belong to the answer the grammar constrains). Each keeps its own
`ReasoningTracker` per request; since they read the same tokens they always agree, and a
tracker rebuilt after preemption (prompt + the outputs so far) lands in the same state.

The markers are token sequences: the engine's `reasoning_config` strings tokenized once
(`EngineConfig.reasoning_token_ids`). Text that spells a marker with other tokens is not one.

Phases:
- OUTSIDE: not thinking; a start sequence opens a block (unconstrained requests; a block
  may open and close again and again).
- OPEN: a constrained request whose prompt has no marker, before its first output token,
  when the start marker is one token: that token either is the start (the model chose to
  think) or the answer's first. A start of several tokens cannot be told from text at its
  first token (SmolLM2's `<think>` begins with `<`), so such a request answers at once.
- THINKING: inside a block. Tokens are free, counted against the budget. The end sequence
  closes the block.
- ANSWER: a constrained request's reasoning is over for good: every later token is the
  grammar's, even one that spells a start sequence (inside a JSON string, say).
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field


class Phase(enum.Enum):
    OUTSIDE = enum.auto()
    OPEN = enum.auto()
    THINKING = enum.auto()
    ANSWER = enum.auto()


@dataclass(frozen=True)
class ReasoningMarkers:
    """The start and end token sequences (each non-empty)."""

    start: tuple[int, ...]
    end: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.start or not self.end:
            raise ValueError(f"reasoning markers need non-empty start and end token ids, got "
                             f"{list(self.start)!r} and {list(self.end)!r}")

    @classmethod
    def from_config(cls, config) -> "ReasoningMarkers | None":
        """From a finalized EngineConfig (None without a reasoning config)."""
        ids = config.reasoning_token_ids
        return None if not ids else cls(tuple(ids[0]), tuple(ids[1]))

    def tracker(self, prompt: Sequence[int], output: Sequence[int] = (), *, constrained: bool = False,
                budget: int | None = None) -> "ReasoningTracker":
        """The state after `prompt` and then `output` (fed one by one, as generated)."""
        tr = ReasoningTracker(self, constrained, budget)
        tr.start_from(prompt)
        for token in output:
            tr.feed(token)
        return tr


@dataclass
class ReasoningTracker:
    markers: ReasoningMarkers
    constrained: bool = False  # a grammar waits for the answer: ANSWER is final, OPEN may begin
    budget: int | None = None  # thinking tokens allowed per block (None: unlimited)
    phase: Phase = Phase.OUTSIDE
    count: int = 0  # tokens since the block's start sequence (THINKING)
    tail: list[int] = field(default_factory=list)  # the last few tokens, for sequence matching

    def start_from(self, prompt: Sequence[int]) -> None:
        """Set the state a prompt leaves: inside a block when its last start sequence is not
        closed; a constrained request after a closed block (or a bare end) is answering."""
        m, keep = self.markers, self._keep
        at = _rfind(prompt, m.start)
        if at >= 0:
            # Only what follows the last start sequence matters: jump there, feed the rest.
            self.phase, self.count, self.tail = Phase.THINKING, 0, list(prompt[max(0, at - keep): at])
            for token in prompt[at:]:
                if self.phase is Phase.ANSWER:
                    break
                self.feed(token)
        else:
            self.tail = list(prompt[-keep:]) if keep else []
            if self.constrained:
                closed = _rfind(prompt, m.end) >= 0 or len(m.start) > 1
                self.phase = Phase.ANSWER if closed else Phase.OPEN

    def feed(self, token: int) -> bool:
        """Advance by one generated token; True when it belongs to the answer's grammar."""
        m, phase = self.markers, self.phase
        if phase is Phase.ANSWER:
            return True
        if phase is Phase.OPEN and token != m.start[0]:
            self.phase = Phase.ANSWER
            return True
        self._push(token)
        if _ends_with(self.tail, m.start):
            self.phase, self.count = Phase.THINKING, 0
        elif phase is Phase.THINKING:
            if _ends_with(self.tail, m.end):
                self.phase = Phase.ANSWER if self.constrained else Phase.OUTSIDE
            else:
                self.count += 1
        return False

    def forced_token(self) -> int | None:
        """The end sequence's next token once the budget is spent (continuing one already
        under way), else None."""
        m = self.markers
        if self.phase is not Phase.THINKING or self.budget is None or self.count < self.budget:
            return None
        for k in range(min(len(m.end) - 1, self.count), 0, -1):
            if _ends_with(self.tail, m.end, k):
                return m.end[k]
        return m.end[0]

    @property
    def _keep(self) -> int:
        return max(len(self.markers.start), len(self.markers.end))

    def _push(self, token: int) -> None:
        self.tail.append(token)
        if len(self.tail) > self._keep:
            del self.tail[0]


def count_reasoning_tokens(markers: ReasoningMarkers, prompt: Sequence[int], output: Sequence[int]) -> int:
    """Output tokens spent on reasoning, markers included: the tokens up to the end of the block
    the prompt leaves open, or of the block the output begins with (else none), as the chat
    answer's reasoning_content is split."""
    tr = ReasoningTracker(markers)
    tr.start_from(prompt)
    if tr.phase is not Phase.THINKING and tuple(output[:len(markers.start)]) != markers.start:
        return 0
    n = 0
    for i, token in enumerate(output):
        before = tr.phase
        tr.feed(token)
        if before is Phase.THINKING or tr.phase is Phase.THINKING:
            n = i + 1
        if before is Phase.THINKING and tr.phase is Phase.OUTSIDE:
            return n
    return n


def _ends_with(tail: Sequence[int], seq: tuple[int, ...], n: int | None = None) -> bool:
    n = len(seq) if n is None else n
    return len(tail) >= n and tuple(tail[len(tail) - n:]) == seq[:n]


def _rfind(tokens: Sequence[int], seq: tuple[int, ...]) -> int:
    """Index just past the last occurrence of seq in tokens, or -1."""
    n, last = len(seq), seq[-1]
    for i in range(len(tokens) - 1, n - 2, -1):
        if tokens[i] == last and tuple(tokens[i - n + 1: i + 1]) == seq:
            return i + 1
    return -1
