"""The serving state both the engine and the simulator mutate: queues and KV-block accounting
(the pool and its prefix cache: engine/core/block_pool.py)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol, cast

from engine.core.block_pool import KVBlockPool
from engine.core.config import SchedulerConfig
from engine.core.lane import BY_ADMISSION, DecodeLane
from engine.core.plan import BatchPlan, LaneIds
from engine.core.request import Request, RequestStatus


class GapSink(Protocol):
    """Hears the inter-token gaps of decode steps that ran without a plan each (a simulator's
    compact request log counts them once per step instead of once per request)."""

    def add(self, gap_s: float, count: int = 1) -> None:
        """``count`` gaps of ``gap_s``."""

    def add_series(self, first_s: float, step_s: float, num: int, count: int) -> None:
        """``num`` gaps ``first_s + i × step_s`` (i = 0 … num − 1), ``count`` of each: the steps
        of a run advanced at once, each one context token per member longer than the one before."""


class ServingState:
    """Waiting, running and finished requests. Schedulers read and admit; ``apply`` advances.

    Between steps, every running request that decodes sits in ``lane`` (engine/core/lane.py), which
    advances them together in O(1) when a step decodes them all (``decode_together``). Only this
    class touches the lane: schedulers ask for the decodes together or one by one.
    """

    def __init__(self, config: SchedulerConfig, keep_token_times: bool = True) -> None:
        self.config = config
        self.kv = KVBlockPool(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.requests: dict[str, Request] = {}  # every request not yet finished, by id
        self.lane = DecodeLane(config.block_size, keep_token_times)  # False: Request.token_times_s says what is kept
        self._num_admitted = 0
        self.released: list[str] = []  # ids whose KV the executor is yet to free (take_released)
        # prefix caching, over every admission: tokens looked up, found cached; requests with a hit
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.prefix_hit_requests = 0

    # --- arrivals ------------------------------------------------------------------------------
    def validate(self, request: Request) -> None:
        """Refuse what could never run here, before it is accepted."""
        cfg = self.config
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        if (request.status != RequestStatus.WAITING or request.lane is not None or request.num_computed_tokens
                or request.first_scheduled_s is not None):
            # a Request carries its run's progress: served again, it would keep the first run's times
            raise ValueError(f"request {request.request_id}: already served or in progress "
                             f"({request.status.name}, {request.num_output_tokens} tokens out); a run takes fresh "
                             f"requests")
        if request.max_total_tokens > cfg.max_model_len:
            raise ValueError(
                f"request {request.request_id}: prompt ({request.num_prompt_tokens} tokens) + max_tokens "
                f"({request.max_tokens}) = {request.max_total_tokens} exceeds max_model_len ({cfg.max_model_len})")
        if self.kv.blocks_for(request.max_total_tokens) > cfg.num_kv_blocks:
            raise ValueError(
                f"request {request.request_id}: needs {self.kv.blocks_for(request.max_total_tokens)} KV blocks "
                f"but the cache has only {cfg.num_kv_blocks}")

    def add(self, request: Request) -> None:
        self.validate(request)
        self.enqueue(request)

    def enqueue(self, request: Request) -> None:
        """Join the waiting queue; ``validate`` has accepted it already (EngineCore.add)."""
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- transitions the schedulers use ------------------------------------------------------
    def prefix_hit(self, request: Request) -> tuple[int, list[int]]:
        """(tokens, block ids) of the longest cached prefix of a waiting request's prompt, at
        least one token short of everything it needs, so its admission still samples a token.
        (0, []) without prefix caching. Nothing changes until ``kv.grow(..., shared=ids)``."""
        if not self.kv.caching:
            return 0, []
        block_size = self.config.block_size
        usable = (request.num_tokens - 1) // block_size
        ids = self.kv.lookup(request.block_hashes(block_size)[:usable])
        return len(ids) * block_size, ids

    def plan_saves(self, request: Request, num_tokens: int) -> list[tuple[int, int]]:
        """(block index, block id) of the request's full prompt blocks that a chunk of
        ``num_tokens`` from its computed tokens completes: the executor stores their KV."""
        end = min(request.num_computed_tokens + num_tokens, request.num_prompt_tokens) // self.config.block_size
        return self.kv.plan_saves(request.request_id, end)

    def admit(self, request: Request, cached_tokens: int = 0) -> None:
        """Move the head of the waiting queue into the running set; its first ``cached_tokens``
        are a prefix hit (``prefix_hit``; their blocks are already referenced)."""
        if not self.waiting or self.waiting[0] is not request:
            raise ValueError("only the head of the waiting queue can be admitted")
        self.waiting.popleft()
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = cached_tokens
        num_tokens = request.num_tokens
        request.num_lookup_tokens += num_tokens
        request.num_cached_tokens += cached_tokens
        self.prefix_queries += num_tokens
        if cached_tokens:
            self.prefix_hits += cached_tokens
            self.prefix_hit_requests += 1
        self._num_admitted += 1
        request.admit_seq = self._num_admitted
        self.running.append(request)

    # --- the decoding requests: together (the lane) or one by one -------------------------------
    @property
    def num_decoding(self) -> int:
        """Running requests that decode together this step (between steps: every decoding request)."""
        return len(self.lane.members)

    def prefilling(self) -> list[Request]:
        """Running requests with prompt (or recompute) tokens left, in running order."""
        if len(self.lane.members) == len(self.running):  # every running request decodes together
            return []
        # a lane member decodes: the attribute test spares most of them the property
        return [r for r in self.running if r.lane is None and not r.is_decoding]

    def decode_together(self) -> tuple[int, int, LaneIds] | None:
        """Reserve KV for one more token of every decoding request and describe that part of the
        step: (count, Σ contexts, their ids on demand). None, and nothing reserved, if blocks are
        short. O(1) whatever the count: the simulator's common step."""
        lane = self.lane
        if not lane.members:
            return None
        needing = lane.needing_block()  # their blocks are full: the next token takes one more each
        if needing:
            if not self.kv.add_block_each(needing):
                return None
            lane.got_block()
        return len(lane.members), lane.context_sum(), lane.part_reader()

    def repeat_decodes(self, start_s: float, before_s: float, step_s: float, per_context_s: float, overhead_s: float,
                       arrival_s: float, until_s: float, gaps: GapSink | None
                       ) -> tuple[int, float, float, list[Request]]:
        """Run, at once, the decodes-together steps that would follow one another unchanged (a
        simulator's shortcut, see EngineCore.repeat_decodes): each takes ``before_s``, then a call
        of ``step_s + per_context_s × Σ context``, then ``overhead_s``. A step runs if it starts before ``arrival_s``, is
        over before ``until_s`` and gets its blocks; the run ends with the first step in which
        requests finish. Returns (steps, last end, last ready, finished): the same token times,
        in the same arithmetic and order, as planning, executing and applying each step.
        ``gaps`` hears each step's uniform gaps (``count`` requests each), those inside the run
        as one series (the cost model's gaps: the end times' differences up to rounding)."""
        lane = self.lane
        n = len(lane.members)
        if not n:
            return 0, start_s, start_s, []
        context = lane.context_sum()
        steps, finished, (gap, count) = lane.advance_run(start_s, before_s, step_s, per_context_s, overhead_s,
                                                         arrival_s, until_s, self.kv)
        if not steps:
            return 0, start_s, start_s, []
        end = lane.last_end
        for request in finished:
            self.running.remove(request)
            self._finish(request, cast(RequestStatus, request.stop_reason()), end)  # reached max_tokens
        if gaps is not None:
            if count:
                gaps.add(gap, count)
            if steps > 1:  # step j's gap: its call and the overheads, at Σ context + j × n
                gaps.add_series(overhead_s + before_s + (step_s + per_context_s * (context + n)), per_context_s * n,
                                steps - 1, n)
        return steps, end, end + overhead_s, finished

    def decode_one_by_one(self) -> None:
        """This step treats each decoding request on its own (a budget or block shortage)."""
        self.lane.flush()

    def preempt(self, request: Request) -> None:
        """Free the request's KV and put it back at the head of the queue to recompute later."""
        if request.lane is not None:
            request.lane.leave(request)
        self.running.remove(request)
        self.kv.release(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self.released.append(request.request_id)

    def abort(self, request_id: str, now_s: float) -> Request | None:
        """Cancel a request wherever it is; its blocks are free at once."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED, now_s)
        return request

    # --- after a model call -------------------------------------------------------------------
    def apply(self, plan: BatchPlan, token_ids: Sequence[int] | None, start_s: float,
              end_s: float) -> list[Request]:
        """Advance every scheduled request; ``token_ids`` (None in simulation) go to sampling entries.

        Returns the requests that finished in this step, in plan order.
        """
        lane = self.lane
        together = plan.lane_size > 0 and lane.is_current()
        if together:
            finished = self._advance_lane(token_ids, end_s)
            if not plan.ids:  # the lane was the whole plan
                return finished
            entries = zip(plan.ids, plan.tokens, plan.sampled)
            k = plan.lane_size
            decodes = plan.explicit_decodes  # the entries' first ones (the lane's are not listed)
        else:  # request by request (a flushed lane writes the members' progress back); also a plan
            # whose decodes-together lost a member to an abort while the call ran
            finished = []
            lane.flush()
            lane.last_continuing = 0
            entries = zip(plan.request_ids, plan.num_tokens, plan.samples)
            k = 0
            decodes = plan.num_decodes
        requests = self.requests
        joining: list[Request] = []
        pending = self.kv.pending  # prefix blocks this step computed, to be cached now
        for request_id, n, sampled in entries:
            request = requests.get(request_id)
            decodes -= 1
            if request is None:  # aborted while the call ran
                k += sampled
                continue
            if request.first_scheduled_s is None:
                request.first_scheduled_s = start_s
            if decodes < 0:  # a prefill chunk (a prompt's, or a recompute's: one token may be left)
                request.num_prefill_tokens += n
            request.num_computed_tokens += n
            if pending and request_id in pending:
                self.kv.commit(request_id, request.block_hashes(self.config.block_size))
            if sampled:
                request.append_output(token_ids[k] if token_ids is not None else None, end_s)
                k += 1
                reason = request.stop_reason()
                if reason is not None:
                    self.running.remove(request)
                    self._finish(request, reason, end_s)
                    finished.append(request)
                    continue
            if request.is_decoding:  # sampled, or recomputed up to its newest token
                joining.append(request)
        if not together:  # decoders the plan left out (budget or preemption) rejoin as well
            joining = [r for r in self.running if r.is_decoding]
        held = self.kv.held
        for request in joining:
            lane.join(request, held[request.request_id])
        return finished

    @property
    def last_uniform_gaps(self) -> tuple[float, int]:
        """(gap, count): in the last applied step, ``count`` requests that decoded together in the
        step before too got their token ``gap`` seconds after their previous one. Compact
        records count those gaps here, once per step, instead of once per token."""
        lane = self.lane
        return lane.last_gap_s, lane.last_continuing

    def take_released(self) -> list[str]:
        """Requests whose KV the executor should free: finished, aborted or preempted since the
        last call."""
        released, self.released = self.released, []
        return released

    def _advance_lane(self, token_ids: Sequence[int] | None, end_s: float) -> list[Request]:
        """Every lane member got one token at ``end_s`` (values first in ``token_ids``, in real
        runs); returns those that finished, in running order."""
        lane = self.lane
        stopped = []
        if token_ids is not None:
            for request, token in zip(lane.members, token_ids):
                request.output_token_ids.append(token)
                if token == request.eos_token_id and not request.ignore_eos:
                    stopped.append(request)
        done = lane.advance(end_s)
        for request in stopped:
            if request not in done:
                done.append(request)
        if stopped:
            done.sort(key=BY_ADMISSION)
        for request in done:
            self.running.remove(request)
            self._finish(request, cast(RequestStatus, request.stop_reason()), end_s)  # length or EOS
        return done

    def _finish(self, request: Request, status: RequestStatus, now_s: float) -> None:
        if request.lane is not None:
            request.lane.leave(request)
        request.status = status
        request.finished_s = now_s
        self.kv.release(request.request_id)
        self.released.append(request.request_id)
        del self.requests[request.request_id]
        self.finished.append(request)

    def check_invariants(self) -> None:
        """Conservation of blocks and requests; tests call it after every step."""
        kv = self.kv
        kv.check()
        assert len(self.running) <= self.config.max_num_seqs
        ids = [r.request_id for r in self.running] + [r.request_id for r in self.waiting]
        assert len(ids) == len(set(ids)) == len(self.requests)
        for r in self.running:
            assert r.status == RequestStatus.RUNNING
            assert kv.held.get(r.request_id, 0) >= kv.blocks_for(r.num_computed_tokens)
            assert (r.lane is self.lane) == r.is_decoding  # between steps, every decoder is in the lane
        assert [r.admit_seq for r in self.running] == sorted(r.admit_seq for r in self.running)
        assert self.lane.members == [r for r in self.running if r.lane is not None]
        self.lane.check(kv.held)
        for r in self.waiting:
            assert r.request_id not in kv.held and r.num_computed_tokens == 0
        assert not kv.pending  # saves are planned and committed within one step
