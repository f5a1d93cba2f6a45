"""Closed groups: the seed's static batching, and serial as a group of one."""

from __future__ import annotations

import sys

from engine.core.config import SchedulerConfig
from engine.core.plan import BatchPlan
from engine.core.scheduler.base import PlanBuilder, Scheduler
from engine.core.state import ServingState


class StaticScheduler(Scheduler):
    """A closed group: admit up to ``max_num_seqs`` when nothing runs, prefill them in one call,
    then decode the unfinished members every step. Holes left by short requests stay empty
    until the whole group is done. The group reserves its full KV up front, so it never preempts."""

    name = "static"
    decode_steps_repeat = True

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self._hits: dict[str, tuple[int, ...]] = {}  # admitted with a prefix hit, not yet prefilled

    @property
    def group_size(self) -> int:
        return self.config.max_num_seqs

    def schedule(self, state: ServingState) -> BatchPlan | None:
        if not state.running:
            self._admit_group(state)
        members = state.running
        if not members:
            return None
        if state.num_decoding == len(members):  # the whole group decodes, together
            together = state.decode_together()
            assert together is not None  # never short: the group holds its KV
            count, context_sum, ids = together
            return BatchPlan(self.name, lane_size=count, lane_context_sum=context_sum, lane_ids=ids)
        to_prefill = [r for r in members if r.num_output_tokens == 0]  # admitted, prefilled in one call
        if to_prefill:
            step = PlanBuilder(state, sys.maxsize)
            for r in to_prefill:  # each from its cached prefix, if any
                step.add_prefill(r, r.num_tokens - r.num_computed_tokens, self._hits.pop(r.request_id, ()))
            return step.build(self.name)
        return BatchPlan.of(self.name, (r.request_id for r in members), (1,) * len(members),  # decodes one by one
                            (r.num_computed_tokens for r in members), (True,) * len(members), len(members))

    def _admit_group(self, state: ServingState) -> None:
        self._hits.clear()  # (a member aborted before its prefill leaves its entry behind)
        while state.waiting and len(state.running) < self.group_size:
            head = state.waiting[0]
            cached, blocks = state.prefix_hit(head)  # (0, []) without prefix caching
            if not state.kv.grow(head.request_id, head.max_total_tokens, blocks):
                break
            state.admit(head, cached)
            if blocks:
                self._hits[head.request_id] = tuple(blocks)


class SerialScheduler(StaticScheduler):
    """One request from prefill to its last token, then the next: a static group of one."""

    name = "serial"

    @property
    def group_size(self) -> int:
        return 1
