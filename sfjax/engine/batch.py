"""Host batch building: a step's rows (prefill chunks, decode rows, a round's verify rows and
the draft model's rows) laid out by data shard in shape buckets, and the per-row sampling arrays.

``layout`` gives each plan entry's rows, ``pack`` places them by data shard in a bucketed number
of rows, and ``BatchBuilder.build`` turns a plan into the ``StepBatch`` of a step (with
``spec_batch`` the ``SpecBatch`` of a speculative round)."""

from __future__ import annotations

from typing import Callable

import numpy as np

from sfjax import sampling
from sfjax.engine.scheduler import Request, Scheduled
from sfjax.spec.round import SpecBatch
from sfjax.step import StepBatch


def layout(plan: list[Scheduled], spec_k: dict[int, int], k_max: int) -> list[tuple]:
    """Each entry's rows of the step as (tokens, positions, slots) lists: its tokens, or K + 1
    verify rows ``[last token, 0 x K]`` at L-1 .. L-1+K for a speculating decode entry."""
    out = []
    for i, s in enumerate(plan):
        req = s.request
        if i in spec_k:
            length = req.num_tokens
            out.append(([req.token(length - 1)] + [0] * k_max,
                        list(range(length - 1, length + k_max)), [req.slot] * (k_max + 1)))
        else:
            out.append(([req.token(j) for j in range(s.start, s.start + s.count)],
                        list(range(s.start, s.start + s.count)), [req.slot] * s.count))
    return out


def draft_rows(plan: list[Scheduled], decode: set[int]) -> list[tuple]:
    """The draft model's first pass, per entry as ``layout``: prefill rows as the target's,
    (L-2, L-1) per decode entry (speculating or not, so its cache stays current)."""
    out = []
    for i, s in enumerate(plan):
        req = s.request
        if i in decode:
            length = req.num_tokens
            out.append(([req.token(length - 2), req.token(length - 1)], [length - 2, length - 1],
                        [req.slot] * 2))
        else:
            out.append(([req.token(j) for j in range(s.start, s.start + s.count)],
                        list(range(s.start, s.start + s.count)), [req.slot] * s.count))
    return out


def bucket(n: int, tile: int) -> int:
    """Smallest tile * 2**j >= n: few shapes, so few compilations."""
    b = tile
    while b < n:
        b *= 2
    return b


def pack(entries: list[tuple], shards: list[int], num_shards: int, tile: int, min_rows: int = 0):
    """The step's rows laid out by data shard (``sfjax.sharding``): each entry's rows (``layout``)
    go to its shard's segment in order, and every segment is padded to one length, the busiest
    shard's bucketed (at least ``min_rows / num_shards``): the shapes stay a small fixed set. With
    one shard, the entries' rows in order, padded to a bucket of at least ``min_rows``.

    Returns (tokens, positions, slots int32 [num_shards * segment], first row of each entry).
    """
    load, offset = [0] * num_shards, []
    for (rows, _, _), d in zip(entries, shards):
        offset.append(load[d])
        load[d] += len(rows)
    seg = bucket(max(max(load), -(-min_rows // num_shards), 1), tile)
    n = num_shards * seg
    tokens, positions, slots = (np.full(n, fill, np.int32) for fill in (0, -1, -1))
    first = [d * seg + o for d, o in zip(shards, offset)]
    for (t, p, s), r in zip(entries, first):
        tokens[r:r + len(t)], positions[r:r + len(t)], slots[r:r + len(t)] = t, p, s
    return tokens, positions, slots, first


def pad(values: list[int], n: int, fill: int) -> np.ndarray:
    out = np.full(n, fill, np.int32)
    out[:len(values)] = values
    return out


def spec_batch(plan, spec_k, verify_row, draft, stops, n_slots: int, n_draft: int,
               verify_start: int) -> SpecBatch:
    """verify_row: per speculating entry, its first row; draft: the draft rows (tokens,
    positions, slots, padded to ``n_draft``) and per decode entry its row at L-1; stops: per
    speculating entry (stop ids, min_left, budget)."""
    order = sorted(spec_k)
    s = n_slots
    slots = pad([plan[i].request.slot for i in order], s, -1)
    width = max([len(stops[i][0]) for i in order] + [1])
    stop_ids = np.full((s, -(-width // 4) * 4), -1, np.int32)
    for r, i in enumerate(order):
        stop_ids[r, :len(stops[i][0])] = stops[i][0]
    d_tokens, d_pos, d_slots, d_last = draft
    return SpecBatch(
        slots=slots, length=pad([plan[i].request.num_tokens for i in order], s, 0),
        k=pad([spec_k[i] for i in order], s, 0), verify_row=pad([verify_row[i] for i in order], s, 0),
        stop_ids=stop_ids, min_left=pad([stops[i][1] for i in order], s, 0),
        budget=pad([stops[i][2] for i in order], s, 0),
        draft_tokens=pad(d_tokens, n_draft, 0), draft_positions=pad(d_pos, n_draft, -1),
        draft_slots=pad(d_slots, n_draft, -1), draft_last=pad([d_last.get(i, 0) for i in order], s, 0),
        verify_start=np.int32(verify_start))


def padded(lists: list[list], r: int, fill, dtype) -> np.ndarray:
    """[r, bucketed width] array of the lists, padded with ``fill``."""
    out = np.full((r, bucket(max(map(len, lists), default=1), 4)), fill, dtype)
    for i, x in enumerate(lists):
        out[i, :len(x)] = x
    return out


class BatchBuilder:
    """Builds a step's batch from the scheduler's plan, on the host."""

    def __init__(self, *, row_tile: int, max_model_len: int, dp: int, block_tables: np.ndarray,
                 eos_token_ids: frozenset[int], shard_of: Callable[[int], int]):
        self.row_tile, self.max_model_len, self.dp = row_tile, max_model_len, dp
        self.block_tables = block_tables          # the scheduler's, updated in place
        self.eos_token_ids = eos_token_ids
        self.shard_of = shard_of                  # slot -> data shard

    def shards(self, plan: list[Scheduled]) -> list[int]:
        return [self.shard_of(s.request.slot) for s in plan]

    def build(self, plan: list[Scheduled], rows: list[tuple] | None = None,
                     tail: list | None = None, verify: set[int] = frozenset(), k1: int = 1,
                     min_rows: int = 0) -> tuple[StepBatch, list, list[int]]:
        """Packs the plan's rows by data shard (``pack``); returns the batch, per
        logit row (request, prompt position whose next token's logprob it reports or -1 for a
        draw, offset of a verify row), and each entry's first row.

        ``rows`` overrides each entry's rows (``layout``); the ``tail`` logit rows
        come last: a round's verify rows, ``k1`` per entry in ``verify`` (slot-major, then
        padding slots), given as (request, -1, j). Trailing padding costs nothing: whole tiles
        past the real rows are skipped. At least ``min_rows`` rows are laid out, so a round's
        shape does not follow its composition.
        """
        tile = self.row_tile
        rows = rows if rows is not None else layout(plan, {}, 0)
        tokens, positions, slots, first = pack(rows, self.shards(plan), self.dp, tile,
                                                           min_rows)
        logit_rows, verify_rows = [], []
        for i, s in enumerate(plan):
            req, row = s.request, first[i]
            if i in verify:
                verify_rows += range(row, row + k1)
                continue
            if req.params.prompt_logprobs is not None:
                start = max(s.start, len(req.prompt_logprobs))
                for pos in range(start, min(s.start + s.count, len(req.prompt_token_ids) - 1)):
                    logit_rows.append((row + pos - s.start, (req, pos, 0)))
            if s.draws:
                logit_rows.append((row + s.count - 1, (req, -1, 0)))
        tail = tail or []
        all_rows = [r for r, _ in logit_rows] + verify_rows + [0] * (len(tail) - len(verify_rows))
        meta = [m for _, m in logit_rows] + list(tail)
        real = len(logit_rows) + len(verify_rows)
        r = bucket(max(len(meta), 1), tile)
        logprobs = any(req is not None and (req.params.logprobs is not None or pos >= 0)
                       for req, pos, _ in meta)
        batch = StepBatch(
            tokens=tokens, positions=positions, slots=slots,
            block_tables=self.block_tables.copy(), logit_rows=pad(all_rows, r, 0),
            num_logit_rows=np.int32(real), with_logprobs=np.bool_(logprobs),
            sampling=self.sampling_rows(meta, r))
        return batch, meta, first

    def sampling_rows(self, meta: list, r: int) -> sampling.SamplingBatch:
        f32 = lambda v: np.full(r, v, np.float32)
        i32 = lambda v: np.full(r, v, np.int32)
        b = dict(temperature=f32(0), top_k=i32(0), top_p=f32(1), min_p=f32(0), presence=f32(0),
                 frequency=f32(0), repetition=f32(1), key_data=np.zeros((r, 2), np.uint32),
                 position=i32(0), slot=i32(0), seq_pos=i32(-1), prompt_len=i32(0), target=i32(-1))
        draws = [req is not None and pos < 0 for req, pos, _ in meta]
        suppress = [self.suppressed(req, j) if d else [] for (req, _, j), d in zip(meta, draws)]
        bias = [sorted(req.params.logit_bias.items()) if d else [] for (req, _, _), d in zip(meta, draws)]
        allowed = [req.params.allowed_token_ids or [] if d else [] for (req, _, _), d in zip(meta, draws)]
        for i, (req, pos, j) in enumerate(meta):
            if req is None:
                continue
            p = req.params
            b["slot"][i], b["prompt_len"][i] = req.slot, len(req.prompt_token_ids)
            if pos >= 0:                       # a prompt-logprobs row: nothing is drawn
                b["seq_pos"][i], b["target"][i] = pos, req.prompt_token_ids[pos + 1]
                continue
            b["temperature"][i], b["top_k"][i], b["top_p"][i] = p.temperature, p.top_k, p.top_p
            b["min_p"][i], b["presence"][i] = p.min_p, p.presence_penalty
            b["frequency"][i], b["repetition"][i] = p.frequency_penalty, p.repetition_penalty
            b["key_data"][i] = req.key_data
            b["position"][i] = len(req.output_token_ids) + j
            b["seq_pos"][i] = req.num_tokens - 1 + j
        return sampling.SamplingBatch(
            **b, suppress=padded(suppress, r, -1, np.int32),
            bias_ids=padded([[t for t, _ in x] for x in bias], r, -1, np.int32),
            bias=padded([[max(-100.0, min(100.0, v)) for _, v in x] for x in bias], r, 0, np.float32),
            allowed=padded(allowed, r, -1, np.int32))

    def suppressed(self, req: Request, offset: int = 0) -> list[int]:
        """Stop tokens can't be drawn before min_tokens (vLLM's semantics)."""
        if len(req.output_token_ids) + offset >= req.params.min_tokens:
            return []
        eos = [] if req.params.ignore_eos else sorted(self.eos_token_ids)
        return eos + list(req.params.stop_token_ids)

    def stop_rule(self, req: Request) -> tuple[list[int], int, int]:
        """(stop token ids, index from which they count, tokens left) for the device."""
        stops = ([] if req.params.ignore_eos else sorted(self.eos_token_ids)) + req.params.stop_token_ids
        out = len(req.output_token_ids)
        budget = min(req.max_tokens - out, self.max_model_len - req.num_tokens)
        return stops, max(0, req.params.min_tokens - out), budget
