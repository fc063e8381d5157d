"""The waiting queue, as vLLM V1 keeps it (`v1/core/sched/request_queue.py`).

fcfs: a deque in arrival order; a preempted request goes back to the front.
priority: a heap on (priority, arrival); a preempted request is simply pushed again, so it
waits behind every request more urgent than it, wherever it was before.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar

from sim.types import SchedulingPolicy


class Queued(Protocol):
    """What the queue reads from a request."""

    @property
    def priority(self) -> int: ...

    @property
    def arrival(self) -> float: ...


Q = TypeVar("Q", bound=Queued)


class WaitingQueue(ABC, Generic[Q]):
    """The interface both policies share: add, put a preempted one back, peek, pop, remove."""

    @abstractmethod
    def add(self, item: Q) -> None: ...

    @abstractmethod
    def prepend(self, item: Q) -> None: ...

    @abstractmethod
    def peek(self) -> Q: ...

    @abstractmethod
    def pop(self) -> Q: ...

    @abstractmethod
    def remove(self, item: Q) -> None: ...

    @abstractmethod
    def clear(self) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Q]: ...


class FcfsQueue(WaitingQueue[Q]):
    def __init__(self) -> None:
        self._items: deque[Q] = deque()

    def add(self, item: Q) -> None:
        self._items.append(item)

    def prepend(self, item: Q) -> None:
        self._items.appendleft(item)

    def peek(self) -> Q:
        return self._items[0]

    def pop(self) -> Q:
        return self._items.popleft()

    def remove(self, item: Q) -> None:
        self._items.remove(item)

    def clear(self) -> None:
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Q]:
        return iter(self._items)


class PriorityQueue(WaitingQueue[Q]):
    def __init__(self) -> None:
        # A counter breaks ties like vLLM's request ID, and keeps items from being compared.
        self._heap: list[tuple[int, float, int, Q]] = []
        self._count = itertools.count()

    def add(self, item: Q) -> None:
        heapq.heappush(self._heap, (item.priority, item.arrival, next(self._count), item))

    def prepend(self, item: Q) -> None:
        self.add(item)  # no front in a heap: (priority, arrival) decides, as in vLLM

    def peek(self) -> Q:
        return self._heap[0][3]

    def pop(self) -> Q:
        return heapq.heappop(self._heap)[3]

    def remove(self, item: Q) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not item]
        heapq.heapify(self._heap)

    def clear(self) -> None:
        self._heap.clear()

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Q]:
        return (entry[3] for entry in self._heap)


def waiting_queue(policy: SchedulingPolicy) -> WaitingQueue[Q]:
    return PriorityQueue() if policy == "priority" else FcfsQueue()
