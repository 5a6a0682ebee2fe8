"""Compiling ahead: the shape buckets an engine's steps take, and running each once."""

from __future__ import annotations

import time

import jax
import numpy as np

from sfjax.engine import slots
from sfjax.engine.batch import bucket, spec_batch


def shape_buckets(engine) -> list[tuple]:
    """Every (kind, N, R, draft rows) a step of this engine can take; prompt-logprob rows
    beyond ``max_num_seqs`` draws, and sampling lists longer than ``sampling.MIN_LIST_WIDTHS``
    (min_tokens stop ids, logit_bias, allowed_token_ids), add shapes not listed here. Over dp
    data shards N is dp segments of a bucketed length (``batch.pack``), any shard taking the
    whole token budget."""
    c, tile, dp = engine.config, engine.config.row_tile, engine.dp
    span = lambda lo, hi: sorted({bucket(x, tile) for x in (lo, hi)} |
                                 {b for b in (tile * 2**j for j in range(24))
                                  if bucket(lo, tile) <= b <= bucket(hi, tile)})
    max_draws, per_shard = c.max_num_seqs, c.max_num_seqs // dp
    out = []
    if engine.spec is None or not engine.spec.every_step:          # plain steps
        out += [("plain", dp * n, r, 0) for n in span(1, c.max_num_batched_tokens)
                for r in span(1, max_draws) if r <= bucket(dp * n, tile)]
    if engine.spec is not None:
        k1 = engine.spec.k_max + 1
        verify = c.max_num_seqs * k1
        ns = [dp * n for n in span(per_shard * k1,
                                   c.max_num_batched_tokens + per_shard * engine.spec.k_max)]
        rs = span(verify, verify + max_draws)
        ds = lambda n: [n, 2 * n] if engine.spec.draft_cfg is not None else [tile]
        out += [("spec", n, r, d) for n in ns for r in rs for d in ds(n)]
    if c.num_scheduler_steps > 1:            # the rounds' program, and with logprobs (N = 1)
        out += [("rounds", 0, 0, 0), ("rounds", 1, 0, 0)]
    if engine.programs.forget is not None:                 # an EAGLE head's features dropped
        out.append(("forget", 0, 0, 0))
    if c.enable_prefix_caching:               # a cache hit's skipped tokens into the history
        out.append(("history", 0, 0, 0))
    return out + [("slots", u, 0, 0) for u in slots.buckets(c.max_num_seqs)]


def precompile(engine, progress: bool = True) -> float:
    """Compiles every shape bucket (``shape_buckets``) by running each step once on padding
    rows, which write only the null block (and the history write of a prefix-cache hit, of no
    position); returns the seconds spent."""
    from tqdm.auto import tqdm

    t0 = time.monotonic()
    for kind, n, r, d in tqdm(shape_buckets(engine), desc="Compiling shape buckets",
                              disable=not progress, dynamic_ncols=True):
        if kind == "plain":
            batch, _, _ = engine.batches.build([], [], [(None, -1, 0)] * r, min_rows=n)
            engine._run_plain(batch)
            continue
        if kind == "slots":                  # updates of the device's slot rows
            engine.state = engine.programs.update_slots(engine.state, *engine.slots.padding(n))
            continue
        if kind == "history":                # nothing written: positions < 0
            row = np.zeros(engine.config.max_model_len, np.int32)
            engine.state = engine.programs.write_history(engine.state, np.int32(0), row, np.int32(0))
            continue
        if kind == "forget":
            engine.spec.draft_cache = engine.programs.forget(engine.spec.draft_cache, np.int32(0))
            continue
        if kind == "rounds":                 # no live slot: the loop ends before a round
            s = engine.config.max_num_seqs
            zeros = np.zeros(s, np.int32)
            engine._run_rounds(zeros, zeros, zeros, np.zeros(s, bool), 0, with_logprobs=n == 1)
            continue
        k1 = engine.spec.k_max + 1
        tail = [(None, -1, 0)] * r
        batch, _, _ = engine.batches.build([], [], tail, min_rows=n)
        start = r - engine.config.max_num_seqs * k1
        sb = spec_batch([], {}, {}, ([], [], [], {}), engine.config.max_num_seqs, d, start, k1)
        engine._run_spec(batch, sb)
    jax.block_until_ready(engine.state)
    return time.monotonic() - t0
