"""Invariants of a live engine, checked between steps by several tests."""

import collections

import numpy as np

# The suite compiles at LLVM -O0 (conftest.py): a third less time per compile, but code several
# times slower for everything XLA:CPU generates itself (all but the matmuls). A test that runs a
# full-size model for hundreds of steps spends more time running than compiling, so its engines
# compile at level 2 (``EngineConfig.compiler_options``); such a test compares its engines' runs
# with each other, all compiled alike (options change bits: tests/conftest.py).
RUNS_LONG = {"xla_backend_optimization_level": 2}


def check_engine(eng) -> None:
    """Blocks are free or referenced exactly by the running requests that hold them; block tables
    agree with the holders; the device history holds each running request's computed tokens;
    no request is queued twice. With data shards (one allocator per shard, local page ids), all
    of this holds per shard: a request's blocks are its slot's shard's, counted there only, and
    each shard's free slots are its own."""
    sched = eng.scheduler
    queued = [r.request_id for r in sched.running + sched.waiting]
    assert len(queued) == len(set(queued)), "a request is queued twice"
    assert set(queued) == set(eng.requests), "the engine and the scheduler disagree on requests"
    holders = [collections.Counter() for _ in sched.pools]
    for req in sched.waiting:
        assert not req.blocks and req.slot is None, "a waiting request holds blocks"
    slots = set()
    # read whole, once: indexing the device array compiles a slice program per row length
    device_history = np.asarray(eng.state.history) if sched.running else None
    for req in sched.running:
        assert req.slot not in slots, "two requests in one slot"
        slots.add(req.slot)
        assert len(set(req.blocks)) == len(req.blocks)
        shard = sched.shard_of(req.slot)
        assert all(0 < b < sched.pools[shard].num_blocks for b in req.blocks), "a page off-shard"
        holders[shard].update(req.blocks)
        row = eng.block_tables[req.slot]
        assert list(row[:len(req.blocks)]) == req.blocks and not row[len(req.blocks):].any()
        n = req.num_computed
        assert len(req.blocks) * eng.config.block_size >= n
        history = device_history[req.slot, :n]
        assert history.tolist() == [req.token(j) for j in range(n)], "device history is stale"
    for s in set(range(eng.config.max_num_seqs)) - slots:
        assert not eng.block_tables[s].any(), "a free slot's block table is not cleared"
    free_slots = [s for free in sched._free_slots for s in free]
    assert sorted(free_slots + sorted(slots)) == list(range(eng.config.max_num_seqs))
    assert all(sched.shard_of(s) == d for d, free in enumerate(sched._free_slots) for s in free)
    assert sum(pool.num_blocks for pool in sched.pools) == eng.config.num_kv_blocks
    for d, pool in enumerate(sched.pools):
        free = pool.free_ids()
        for b in range(1, pool.num_blocks):
            refs, held = pool.refs(b), holders[d][b]
            assert refs == held, f"shard {d} block {b}: {refs} references, {held} holders"
            assert (b in free) == (held == 0), f"shard {d} block {b}: free and held, or neither"


def check_idle(eng) -> None:
    """At idle every block is free (cached ones included), and the cache releases them all."""
    assert not eng.has_unfinished_requests()
    for pool in eng.scheduler.pools:
        assert pool.num_free == pool.num_blocks - 1, "a block leaked"
        assert all(pool.refs(b) == 0 for b in range(1, pool.num_blocks))
    assert not eng.block_tables.any()
