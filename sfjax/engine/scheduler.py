"""Host-side request state and the first-come-first-served scheduler with paged blocks."""

from __future__ import annotations

import collections
import dataclasses
import enum

from sfjax.engine.allocator import BlockAllocator, ShardedAllocator, hash_blocks
from sfjax.sampling_params import SamplingParams
from sfjax.tokenizer import IncrementalDetokenizer


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int                    # arrival number in this engine
    key_data: tuple[int, int]       # raw threefry request key
    max_tokens: int                 # resolved against max_model_len
    detok: IncrementalDetokenizer
    arrival_time: float
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0           # tokens of prompt + output whose K/V is in the cache
    blocks: list[int] = dataclasses.field(default_factory=list)
    slot: int | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    logprobs: list = dataclasses.field(default_factory=list)
    prompt_logprobs: list = dataclasses.field(default_factory=list)
    cumulative_logprob: float = 0.0
    strategy_slot: int = 0          # the engine registry's slot (0: plain decoding)
    spec_metrics: object | None = None
    certificate: object | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)  # of full blocks

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]


@dataclasses.dataclass
class Scheduled:
    request: Request
    start: int      # first position fed this step
    count: int      # tokens fed this step
    cached: int = 0  # tokens before ``start`` served by the prefix cache at this admission

    @property
    def draws(self) -> bool:
        """Whether this step ends at the sequence's last token, so its next token is drawn."""
        return self.start + self.count == self.request.num_tokens


class Scheduler:
    """FCFS within ``max_num_seqs`` slots and ``max_num_batched_tokens`` per step.

    Running requests go first (decode rows and unfinished prefill chunks), then waiting ones are
    admitted in arrival order while slots, token budget and blocks allow. When a running request
    needs a block and none is free, the latest-arrived running request is preempted by recompute:
    its blocks are freed and it goes back to the front of the queue with its output so far.

    With prefix caching, an admitted request first takes the cached blocks of its longest cached
    prefix (prompt and any output so far, so a preempted request recomputes only what was
    evicted) and starts computing after them; at least its last token is always computed, so its
    next token is drawn. Requests asking for prompt logprobs compute their whole prompt.
    ``cache_lag`` holds back registering a block until that many positions past it are computed
    (1 with a draft model, whose cache trails the target's by up to one position, and with an
    EAGLE head, whose row at a position runs once the next token is fed); ``hash_lookahead``
    tokens after a block enter its hash (1 with an EAGLE head: its K/V there reads the next
    token).

    With a ``ShardedAllocator`` (data parallelism) the slots are split evenly over its shards: a
    request's pages, its prefix-cache lookups and any preemption for it stay in its slot's shard.
    A waiting request goes to the shard with a free slot where it fits that holds the longest
    cached prefix of it, then the one with the most free blocks, then the lowest.
    """

    def __init__(self, allocator: BlockAllocator | ShardedAllocator, block_tables, *,
                 block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 cache_lag: int = 0, hash_lookahead: int = 0):
        self.allocator = allocator
        sharded = isinstance(allocator, ShardedAllocator)
        self.pools = list(allocator.shards) if sharded else [allocator]
        if max_num_seqs % len(self.pools):
            raise ValueError(f"max_num_seqs ({max_num_seqs}) must be divisible by "
                             f"data_parallel_size ({len(self.pools)})")
        self.slots_per_shard = max_num_seqs // len(self.pools)
        self.cache_lag = cache_lag
        self.hash_lookahead = hash_lookahead
        self.block_tables = block_tables            # numpy int32 [max_num_seqs, max_blocks]
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        per = self.slots_per_shard                  # pop() hands out each shard's low slots first
        self._free_slots = [list(range((d + 1) * per - 1, d * per - 1, -1))
                            for d in range(len(self.pools))]
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_free_slot(self) -> bool:
        return any(self._free_slots)

    def shard_of(self, slot: int) -> int:
        return slot // self.slots_per_shard

    def pool(self, req: Request) -> BlockAllocator:
        """The allocator of the request's slot's data shard."""
        return self.pools[self.shard_of(req.slot)]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_grow(self, targets: list[tuple[Request, int]]) -> bool:
        """Whether every (request, upto) of ``targets`` can grow at once (``grow``)."""
        need = collections.Counter()
        for req, upto in targets:
            need[self.shard_of(req.slot)] += max(0, self.blocks_needed(upto) - len(req.blocks))
        return all(n <= self.pools[d].num_free for d, n in need.items())

    def grow(self, req: Request, upto: int) -> bool:
        """Makes ``req`` own blocks for positions < ``upto`` if its pool has them (no one is
        preempted); False if the pool is short."""
        need = self.blocks_needed(upto) - len(req.blocks)
        if need <= 0:
            return True
        pool = self.pool(req)
        if need > pool.num_free:
            return False
        new = pool.allocate(need)
        self.block_tables[req.slot, len(req.blocks):len(req.blocks) + need] = new
        req.blocks.extend(new)
        return True

    def set_computed(self, req: Request, n: int) -> None:
        """Records that positions < ``n`` hold valid K/V; offers newly full blocks to the cache."""
        before = max(req.num_computed - self.cache_lag, 0) // self.block_size
        req.num_computed = n
        if not self.allocator.prefix_caching:
            return
        full = max(n - self.cache_lag, 0) // self.block_size
        if full > before:
            full = min(full, len(self._hashes(req, full * self.block_size)))
            pool = self.pool(req)
            for i in range(before, full):
                pool.register(req.blocks[i], req.block_hashes[i])

    def _hashes(self, req: Request, upto: int) -> list[bytes]:
        if len(req.block_hashes) < upto // self.block_size:
            tokens = (req.prompt_token_ids + req.output_token_ids)[:upto + self.hash_lookahead]
            hash_blocks(tokens, self.block_size, req.block_hashes, self.hash_lookahead)
        return req.block_hashes[:upto // self.block_size]

    def _cached_prefix(self, req: Request, pool: BlockAllocator) -> list[int]:
        """Cached blocks in ``pool`` for the request's longest cached prefix, leaving its last
        token."""
        if not self.allocator.prefix_caching or req.params.prompt_logprobs is not None:
            return []
        return pool.lookup(self._hashes(req, req.num_tokens - 1))

    def release(self, req: Request) -> None:
        """Frees the request's blocks and slot at once (finish, abort, preemption)."""
        if req.blocks:
            self.pool(req).free(req.blocks)
            req.blocks = []
        if req.slot is not None:
            self.block_tables[req.slot] = 0
            self._free_slots[self.shard_of(req.slot)].append(req.slot)
            req.slot = None
        req.num_computed = 0

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.release(req)
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, req)

    def remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.release(req)

    def schedule(self) -> list[Scheduled]:
        budget = self.max_num_batched_tokens
        out: list[Scheduled] = []
        for req in list(self.running):
            if req not in self.running:      # preempted by an earlier request of this loop
                continue
            count = min(req.num_tokens - req.num_computed, budget)
            if count <= 0:
                continue
            shard = self.shard_of(req.slot)
            while not self.grow(req, req.num_computed + count):
                victim = [r for r in self.running if self.shard_of(r.slot) == shard][-1]
                self._preempt(victim)
                if victim is req:
                    break
            if req.status is Status.RUNNING:
                out.append(Scheduled(req, req.num_computed, count))
                budget -= count
        while self.waiting and self.has_free_slot() and budget > 0:
            req = self.waiting[0]
            placed = self._place(req, budget)
            if placed is None:
                break
            shard, hit, count = placed
            cached = len(hit) * self.block_size
            pool = self.pools[shard]
            self.waiting.pop(0)
            req.slot = self._free_slots[shard].pop()
            if pool.prefix_caching and req.params.prompt_logprobs is None:
                pool.query_tokens += req.num_tokens
                pool.hit_tokens += cached
            pool.acquire(hit)
            req.blocks = list(hit)
            self.block_tables[req.slot, :len(hit)] = hit
            req.num_computed = cached
            self.grow(req, cached + count)
            req.status = Status.RUNNING
            self.running.append(req)
            self.running.sort(key=lambda r: r.arrival)   # preemption takes the latest arrival
            out.append(Scheduled(req, cached, count, cached))
            budget -= count
        return out

    def _place(self, req: Request, budget: int) -> tuple[int, list[int], int] | None:
        """(shard, cached blocks, tokens to compute) for admitting ``req``, or None if no shard
        with a free slot has the blocks (FCFS: then nothing behind it is admitted either)."""
        best, key = None, None
        for shard, pool in enumerate(self.pools):
            if not self._free_slots[shard]:
                continue
            hit = self._cached_prefix(req, pool)
            cached = len(hit) * self.block_size
            count = min(req.num_tokens - cached, budget)
            need = self.blocks_needed(cached + count) - len(hit)
            if need + pool.num_evictable(hit) > pool.num_free:
                continue
            if key is None or (len(hit), pool.num_free) > key:
                best, key = (shard, hit, count), (len(hit), pool.num_free)
        return best
