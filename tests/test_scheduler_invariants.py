"""Hypothesis state machine over the host scheduler and block allocator: add / step / abort /
finish, with preemption forced by a small pool, with and without prefix caching, on one data
shard and on two (a ``ShardedAllocator``: each shard's pages, local ids, its own slots). After
every rule: each block is free or referenced exactly by the requests holding it, block tables
agree with the holders, every block a request reads holds exactly the prefix it expects (a shadow
of the pages' contents is kept, per shard), and no request is lost or duplicated."""

import collections

import numpy as np
from hypothesis import settings, strategies as st, target
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sfjax.engine.allocator import BlockAllocator, ShardedAllocator
from sfjax.engine.scheduler import Request, Scheduler, Status
from sfjax.sampling_params import SamplingParams

BLOCK, BLOCKS, SEQS, BUDGET = 4, 17, 4, 24
FAMILIES = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 1, 1, 1, 1], [2] * 10]


class SchedulerMachine(RuleBasedStateMachine):
    prefix_caching = False
    dp, blocks = 1, BLOCKS             # two shards: 14 blocks each, so any request fits in one

    def __init__(self):
        super().__init__()
        caching = self.prefix_caching
        self.alloc = (BlockAllocator(self.blocks, prefix_caching=caching) if self.dp == 1
                      else ShardedAllocator(self.blocks, self.dp, prefix_caching=caching))
        self.tables = np.zeros((SEQS, 16), np.int32)
        self.sched = Scheduler(self.alloc, self.tables, block_size=BLOCK, max_num_seqs=SEQS,
                               max_num_batched_tokens=BUDGET)
        self.pools = self.sched.pools
        self.pages = collections.defaultdict(dict)   # (shard, block) -> offset -> prefix written
        self.live: dict[str, Request] = {}
        self.done: set[str] = set()
        self.n = 0

    @rule(family=st.sampled_from(range(len(FAMILIES))), cut=st.integers(1, 10),
          tail=st.lists(st.integers(1, 2), max_size=10), max_tokens=st.integers(1, 30))
    def add(self, family, cut, tail, max_tokens):
        rid = f"r{self.n}"
        prompt = FAMILIES[family][:cut] + tail
        req = Request(rid, None, prompt, SamplingParams(max_tokens=max_tokens), self.n, (0, 0),
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
            assert s.start == s.request.num_computed
            tokens = s.request.prompt_token_ids + s.request.output_token_ids
            shard = self.sched.shard_of(s.request.slot)
            for pos in range(s.start, s.start + s.count):      # the step writes these pages
                page = (shard, s.request.blocks[pos // BLOCK])
                self.pages[page][pos % BLOCK] = tuple(tokens[:pos + 1])
            self.sched.set_computed(s.request, s.start + s.count)
        for s in plan:
            req = s.request
            if s.draws:
                req.output_token_ids.append(len(req.output_token_ids) % 3)
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
    def blocks_are_referenced_by_their_holders_or_free(self):
        holders = collections.Counter()
        for req in self.sched.running + self.sched.waiting:
            if req.slot is not None:
                holders.update((self.sched.shard_of(req.slot), b) for b in req.blocks)
                assert list(self.tables[req.slot, :len(req.blocks)]) == req.blocks
            else:
                assert not req.blocks
        if not self.prefix_caching:
            assert max(holders.values(), default=1) == 1, "a block owned twice"
        for d, pool in enumerate(self.pools):
            free = pool.free_ids()
            for b in range(1, pool.num_blocks):
                held = holders[d, b]
                assert pool.refs(b) == held, f"shard {d} block {b}: references != holders"
                assert (b in free) == (held == 0), f"shard {d} block {b}: free and held, or lost"

    @invariant()
    def every_computed_position_holds_the_expected_prefix(self):
        for req in self.sched.running:
            tokens = req.prompt_token_ids + req.output_token_ids
            shard = self.sched.shard_of(req.slot)
            for pos in range(req.num_computed):
                got = self.pages[shard, req.blocks[pos // BLOCK]].get(pos % BLOCK)
                assert got == tuple(tokens[:pos + 1]), f"{req.request_id} reads a wrong page at {pos}"

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
        assert self.alloc.num_free == self.blocks - self.dp
        self.alloc.reset_prefix_cache()
        assert not any(p.cached_ids() for p in self.pools)
        assert self.alloc.num_free == self.blocks - self.dp


class PrefixCachingMachine(SchedulerMachine):
    prefix_caching = True

    def teardown(self):
        target(float(self.alloc.hit_tokens), label="prefix-cache hit tokens")   # seek sharing
        super().teardown()


class TwoDataShardsMachine(PrefixCachingMachine):
    dp, blocks = 2, 28


SchedulerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
PrefixCachingMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TwoDataShardsMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                                  deadline=None)
TestScheduler = SchedulerMachine.TestCase
TestSchedulerWithPrefixCaching = PrefixCachingMachine.TestCase
TestSchedulerOverTwoDataShards = TwoDataShardsMachine.TestCase
