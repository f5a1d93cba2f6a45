"""The three scheduling policies. Pure: they read and admit into a ServingState, return a plan.

No torch, no simpy, no clock here: the real engine and the simulator run exactly this code, and
the only thing that differs between them is how long executing the returned plan takes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from engine.core.config import SchedulerConfig
from engine.core.plan import BatchPlan
from engine.core.request import Request, RequestStatus
from engine.core.state import ServingState


class Scheduler(ABC):
    name: str

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config

    @abstractmethod
    def schedule(self, state: ServingState) -> BatchPlan | None:
        """The next model call, or None when nothing can run until a request arrives."""

    @abstractmethod
    def decodes_only(self, state: ServingState) -> bool:
        """Whether the next step is one token for every member of the decode lane and nothing
        else; ``schedule`` then returns exactly that plan. The simulator runs such steps
        without building their plans. True has reserved what the step needs (as ``schedule``
        would have)."""


def lane_plan(scheduler: str, state: ServingState) -> BatchPlan:
    """The step that decodes every lane member: one token each, in running order."""
    ids, contexts = state.lane.decode_part()
    n = len(ids)
    return BatchPlan(scheduler, ids, (1,) * n, contexts, (True,) * n, n)


class StaticScheduler(Scheduler):
    """A closed group: admit up to ``max_num_seqs`` when nothing runs, prefill them in one call,
    then decode the unfinished members every step. Holes left by short requests stay empty
    until the whole group is done. The group reserves its full KV up front, so it never preempts."""

    name = "static"

    @property
    def group_size(self) -> int:
        return self.config.max_num_seqs

    def schedule(self, state: ServingState) -> BatchPlan | None:
        if not state.running:
            self._admit_group(state)
        if not state.running:
            return None
        if self.decodes_only(state):  # the whole group decodes
            return lane_plan(self.name, state)
        members = state.running
        to_prefill = [r for r in members if r.num_computed_tokens == 0]
        if to_prefill:
            return BatchPlan(
                scheduler=self.name,
                request_ids=tuple(r.request_id for r in to_prefill),
                num_tokens=tuple(r.num_tokens for r in to_prefill),
                context_lens=(0,) * len(to_prefill),
                samples=(True,) * len(to_prefill),
                num_decodes=0,
            )
        return BatchPlan(  # decoders outside the lane (it was flushed): the same step, request by request
            scheduler=self.name,
            request_ids=tuple(r.request_id for r in members),
            num_tokens=(1,) * len(members),
            context_lens=tuple(r.num_computed_tokens for r in members),
            samples=(True,) * len(members),
            num_decodes=len(members),
        )

    def decodes_only(self, state: ServingState) -> bool:
        return bool(state.running) and len(state.lane.members) == len(state.running)

    def _admit_group(self, state: ServingState) -> None:
        while state.waiting and len(state.running) < self.group_size:
            head = state.waiting[0]
            if not state.kv.grow(head.request_id, head.max_total_tokens):
                break
            state.admit(head)


class SerialScheduler(StaticScheduler):
    """One request from prefill to its last token, then the next: a static group of one."""

    name = "serial"

    @property
    def group_size(self) -> int:
        return 1


class ContinuousScheduler(Scheduler):
    """Iteration-level batching with chunked prefill (vLLM v1 style).

    Each step: one token for every decoding request, then the rest of ``max_num_batched_tokens``
    on prefill chunks of at most ``long_prefill_token_threshold`` tokens — partially prefilled
    requests first, then waiting requests FCFS while ``max_num_seqs`` and KV blocks allow. When a
    running request cannot get a KV block, the newest running request is preempted and will be
    recomputed from scratch later.
    """

    name = "continuous"

    def decodes_only(self, state: ServingState) -> bool:
        cfg = self.config
        n = len(state.lane.members)
        if not n or n < len(state.running) or n > cfg.max_num_batched_tokens or not state.grow_lane():
            return False
        if state.waiting and n < cfg.max_num_batched_tokens and n < cfg.max_num_seqs:
            head = state.waiting[0]  # would it be admitted?
            chunk = min(head.num_tokens, cfg.long_prefill_token_threshold, cfg.max_num_batched_tokens - n)
            return not state.kv.can_grow(head.request_id, chunk)
        return True

    def schedule(self, state: ServingState) -> BatchPlan | None:
        if self.decodes_only(state):
            return lane_plan(self.name, state)
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        kv, lane = state.kv, state.lane
        lane_part: tuple[tuple[str, ...], tuple[int, ...]] | None = None  # every lane member decodes
        decodes: dict[str, int] = {}  # otherwise: id -> context, request by request
        prefills: dict[str, tuple[int, int, bool]] = {}  # id -> (tokens, context, samples)
        preempted: list[str] = []

        def reserve(request: Request, n: int) -> bool:
            """Blocks for ``n`` more tokens, preempting the newest running requests if needed."""
            nonlocal budget, lane_part
            while not kv.grow(request.request_id, request.num_computed_tokens + n):
                if lane_part is not None:  # preemption is request by request: unpack the lane
                    decodes.update(zip(*lane_part))
                    lane_part = None
                    lane.flush()
                victim = state.running[-1]
                state.preempt(victim)
                preempted.append(victim.request_id)
                if victim.request_id in decodes:
                    del decodes[victim.request_id]
                    budget += 1
                elif victim.request_id in prefills:
                    budget += prefills.pop(victim.request_id)[0]
                if victim is request:
                    return False
            return True

        # Decodes first, one token each in running order. When the budget and the free blocks
        # cover them all, that is the whole lane at once (the common case); otherwise request by
        # request, preempting the newest running requests when blocks run out.
        num_lane = len(lane.members)
        if num_lane and budget >= num_lane and state.grow_lane():
            lane_part = lane.decode_part()
            budget -= num_lane
            prefilling = [r for r in state.running if r.lane is None] if num_lane < len(state.running) else []
        else:
            lane.flush()
            # Split once: preemption below only removes requests (newest first), and it leaves the
            # decode/prefill split of the others unchanged, so each pass sees what it always saw.
            decoding, prefilling = [], []
            for request in state.running:
                (decoding if request.is_decoding else prefilling).append(request)
            for request in decoding:
                if budget == 0:
                    break
                if request.status != RequestStatus.RUNNING:  # preempted earlier in this step
                    continue
                if reserve(request, 1):
                    decodes[request.request_id] = request.num_computed_tokens
                    budget -= 1

        for request in prefilling:
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue
            remaining = request.num_tokens - request.num_computed_tokens
            n = min(remaining, cfg.long_prefill_token_threshold, budget)
            if reserve(request, n):
                prefills[request.request_id] = (n, request.num_computed_tokens, n == remaining)
                budget -= n

        if not preempted:  # as vLLM: no admissions in a step that had to preempt
            while state.waiting and budget > 0 and len(state.running) < cfg.max_num_seqs:
                request = state.waiting[0]
                remaining = request.num_tokens  # nothing computed while waiting
                n = min(remaining, cfg.long_prefill_token_threshold, budget)
                if not kv.grow(request.request_id, n):
                    break
                state.admit(request)
                prefills[request.request_id] = (n, 0, n == remaining)
                budget -= n

        decode_ids, contexts = lane_part if lane_part is not None else (tuple(decodes), tuple(decodes.values()))
        if not decode_ids and not prefills:
            return None
        nd = len(decode_ids)
        if prefills:
            chunks, chunk_contexts, chunk_samples = zip(*prefills.values())
            plan = BatchPlan(self.name, decode_ids + tuple(prefills), (1,) * nd + chunks,
                             contexts + chunk_contexts, (True,) * nd + chunk_samples, nd, tuple(preempted))
        else:
            plan = BatchPlan(self.name, decode_ids, (1,) * nd, contexts, (True,) * nd, nd, tuple(preempted))
        return plan  # within max_num_batched_tokens and max_num_seqs: tests check every plan


SCHEDULERS: dict[str, type[Scheduler]] = {
    cls.name: cls for cls in (SerialScheduler, StaticScheduler, ContinuousScheduler)
}


def make_scheduler(config: SchedulerConfig) -> Scheduler:
    return SCHEDULERS[config.name](config)
