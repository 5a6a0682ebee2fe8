"""The scheduler over data shards, on the host (no mesh): slots split evenly, each shard's pages
from its own allocator with local ids, admission by cached prefix then free blocks, preemption
inside the shard that is short, and sizes that don't split refused naming them."""

import numpy as np
import pytest

from sfjax.engine.allocator import BlockAllocator, ShardedAllocator
from sfjax.engine.scheduler import Request, Scheduler
from sfjax.sampling_params import SamplingParams

BLOCK = 4


def _sched(num_blocks, dp=2, seqs=4, budget=64, prefix_caching=False):
    alloc = ShardedAllocator(num_blocks, dp, prefix_caching=prefix_caching)
    return Scheduler(alloc, np.zeros((seqs, 8), np.int32), block_size=BLOCK, max_num_seqs=seqs,
                     max_num_batched_tokens=budget)


def _request(n, prompt, max_tokens=8):
    return Request(f"r{n}", None, list(prompt), SamplingParams(max_tokens=max_tokens), n, (0, 0),
                   max_tokens, None, 0.0)


def _run(sched, plan):
    """Marks the plan computed and appends a token to the rows that draw; finishes at max_tokens."""
    for s in plan:
        sched.set_computed(s.request, s.start + s.count)
        if s.draws:
            s.request.output_token_ids.append(7)
            if len(s.request.output_token_ids) >= s.request.max_tokens:
                sched.remove(s.request)


def test_slots_and_pages_split_over_the_shards():
    sched = _sched(12)                                       # 6 pages a shard, 5 usable
    reqs = [_request(i, range(10 * i, 10 * i + 5)) for i in range(4)]   # 2 blocks each
    for r in reqs:
        sched.add(r)
    sched.schedule()
    # ties go to shard 0, then the shard with more free blocks: the shards alternate
    assert [r.slot for r in reqs] == [0, 2, 1, 3]
    assert [sched.shard_of(r.slot) for r in reqs] == [0, 1, 0, 1]
    assert [r.blocks for r in reqs] == [[1, 2], [1, 2], [3, 4], [3, 4]]   # local page ids
    assert [p.num_free for p in sched.pools] == [1, 1]
    sched.remove(reqs[1])
    assert sched.pools[1].num_free == 3 and sched.pools[0].num_free == 1


def test_preemption_stays_inside_the_short_shard():
    sched = _sched(8)                                        # 3 usable pages a shard
    long = lambda i: _request(i, range(10 * i, 10 * i + 4), max_tokens=8)
    short = lambda i: _request(i, range(10 * i, 10 * i + 2), max_tokens=2)
    a, b, c, d = long(0), short(1), long(2), short(3)
    for r in (a, b, c, d):
        sched.add(r)
    _run(sched, sched.schedule())
    assert [sched.shard_of(r.slot) for r in (a, b, c, d)] == [0, 1, 0, 1]
    _run(sched, sched.schedule())               # a and c need a second page; shard 0 has one
    # c goes: shard 0's latest arrival, though d, on the other shard, arrived later
    assert sched.num_preemptions == 1 and c.num_preemptions == 1 and c in sched.waiting
    assert d.num_preemptions == 0 and len(d.output_token_ids) == 2


def test_a_request_goes_where_its_prefix_is_cached():
    sched = _sched(16, prefix_caching=True)
    first, other = _request(0, range(100, 105)), _request(1, range(200, 209))
    sched.add(other)
    sched.add(first)
    _run(sched, sched.schedule())                            # other: shard 0, first: shard 1
    assert sched.shard_of(first.slot) == 1
    sched.remove(other)                                      # shard 0 now has the most free pages
    again = _request(2, list(range(100, 105)) + [1, 2, 3])   # first's first block is cached
    sched.add(again)
    plan = sched.schedule()
    assert sched.shard_of(again.slot) == 1 and again.blocks[0] == first.blocks[0]
    assert [s.cached for s in plan if s.request is again] == [BLOCK]
    assert sched.pools[1].hit_tokens == BLOCK and sched.allocator.hit_tokens == BLOCK


def test_sizes_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match=r"num_kv_blocks \(7\) must be a multiple of "
                                         r"data_parallel_size \(2\)"):
        ShardedAllocator(7, 2)
    with pytest.raises(ValueError, match="with >= 2 blocks per data shard"):
        ShardedAllocator(2, 2)
    with pytest.raises(ValueError, match=r"max_num_seqs \(3\) must be divisible by "
                                         r"data_parallel_size \(2\)"):
        _sched(8, seqs=3)


def test_one_shard_is_the_plain_allocator():
    sched = Scheduler(BlockAllocator(9), np.zeros((4, 8), np.int32), block_size=BLOCK,
                      max_num_seqs=4, max_num_batched_tokens=64)
    reqs = [_request(i, range(5)) for i in range(3)]
    for r in reqs:
        sched.add(r)
    sched.schedule()
    assert [r.slot for r in reqs] == [0, 1, 2]
    assert [r.blocks for r in reqs] == [[1, 2], [3, 4], [5, 6]]
