"""Requests accepted but not yet arrived, released in arrival order by whichever clock drives the run."""

from __future__ import annotations

from bisect import insort
from collections import deque
from collections.abc import Iterable, Iterator

from engine.core.request import Request

ARRIVAL = lambda r: r.arrival_s  # noqa: E731
INF = float("inf")


class ArrivalQueue:
    def __init__(self, requests: Iterable[Request] = ()) -> None:
        self._pending = deque(sorted(requests, key=ARRIVAL))
        self._ids = {r.request_id for r in self._pending}
        self.next_s = self._pending[0].arrival_s if self._pending else INF  # the next arrival, or inf

    def __len__(self) -> int:
        return len(self._pending)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._pending)

    @property
    def next_arrival_s(self) -> float | None:
        return self.next_s if self._pending else None

    def _update_next(self) -> None:
        self.next_s = self._pending[0].arrival_s if self._pending else INF

    def push(self, request: Request) -> None:
        """Add one; in order (the usual case) this is an append."""
        self._ids.add(request.request_id)
        pending = self._pending
        if not pending or pending[-1].arrival_s <= request.arrival_s:
            pending.append(request)
        else:
            items = list(pending)
            insort(items, request, key=ARRIVAL)
            self._pending = deque(items)
        self._update_next()

    def holds(self, request_id: str) -> bool:
        return request_id in self._ids

    def remove(self, request_id: str) -> Request | None:
        if request_id not in self._ids:
            return None
        request = next(r for r in self._pending if r.request_id == request_id)
        self._pending.remove(request)
        self._ids.discard(request_id)
        self._update_next()
        return request

    def pop_due(self, now_s: float) -> list[Request]:
        """Every request with ``arrival_s <= now_s``, in arrival order (callers on a hot path test
        ``next_s <= now_s`` first)."""
        pending, ids = self._pending, self._ids
        due = []
        while pending and pending[0].arrival_s <= now_s:
            request = pending.popleft()
            ids.discard(request.request_id)
            due.append(request)
        self._update_next()
        return due
