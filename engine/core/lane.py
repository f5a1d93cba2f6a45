"""The decode lane: the running requests that decode one token every step, advanced together.

Most request-steps of a serving run are decodes that all do the same thing: one token each,
context one longer. The lane keeps each member's progress relative to one step clock, so a step
that decodes every member updates the state in O(1) instead of once per member, and knows
ahead of time which members finish (by length) and which need a new KV block at which step.
That is what lets the simulator replay millions of requests; the real engine runs the same
code, so both see identical plans. A member leaves (its progress written back) when it
finishes, is preempted or aborted, or when a step does not decode every member.
"""

from __future__ import annotations

from bisect import bisect_left
from heapq import heappop, heappush
from collections.abc import Callable
from operator import attrgetter

from engine.core.request import Request

BY_ADMISSION = attrgetter("admit_seq")  # running order

COMPACT_EVERY = 1 << 16  # steps between dropping token times no member needs any more


class DecodeLane:
    """Members in running order (admission order), with calendars of their next events."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.clock = 0  # steps advanced so far
        self.members: list[Request] = []
        self._ids: list[str] = []
        self._offsets: list[int] = []  # computed tokens minus the clock
        self._offset_sum = 0
        self._times: list[float] = []  # end time of each advance; index = clock - _times_base - 1
        self._times_base = 0
        self._finish_at: dict[int, list[Request]] = {}  # clock at which a member reaches max_tokens
        self._finish_clocks: list[int] = []  # heap of _finish_at's keys (and some since removed)
        self._block_at: dict[int, list[str]] = {}  # clock at which members (by id) have filled their blocks
        self._block_due: dict[str, int] = {}  # the same, by member id
        self._compact_at = COMPACT_EVERY
        self._snapshot = -1  # the version the last part_reader described
        self._num_joined_now = 0  # members that joined since the last advance
        # the last advance: members whose previous token came from the advance before, and the gap
        self.last_continuing = 0
        self.last_gap_s = 0.0
        self._version = 0  # changes with every join, leave, flush and advance

    def times_since(self, joined: int) -> list[float]:
        """End times of the advances after clock ``joined``."""
        return self._times[joined - self._times_base:]

    # --- membership ---------------------------------------------------------------------------
    def join(self, request: Request, held_blocks: int) -> None:
        """Take over a decoding request's progress; ``held_blocks`` is its KV now."""
        clock = self.clock
        request._computed -= clock
        request._num_output -= clock
        request.lane, request.lane_joined = self, clock
        members = self.members
        if not members or members[-1].admit_seq < request.admit_seq:  # usually the newest member
            members.append(request)
            self._ids.append(request.request_id)
            self._offsets.append(request._computed)
        else:
            i = bisect_left(members, request.admit_seq, key=BY_ADMISSION)
            members.insert(i, request)
            self._ids.insert(i, request.request_id)
            self._offsets.insert(i, request._computed)
        self._offset_sum += request._computed
        self._num_joined_now += 1
        finish = request.max_tokens - request._num_output
        if finish not in self._finish_at:
            heappush(self._finish_clocks, finish)
        self._file(self._finish_at, finish, request)
        due = self._block_due[request.request_id] = held_blocks * self.block_size - request._computed
        self._file(self._block_at, due, request.request_id)
        self._version += 1

    def leave(self, request: Request) -> None:
        """Write the member's progress back onto it."""
        if request.lane_joined == self.clock:
            self._num_joined_now -= 1
        i = bisect_left(self.members, request.admit_seq, key=BY_ADMISSION)
        del self.members[i], self._ids[i], self._offsets[i]
        self._offset_sum -= request._computed
        self._unfile(self._finish_at, request.max_tokens - request._num_output, request)
        self._unfile(self._block_at, self._block_due.pop(request.request_id), request.request_id)
        self._write_back(request)
        self._version += 1

    def flush(self) -> None:
        """Every member leaves: the step ahead treats each request on its own."""
        if not self.members:
            return
        for request in self.members:
            self._write_back(request)
        for lst in (self.members, self._ids, self._offsets):
            lst.clear()
        self._offset_sum = 0
        self._finish_at.clear()
        self._finish_clocks.clear()
        self._block_at.clear()
        self._block_due.clear()
        self._num_joined_now = 0
        self._version += 1

    def _write_back(self, request: Request) -> None:
        clock = self.clock
        request._computed += clock
        request._num_output += clock
        if clock > request.lane_joined:
            request.lane_runs.append((len(request._times), clock - request.lane_joined))
            request._times += self.times_since(request.lane_joined)
        request.lane = None

    @staticmethod
    def _file(calendar: dict[int, list], at: int, member: Request | str) -> None:
        calendar.setdefault(at, []).append(member)

    @staticmethod
    def _unfile(calendar: dict[int, list], at: int, member: Request | str) -> None:
        filed = calendar[at]
        filed.remove(member)
        if not filed:
            del calendar[at]

    # --- one step -------------------------------------------------------------------------------
    def needing_block(self) -> list[str]:
        """Ids of the members whose next token needs one more KV block (their blocks are full)."""
        return self._block_at.get(self.clock, [])

    def got_block(self) -> None:
        """Every member in needing_block() got its block: the next need is a block later."""
        filed = self._block_at.pop(self.clock, None)
        if filed:
            due = self.clock + self.block_size
            self._block_at.setdefault(due, []).extend(filed)
            for request_id in filed:
                self._block_due[request_id] = due

    def context_sum(self) -> int:
        """Σ contexts of a step that decodes every member (what decode attention reads)."""
        return self._offset_sum + len(self.members) * self.clock

    def part_reader(self) -> Callable[[], tuple[tuple[str, ...], tuple[int, ...]]]:
        """A function giving (request ids, contexts) of the step that decodes every member now, in
        running order; it refuses to answer once the lane has moved on (the step was applied)."""
        snapshot = self._version

        def read() -> tuple[tuple[str, ...], tuple[int, ...]]:
            if self._version != snapshot:
                raise RuntimeError("a plan's lane part was read after its step was applied; "
                                   "materialize() kept plans before applying them")
            clock = self.clock
            return tuple(self._ids), tuple([offset + clock for offset in self._offsets])

        self._snapshot = snapshot
        return read

    def is_current(self) -> bool:
        """Whether the last part_reader() still describes the members (nothing joined, left or moved)."""
        return self._snapshot == self._version

    def advance(self, end_s: float) -> list[Request]:
        """Every member got one token at ``end_s``; returns those that reached max_tokens (still
        members: the caller finishes them)."""
        return self.advance_many([end_s])[0]

    def run_ends(self, start_s: float, before_s: float, step_s: float, per_context_s: float, overhead_s: float,
                 arrival_s: float, until_s: float, grant: Callable[[list[str]], bool]) -> list[float]:
        """End times of the steps that decode every member from ``start_s`` on, each taking
        ``before_s``, a call of ``step_s + per_context_s × Σ context``, then ``overhead_s``: those that start before
        ``arrival_s``, are over before ``until_s``, whose block needs ``grant`` meets (given the
        ids needing one), up to the
        first in which a member finishes. Blocks granted are filed as got_block would; nothing
        else changes until ``advance_many(ends)``."""
        n = len(self.members)
        context = self._offset_sum + n * self.clock
        block_at, block_due, block_size = self._block_at, self._block_due, self.block_size
        ends: list[float] = []
        start = start_s
        at = self.clock
        for j in range(self.steps_to_finish()):
            if start >= arrival_s:
                break
            end = start + before_s + (step_s + per_context_s * (context + j * n))
            ready = end + overhead_s
            if ready >= until_s:
                break
            needing = block_at.get(at)
            if needing:
                if not grant(needing):
                    break
                del block_at[at]
                due = at + block_size
                block_at.setdefault(due, []).extend(needing)
                for request_id in needing:
                    block_due[request_id] = due
            ends.append(end)
            start = ready
            at += 1
        return ends

    def steps_to_finish(self) -> int:
        """Steps until the first member reaches max_tokens (the step in which it does counts)."""
        clocks, calendar = self._finish_clocks, self._finish_at
        while clocks and clocks[0] not in calendar:  # left since it was filed
            heappop(clocks)
        return clocks[0] - self.clock if clocks else 0

    def advance_many(self, ends: list[float]) -> tuple[list[Request], tuple[float, int]]:
        """``advance`` for each end time in turn, at once; no member may finish before the last
        (``steps_to_finish``). Returns those that finished and the first step's (gap, continuing
        members); ``last_gap_s``/``last_continuing`` are the last step's."""
        n = len(self.members)
        continuing = n - self._num_joined_now
        first_gap = (ends[0] - self._times[-1] if continuing else 0.0, continuing)
        if len(ends) > 1:
            self.last_continuing, self.last_gap_s = n, ends[-1] - ends[-2]
        else:
            self.last_gap_s, self.last_continuing = first_gap
        self._num_joined_now = 0
        self._version += 1
        self.clock += len(ends)
        self._times += ends
        if len(self._times) >= self._compact_at:
            self._compact()
        done = self._finish_at.get(self.clock)
        return (sorted(done, key=BY_ADMISSION) if done else []), first_gap

    def _compact(self) -> None:
        oldest = min((r.lane_joined for r in self.members), default=self.clock)
        drop = oldest - self._times_base
        if drop > 0:
            del self._times[:drop]
            self._times_base = oldest
        self._compact_at = len(self._times) + COMPACT_EVERY
