"""The waiting sequences, grouped for fair scheduling.

A group is the unit of fairness: one request's n completions, or the prompts of one HTTP
request. Groups come out in order of their key `(priority, sequences the group has in the
batch, arrival, group id)`: priority first (always 0 under "fcfs"), then the group with fewer
sequences running, then the older. So a new request never queues behind the remaining
children of a large one, and two large requests share the batch evenly.

The key changes as the group's sequences start and stop running (the scheduler keeps
`num_running` and calls `touch`); the heap holds one entry per key change and drops stale ones
when they reach the top, so adding, removing and finding the best group cost O(log groups).
"""
from __future__ import annotations

import heapq
from typing import Iterator

from cluster.engine.request import Request

Key = tuple[int, int, float, str]


class WaitingQueue:
    def __init__(self, num_running: dict[str, int]) -> None:
        self.num_running = num_running  # group id -> its sequences in the batch (the scheduler's)
        self.groups: dict[str, dict[str, Request]] = {}  # group id -> request id -> request
        self.heap: list[Key] = []
        self.deferred: set[str] = set()  # groups passed over until `restore`
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[Request]:
        """Every waiting sequence, group by group (not in scheduling order)."""
        for group in self.groups.values():
            yield from group.values()

    def key(self, req: Request) -> Key:
        """The key of `req`'s group if `req` were the group's next sequence to run."""
        return req.priority, self.num_running.get(req.group_id, 0), req.arrival_time, req.group_id

    def add(self, req: Request) -> None:
        group = self.groups.setdefault(req.group_id, {})
        group[req.request_id] = req
        self.size += 1
        if len(group) == 1:
            self.touch(req.group_id)

    def remove(self, req: Request) -> None:
        group = self.groups[req.group_id]
        del group[req.request_id]
        self.size -= 1
        if not group:
            del self.groups[req.group_id]

    def touch(self, group_id: str) -> None:
        """Re-key a group after its running count changed (a no-op when none of it waits)."""
        group = self.groups.get(group_id)
        if group and group_id not in self.deferred:
            heapq.heappush(self.heap, self.key(next(iter(group.values()))))
            if len(self.heap) > 4 * len(self.groups) + 64:  # mostly stale entries: rebuild
                self.heap = [self.key(next(iter(g.values()))) for g in self.groups.values()]
                heapq.heapify(self.heap)

    def peek(self) -> Request | None:
        """The next sequence of the best group not deferred, or None."""
        while self.heap:
            _, num_running, _, gid = self.heap[0]
            group = self.groups.get(gid)
            if group and gid not in self.deferred and num_running == self.num_running.get(gid, 0):
                return next(iter(group.values()))
            heapq.heappop(self.heap)  # stale: emptied, deferred or re-keyed since
        return None

    def defer(self, group_id: str) -> None:
        """Pass over a group (waiting for its grammar or a sibling's prefill) until `restore`."""
        self.deferred.add(group_id)

    def restore(self) -> None:
        deferred, self.deferred = self.deferred, set()
        for gid in deferred:
            self.touch(gid)
