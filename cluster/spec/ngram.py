"""N-gram (prompt lookup) drafts over a request's prompt + output, kept incrementally.

Each request's `NgramIndex` maps every n-gram of its token stream (prompt_lookup_min <= n <=
prompt_lookup_max) to the end of its latest occurrence. A lookup takes the stream's last n
tokens, longest n first, and proposes the tokens that followed that earlier occurrence. Each
token is indexed once ((max - min + 1) dict writes) and a lookup is a few dict reads, so
drafting for every request every step never rescans a sequence.
"""
from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """One request's n-grams -> exclusive end of their latest occurrence."""

    __slots__ = ("ends", "indexed")

    def __init__(self) -> None:
        self.ends: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending at positions <= indexed are in `ends`


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{prompt_lookup_min} and {prompt_lookup_max}")
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max

    def propose(self, index: NgramIndex, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix
        of `tokens` found; [] when none of its last n-grams occurred before."""
        length = len(tokens)
        if k < 1 or length <= self.n_min:
            return []
        # Everything ending before the last position: the suffix itself must not match itself.
        self._extend(index, tokens, length - 1)
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            end = index.ends.get(tuple(tokens[length - n:]))
            if end is not None:
                return list(tokens[end:end + k])
        return []

    def _extend(self, index: NgramIndex, tokens: Sequence[int], upto: int) -> None:
        ends = index.ends
        for end in range(index.indexed + 1, upto + 1):
            for n in range(self.n_min, min(self.n_max, end) + 1):
                ends[tuple(tokens[end - n:end])] = end
        index.indexed = max(index.indexed, upto)
