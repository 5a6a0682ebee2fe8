"""Shape buckets: the one an engine's call runs in (``Buckets``), every one its calls can take
(``shape_buckets``), and compiling them ahead (``precompile``)."""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from sfjax.engine import slots
from sfjax.engine.batch import bucket

FIT_SLACK = 2           # a call reuses a compiled bucket of at most 2 times its rows (``fit``)
COMPILE_AFTER = 2       # calls that run padded in a larger bucket before their own compiles


class Buckets:
    """The (rows, logit rows, draft rows) buckets an engine's calls run in: the one a call
    takes (``shape``), the ones its calls have run (``ran``), and those asked for but not yet
    compiled (``pending``)."""

    def __init__(self, config, dp: int, spec, shard_of, run):
        """``config``: the engine's ``EngineConfig``; ``spec``: its ``Speculator`` or None;
        ``shard_of``: a slot's data shard; ``run``: its ``RunConfig`` (whether small row tiles
        are certified for the target and the draft)."""
        self.config, self.dp, self.spec, self.shard_of = config, dp, spec, shard_of
        self.small, self.draft_small = bool(run.small_tiles), bool(run.draft_small_tiles)
        self.ran: set[tuple] = set()          # the buckets calls have run in
        self.asked: dict[tuple, int] = {}     # calls that asked for each bucket (``fit``)

    def shape(self, rows: list[int], logit_rows: int, decode: list, with_logprobs: bool) -> tuple:
        """The (rows, logit rows, draft rows) a call runs in: the host's ``rows`` per data shard
        and ``logit_rows``, then ``decode``'s rows (a speculating engine's: each one's k_max + 1),
        bucketed, or a larger bucket the engine has run (``fit``). A speculating engine's call
        without host rows is sized by the slots that decode (a call's live slots only end, never
        join, within it: one request of 32 slots at k = 3 decodes in 8 rows, not 128); one with
        host rows past one tile takes at least every slot's k_max + 1 rows and logit rows, so
        that one bucket holds prefill chunks of any length up to it (few calls, each compiled
        once, rather than one bucket per chunk length and load), and one within a tile runs in
        a tile's rows, which decoding compiles anyway. With logprobs, the host's
        rows and then every slot's (that program's bucket without host rows is compiled once,
        ``shape_buckets``; one with prefill rows the first time a call needs it: a fixed
        bucket of a whole token budget would run its padding rows wherever kernels take every
        row, as the accelerator path's do)."""
        c, dp, tile, spec = self.config, self.dp, self.config.row_tile, self.spec
        load = [0] * dp
        for req in decode:
            load[self.shard_of(req.slot)] += 1
        if with_logprobs:
            load = [c.max_num_seqs // dp] * dp
        k1 = spec.k_max + 1 if spec else 1
        seg = max(h + per * k1 for h, per in zip(rows, load))
        if spec is None:
            shape = (dp * bucket(max(seg, 1), tile),
                     bucket(max(logit_rows + sum(load), 1), tile), None)
        else:
            floor = c.max_num_seqs * k1 if any(rows) and seg > tile else sum(load) * k1
            seg = bucket(max(seg, -(-floor // dp), 1), tile)
            na = (dp * bucket(max(max(h + 2 * per for h, per in zip(rows, load)), seg), tile)
                  if spec.draft_cfg is not None else None)
            shape = dp * seg, bucket(max(logit_rows + floor, 1), tile), na
        return shape if with_logprobs else self.fit(shape)

    def fit(self, shape: tuple) -> tuple:
        """The smallest bucket this engine has run that holds ``shape`` with at most
        ``FIT_SLACK`` times its rows, else ``shape``: a call runs in a compiled bucket when one
        holds its rows, which saves a compile but not the padding rows' cost (the matmul tiles
        past the real rows are skipped; the K/V scatter, the gathers and the zeroed outputs take
        every row), so decode calls do not run in a prefill's bucket of more than ``FIT_SLACK``
        times their rows (past their first asks, below). A count of one tile stays one tile
        where small tiles are certified: a call of one tile runs in a smaller one
        (``rows.Rows``).

        A bucket is compiled only once ``COMPILE_AFTER`` calls have asked for it: until then
        they run in the smallest larger bucket the engine has run, so a load that passes (a
        batch draining as its requests end) costs a padded call or two, not a compile (seconds
        on XLA:CPU, more on an accelerator), and a load that comes back gets its own bucket.
        Counted per bucket, not in a row, so prefill calls between decode calls do not reset
        the count. A call that no compiled bucket holds compiles its own at once; ``precompile``
        runs every bucket, so a precompiled engine never waits."""
        fits = self.fits(shape)
        if fits:
            return min(fits)
        n, r, na = shape
        larger = [sh for sh in self.ran
                  if sh[0] >= n and sh[1] >= r and (na is None or sh[2] >= na)]
        self.asked[shape] = asked = self.asked.get(shape, 0) + 1
        return min(larger) if larger and asked <= COMPILE_AFTER else shape

    def fits(self, shape: tuple) -> list[tuple]:
        """The buckets this engine has run that hold ``shape`` within ``FIT_SLACK`` (``fit``)."""
        n, r, na = shape
        one, small, draft_small = self.dp * self.config.row_tile, self.small, self.draft_small
        holds = lambda have, need, tiny: (have == need if tiny and need <= one
                                          else need <= have <= FIT_SLACK * need)
        return [sh for sh in self.ran if holds(sh[0], n, small) and holds(sh[1], r, small)
                and (na is None or holds(sh[2], na, draft_small))]

    def pending(self) -> list[tuple]:
        """The buckets calls have asked for that have not compiled yet (``fit``): calls that
        ask for them again run padded until the ask after ``COMPILE_AFTER``."""
        return sorted(sh for sh in self.asked if sh not in self.ran and not self.fits(sh))


def shape_buckets(engine) -> list[tuple]:
    """Every (kind, N, R, draft rows) a call of this engine can take: its one program's shape
    buckets (the host's rows and the device's after them; ``Buckets.shape``), and the rounds
    with logprobs without host rows (in the bucket of every slot's rows). A call with prefill
    rows while a request that asks for logprobs decodes, prompt-logprob rows beyond
    ``max_num_seqs`` draws, and sampling lists longer than ``sampling.MIN_LIST_WIDTHS``
    (min_tokens stop ids, logit_bias, allowed_token_ids), add shapes not listed here. Over dp
    data shards N is dp segments of a bucketed length (``batch.pack``), any shard taking the
    whole token budget, or every slot of it a whole sequence where that is fewer: a bucket no
    call can fill is not compiled. Each is listed once."""
    c, tile, dp = engine.config, engine.config.row_tile, engine.dp
    span = lambda lo, hi: sorted({bucket(x, tile) for x in (lo, hi)} |
                                 {b for b in (tile * 2**j for j in range(24))
                                  if bucket(lo, tile) <= b <= bucket(hi, tile)})
    max_draws, per_shard = c.max_num_seqs, c.max_num_seqs // dp
    tokens = min(c.max_num_batched_tokens, per_shard * c.max_model_len)   # a shard's host rows
    out = []
    if engine.spec is None:
        out += [("round", dp * n, r, 0) for n in span(1, tokens)
                for r in span(1, max_draws) if r <= bucket(dp * n, tile)]
    else:
        k1 = engine.spec.k_max + 1
        verify = c.max_num_seqs * k1
        ds = lambda n: [n, 2 * n] if engine.spec.draft_cfg is not None else [0]
        out += [("round", dp * n, r, d) for n in span(1, per_shard * k1)
                for r in span(1, verify) if r <= bucket(dp * n, tile) for d in ds(dp * n)]
        prefill = span(per_shard * k1, tokens + per_shard * engine.spec.k_max)
        out += [("round", dp * n, r, d) for n in prefill
                for r in span(verify, verify + max_draws) for d in ds(dp * n)]
    out.append(("logprobs", *engine.buckets.shape([0] * dp, 0, [], True)))
    if engine.programs.forget is not None:                 # an EAGLE head's features dropped
        out.append(("forget", 0, 0, 0))
    if c.enable_prefix_caching:               # a cache hit's skipped tokens into the history
        out.append(("history", 0, 0, 0))
    out += [(kind, u, 0, 0) for kind in ("slots", "blocks") for u in slots.buckets(c.max_num_seqs)]
    return list(dict.fromkeys(out))           # decode's and prefill's spans meet at one bucket


def precompile(engine, progress: bool = True) -> float:
    """Compiles every shape bucket (``shape_buckets``) by running each call once on padding
    rows, which write only the null block (and the history write of a prefix-cache hit, of no
    position); returns the seconds spent."""
    from tqdm.auto import tqdm

    t0 = time.monotonic()
    for kind, n, r, d in tqdm(shape_buckets(engine), desc="Compiling shape buckets",
                              disable=not progress, dynamic_ncols=True):
        if kind in ("round", "logprobs"):    # no rounds: the loop ends before one
            engine._run_padding((n, r, d or None), with_logprobs=kind == "logprobs")
        elif kind == "slots":                # updates of the device's slot rows
            engine.state = engine.programs.update_slots(engine.state, *engine.slots.padding(n))
        elif kind == "blocks":               # updates of the device's block tables alone
            tables = engine.programs.update_blocks(engine.state.block_tables,
                                                   *engine.slots.padding(n)[:2])
            engine.state = dataclasses.replace(engine.state, block_tables=tables)
        elif kind == "history":              # nothing written: positions < 0
            row = np.zeros(engine.config.max_model_len, np.int32)
            engine.state = engine.programs.write_history(engine.state, np.int32(0), row, np.int32(0))
        elif kind == "forget":
            engine.state = engine.programs.forget(engine.state, np.int32(0))
    jax.block_until_ready(engine.state)
    return time.monotonic() - t0
