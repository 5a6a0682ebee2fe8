"""The step-level engine: requests in, one jitted device call per step, RequestOutputs out.

Admission (``prepare``: validation, tokenization, the strategy's certificate) and the loop
(``step``: schedule, build, run, read back, with one request's failure kept its own) live here;
the jobs around them have their modules: ``scheduler`` (chunked prefill, preemption, prefix
caching), ``allocator`` (KV pages), ``batch`` (a plan's rows, packed by data shard, and their
sampling arrays), ``output`` (tokens into requests, detokenization, stops, RequestOutputs),
``speculation`` (the draft model, per-row k, counters), ``rounds`` (the one program every call
runs: rounds the device lays out, the first after the host's prefill rows), ``programs`` (the
compiled programs this engine owns), ``compile`` (shape buckets, precompile) and ``config``
(its settings)."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import PartitionSpec as P

from sfjax import checks as C, model, rows as R, sampling, sharding
from sfjax.cache import KVCache
from sfjax.config import ModelConfig
from sfjax.engine.allocator import BlockAllocator, ShardedAllocator
from sfjax.engine.scheduler import Request, Scheduled, Scheduler, Status
from sfjax.outputs import RequestOutput, merge_outputs
from sfjax.run import RunConfig
from sfjax.sampling_params import SamplingParams
from sfjax.engine import compile, programs, rounds, speculation
from sfjax.engine.batch import BatchBuilder, layout, pack
from sfjax.engine.config import EngineConfig
from sfjax.engine.output import OutputProcessor
from sfjax.engine.slots import LIVE, SlotSync
from sfjax.engine.speculation import Speculator
from sfjax.spec.config import SpeculativeConfig
from sfjax.spec.registry import Registry
from sfjax.step import DeviceState
from sfjax.tokenizer import IncrementalDetokenizer, encode
from sfjax.weights import Weights

logger = logging.getLogger("sfjax")


@dataclasses.dataclass
class Call:
    """A device call sent (``Engine._launch``, ``Engine._follow``) and what reading it back
    needs."""
    decode: list[Request]     # the requests whose slots the device laid out
    slots: np.ndarray         # int32 [D]: their slots when it was sent
    prefill: list[Scheduled]  # the host's rows (prefill chunks)
    meta: list                # their logit rows (BatchBuilder.build's)
    drafts: dict[str, int]    # each decoding request's drafts in the first round, by id
    num_rounds: int
    args: tuple               # (batch, draft rows, host rows per shard, with_logprobs)
    result: tuple             # (out, logprobs, drawn) on the device
    waits: bool = False       # sent ahead while requests wait for slots (``Engine._follow``)


def host(tree):
    """``tree``'s arrays as numpy arrays (read back; whole on every device of a mesh): each by
    ``np.asarray``, which costs microseconds where ``jax.device_get``'s tree walk and
    asynchronous copies cost tens of them, on every call."""
    return jax.tree.map(np.asarray, tree)


def _max_len(cfg: ModelConfig, config: EngineConfig) -> int:
    """``max_model_len``, by default the most the model runs at (``ModelConfig.context``)."""
    limit, what = cfg.context
    max_len = limit if config.max_model_len is None else config.max_model_len
    if max_len > limit:
        raise ValueError(f"max_model_len ({max_len}) must be <= {what}")
    return max_len


def check_model_settings(cfg: ModelConfig, config: EngineConfig, mesh=None) -> None:
    """The settings that need the model's config.json (its context and head counts), or the
    mesh (its data-parallel size), refused naming the field before any weight loads."""
    mesh = None if mesh is None else sharding.as_mesh(mesh)
    _max_len(cfg, config)
    if mesh is not None:
        sharding.validate(cfg, mesh)
    sharding.validate_slots(config.max_num_seqs, mesh)
    dp = sharding.dp_of(mesh)
    if config.num_kv_blocks is not None and dp > 1:
        ShardedAllocator.check(config.num_kv_blocks, dp)


class Engine:
    """``add_request`` / ``step`` / ``abort`` / ``has_unfinished_requests``; LLM.generate is built on it."""

    def __init__(self, cfg: ModelConfig, weights: Weights, tokenizer, config: EngineConfig,
                 eos_token_ids: tuple[int, ...] = (), speculative: SpeculativeConfig | None = None,
                 draft: tuple[ModelConfig, Weights] | None = None, mesh=None):
        """``mesh``: a (data, model) ``jax.sharding.Mesh`` (``sharding.make_mesh``) to shard the
        weights, the KV cache and the steps over; None runs on the default device. Over dp data
        shards each holds max_num_seqs / dp slots and num_kv_blocks / dp pages (sfjax.sharding)."""
        self.cfg, self.tokenizer = cfg, tokenizer
        check_model_settings(cfg, config, mesh)
        self.mesh = mesh = None if mesh is None else sharding.as_mesh(mesh)
        self.dp = dp = sharding.dp_of(mesh)
        self._split = model.unrolled(config.layer_loop)
        self.weights = sharding.place_weights(weights, cfg, mesh, self._split)
        tiles = lambda c, w: R.certified_tiles(w, c, config.row_tile, mesh=mesh,
                                               attention=config.attention,
                                               compiler_options=config.compiler_options,
                                               enabled=config.small_row_tiles
                                               and R.kernel_for(config.matmul, cfg) is None)
        max_len = _max_len(cfg, config)
        blocks_per_seq = -(-max_len // config.block_size)
        num_blocks, per_block = self._kv_pages(config, blocks_per_seq, mesh)
        max_len = self._fitted_len(config, max_len, (num_blocks // dp - 1) * config.block_size)
        blocks_per_seq = -(-max_len // config.block_size)
        self.config = dataclasses.replace(config, max_model_len=max_len, num_kv_blocks=num_blocks)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.allocator = (BlockAllocator(num_blocks, prefix_caching=config.enable_prefix_caching)
                          if dp == 1 else ShardedAllocator(
                              num_blocks, dp, prefix_caching=config.enable_prefix_caching))
        self.block_tables = np.zeros((config.max_num_seqs, blocks_per_seq), np.int32)
        self.scheduler = Scheduler(self.allocator, self.block_tables, block_size=config.block_size,
                                   max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   cache_lag=1 if draft is not None else 0,
                                   hash_lookahead=int(bool(speculative)
                                                      and speculative.method == "eagle3"))
        self.batches = BatchBuilder(row_tile=config.row_tile, max_model_len=max_len, dp=dp,
                                    num_slots=config.max_num_seqs,
                                    eos_token_ids=self.eos_token_ids,
                                    shard_of=self.scheduler.shard_of)
        self.slots = SlotSync(self.block_tables, self.batches.table, self.batches.widths, mesh)
        self.registry = Registry()
        self.spec = (Speculator(speculative, cfg, max_len, num_blocks, config.block_size, draft,
                                self.registry, mesh, self._split, tiles, self.weights.embed,
                                config.max_num_seqs) if speculative else None)
        self.state = self._initial_state()
        self.run = self._run_config(*tiles(cfg, self.weights))
        if self.spec:
            self.spec.k_table = self.run.k_table(config.max_num_seqs)
        self._programs = programs.ByWidths(self, self.slots.widths)   # freed with the engine
        self.buckets = compile.Buckets(self.config, dp, self.spec, self.scheduler.shard_of, self.run)
        self._pads: dict[tuple, tuple] = {}            # padding batches of those buckets
        self.requests: dict[str, Request] = {}
        self._held: dict[str, RequestOutput] = {}      # outputs for the next step
        self._plan, self._dispatched = [], False
        self._inflight: Call | None = None          # sent, not yet read back (_follow)
        self._arrivals = 0
        self.stats = {"steps": 0, "host_steps": 0, "prompt_tokens": 0, "generation_tokens": 0}
        self.outputs = OutputProcessor(tokenizer, eos_token_ids=self.eos_token_ids,
                                       max_model_len=max_len, stats=self.stats,
                                       release=lambda req: self._release(req))
        self._log_cache(per_block)

    def _initial_state(self) -> DeviceState:
        """The device state of an idle engine: an empty cache and history, the slot tables, no
        slot's progress, the proposer's empty state."""
        c = self.config
        block_tables, table, progress = self.slots.initial()
        return DeviceState(
            cache=KVCache.zeros(self.cfg, c.num_kv_blocks, c.block_size, mesh=self.mesh),
            history=sharding.zeros((c.max_num_seqs, c.max_model_len), jnp.int32, P(), self.mesh),
            block_tables=block_tables, table=table, progress=progress,
            draft_cache=self.spec.initial_cache() if self.spec else None)

    def _log_cache(self, per_block: int) -> None:
        c, dp = self.config, self.dp
        tokens = (c.num_kv_blocks - dp) * c.block_size
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB per device%s); maximum "
                    "concurrency for %d tokens per request: %.2fx", c.num_kv_blocks - dp,
                    c.block_size, tokens, c.num_kv_blocks // dp * per_block / 2**20,
                    f", {dp} data shards" if dp > 1 else "", c.max_model_len,
                    tokens / c.max_model_len)

    @staticmethod
    def _fitted_len(config: EngineConfig, max_len: int, room: int) -> int:
        """``max_len``, or what one sequence's KV cache holds (``room`` tokens in a data
        shard's pages) if that is less and ``max_model_len`` was left to the model's context:
        a long-context model's full length can outgrow the default ``kv_cache_bytes``, and
        every request asking for the rest of the context (a chat without max_tokens) would be
        refused. A length or cache given outright is kept (a request needing more than the
        cache is refused on its own), with a warning."""
        if room >= max_len:
            return max_len
        if config.max_model_len is None and config.num_kv_blocks is None:
            logger.warning("max_model_len: the model's context (%d) needs more KV cache than "
                           "kv_cache_bytes (%d) gives one sequence; serving at max_model_len %d "
                           "(raise kv_cache_bytes or num_kv_blocks for more)", max_len,
                           config.kv_cache_bytes, room)
            return room
        logger.warning("the KV cache holds %d tokens of one sequence, fewer than max_model_len "
                       "(%d): a request needing more is refused (raise num_kv_blocks or "
                       "kv_cache_bytes)", room, max_len)
        return max_len

    def _kv_pages(self, config: EngineConfig, blocks_per_seq: int, mesh) -> tuple[int, int]:
        """(KV pages, bytes of a page on one device): ``num_kv_blocks``, else enough for
        max_num_seqs full sequences within ``kv_cache_bytes`` of pages per device; each data
        shard has its null block too."""
        per_block = KVCache.bytes_per_block(self.cfg, config.block_size, mesh=mesh)
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks, per_block
        return self.dp * (1 + min(config.max_num_seqs // self.dp * blocks_per_seq,
                                  max(1, config.kv_cache_bytes // per_block))), per_block

    def _run_config(self, small_tiles: tuple[int, ...], stage_tiles: tuple) -> RunConfig:
        """What the engine's programs are specialised on, from its settings (``EngineConfig``'s
        device fields, the speculator's draft and mesh), the certified small tiles and each
        stage's among them."""
        c, spec = self.config, self.spec
        return RunConfig(
            model=self.cfg, max_model_len=c.max_model_len, block_size=c.block_size,
            speculative_config=None if spec is None else dataclasses.replace(
                spec.config, model=spec.round_model),
            row_tile=c.row_tile, sampler=c.sampler, attention=c.attention,
            layer_loop="unrolled" if self._split else "scan", mesh=self.mesh,
            draft_mesh=None if spec is None else spec.mesh, small_tiles=small_tiles,
            draft_small_tiles=() if spec is None else spec.small_tiles, matmul=c.matmul,
            stage_tiles=stage_tiles, draft_stage_tiles=() if spec is None else spec.stage_tiles)

    # -- admission ---------------------------------------------------------------------------

    def prepare(self, request_id: str, prompt: Any, params: SamplingParams | None,
                max_tokens_cap: int | None = None) -> Request:
        """Validates one request and builds its state; raises ValueError (TypeError for a wrong
        type) naming the field. The request keeps its own checked copy of ``params``; with
        ``max_tokens`` None it runs to the end of the context, or ``max_tokens_cap`` tokens
        before it (a model's max_new_tokens)."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise C.InvalidType(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params = params.checked()
        if params.n != 1:
            raise ValueError(f"SamplingParams.n = {params.n}: the engine runs one sequence per "
                             f"request (LLM.generate runs n of them: SamplingParams.children)")
        request_id = C.text("request_id", request_id)
        if self.holds(request_id):
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        text, ids = self._tokenize(prompt)
        if not ids:
            raise ValueError("prompt is empty (it has no tokens)")
        params.validate_for(self.cfg.vocab_size, self.eos_token_ids)
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {limit}, which leaves no "
                             f"room for output")
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - len(ids)
        if params.max_tokens is None and max_tokens_cap is not None:
            max_tokens = min(max_tokens, max_tokens_cap)
        if len(ids) + max_tokens > limit:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                             f"max_model_len ({limit})")
        if params.min_tokens > max_tokens:
            raise ValueError(f"SamplingParams.min_tokens = {params.min_tokens} is out of range: must "
                             f"be <= max_tokens (here {max_tokens}: max_model_len - the prompt)")
        blocks = self.scheduler.blocks_needed(len(ids) + max_tokens)
        if blocks > self.config.num_kv_blocks // self.dp - 1:
            where = "the cache" if self.dp == 1 else "each data shard's cache"
            how = ("" if params.max_tokens is not None else ", the model's default"
                   if max_tokens == max_tokens_cap else ", the room left under max_model_len")
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}{how}) needs "
                             f"{blocks} KV blocks; {where} has only "
                             f"{self.config.num_kv_blocks // self.dp - 1} (raise num_kv_blocks or "
                             f"kv_cache_bytes, or ask for fewer tokens)")
        slot = self._strategy_slot(params)
        arrival, self._arrivals = self._arrivals, self._arrivals + 1
        seed = params.seed
        if seed is None:  # the engine seed and the arrival number (one per prepared request)
            seed = (self.config.seed * 0x9E3779B97F4A7C15 + arrival + 1) % 2**63
        return Request(
            request_id=request_id, prompt=text, prompt_token_ids=list(ids), params=params,
            arrival=arrival, key_data=sampling.request_key_data(seed), max_tokens=max_tokens,
            detok=IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, ids),
            arrival_time=time.monotonic(), strategy_slot=slot, certificate=self.registry.slots[slot])

    def _strategy_slot(self, params: SamplingParams) -> int:
        """The registry slot serving the request; refuses an ungranted strategy or one whose
        certificate does not give the demanded exactness for the request's sampling mode."""
        if params.spec_strategy is not None:
            slot = self.registry.lookup(params.spec_strategy)
        else:
            slot = self.spec.slot if self.spec else 0
        if params.disable_spec_decode:
            slot = 0
        cert = self.registry.slots[slot]
        if not cert.covers(params.spec_exactness, params.greedy):
            mode = "greedy" if params.greedy else "sampled (gumbel)"
            raise ValueError(f"spec_exactness: {params.spec_exactness!r} demanded, but {cert.strategy} is "
                             f"certified {cert.class_for(params.greedy)} for {mode} requests")
        return slot

    def _tokenize(self, prompt: Any) -> tuple[str | None, list[int]]:
        vocab = f"token ids in the vocabulary [0, {self.cfg.vocab_size})"
        if isinstance(prompt, str):
            ids = encode(self.tokenizer, C.text("prompt", prompt))
            bad = next((t for t in ids if not 0 <= t < self.cfg.vocab_size), None)
            if bad is not None:        # a tokenizer with more tokens than the model's embedding
                raise ValueError(f"prompt: the tokenizer gives token id {bad}, outside the "
                                 f"model's vocabulary [0, {self.cfg.vocab_size})")
            return prompt, ids
        if isinstance(prompt, dict) and (extra := sorted(set(prompt) - {"prompt",
                                                                        "prompt_token_ids"})):
            raise ValueError(f"prompt: {extra[0]!r} is not offered (a prompt dict takes "
                             f"'prompt' and 'prompt_token_ids')")
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = C.int_list("prompt_token_ids", prompt["prompt_token_ids"], 0,
                             self.cfg.vocab_size - 1, allowed=vocab)
            return C.text("prompt", prompt.get("prompt"), optional=True), ids
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self._tokenize(C.text("prompt", prompt["prompt"]))
        raise C.InvalidType(f"prompt must be a str or a dict with 'prompt_token_ids' (or 'prompt'), "
                            f"got {type(prompt).__name__}")

    def add_request(self, request_id: str, prompt: Any, sampling_params: SamplingParams | None = None,
                    max_tokens_cap: int | None = None) -> None:
        self.enqueue(self.prepare(request_id, prompt, sampling_params, max_tokens_cap))

    def enqueue(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.scheduler.add(req)

    def abort(self, request_id: str) -> None:
        """Drops the request and frees its blocks at once; the next ``step`` returns its final
        output (finish_reason "abort"). Unknown ids are ignored."""
        req = self.requests.get(request_id)
        if req is not None:
            self.outputs.finish(req, "abort", None)
            self._hold(self.outputs.output(req))

    def holds(self, request_id: str) -> bool:
        """Whether the engine holds the id: a live request, or a final output not yet returned
        by ``step`` (an id is free for a new request only once this is False)."""
        return request_id in self.requests or request_id in self._held

    def drop(self, request_id: str) -> None:
        """Aborts the request and forgets its outputs: its caller has left, and nothing will
        read them (``LLM.generate`` interrupted)."""
        self.abort(request_id)
        self._held.pop(request_id, None)

    def drop_all(self) -> None:
        """Drops every request and held output: their callers have all gone (``AsyncLLM``
        stopping)."""
        for request_id in [*self.requests, *self._held]:
            self.drop(request_id)

    def _fail(self, req: Request, error: BaseException) -> None:
        """Ends one request after a failure serving it (finish_reason "error", the error on its
        output, returned by the next ``step``); every other request carries on."""
        logger.warning("request %r failed and was finished: %s: %s", req.request_id,
                       type(error).__name__, error)
        req.status, req.finish_reason, req.stop_reason = Status.FINISHED, "error", None
        req.finished_time = time.monotonic()
        self._release(req)
        out = self.outputs.output(req)
        out.error = f"{type(error).__name__}: {error}"
        self._hold(out)

    def _hold(self, out: RequestOutput) -> None:
        """Queues an output for the next ``step`` (merged with one already queued)."""
        self._held[out.request_id] = merge_outputs([self._held[out.request_id], out])[0] \
            if out.request_id in self._held else out

    def put_back(self, outputs: list[RequestOutput]) -> None:
        """Returns outputs a caller took from ``step`` but does not own (``LLM.generate`` steps
        the whole engine); the next ``step`` returns them, merged with what that step adds."""
        for out in outputs:
            self._hold(out)

    def has_unfinished_requests(self) -> bool:
        """Whether a request runs or waits, or a final output waits for the next ``step``."""
        return self.scheduler.has_unfinished() or any(o.finished for o in self._held.values())

    # -- the step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Reads back one device call (the one sent ahead by the last step under
        ``async_scheduling``, else one it schedules and sends now) and returns an output for
        every request that got tokens or ended (aborted and failed ones included), one per
        request.

        A failure while building one request's rows finishes that request with
        finish_reason "error" (``RequestOutput.error``) and leaves the others as they were, to
        run in the next step; so does a failure while reading one request's tokens back."""
        held = list(self._held.values())
        self._held.clear()
        self._plan, self._dispatched = [], self._inflight is not None
        try:
            new = self._step()
        except BaseException as e:
            if self._dispatched:         # a call sent, or in flight, was not read back in full
                self._inflight = None
                self.slots.forget()
            if self._dispatched or not isinstance(e, Exception) or not self._fail_culprits():
                # no single request's rows raise alone; the outputs held for this step (an
                # aborted request's final one) wait for the next
                newer, self._held = list(self._held.values()), {}
                self.put_back(held + newer)
                raise
            new = []
        outs = merge_outputs(held + new + list(self._held.values()))
        self._held.clear()
        return outs

    def _fail_culprits(self) -> bool:
        """After a failure before the device call: finishes the requests whose own rows raise
        when built alone; returns whether there was one."""
        found = False
        for s in self._plan:
            try:
                self.batches.build([s])
                self.batches.table([s.request])
            except Exception as e:
                self._fail(s.request, e)
                found = True
        return found

    def _step(self) -> list[RequestOutput]:
        """Reads back the call in flight, else launches one (``_launch``); with
        ``async_scheduling``, the next call goes out before this one is read (``_follow``)."""
        call, self._inflight = self._inflight, None
        if call is None:
            call = self._launch()
            if call is None:
                return []
        self._inflight = follow = self._follow(call) if self.config.async_scheduling else None
        outputs = self._collect(call)
        ended = [r.status is not Status.RUNNING for r in follow.decode] if follow else []
        if ended and (all(ended) or follow.waits and any(ended)):
            # each of its requests ended in ``call``, or one did while others wait for its slot
            # (it runs no round then, ``rounds.call``): read it now, the next step admits
            self._inflight = None
            try:
                outputs += self._collect(follow)
            except BaseException:       # ``call``'s outputs (final ones among them) are kept
                self.put_back(outputs)
                raise
        return outputs

    def _launch(self) -> Call | None:
        """Schedules (admission, chunked prefill, preemption) and dispatches one call; None when
        nothing is scheduled."""
        self._plan = plan = self.scheduler.schedule()
        if not plan:
            if self.scheduler.running or self.scheduler.waiting:
                raise RuntimeError("the scheduler could not place any request (KV cache too small)")
            return None
        now = time.monotonic()
        for s in plan:
            if s.request.first_scheduled_time is None:
                s.request.first_scheduled_time = now
            if s.cached:        # penalties and n-gram lookup read the tokens the cache skipped
                row = np.zeros(self.config.max_model_len, np.int32)
                row[:s.cached] = [s.request.token(j) for j in range(s.cached)]
                self.state = self.programs.write_history(self.state, np.int32(s.request.slot), row, np.int32(s.cached))
                if self.programs.forget is not None:     # an EAGLE head's kept features
                    self.state = self.programs.forget(self.state, np.int32(s.request.slot))
        decode = [s.request for s in plan if self._is_decode(s)]
        prefill = [s for s in plan if not self._is_decode(s)]
        # each decoding request's drafts this round, as the device picks them (before its pages)
        on = self.spec is not None and self.spec.config.speculates_at(len(self.scheduler.running))
        drafts = {req.request_id: self.spec.k_for(req, self.batches.budget(req), len(decode))
                  for req in decode} if on else {}
        num_rounds = self._rounds_for(plan, decode, prefill, drafts)
        progress = np.zeros_like(self.slots.progress)        # every other slot: not live
        for req in decode:            # its row (slots.PROGRESS_FIELDS); adaptive_k reads counts
            m = req.spec_metrics or speculation.SpecMetrics()
            progress[req.slot] = (len(req.prompt_token_ids), req.num_tokens,
                                  req.output_token_ids[-1], 1, m.num_draft_tokens,
                                  m.num_accepted_tokens, m.num_drafts, m.num_rejections,
                                  bool(self.spec) and req.strategy_slot == self.spec.slot,
                                  m.copy_accepted, m.copy_rejections)
        with_logprobs = any(req.params.logprobs is not None for req in decode)
        batch, draft, meta, rows = self._host_rows(prefill, decode, with_logprobs)
        args = (batch, draft, rows, with_logprobs)
        result = self._call(*args, progress, num_rounds, bool(self.scheduler.waiting),
                            len(self.scheduler.running) - len(decode), bool(meta))
        return Call(decode, np.array([req.slot for req in decode], np.int32), prefill, meta,
                    drafts, num_rounds, args, result)

    def _follow(self, call: Call) -> Call | None:
        """The next call, dispatched before ``call`` is read back, or None. It runs ``call``'s
        rounds in the bucket of ``call``'s rows (``Buckets.shape``: ``call``'s, or a smaller one once
        its compile is due) over the slot state ``call`` leaves on the device (only new
        pages sent): the rounds a later call would run, so the same tokens. A row that ended in
        ``call`` is not live there (``rounds.call``); the tokens of a request that ended on the
        host meanwhile (a stop string, an abort, a failure) are dropped when it is read.

        Sent only when ``call`` only decoded, every running request, none has ended, and:
        - no waiting request has a free slot (while one waits for a slot, the call runs no round
          if a row ended in ``call``: ``rounds.call``'s ``expect_live``);
        - some request may outlive ``call`` (each round emits a token per live row);
        - the pages for ``call``'s rounds again can be had;
        - no request has a stop string while requests wait (the call would run on past a stop
          the host sees, with a slot standing free) or while the speculation threshold
          (``disable_by_batch_size``) counts rows (the device would count an ended request)."""
        sched, decode = self.scheduler, call.decode
        if (call.prefill or not decode or len(sched.running) != len(decode)
                or (sched.waiting and sched.has_free_slot())
                or any(req.status is not Status.RUNNING for req in decode)
                or not self.slots.progress[call.slots, LIVE].all()
                or ((sched.waiting or self.spec is not None
                     and self.spec.config.disable_by_batch_size is not None)
                    and any(req.params.stop for req in decode))):
            return None
        if all(req.num_tokens + call.num_rounds >= len(req.prompt_token_ids) + req.max_tokens
               for req in decode):
            return None              # every request ends in ``call``
        # each request's tokens now are those ``call`` starts from (the call before it was read)
        k1 = self.spec.k_max + 1 if self.spec else 1
        reach = [(req, min(req.num_tokens + 2 * call.num_rounds * k1,
                           len(req.prompt_token_ids) + req.max_tokens)) for req in decode]
        if not sched.can_grow(reach):
            return None
        for req, upto in reach:
            sched.grow(req, upto)
        waits = bool(sched.waiting)      # then no round if a request ended in ``call``
        with_logprobs = call.args[3]     # its bucket again: ``Buckets.fit`` counts it
        batch, draft, _, rows = self._host_rows([], decode, with_logprobs)
        args = (batch, draft, rows, with_logprobs)
        result = self._call(*args, None, call.num_rounds, waits, 0, False,
                            len(decode) if waits else 0)
        return dataclasses.replace(call, args=args, result=result, waits=waits)

    def _collect(self, call: Call) -> list[RequestOutput]:
        """Reads ``call`` back: its host rows' draws, its decoding requests' tokens (those still
        running: one that ended since ``call`` was sent gets none) and counters."""
        out, logprobs, drawn = host(call.result)
        for s in call.prefill:
            self.scheduler.set_computed(s.request, s.start + s.count)
        outputs = self._read_rows(call.meta, drawn, 0) if call.meta else []
        n, tokens, new_len, live, drafted, accepted, copies = rounds.unpack(
            out, self.programs.max_rounds)
        if call.decode:          # what the rounds left on the device (new tokens, counters)
            at = call.slots
            self.slots.advanced(at, new_len[at], live[at], tokens, drafted[:n, at],
                                accepted[:n, at], copies[at])
        self.stats["steps"] += n                           # device rounds
        self.stats["host_steps"] += n > 0        # calls that ran rounds (a follow may run none)
        for req, slot in zip(call.decode, call.slots):
            if req.status is not Status.RUNNING:
                continue
            read = lambda: self._read_rounds(req, tokens[slot], int(new_len[slot]),
                                             drafted[:n, slot], accepted[:n, slot],
                                             call.drafts.get(req.request_id, 0) > 0
                                             or bool(drafted[:n, slot].any()),
                                             req.params.logprobs is not None and
                                             rounds.unpack_logprobs(logprobs, slot), copies[slot])
            outputs.append(self._guarded(req, read))
        return [o for o in outputs if o is not None]

    def _read_rows(self, meta, drawn, first: int) -> list[RequestOutput]:
        """Prompt logprobs and drawn tokens of the logit rows from ``first`` on."""
        outputs = []
        for i, (req, pos, _) in enumerate(meta[first:], first):
            if req.status is Status.FINISHED:          # failed on an earlier row of this step
                continue
            out = self._guarded(req, lambda: self._read_row(req, drawn, i, pos))
            if out is not None:
                outputs.append(out)
        return outputs

    def _read_row(self, req: Request, drawn, i: int, pos: int) -> RequestOutput | None:
        lp = self.outputs.logprob_entry(req, drawn, i, pos, int(drawn.tokens[i]))
        if pos >= 0:
            req.prompt_logprobs.append(lp)
            return None
        token = int(drawn.tokens[i])
        self.outputs.append(req, token, lp)
        return self.outputs.output(req, new_token_ids=[token])

    def _guarded(self, req: Request, read):
        """``read()``: one request's host work on a step's results. A failure there ends that
        request alone (``_fail``) and gives None."""
        try:
            return read()
        except Exception as e:
            self._fail(req, e)
            return None

    def _is_decode(self, s: Scheduled) -> bool:
        return s.count == 1 and s.start == s.request.num_tokens - 1 and bool(s.request.output_token_ids)

    # -- the one program -------------------------------------------------------------------------

    def _rounds_for(self, plan: list[Scheduled], decode: list[Request],
                    prefill: list[Scheduled], drafts: dict[str, int]) -> int:
        """Rounds the device lays out in this call, and their pages. Several (up to
        ``num_scheduler_steps``, fewer tried before one) when every running request decodes, no
        waiting request has a free slot to be admitted to, and the free blocks hold every
        request's growth over the rounds; else one, each drafting row's pages grown for its k
        drafts (``drafts``, by request id) where they can be had (the device drafts none for a
        row whose pages do not hold them, ``functional._spec_k``)."""
        sched, steps = self.scheduler, self.config.num_scheduler_steps
        k1 = self.spec.k_max + 1 if self.spec else 1
        def upto(req, r):       # the round's K/V writes stay below prompt + max_tokens
            return min(req.num_tokens + r * k1, len(req.prompt_token_ids) + req.max_tokens)
        if steps > 1 and not prefill and len(plan) == len(sched.running):
            r = 1 if sched.waiting and sched.has_free_slot() else steps
            while r > 1 and not sched.can_grow([(req, upto(req, r)) for req in decode]):
                r //= 2
            if sched.can_grow([(req, upto(req, r)) for req in decode]):
                for req in decode:
                    sched.grow(req, upto(req, r))
                return r
        for req in decode:
            if drafts.get(req.request_id, 0) > 0:
                sched.grow(req, req.num_tokens + drafts[req.request_id])
        return 1

    def _read_rounds(self, req: Request, tokens, new_len: int, drafted, accepted,
                     speculating: bool, drawn, copies) -> RequestOutput:
        """One request's tokens from several rounds (its slot's row, with their logprobs in
        ``drawn``, or False if it asked for none), and its counters (``copies``: its copies'
        accepted drafts and rejecting rounds as the device counts them); tokens past a stop
        string are dropped, and so are the rounds that drew only them."""
        new = []
        for j in range(new_len - req.num_tokens):
            token = int(tokens[j])
            new.append(token)
            lp = self.outputs.logprob_entry(req, drawn, j, -1, token) if drawn else None
            if self.outputs.append(req, token, lp):
                break
        if req.status is not Status.FINISHED:
            self.scheduler.set_computed(req, req.num_tokens - 1)
        if speculating:
            if req.spec_metrics is None:
                req.spec_metrics = speculation.SpecMetrics()
            for d, a in rounds.taken(drafted, accepted, len(new)):
                for m in (self.spec.metrics, req.spec_metrics):
                    m.add(d, a)
            req.spec_metrics.copied(*map(int, copies), self.spec.metrics)
        return self.outputs.output(req, new_token_ids=new)

    @property
    def programs(self) -> programs.Programs:
        """The engine's compiled programs for its device table as it is now (the id lists'
        widths, ``programs.ByWidths``)."""
        return self._programs(self, self.slots.widths)

    def _sync(self, progress=None) -> None:
        """Sends the slot rows that changed since the last call (``engine.slots``; with
        ``progress``, every slot's progress too), then marks the call dispatched: a failure from
        here on is the device call's."""
        self.state = self.slots.sync(self.state, self.scheduler.running,
                                     lambda widths: self._programs(self, widths), progress)
        self._dispatched = True

    def buckets_pending(self) -> list[tuple]:
        """The buckets calls have asked for that have not compiled yet (``compile.Buckets``): a
        benchmark's warm-up runs until this is empty (``sfjax.benchmark.warm_up``)."""
        return self.buckets.pending()

    def _host_rows(self, prefill: list[Scheduled], decode: list[Request], with_logprobs: bool):
        """The host's rows of a call: ``prefill``'s chunks packed by data shard, in the bucket
        that holds them and ``decode``'s rows after them (``Buckets.shape``); for a draft model the same
        rows in its row count. Returns (batch, draft rows or None, the logit rows' meta, the rows
        per data shard)."""
        rows = [0] * self.dp
        for s in prefill:
            rows[self.scheduler.shard_of(s.request.slot)] += s.count
        if not prefill:
            shape = self.buckets.shape(rows, 0, decode, with_logprobs)
            if shape not in self._pads:        # built once per shape (calls do not donate them)
                self._pads[shape] = self._build([], shape)
            return (*self._pads[shape], rows)
        logits = self.batches.logits(prefill)
        shape = self.buckets.shape(rows, len(logits), decode, with_logprobs)
        return (*self._build(prefill, shape, logits), rows)

    def _build(self, prefill: list[Scheduled], shape: tuple, logits=None):
        """``prefill``'s rows in at least ``shape`` (``logits``: their logit rows, as
        ``BatchBuilder.logits`` gives them): (batch, the draft model's copy of its rows or None,
        meta)."""
        n, r, na = shape
        batch, meta, _ = self.batches.build(prefill, n, r, logits)
        if self.spec is None or self.spec.draft_cfg is None:
            return batch, None, meta
        return batch, pack(layout(prefill), self.batches.shards(prefill), self.dp,
                           self.config.row_tile, na or 0)[:3], meta

    def _call(self, batch, draft, rows, with_logprobs, progress, num_rounds, until_one_ends,
              running=0, read_drawn=False, expect_live=0):
        """Dispatches the engine's one program (``rounds.call``) on the host's rows and the slots
        ``progress`` marks live (every slot's row, as ``SlotSync.progress``, sent where it
        differs from the device's; None: the device's as it is): (out, logprobs, drawn), not
        yet read back (``host``); drawn only with ``read_drawn``."""
        self._sync(progress)
        program = self.programs.round_logprobs if with_logprobs else self.programs.round
        self.state, out, logprobs, drawn = program(
            self.weights, self.spec.draft_weights if self.spec else None, self.state, batch, draft,
            np.asarray(rows, np.int32), np.int32(running), np.int32(num_rounds),
            np.bool_(until_one_ends), np.int32(expect_live))
        if not with_logprobs:
            self.buckets.ran.add((len(batch.tokens), len(batch.logit_rows),
                                  None if draft is None else len(draft[0])))
        return out, logprobs, drawn if read_drawn else None

    def _run_padding(self, shape: tuple, with_logprobs: bool = False) -> None:
        """A call of no rows and no rounds in ``shape`` (compiles its program: ``precompile``)."""
        batch, draft, _ = self._build([], shape)
        host(self._call(batch, draft, [0] * self.dp, with_logprobs, None, 0, False))

    # -- compiling ahead -----------------------------------------------------------------------

    def shape_buckets(self) -> list[tuple]:
        """Every (kind, N, R, draft rows) a step of this engine can take
        (``engine.compile.shape_buckets``)."""
        return compile.shape_buckets(self)

    def precompile(self, progress: bool = True) -> float:
        """Compiles every shape bucket by running each step once on padding rows, which write
        only the null block; returns the seconds spent (``engine.compile.precompile``)."""
        return compile.precompile(self, progress)

    def get_metrics(self) -> dict:
        m = dict(self.stats, num_preemptions=self.scheduler.num_preemptions)
        if self.allocator.prefix_caching:
            a = self.allocator
            m["prefix_cache"] = {"query_tokens": a.query_tokens, "hit_tokens": a.hit_tokens,
                                 "hit_rate": a.hit_tokens / max(a.query_tokens, 1)}
        if self.spec:
            m["spec_decode"] = self.spec.metrics.as_dict()
        return m

    def _release(self, req: Request) -> None:
        """Frees a finished request's slot and blocks and forgets it."""
        self.scheduler.remove(req)
        self.requests.pop(req.request_id, None)

