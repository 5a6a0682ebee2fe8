"""Hypothesis state machine over the host scheduler and block allocator: add / step / abort /
finish, with preemption forced by a small pool. After every rule: each block is free or owned by
exactly one request, block tables agree with the owners, and no request is lost or duplicated."""

import numpy as np
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sfjax.cache import BlockAllocator
from sfjax.engine.scheduler import Request, Scheduler, Status
from sfjax.sampling_params import SamplingParams

BLOCK, BLOCKS, SEQS, BUDGET = 4, 17, 4, 24


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.alloc = BlockAllocator(BLOCKS)
        self.tables = np.zeros((SEQS, 16), np.int32)
        self.sched = Scheduler(self.alloc, self.tables, block_size=BLOCK, max_num_seqs=SEQS,
                               max_num_batched_tokens=BUDGET)
        self.live: dict[str, Request] = {}
        self.done: set[str] = set()
        self.n = 0

    @rule(prompt=st.integers(1, 20), max_tokens=st.integers(1, 30))
    def add(self, prompt, max_tokens):
        rid = f"r{self.n}"
        req = Request(rid, None, [3] * prompt, SamplingParams(max_tokens=max_tokens), self.n, (0, 0),
                      max_tokens, None, 0.0)
        self.n += 1
        self.live[rid] = req
        self.sched.add(req)

    @rule()
    def step(self):
        plan = self.sched.schedule()
        seen = set()
        for s in plan:
            assert s.request.request_id not in seen, "a request scheduled twice in one step"
            seen.add(s.request.request_id)
            assert s.request.status is Status.RUNNING
            assert len(s.request.blocks) * BLOCK >= s.start + s.count
            s.request.num_computed = s.start + s.count
        for s in plan:
            req = s.request
            if s.draws:
                req.output_token_ids.append(7)
                if len(req.output_token_ids) >= req.max_tokens:
                    self._finish(req)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self._finish(self.live[rid])

    def _finish(self, req):
        self.sched.remove(req)
        req.status = Status.FINISHED
        del self.live[req.request_id]
        assert req.request_id not in self.done, "a request finished twice"
        self.done.add(req.request_id)

    @invariant()
    def blocks_are_owned_once_or_free(self):
        owners = {}
        for req in self.sched.running + self.sched.waiting:
            for b in req.blocks:
                assert b not in owners, f"block {b} owned twice"
                owners[b] = req
            if req.slot is not None:
                assert list(self.tables[req.slot, :len(req.blocks)]) == req.blocks
        free = self.alloc.free_ids()
        assert not (free & set(owners)), "a block is both free and owned"
        assert free | set(owners) == set(range(1, BLOCKS)), "a block was lost"

    @invariant()
    def no_request_lost(self):
        queued = [r.request_id for r in self.sched.running + self.sched.waiting]
        assert len(queued) == len(set(queued))
        assert set(queued) == set(self.live)

    def teardown(self):
        for _ in range(500):                # drain: everything finishes, all blocks come back
            if not self.live:
                break
            self.step()
        assert not self.live, "a request starved"
        assert self.alloc.num_free == BLOCKS - 1


SchedulerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestScheduler = SchedulerMachine.TestCase
