"""Host batch building: a call's host rows (prefill chunks) laid out by data shard in shape
buckets, and the per-row sampling arrays; the decoding slots' rows are the device's
(``functional._layout``), after these.

``layout`` gives each plan entry's rows, ``pack`` places them by data shard in a bucketed number
of rows, and ``BatchBuilder.build`` turns a plan into the ``StepBatch`` of a call."""

from __future__ import annotations

from typing import Callable

import numpy as np

from sfjax import sampling
from sfjax.rows import bucket
from sfjax.engine.scheduler import Request, Scheduled
from sfjax.step import StepBatch


def layout(plan: list[Scheduled]) -> list[tuple]:
    """Each entry's rows, its scheduled tokens, as (tokens, positions, slots) lists."""
    out = []
    for s in plan:
        span = range(s.start, s.start + s.count)
        out.append(([s.request.token(j) for j in span], list(span), [s.request.slot] * s.count))
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

    def logits(self, plan: list[Scheduled]) -> list[tuple[int, int, tuple]]:
        """The plan's logit rows, each as (entry, its row among the entry's rows, meta): meta is
        (request, prompt position whose next token's logprob it reports or -1 for a draw, 0)."""
        out = []
        for i, s in enumerate(plan):
            req = s.request
            if req.params.prompt_logprobs is not None:
                start = max(s.start, len(req.prompt_logprobs))
                for pos in range(start, min(s.start + s.count, len(req.prompt_token_ids) - 1)):
                    out.append((i, pos - s.start, (req, pos, 0)))
            if s.draws:
                out.append((i, s.count - 1, (req, -1, 0)))
        return out

    def build(self, plan: list[Scheduled], min_rows: int = 0, min_logit_rows: int = 0,
              logits: list | None = None) -> tuple[StepBatch, list, list[int]]:
        """Packs the plan's rows by data shard (``pack``); returns the batch, each logit row's
        meta (``logits``, given or found), and each entry's first row. At least ``min_rows``
        rows and ``min_logit_rows`` logit rows are laid out (the call's bucket); trailing
        padding costs nothing (whole tiles past the real rows are skipped)."""
        tile = self.row_tile
        tokens, positions, slots, first = pack(layout(plan), self.shards(plan), self.dp, tile,
                                               min_rows)
        logits = self.logits(plan) if logits is None else logits
        meta = [m for _, _, m in logits]
        r = bucket(max(len(meta), 1, min_logit_rows), tile)
        logprobs = any(req.params.logprobs is not None or pos >= 0 for req, pos, _ in meta)
        batch = StepBatch(
            tokens=tokens, positions=positions, slots=slots,
            logit_rows=pad([first[i] + j for i, j, _ in logits], r, 0),
            num_logit_rows=np.int32(len(meta)), with_logprobs=np.bool_(logprobs),
            draws=self.draws(meta, r))
        return batch, meta, first

    def draws(self, meta: list, r: int) -> sampling.Draws:
        """Which slot and position each logit row draws at (``sampling.rows`` expands them on
        the device): a draw after the request's newest token, a prompt-logprobs row at its
        prompt position, or padding."""
        d = sampling.Draws.padding(r)
        for i, (req, pos, _) in enumerate(meta):
            d.slot[i], d.prompt_len[i] = req.slot, len(req.prompt_token_ids)
            if pos >= 0:
                d.seq_pos[i], d.target[i] = pos, req.prompt_token_ids[pos + 1]
            else:
                d.seq_pos[i] = req.num_tokens - 1
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
