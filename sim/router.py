"""Which replica a new request goes to."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Protocol


class HasOutstanding(Protocol):
    @property
    def outstanding(self) -> int: ...


class RoundRobin:
    name: ClassVar[str] = "round_robin"
    reads_load: ClassVar[bool] = False  # the pick does not depend on the replicas' state: it can be made early

    def __init__(self) -> None:
        self._next = 0

    def pick(self, replicas: Sequence[HasOutstanding]) -> int:
        i = self._next % len(replicas)
        self._next += 1
        return i


class LeastOutstanding:
    """Fewest requests delivered and not yet finished; ties go to the lowest index."""

    name: ClassVar[str] = "least_outstanding"
    reads_load: ClassVar[bool] = True

    def pick(self, replicas: Sequence[HasOutstanding]) -> int:
        return min(range(len(replicas)), key=lambda i: replicas[i].outstanding)


ROUTERS = {cls.name: cls for cls in (RoundRobin, LeastOutstanding)}


def make_router(name: str) -> RoundRobin | LeastOutstanding:
    if name not in ROUTERS:
        raise ValueError(f"router must be one of {tuple(ROUTERS)}, got {name!r}")
    return ROUTERS[name]()
