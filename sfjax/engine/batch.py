"""Host batch building: a step's rows (prefill chunks, decode rows, a round's verify rows and
the draft model's rows) laid out by data shard in shape buckets, and the per-row sampling arrays.

``layout`` gives each plan entry's rows, ``pack`` places them by data shard in a bucketed number
of rows, and ``BatchBuilder.build`` turns a plan into the ``StepBatch`` of a step (with
``spec_batch`` the ``SpecBatch`` of a speculative round)."""

from __future__ import annotations

from typing import Callable

import numpy as np

from sfjax import sampling
from sfjax.rows import bucket
from sfjax.engine.scheduler import Request, Scheduled
from sfjax.round import SpecBatch
from sfjax.step import StepBatch


def layout(plan: list[Scheduled], spec_k: dict[int, int], k_max: int) -> list[tuple]:
    """Each entry's rows of the step as (tokens, positions, slots) lists: its tokens, or K + 1
    verify rows ``[last token, 0 x K]`` for a speculating decode entry, at L-1 .. L-1+k for its
    k = ``spec_k[i]`` and padding past them (the round writes its drafts into the k)."""
    out = []
    for i, s in enumerate(plan):
        req = s.request
        if i in spec_k:
            length, k = req.num_tokens, spec_k[i]
            mine = lambda j, x: x if j <= k else -1
            out.append(([req.token(length - 1)] + [0] * k_max,
                        [mine(j, length - 1 + j) for j in range(k_max + 1)],
                        [mine(j, req.slot) for j in range(k_max + 1)]))
        else:
            out.append(_scheduled_rows(s))
    return out


def _scheduled_rows(s: Scheduled) -> tuple:
    """The rows of an entry's scheduled tokens, as ``layout``'s (tokens, positions, slots)."""
    span = range(s.start, s.start + s.count)
    return [s.request.token(j) for j in span], list(span), [s.request.slot] * s.count


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
            out.append(_scheduled_rows(s))
    return out


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


def spec_batch(plan, spec_k, verify_row, draft, n_slots: int, n_draft: int,
               verify_start: int, k1: int) -> SpecBatch:
    """verify_row: per speculating entry, its first row; draft: the draft rows (tokens,
    positions, slots, padded to ``n_draft``) and per decode entry its row at L-1. The verify
    logit rows are ``k1`` per slot from ``verify_start``, slot-major."""
    order = sorted(spec_k)
    s = n_slots
    reqs = [plan[i].request for i in order]
    d_tokens, d_pos, d_slots, d_last = draft
    return SpecBatch(
        slots=pad([r.slot for r in reqs], s, -1), length=pad([r.num_tokens for r in reqs], s, 0),
        prompt_len=pad([len(r.prompt_token_ids) for r in reqs], s, 0),
        k=pad([spec_k[i] for i in order], s, 0), verify_row=pad([verify_row[i] for i in order], s, 0),
        draft_tokens=pad(d_tokens, n_draft, 0), draft_positions=pad(d_pos, n_draft, -1),
        draft_slots=pad(d_slots, n_draft, -1), draft_last=pad([d_last.get(i, 0) for i in order], s, 0),
        verify_logit=(verify_start + k1 * np.arange(s)).astype(np.int32))


class BatchBuilder:
    """Builds a step's batch from the scheduler's plan, on the host."""

    def __init__(self, *, row_tile: int, max_model_len: int, dp: int, num_slots: int,
                 eos_token_ids: frozenset[int], shard_of: Callable[[int], int]):
        self.row_tile, self.max_model_len, self.dp = row_tile, max_model_len, dp
        self.num_slots = num_slots
        self.eos_token_ids = eos_token_ids
        self.shard_of = shard_of                  # slot -> data shard

    def shards(self, plan: list[Scheduled]) -> list[int]:
        return [self.shard_of(s.request.slot) for s in plan]

    def build(self, plan: list[Scheduled], rows: list[tuple] | None = None,
                     tail: list | None = None, verify: set[int] = frozenset(), k1: int = 1,
                     min_rows: int = 0, min_logit_rows: int = 0) -> tuple[StepBatch, list, list[int]]:
        """Packs the plan's rows by data shard (``pack``); returns the batch, per
        logit row (request, prompt position whose next token's logprob it reports or -1 for a
        draw, offset of a verify row), and each entry's first row.

        ``rows`` overrides each entry's rows (``layout``); the ``tail`` logit rows
        come last: a round's verify rows, ``k1`` per entry in ``verify`` (slot-major, then
        padding slots), given as (request, -1, j). Trailing padding costs nothing: whole tiles
        past the real rows are skipped. At least ``min_rows`` rows are laid out, so a round's
        shape does not follow its composition; and at least ``min_logit_rows`` logit rows.
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
        r = bucket(max(len(meta), 1, min_logit_rows), tile)
        logprobs = any(req is not None and (req.params.logprobs is not None or pos >= 0)
                       for req, pos, _ in meta)
        batch = StepBatch(
            tokens=tokens, positions=positions, slots=slots, logit_rows=pad(all_rows, r, 0),
            num_logit_rows=np.int32(real), with_logprobs=np.bool_(logprobs),
            draws=self.draws(meta, r))
        return batch, meta, first

    def draws(self, meta: list, r: int) -> sampling.Draws:
        """Which slot and position each logit row draws at (``sampling.rows`` expands them on
        the device): a draw after the request's newest token (``j`` rows further for a verify
        row), a prompt-logprobs row at its prompt position, or padding."""
        d = sampling.Draws.padding(r)
        for i, (req, pos, j) in enumerate(meta):
            if req is None:
                continue
            d.slot[i], d.prompt_len[i] = req.slot, len(req.prompt_token_ids)
            if pos >= 0:
                d.seq_pos[i], d.target[i] = pos, req.prompt_token_ids[pos + 1]
            else:
                d.seq_pos[i] = req.num_tokens - 1 + j
        return d

    def table(self, reqs: list[Request], rows: list[int] | None = None,
              num_rows: int | None = None, widths=None) -> sampling.Sampling:
        """The sampling settings of ``reqs`` at ``rows`` (default: by slot) of ``num_rows``
        (default: the slots), other rows inert; the id lists ``widths`` wide (default: theirs)."""
        return sampling.Sampling.placed(
            [r.params for r in reqs], [r.key_data for r in reqs], [r.max_tokens for r in reqs],
            eos_token_ids=sorted(self.eos_token_ids),
            rows=[r.slot for r in reqs] if rows is None else rows,
            num_rows=self.num_slots if num_rows is None else num_rows, widths=widths)

    def widths(self, reqs: list[Request]) -> tuple[int, int, int]:
        """The id-list widths a table holding ``reqs`` needs (``sampling.list_widths``)."""
        return sampling.list_widths([r.params for r in reqs], sorted(self.eos_token_ids))

    def budget(self, req: Request) -> int:
        """Tokens the request may still emit (max_tokens, max_model_len)."""
        return min(req.max_tokens - len(req.output_token_ids), self.max_model_len - req.num_tokens)
