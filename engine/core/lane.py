"""The decode lane: the running requests that decode one token every step, advanced together.

Most request-steps of a serving run are decodes that all do the same thing: one token each,
context one longer. The lane keeps each member's progress relative to one step clock, so a step
that decodes every member updates the state in O(1) instead of once per member, and knows
ahead of time which members finish (by length) and which need a new KV block at which step.
That is what lets the simulator replay millions of requests; the real engine runs the same
code, so both see identical plans. A member leaves (its progress written back) when it
finishes, is preempted or aborted, or when a step does not decode every member. A simulator's
run of such steps (``advance_run``) stores its cost terms, not one end time per step: it stores
O(1) and costs a few floating-point operations per step, plus its block grants and finishes.
"""

from __future__ import annotations

from bisect import insort
from heapq import heappop, heappush
from collections.abc import Callable
from operator import attrgetter

from engine.core.arrivals import INF
from engine.core.block_pool import KVBlockPool
from engine.core.request import Request

BY_ADMISSION = attrgetter("admit_seq")  # running order

COMPACT_EVERY = 1 << 12  # end times listed or runs stored between dropping those no member needs


# Binary searches written as loops rather than bisect's key=: compiled, they read the attribute
# natively, where a key calls back into Python at every probe (a leave and a finish run both).
def member_index(members: list[Request], admit_seq: int) -> int:
    """Where a request admitted ``admit_seq``-th sits (or would) in ``members`` (running order):
    bisect_left by admission."""
    lo, hi = 0, len(members)
    while lo < hi:
        mid = (lo + hi) // 2
        if members[mid].admit_seq < admit_seq:
            lo = mid + 1
        else:
            hi = mid
    return lo


def run_index(runs: list[TimesRun], clock: int) -> int:
    """The last of ``runs`` (clock order) starting at or before ``clock``: bisect_right by clock, less one."""
    lo, hi = 0, len(runs)
    while lo < hi:
        mid = (lo + hi) // 2
        if clock < runs[mid].clock:
            hi = mid
        else:
            lo = mid + 1
    return lo - 1


class TimesRun:
    """End times of consecutive advances of the lane from clock ``clock`` on: listed as they
    come (steps applied one by one), or, for a run of steps advanced at once
    (``DecodeLane.advance_run``), recomputed on demand from the run's cost terms in the run's own
    arithmetic, so a run stores O(1) whatever its length and gives the same floats."""

    def __init__(self, clock: int, ends: list[float] | None, count: int, first_end: float, last_end: float,
                 start_s: float = 0.0, before_s: float = 0.0, step_s: float = 0.0, per_context_s: float = 0.0,
                 overhead_s: float = 0.0, context: int = 0, n: int = 0) -> None:
        self.clock = clock
        self.ends = ends  # None: computed
        self.count = count
        self.first_end = first_end
        self.last_end = last_end
        self.start_s = start_s
        self.before_s = before_s
        self.step_s = step_s
        self.per_context_s = per_context_s
        self.overhead_s = overhead_s
        self.context = context
        self.n = n

    def end(self, i: int) -> float:
        """The end of its ``i``-th advance (0-based)."""
        ends = self.ends
        if ends is not None:
            return ends[i]
        if i == 0:
            return self.first_end
        if i == self.count - 1:
            return self.last_end
        return self.ends_from(i, i + 1)[0]

    def ends_from(self, i: int, stop: int = -1) -> list[float]:
        """End times of its advances ``i`` up to ``stop`` (default: all)."""
        stop = self.count if stop < 0 else stop
        ends = self.ends
        if ends is not None:
            return ends[i:stop]
        before_s, step_s, per_context_s, overhead_s = self.before_s, self.step_s, self.per_context_s, self.overhead_s
        context, n = self.context, self.n
        out: list[float] = []
        start = self.start_s
        for j in range(stop):  # DecodeLane.advance_run's arithmetic, step by step
            end = start + before_s + (step_s + per_context_s * (context + j * n))
            if j >= i:
                out.append(end)
            start = end + overhead_s
        return out


class DecodeLane:
    """Members in running order (admission order), with calendars of their next events."""

    def __init__(self, block_size: int, keep_times: bool = True) -> None:
        self.block_size = block_size
        # False (a simulator's compact records): a member's stay writes back its first and last
        # token times only, which is all those records read (Request.gaps_outside_lane_steps)
        self.keep_times = keep_times
        self.clock = 0  # steps advanced so far
        self.members: list[Request] = []
        self._ids: list[str] = []
        self._offsets: list[int] = []  # computed tokens minus the clock
        self._offset_sum = 0
        self._runs: list[TimesRun] = []  # the end time of every advance: clocks _runs[0].clock + 1 ... clock
        self._stored = 0  # end times listed plus computed runs: what compaction bounds
        self._last_end = 0.0  # the last advance's end
        self._finish_at: dict[int, list[Request]] = {}  # clock at which a member reaches max_tokens
        self._finish_clocks: list[int] = []  # heap of _finish_at's keys (and some since removed)
        self._block_at: dict[int, list[Request]] = {}  # clock at which members have filled their blocks
        self._compact_at = COMPACT_EVERY
        self._snapshot = -1  # the version the last part_reader described
        self._num_joined_now = 0  # members that joined since the last advance
        # the last advance: members whose previous token came from the advance before, and the gap
        self.last_continuing = 0
        self.last_gap_s = 0.0
        self._version = 0  # changes with every join, leave, flush and advance

    def times_since(self, joined: int) -> list[float]:
        """End times of the advances after clock ``joined``."""
        if joined >= self.clock:
            return []
        runs = self._runs
        r = run_index(runs, joined)
        ends = runs[r].ends_from(joined - runs[r].clock)
        for i in range(r + 1, len(runs)):
            ends += runs[i].ends_from(0)
        return ends

    def _end_at(self, clock: int) -> float:
        """The end of the advance that took the lane to ``clock``."""
        run = self._runs[run_index(self._runs, clock - 1)]
        return run.end(clock - 1 - run.clock)

    @property
    def last_end(self) -> float:
        return self._last_end

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
            i = member_index(members, request.admit_seq)
            members.insert(i, request)
            self._ids.insert(i, request.request_id)
            self._offsets.insert(i, request._computed)
        self._offset_sum += request._computed
        self._num_joined_now += 1
        finish = request.max_tokens - request._num_output
        if finish not in self._finish_at:
            heappush(self._finish_clocks, finish)
        self._file(self._finish_at, finish, request)
        due = request.lane_block_due = held_blocks * self.block_size - request._computed
        self._file(self._block_at, due, request)
        self._version += 1

    def leave(self, request: Request) -> None:
        """Write the member's progress back onto it."""
        if request.lane_joined == self.clock:
            self._num_joined_now -= 1
        i = member_index(self.members, request.admit_seq)
        del self.members[i], self._ids[i], self._offsets[i]
        self._offset_sum -= request._computed
        self._unfile(self._finish_at, request.max_tokens - request._num_output, request)
        self._unfile(self._block_at, request.lane_block_due, request)
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
        self._num_joined_now = 0
        self._version += 1

    def _write_back(self, request: Request) -> None:
        clock = self.clock
        request._computed += clock
        request._num_output += clock
        joined = request.lane_joined
        if clock > joined:
            if self.keep_times:
                stay = self.times_since(joined)
            else:
                first = self._end_at(joined + 1)
                stay = [first] if clock == joined + 1 else [first, self._last_end]
            request.lane_runs.append((len(request._times), len(stay)))
            request._times += stay
        request.lane = None

    @staticmethod
    def _file(calendar: dict[int, list[Request]], at: int, member: Request) -> None:
        calendar.setdefault(at, []).append(member)

    @staticmethod
    def _unfile(calendar: dict[int, list[Request]], at: int, member: Request) -> None:
        filed = calendar[at]
        filed.remove(member)
        if not filed:
            del calendar[at]

    def check(self, held: dict[str, int]) -> None:
        """The block calendar files each member once, at the clock its progress and ``held`` (the
        pool's blocks per request) say its blocks are full, never behind the lane's clock; each
        member is in the finish calendar at the clock it reaches max_tokens.
        ServingState.check_invariants calls it."""
        filed = sorted((at, r.admit_seq) for at, members in self._block_at.items() for r in members)
        assert filed == sorted((r.lane_block_due, r.admit_seq) for r in self.members)
        for request in self.members:
            assert request.lane_block_due == held[request.request_id] * self.block_size - request._computed
            assert request.lane_block_due >= self.clock  # no need was stepped past without its block
            assert request in self._finish_at[request.max_tokens - request._num_output]

    # --- one step -------------------------------------------------------------------------------
    def needing_block(self) -> list[Request]:
        """The members whose next token needs one more KV block (their blocks are full)."""
        return self._block_at.get(self.clock, [])

    def got_block(self) -> None:
        """Every member in needing_block() got its block: the next need is a block later."""
        filed = self._block_at.get(self.clock)
        if filed:
            self._refile(self.clock, filed)

    def _refile(self, at: int, filed: list[Request]) -> int:
        """The members ``filed`` at clock ``at`` got their blocks: they need the next a block later
        (returned)."""
        block_at = self._block_at
        del block_at[at]
        due = at + self.block_size
        later = block_at.get(due)
        if later is None:
            block_at[due] = filed
        else:
            later.extend(filed)
        for request in filed:
            request.lane_block_due = due
        return due

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
        n = len(self.members)
        continuing = n - self._num_joined_now
        self.last_gap_s, self.last_continuing = (end_s - self._last_end if continuing else 0.0), continuing
        last = self._runs[-1] if self._runs else None
        if last is not None and last.ends is not None:
            last.ends.append(end_s)
            last.count += 1
            last.last_end = end_s
            self._stored += 1
        else:
            self._add_run(TimesRun(self.clock, [end_s], 1, end_s, end_s))
        return self._advanced(1, end_s)

    def advance_run(self, start_s: float, before_s: float, step_s: float, per_context_s: float, overhead_s: float,
                    arrival_s: float, until_s: float, pool: KVBlockPool
                    ) -> tuple[int, list[Request], tuple[float, int]]:
        """Advance at once the steps that decode every member from ``start_s`` on, each taking
        ``before_s``, a call of ``step_s + per_context_s × Σ context``, then ``overhead_s``: those
        that start before ``arrival_s``, are over before ``until_s`` and whose block needs
        ``pool`` meets, up to the first in which a member finishes.
        Stores the run, not its end times (TimesRun recomputes them), so what it costs is a few
        floating-point operations per step plus the block grants. Returns (steps, those that
        finished, the first step's (gap, continuing members)); no steps: nothing changed."""
        n = len(self.members)
        context = self._offset_sum + n * self.clock
        steps, first_end, previous_end, last_end = self._run_ends(
            start_s, before_s, step_s, per_context_s, overhead_s, context, n, arrival_s, until_s, self.steps_to_finish())
        if steps and self._block_at:
            granted = self._grant_blocks(steps, pool)
            if granted < steps:  # the pool ran short: the run's ends again, up to there
                steps, first_end, previous_end, last_end = self._run_ends(
                    start_s, before_s, step_s, per_context_s, overhead_s, context, n, INF, INF, granted)
        if not steps:
            return 0, [], (0.0, 0)
        continuing = n - self._num_joined_now
        first_gap = (first_end - self._last_end if continuing else 0.0, continuing)
        if steps > 1:
            self.last_gap_s, self.last_continuing = last_end - previous_end, n
        else:
            self.last_gap_s, self.last_continuing = first_gap
        self._add_run(TimesRun(self.clock, None, steps, first_end, last_end, start_s, before_s, step_s, per_context_s,
                               overhead_s, context, n))
        return steps, self._advanced(steps, last_end), first_gap

    @staticmethod
    def _run_ends(start_s: float, before_s: float, step_s: float, per_context_s: float, overhead_s: float,
                  context: int, n: int, arrival_s: float, until_s: float, limit: int
                  ) -> tuple[int, float, float, float]:
        """How many of the next ``limit`` steps start before ``arrival_s`` and are over before
        ``until_s``, and the ends of the first, the one before the last, and the last of them."""
        start = start_s
        first = previous = last = 0.0
        for j in range(limit):
            if start >= arrival_s:
                return j, first, previous, last
            end = start + before_s + (step_s + per_context_s * (context + j * n))  # TimesRun.ends_from's
            start = end + overhead_s
            if start >= until_s:
                return j, first, previous, last
            if j == 0:
                first = end
            previous, last = last, end
        return limit, first, previous, last

    def _grant_blocks(self, steps: int, pool: KVBlockPool) -> int:
        """Grant, in clock order, the blocks the members need along the next ``steps`` steps, as
        stepping would (got_block's filing); returns how many steps got theirs (up to the first
        need refused)."""
        block_at = self._block_at
        clock = self.clock
        stop = clock + steps
        if steps <= len(block_at):
            pending = [at for at in range(clock, stop) if at in block_at]
        else:
            pending = sorted([at for at in block_at if clock <= at < stop])
        i = 0
        while i < len(pending):
            at = pending[i]
            i += 1
            needing = block_at.get(at)
            if needing is None:  # filed twice in pending, granted already
                continue
            if not pool.add_block_each(needing):
                return at - clock
            due = self._refile(at, needing)
            if due < stop:
                insort(pending, due, i)
        return steps

    def steps_to_finish(self) -> int:
        """Steps until the first member reaches max_tokens (the step in which it does counts)."""
        clocks, calendar = self._finish_clocks, self._finish_at
        while clocks and clocks[0] not in calendar:  # left since it was filed
            heappop(clocks)
        return clocks[0] - self.clock if clocks else 0

    def _add_run(self, run: TimesRun) -> None:
        self._runs.append(run)
        self._stored += 1

    def _advanced(self, steps: int, last_end: float) -> list[Request]:
        """The clock moved ``steps`` on: the members that reached max_tokens, in running order."""
        self._num_joined_now = 0
        self._version += 1
        self.clock += steps
        self._last_end = last_end
        if self._stored >= self._compact_at:
            self._compact()
        done = self._finish_at.get(self.clock)
        if not done:
            return []
        return [done[0]] if len(done) == 1 else sorted(done, key=BY_ADMISSION)  # (a copy: leaving unfiles them)

    def _compact(self) -> None:
        """Drop the end times of advances up to the oldest member's join: nobody reads them."""
        oldest = min((r.lane_joined for r in self.members), default=self.clock)
        runs = self._runs
        r = run_index(runs, oldest)  # the run holding the advance after `oldest`
        dropped = 0
        if r > 0:
            dropped = sum([len(run.ends) if run.ends is not None else 1 for run in runs[:r]])
            del runs[:r]
        if runs:
            first = runs[0]
            listed = first.ends
            drop = oldest - first.clock
            if listed is not None and drop > 0:
                del listed[:drop]
                dropped += drop
                first.clock, first.count = oldest, len(listed)
                if listed:
                    first.first_end = listed[0]
                else:
                    del runs[0]
        self._stored -= dropped
        self._compact_at = self._stored + COMPACT_EVERY
