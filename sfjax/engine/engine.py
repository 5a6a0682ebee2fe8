"""The step-level engine: requests in, one jitted device step per call, RequestOutputs out."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax
import numpy as np

from sfjax import sampling
from sfjax.cache import KVCache, BlockAllocator, validate_block_size
from sfjax.config import ModelConfig
from sfjax.engine.scheduler import Request, Scheduled, Scheduler, Status
from sfjax.outputs import CompletionOutput, RequestMetrics, RequestOutput
from sfjax.sampling_params import SamplingParams
from sfjax.step import StepBatch, model_step
from sfjax.tokenizer import IncrementalDetokenizer
from sfjax.weights import Weights

logger = logging.getLogger("sfjax")

DEFAULT_KV_CACHE_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None       # None: enough for max_num_seqs full sequences,
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES  # capped by this budget
    max_model_len: int | None = None       # None: the model's max_position_embeddings
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    row_tile: int = 8                      # rows per tile of every op; fixed => row-invariant bits
    seed: int = 0

    def __post_init__(self):
        validate_block_size(self.block_size)
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                             f"max_num_seqs ({self.max_num_seqs})")
        if self.row_tile < 1:
            raise ValueError(f"row_tile must be >= 1, got {self.row_tile}")


def _bucket(n: int, tile: int) -> int:
    """Smallest tile * 2**j >= n: few shapes, so few compilations."""
    b = tile
    while b < n:
        b *= 2
    return b


class Engine:
    """``add_request`` / ``step`` / ``abort`` / ``has_unfinished_requests``; LLM.generate is built on it."""

    def __init__(self, cfg: ModelConfig, weights: Weights, tokenizer, config: EngineConfig,
                 eos_token_ids: tuple[int, ...] = ()):
        self.cfg = cfg
        self.weights = weights
        self.tokenizer = tokenizer
        max_len = config.max_model_len or cfg.max_position_embeddings
        if max_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len ({max_len}) must be <= the model's "
                             f"max_position_embeddings ({cfg.max_position_embeddings})")
        per_block = KVCache.bytes_per_block(cfg, config.block_size)
        blocks_per_seq = -(-max_len // config.block_size)
        num_blocks = config.num_kv_blocks or 1 + min(
            config.max_num_seqs * blocks_per_seq, max(1, config.kv_cache_bytes // per_block))
        self.config = dataclasses.replace(config, max_model_len=max_len, num_kv_blocks=num_blocks)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.allocator = BlockAllocator(num_blocks)
        self.block_tables = np.zeros((config.max_num_seqs, blocks_per_seq), np.int32)
        self.scheduler = Scheduler(self.allocator, self.block_tables, block_size=config.block_size,
                                   max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens)
        self.cache = KVCache.zeros(cfg, num_blocks, config.block_size)
        self.requests: dict[str, Request] = {}
        self._arrivals = 0
        self.stats = {"steps": 0, "prompt_tokens": 0, "generation_tokens": 0, "preemptions": 0}
        tokens = (num_blocks - 1) * config.block_size
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB); maximum concurrency "
                    "for %d tokens per request: %.2fx", num_blocks - 1, config.block_size, tokens,
                    num_blocks * per_block / 2**20, max_len, tokens / max_len)

    # -- admission ---------------------------------------------------------------------------

    def prepare(self, request_id: str, prompt: Any, params: SamplingParams | None) -> Request:
        """Validates one request and builds its state; raises ValueError naming the problem."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        text, ids = self._tokenize(prompt)
        if not ids:
            raise ValueError("prompt is empty (it has no tokens)")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids: {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})")
        params.validate_for(self.cfg.vocab_size)
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {limit}, which leaves no "
                             f"room for output")
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - len(ids)
        if len(ids) + max_tokens > limit:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                             f"max_model_len ({limit})")
        blocks = self.scheduler.blocks_needed(len(ids) + max_tokens)
        if blocks > self.config.num_kv_blocks - 1:
            raise ValueError(f"the request needs {blocks} KV blocks; the cache has only "
                             f"{self.config.num_kv_blocks - 1}")
        seed = params.seed
        if seed is None:  # the engine seed and the arrival number, folded on the host
            seed = (self.config.seed * 0x9E3779B97F4A7C15 + self._arrivals + 1) % 2**63
        return Request(
            request_id=request_id, prompt=text, prompt_token_ids=list(ids), params=params,
            arrival=self._arrivals, key_data=sampling.request_key_data(seed), max_tokens=max_tokens,
            detok=IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
            arrival_time=time.monotonic())

    def _tokenize(self, prompt: Any) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt).ids
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self._tokenize(prompt["prompt"])
        raise ValueError(f"prompt must be a str or a dict with 'prompt_token_ids', got {type(prompt).__name__}")

    def add_request(self, request_id: str, prompt: Any, sampling_params: SamplingParams | None = None) -> None:
        self.enqueue(self.prepare(request_id, prompt, sampling_params))

    def enqueue(self, req: Request) -> None:
        self._arrivals += 1
        self.requests[req.request_id] = req
        self.scheduler.add(req)

    def abort(self, request_id: str) -> None:
        """Drops the request and frees its blocks at once; unknown ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.scheduler.remove(req)
            req.status = Status.FINISHED
            req.finish_reason = "abort"

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedules, runs one device step, and returns the requests that got tokens."""
        preempted = sum(r.num_preemptions for r in self.requests.values())
        plan = self.scheduler.schedule()
        self.stats["preemptions"] += sum(r.num_preemptions for r in self.requests.values()) - preempted
        if not plan:
            if self.scheduler.running or self.scheduler.waiting:
                raise RuntimeError("the scheduler could not place any request (KV cache too small)")
            return []
        now = time.monotonic()
        for s in plan:
            if s.request.first_scheduled_time is None:
                s.request.first_scheduled_time = now
        batch, drawing = self._build_batch(plan)
        self.cache, tokens, _ = model_step(self.weights, self.cache, batch, cfg=self.cfg,
                                           row_tile=self.config.row_tile)
        tokens = np.asarray(tokens)
        self.stats["steps"] += 1
        outputs = []
        for s in plan:
            s.request.num_computed = s.start + s.count
        for i, s in enumerate(drawing):
            out = self._append(s.request, int(tokens[i]))
            outputs.append(out)
        return outputs

    def _build_batch(self, plan: list[Scheduled]) -> tuple[StepBatch, list[Scheduled]]:
        tile = self.config.row_tile
        n = _bucket(sum(s.count for s in plan), tile)
        drawing = [s for s in plan if s.draws]
        r = _bucket(max(len(drawing), 1), tile)
        tokens = np.zeros(n, np.int32)
        positions = np.full(n, -1, np.int32)
        slots = np.full(n, -1, np.int32)
        logit_rows = np.zeros(r, np.int32)
        temperature = np.zeros(r, np.float32)
        key_data = np.zeros((r, 2), np.uint32)
        out_pos = np.zeros(r, np.int32)
        suppressed = [self._suppressed(s.request) for s in drawing]
        suppress = np.full((r, _bucket(max(map(len, suppressed), default=1), 4)), -1, np.int32)
        for i, ids in enumerate(suppressed):
            suppress[i, :len(ids)] = ids
        row, j = 0, 0
        for s in plan:
            req = s.request
            ids = [req.token(i) for i in range(s.start, s.start + s.count)]
            tokens[row:row + s.count] = ids
            positions[row:row + s.count] = np.arange(s.start, s.start + s.count)
            slots[row:row + s.count] = req.slot
            row += s.count
            if s.draws:
                logit_rows[j] = row - 1
                temperature[j] = req.params.temperature
                key_data[j] = req.key_data
                out_pos[j] = len(req.output_token_ids)
                j += 1
        batch = StepBatch(tokens=tokens, positions=positions, slots=slots,
                          block_tables=self.block_tables.copy(), logit_rows=logit_rows,
                          num_logit_rows=np.int32(len(drawing)),
                          sampling=sampling.SamplingBatch(temperature=temperature, key_data=key_data,
                                                          position=out_pos, suppress=suppress))
        return batch, drawing

    def _suppressed(self, req: Request) -> list[int]:
        """Stop tokens can't be drawn before min_tokens (vLLM's semantics)."""
        if len(req.output_token_ids) >= req.params.min_tokens:
            return []
        eos = [] if req.params.ignore_eos else sorted(self.eos_token_ids)
        return eos + list(req.params.stop_token_ids)

    def _append(self, req: Request, token: int) -> RequestOutput:
        now = time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = now
            self.stats["prompt_tokens"] += len(req.prompt_token_ids)
        req.output_token_ids.append(token)
        self.stats["generation_tokens"] += 1
        req.detok.add(token)
        n, p = len(req.output_token_ids), req.params
        if n >= p.min_tokens and not p.ignore_eos and token in self.eos_token_ids:
            self._finish(req, "stop", None)
        elif n >= p.min_tokens and token in p.stop_token_ids:
            self._finish(req, "stop", token)
        elif n >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            self._finish(req, "length", None)
        return self.output(req, new_token_ids=[token])

    def _finish(self, req: Request, reason: str, stop_reason) -> None:
        req.status = Status.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
        req.finished_time = time.monotonic()
        req.detok.finish(req.output_token_ids)
        self.scheduler.remove(req)
        self.requests.pop(req.request_id, None)

    def output(self, req: Request, new_token_ids=()) -> RequestOutput:
        completion = CompletionOutput(index=0, text=req.detok.text,
                                      token_ids=list(req.output_token_ids),
                                      finish_reason=req.finish_reason, stop_reason=req.stop_reason)
        metrics = RequestMetrics(arrival_time=req.arrival_time,
                                 first_scheduled_time=req.first_scheduled_time,
                                 first_token_time=req.first_token_time,
                                 finished_time=req.finished_time, num_preemptions=req.num_preemptions)
        return RequestOutput(request_id=req.request_id, prompt=req.prompt,
                             prompt_token_ids=list(req.prompt_token_ids), outputs=[completion],
                             finished=req.status is Status.FINISHED, metrics=metrics,
                             new_token_ids=list(new_token_ids))
