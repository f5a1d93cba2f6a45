"""Requests that have not arrived yet, released in arrival order by whichever clock drives the run."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from engine.core.request import Request


class ArrivalQueue:
    def __init__(self, requests: Iterable[Request]) -> None:
        self._pending = deque(sorted(requests, key=lambda r: r.arrival_s))

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def next_arrival_s(self) -> float | None:
        return self._pending[0].arrival_s if self._pending else None

    def pop_due(self, now_s: float) -> list[Request]:
        due = []
        while self._pending and self._pending[0].arrival_s <= now_s:
            due.append(self._pending.popleft())
        return due
