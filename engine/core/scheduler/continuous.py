"""Iteration-level batching with chunked prefill (vLLM v1 style)."""

from __future__ import annotations

from engine.core.plan import BatchPlan
from engine.core.request import Request, RequestStatus
from engine.core.scheduler.base import PlanBuilder, Scheduler
from engine.core.state import ServingState


class ContinuousScheduler(Scheduler):
    """Each step: one token for every decoding request, then the rest of ``max_num_batched_tokens``
    on prefill chunks of at most ``long_prefill_token_threshold`` tokens — partially prefilled
    requests first, then waiting requests FCFS while ``max_num_seqs`` and KV blocks allow. When a
    running request cannot get a KV block, the newest running request is preempted and will be
    recomputed from scratch later; a step that preempted admits nothing (as vLLM)."""

    name = "continuous"
    decode_steps_repeat = True

    def schedule(self, state: ServingState) -> BatchPlan | None:
        step = PlanBuilder(state, self.config.max_num_batched_tokens)
        # split before the decodes: preemption there only removes requests
        prefilling = state.prefilling()
        self._schedule_decodes(state, step)
        if prefilling:
            self._schedule_prefills(prefilling, step)
        if state.waiting and not step.preempted:
            self._schedule_admissions(state, step)
        return step.build(self.name)

    @staticmethod
    def _schedule_decodes(state: ServingState, step: PlanBuilder) -> None:
        """All together when the budget and the free blocks cover them (the common step);
        otherwise one by one in running order, preempting the newest when blocks run out."""
        if 0 < state.num_decoding <= step.budget:
            part = state.decode_together()
            if part is not None:
                step.add_together(part)
                return
        decoding = [r for r in state.running if r.is_decoding]
        state.decode_one_by_one()
        for request in decoding:
            if step.budget == 0:
                break
            if request.status == RequestStatus.RUNNING and step.reserve(request, 1):
                step.add_decode(request)

    def _schedule_prefills(self, prefilling: list[Request], step: PlanBuilder) -> None:
        """The next chunk of each partially prefilled request, in running order."""
        for request in prefilling:
            if step.budget == 0:
                break
            if request.status != RequestStatus.RUNNING:  # preempted earlier in this step
                continue
            remaining = request.num_tokens - request.num_computed_tokens
            n = min(remaining, self.config.long_prefill_token_threshold, step.budget)
            if step.reserve(request, n):
                step.add_prefill(request, n)

    def _schedule_admissions(self, state: ServingState, step: PlanBuilder) -> None:
        """Waiting requests, first come first served, while budget, seats and blocks allow; each
        starts past its cached prefix (prefix caching)."""
        cfg = self.config
        while state.waiting and step.budget > 0 and len(state.running) < cfg.max_num_seqs:
            request = state.waiting[0]
            cached, blocks = state.prefix_hit(request) if state.kv.caching else (0, ())
            n = min(request.num_tokens - cached, cfg.long_prefill_token_threshold, step.budget)
            if not state.kv.grow(request.request_id, cached + n, blocks):
                break
            state.admit(request, cached)
            step.add_prefill(request, n, blocks)
