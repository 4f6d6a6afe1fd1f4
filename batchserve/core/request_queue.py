"""Waiting queues behind one small interface: FCFS, priority, and shortest-first with aging."""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Protocol

from batchserve.config import SchedulingOrder
from batchserve.request import Request


class RequestQueue(Protocol):
    def push(self, request: Request) -> None: ...
    def push_front(self, request: Request) -> None: ...  # a preempted request goes back ahead of its peers
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, request: Request) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def push(self, request: Request) -> None:
        self._queue.append(request)

    def push_front(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)  # aborts only: O(n) is fine off the hot path

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class _LazyHeap:
    """A heap whose removals are marks, skipped when they reach the top."""

    def __init__(self, key: Callable[[Request], tuple]) -> None:
        self._key = key
        self._heap: list[tuple[tuple, int, Request]] = []
        self._counter = itertools.count()

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (self._key(request), next(self._counter), request))

    def top(self, live: set[int]) -> Request:
        while id(self._heap[0][2]) not in live:
            heapq.heappop(self._heap)
        return self._heap[0][2]


class _HeapQueue:
    """Live requests in a dict, ordered by lazy heaps; subclasses say which heap top is served next."""

    def __init__(self) -> None:
        self._live: dict[int, Request] = {}

    def _heaps(self) -> list[_LazyHeap]:
        raise NotImplementedError

    def push(self, request: Request) -> None:
        self._live[id(request)] = request
        for heap in self._heaps():
            heap.push(request)

    push_front = push  # a preempted request keeps its arrival time, so it sorts ahead of later arrivals anyway

    def peek(self) -> Request:
        raise NotImplementedError

    def pop(self) -> Request:
        request = self.peek()
        self.remove(request)
        return request

    def remove(self, request: Request) -> None:
        del self._live[id(request)]

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._live.values(), key=self._sort_key))

    @staticmethod
    def _sort_key(request: Request) -> tuple:
        raise NotImplementedError


class PriorityQueue(_HeapQueue):
    """Lower priority value first; FCFS (by arrival) within a level."""

    def __init__(self) -> None:
        super().__init__()
        self._heap = _LazyHeap(self._sort_key)

    def _heaps(self) -> list[_LazyHeap]:
        return [self._heap]

    @staticmethod
    def _sort_key(request: Request) -> tuple:
        return (request.priority, request.arrival_time)

    def peek(self) -> Request:
        return self._heap.top(self._live.keys())


class ShortestFirstQueue(_HeapQueue):
    """Smallest worst-case length (prompt + max_tokens) first, so short requests are not stuck behind long ones.
    Aging: a request that has waited longer than max_wait_s is served first, oldest first."""

    def __init__(self, max_wait_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.max_wait_s = max_wait_s
        self._clock = clock
        self._by_length = _LazyHeap(self._sort_key)
        self._by_arrival = _LazyHeap(lambda r: (r.arrival_time,))

    def _heaps(self) -> list[_LazyHeap]:
        return [self._by_length, self._by_arrival]

    @staticmethod
    def _sort_key(request: Request) -> tuple:
        return (request.max_total_tokens, request.arrival_time)

    def peek(self) -> Request:
        oldest = self._by_arrival.top(self._live.keys())
        if self._clock() - oldest.arrival_time > self.max_wait_s:
            return oldest
        return self._by_length.top(self._live.keys())


class DemotingQueue:
    """The configured queue, and behind it the demoted requests (slo_admission "deprioritize"), FCFS among
    themselves: one is served only when no request ahead of the demoted is waiting."""

    def __init__(self, main: RequestQueue) -> None:
        self.main = main
        self.demoted = FCFSQueue()

    def _tier(self, request: Request) -> RequestQueue:
        return self.demoted if request.slo_demoted else self.main

    def push(self, request: Request) -> None:
        self._tier(request).push(request)

    def push_front(self, request: Request) -> None:
        self._tier(request).push_front(request)

    def peek(self) -> Request:
        return self.main.peek() if len(self.main) else self.demoted.peek()

    def pop(self) -> Request:
        return self.main.pop() if len(self.main) else self.demoted.pop()

    def remove(self, request: Request) -> None:
        self._tier(request).remove(request)

    def demote(self, request: Request) -> None:
        self.main.remove(request)
        request.slo_demoted = True
        self.demoted.push(request)

    def __len__(self) -> int:
        return len(self.main) + len(self.demoted)

    def __iter__(self) -> Iterator[Request]:
        return itertools.chain(self.main, self.demoted)


def make_request_queue(
    order: SchedulingOrder, max_wait_s: float = 10.0, clock: Callable[[], float] = time.monotonic
) -> RequestQueue:
    if order == SchedulingOrder.FCFS:
        return FCFSQueue()
    if order == SchedulingOrder.PRIORITY:
        return PriorityQueue()
    if order == SchedulingOrder.SHORTEST_FIRST:
        return ShortestFirstQueue(max_wait_s, clock)
    raise ValueError(f"unknown scheduling order {order!r}")
