"""The contract every policy keeps, and the plan a step fills."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from engine.core.config import SchedulerConfig
from engine.core.plan import BatchPlan, LaneIds
from engine.core.request import Request
from engine.core.state import ServingState


class Scheduler(ABC):
    name: ClassVar[str]  # class-level: the registry (scheduler/__init__.py) reads it off the class
    # True when the policy's next step is "every decoding request together, nothing else" in two
    # cases the step loop can see without asking it: (1) after such a step, until a request
    # arrives to an empty queue (behind a head that could not be admitted, first come first
    # served, it changes nothing), one is aborted or finishes while others wait; (2) after any
    # step that leaves nothing waiting and every running request decoding, within the token
    # budget. Either way, blocks short make it ask the policy. True for every policy here (it
    # follows from their rules); a policy for which it does not hold leaves it False.
    decode_steps_repeat: ClassVar[bool] = False

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config

    @abstractmethod
    def schedule(self, state: ServingState) -> BatchPlan | None:
        """The next model call, or None when nothing can run until a request arrives.

        May mutate ``state`` only through its scheduling transitions: ``admit`` (head of the
        queue into the running set), ``preempt`` (free a running request's KV, back to the head
        of the queue), ``kv.grow`` (reserve blocks), ``decode_together`` / ``decode_one_by_one``.
        Advancing requests is ``state.apply``'s job, after the plan has run.
        """


class PlanBuilder:
    """A step's plan as a scheduler fills it, within a token budget: the decodes (all together,
    or one by one), then prefill chunks. Preempting a request takes its entry back out and
    refunds its tokens; decodes taken together are listed one by one first."""

    __slots__ = ("state", "budget", "together", "decodes", "prefill_ids", "prefill_tokens", "prefill_contexts",
                 "prefill_samples", "preempted", "loads", "saves")

    def __init__(self, state: ServingState, budget: int) -> None:
        self.state = state
        self.budget = budget
        self.together: tuple[int, int, LaneIds] | None = None  # (count, Σ contexts, ids on demand)
        self.decodes: dict[str, int] = {}  # one by one: id -> context
        # the prefill chunks, in order, as the plan's columns (no tuples to zip apart in build)
        self.prefill_ids: list[str] = []
        self.prefill_tokens: list[int] = []
        self.prefill_contexts: list[int] = []
        self.prefill_samples: list[bool] = []
        self.preempted: list[str] = []
        # prefix caching only (built on first use: most steps of most runs have none)
        self.loads: dict[str, tuple[int, ...]] | None = None  # id -> cached blocks it starts from
        self.saves: dict[str, list[tuple[int, int]]] | None = None  # id -> (block index, id) its chunk completes

    def add_together(self, part: tuple[int, int, LaneIds]) -> None:
        self.together = part
        self.budget -= part[0]

    def add_decode(self, request: Request) -> None:
        self.decodes[request.request_id] = request.num_computed_tokens
        self.budget -= 1

    def add_prefill(self, request: Request, n: int, loads: tuple[int, ...] | list[int] = ()) -> None:
        """A chunk of ``n`` tokens; ``loads``: the cached blocks a just admitted request starts from."""
        computed = request.num_computed_tokens
        self.prefill_ids.append(request.request_id)
        self.prefill_tokens.append(n)
        self.prefill_contexts.append(computed)
        self.prefill_samples.append(n == request.num_tokens - computed)
        self.budget -= n
        if self.state.kv.caching:
            if loads:
                if self.loads is None:
                    self.loads = {}
                self.loads[request.request_id] = tuple(loads)
            saves = self.state.plan_saves(request, n)
            if saves:
                if self.saves is None:
                    self.saves = {}
                self.saves[request.request_id] = saves

    def reserve(self, request: Request, n: int) -> bool:
        """KV blocks for ``n`` more tokens of ``request``, preempting the newest running requests
        while blocks are short; False if ``request`` itself had to go."""
        state = self.state
        while not state.kv.grow(request.request_id, request.num_computed_tokens + n):
            victim = self._preempt_newest()
            if victim is request:
                return False
        return True

    def _preempt_newest(self) -> Request:
        state = self.state
        if self.together is not None:  # preemption is request by request: list the decodes
            ids, contexts = self.together[2]()
            self.decodes.update(zip(ids, contexts))
            self.together = None
            state.decode_one_by_one()
        victim = state.running[-1]
        state.preempt(victim)
        self.preempted.append(victim.request_id)
        if victim.request_id in self.decodes:
            del self.decodes[victim.request_id]
            self.budget += 1
        elif victim.request_id in self.prefill_ids:
            i = self.prefill_ids.index(victim.request_id)
            self.budget += self.prefill_tokens.pop(i)
            del self.prefill_ids[i], self.prefill_contexts[i], self.prefill_samples[i]
            if self.loads:
                self.loads.pop(victim.request_id, None)
            if self.saves:
                self.saves.pop(victim.request_id, None)  # its block ids went back with its blocks
        return victim

    def build(self, scheduler: str) -> BatchPlan | None:
        """The plan, or None if nothing was scheduled."""
        decodes, together = self.decodes, self.together
        if not decodes and not self.prefill_ids:
            if together is None:
                return None
            return BatchPlan(scheduler, (), (), (), (), 0, (), *together)  # the common step
        lane_size, lane_context_sum, lane_ids = together or (0, 0, None)
        nd = len(decodes)
        ids, tokens = tuple(self.prefill_ids), tuple(self.prefill_tokens)
        contexts, sampled = tuple(self.prefill_contexts), tuple(self.prefill_samples)
        if nd:
            ids = tuple(decodes) + ids
            tokens, contexts, sampled = (1,) * nd + tokens, tuple(decodes.values()) + contexts, (True,) * nd + sampled
        plan = BatchPlan(scheduler, ids, tokens, contexts, sampled, nd, tuple(self.preempted),
                         lane_size, lane_context_sum, lane_ids)
        if self.loads or self.saves:
            loads, saves = self.loads or {}, self.saves or {}
            plan.kv_loads = tuple(loads.items())
            plan.kv_saves = tuple((rid, i, b) for rid, blocks in saves.items() for i, b in blocks)
            copied = sum(len(b) for b in loads.values()) + len(plan.kv_saves)
            plan.kv_copy_tokens = copied * self.state.config.block_size
        return plan
