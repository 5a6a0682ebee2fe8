"""Host-side request state and the first-come-first-served scheduler with paged blocks."""

from __future__ import annotations

import dataclasses
import enum

from sfjax.cache import BlockAllocator
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
    """

    def __init__(self, allocator: BlockAllocator, block_tables, *, block_size: int,
                 max_num_seqs: int, max_num_batched_tokens: int):
        self.allocator = allocator
        self.block_tables = block_tables            # numpy int32 [max_num_seqs, max_blocks]
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def grow(self, req: Request, upto: int) -> bool:
        """Blocks for positions < ``upto`` if the pool has them, without preempting anyone."""
        return self._grow(req, upto)

    def _grow(self, req: Request, upto: int) -> bool:
        """Makes ``req`` own blocks for positions < ``upto``; False if the pool is short."""
        need = self.blocks_needed(upto) - len(req.blocks)
        if need <= 0:
            return True
        if need > self.allocator.num_free:
            return False
        new = self.allocator.allocate(need)
        self.block_tables[req.slot, len(req.blocks):len(req.blocks) + need] = new
        req.blocks.extend(new)
        return True

    def release(self, req: Request) -> None:
        """Frees the request's blocks and slot at once (finish, abort, preemption)."""
        if req.blocks:
            self.allocator.free(req.blocks)
            req.blocks = []
        if req.slot is not None:
            self.block_tables[req.slot] = 0
            self._free_slots.append(req.slot)
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
            while not self._grow(req, req.num_computed + count):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            if req.status is Status.RUNNING:
                out.append(Scheduled(req, req.num_computed, count))
                budget -= count
        while self.waiting and self._free_slots and budget > 0:
            req = self.waiting[0]
            count = min(req.num_tokens, budget)
            if self.blocks_needed(count) > self.allocator.num_free:
                break
            self.waiting.pop(0)
            req.slot = self._free_slots.pop()
            self._grow(req, count)
            req.status = Status.RUNNING
            self.running.append(req)
            self.running.sort(key=lambda r: r.arrival)   # preemption takes the latest arrival
            out.append(Scheduled(req, 0, count))
            budget -= count
        return out
