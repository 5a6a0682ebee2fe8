"""Invariants of a live engine, checked between steps by several tests."""

import collections

import numpy as np


def check_engine(eng) -> None:
    """Blocks are free or referenced exactly by the running requests that hold them; block tables
    agree with the holders; the device history holds each running request's computed tokens;
    no request is queued twice."""
    sched, alloc = eng.scheduler, eng.allocator
    queued = [r.request_id for r in sched.running + sched.waiting]
    assert len(queued) == len(set(queued)), "a request is queued twice"
    assert set(queued) == set(eng.requests), "the engine and the scheduler disagree on requests"
    holders = collections.Counter()
    for req in sched.waiting:
        assert not req.blocks and req.slot is None, "a waiting request holds blocks"
    slots = set()
    for req in sched.running:
        assert req.slot not in slots, "two requests in one slot"
        slots.add(req.slot)
        assert len(set(req.blocks)) == len(req.blocks)
        holders.update(req.blocks)
        row = eng.block_tables[req.slot]
        assert list(row[:len(req.blocks)]) == req.blocks and not row[len(req.blocks):].any()
        n = req.num_computed
        assert len(req.blocks) * eng.config.block_size >= n
        history = np.asarray(eng.state.history[req.slot, :n])
        assert history.tolist() == [req.token(j) for j in range(n)], "device history is stale"
    for s in set(range(eng.config.max_num_seqs)) - slots:
        assert not eng.block_tables[s].any(), "a free slot's block table is not cleared"
    free = alloc.free_ids()
    for b in range(1, alloc.num_blocks):
        assert alloc.refs(b) == holders[b], f"block {b}: {alloc.refs(b)} references, {holders[b]} holders"
        assert (b in free) == (holders[b] == 0), f"block {b} is both free and held, or neither"


def check_idle(eng) -> None:
    """At idle every block is free (cached ones included), and the cache releases them all."""
    assert not eng.has_unfinished_requests()
    alloc = eng.allocator
    assert alloc.num_free == alloc.num_blocks - 1, "a block leaked"
    assert all(alloc.refs(b) == 0 for b in range(1, alloc.num_blocks))
    assert not eng.block_tables.any()
