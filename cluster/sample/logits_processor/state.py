"""Building one `BatchUpdate` per step, and the container of instantiated processors."""
from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from itertools import chain

from cluster.errors import EngineInternalError
from cluster.sample.logits_processor.interface import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MovedRequest,
    RemovedRequest,
)


class BatchUpdateBuilder:
    """Collects a step's removals, additions and moves (vLLM's contract).

    All removals of a step are registered first; once `removed` (or peek/pop) has been read,
    `removed_append` raises RuntimeError until the next reset. `removed` is sorted descending,
    so `peek_removed` / `pop_removed` give the lowest freed row: adds fill it first.
    """

    def __init__(self, removed: list[RemovedRequest] | None = None,
                 added: list[AddedRequest] | None = None,
                 moved: list[MovedRequest] | None = None) -> None:
        self._removed: list[RemovedRequest] = removed or []
        self._is_removed_sorted = False
        self.added: list[AddedRequest] = added or []
        self.moved: list[MovedRequest] = moved or []
        self._changed = False

    @property
    def batch_changed(self) -> bool:
        return self._changed or bool(self._removed or self.added or self.moved)

    @batch_changed.setter
    def batch_changed(self, value: bool) -> None:
        self._changed = value

    def _sort_removed(self) -> None:
        if not self._is_removed_sorted:
            self._removed.sort(reverse=True)
            self._is_removed_sorted = True

    @property
    def removed(self) -> list[RemovedRequest]:
        self._sort_removed()
        return self._removed

    def removed_append(self, index: int) -> None:
        if self._is_removed_sorted:
            raise EngineInternalError("Cannot register a removed request after `removed` was read "
                               "this step (register all removals before adds and condense).")
        self._removed.append(index)
        self._changed = True

    def has_removed(self) -> bool:
        return bool(self._removed)

    def peek_removed(self) -> int | None:
        if not self._removed:
            return None
        self._sort_removed()
        return self._removed[-1]

    def pop_removed(self) -> int | None:
        if not self._removed:
            return None
        self._sort_removed()
        return self._removed.pop()

    def take_removed(self, index: int) -> bool:
        """A freed row is filled again (not via pop_removed): drop it from `removed`, so that
        no row is both removed and added (vLLM's own processors apply added first)."""
        if index in self._removed:
            self._removed.remove(index)
            return True
        return False

    def cancel_added(self, index: int) -> bool:
        """A request added this step leaves again before the step ran: drop its `added`
        entry and mark the row freed (its previous occupant, if any, was removed too)."""
        kept = [a for a in self.added if a[0] != index]
        if len(kept) == len(self.added):
            return False
        self.added = kept
        if self._is_removed_sorted:  # keep descending order without re-opening removals
            pos = bisect.bisect_left([-i for i in self._removed], -index)
            self._removed.insert(pos, index)
        else:
            self._removed.append(index)
        return True

    def reset(self) -> bool:
        """Forget this step's changes; returns whether there were any."""
        changed = self.batch_changed
        self._removed, self.added, self.moved = [], [], []
        self._is_removed_sorted = self._changed = False
        return changed

    def get_and_reset(self, batch_size: int) -> BatchUpdate | None:
        """This step's `BatchUpdate` (None when the batch did not change), then reset."""
        self._sort_removed()
        update = None
        if self._removed or self.added or self.moved:
            update = BatchUpdate(batch_size, self._removed, self.added, self.moved)
        self._removed, self.added, self.moved = [], [], []
        self._is_removed_sorted = self._changed = False
        return update


class LogitsProcessors:
    """Instantiated processors, split by whether they can change a greedy row's argmax."""

    def __init__(self, logitsprocs: Iterable[LogitsProcessor] | None = None) -> None:
        self.argmax_invariant: list[LogitsProcessor] = []
        self.non_argmax_invariant: list[LogitsProcessor] = []
        for proc in logitsprocs or ():
            (self.argmax_invariant if proc.is_argmax_invariant()
             else self.non_argmax_invariant).append(proc)

    @property
    def all(self) -> Iterator[LogitsProcessor]:
        return chain(self.argmax_invariant, self.non_argmax_invariant)
