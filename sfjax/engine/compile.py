"""Compiling ahead: the shape buckets an engine's steps take, and running each once."""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from sfjax.engine import slots
from sfjax.engine.batch import bucket


def shape_buckets(engine) -> list[tuple]:
    """Every (kind, N, R, draft rows) a call of this engine can take: its one program's shape
    buckets (the host's rows and the device's after them; ``Engine._shape``), and the rounds
    with logprobs without host rows (in the bucket of every slot's rows). A call with prefill
    rows while a request that asks for logprobs decodes, prompt-logprob rows beyond
    ``max_num_seqs`` draws, and sampling lists longer than ``sampling.MIN_LIST_WIDTHS``
    (min_tokens stop ids, logit_bias, allowed_token_ids), add shapes not listed here. Over dp
    data shards N is dp segments of a bucketed length (``batch.pack``), any shard taking the
    whole token budget."""
    c, tile, dp = engine.config, engine.config.row_tile, engine.dp
    span = lambda lo, hi: sorted({bucket(x, tile) for x in (lo, hi)} |
                                 {b for b in (tile * 2**j for j in range(24))
                                  if bucket(lo, tile) <= b <= bucket(hi, tile)})
    max_draws, per_shard = c.max_num_seqs, c.max_num_seqs // dp
    out = []
    if engine.spec is None:
        out += [("round", dp * n, r, 0) for n in span(1, c.max_num_batched_tokens)
                for r in span(1, max_draws) if r <= bucket(dp * n, tile)]
    else:
        k1 = engine.spec.k_max + 1
        verify = c.max_num_seqs * k1
        ds = lambda n: [n, 2 * n] if engine.spec.draft_cfg is not None else [0]
        out += [("round", dp * n, r, d) for n in span(1, per_shard * k1)
                for r in span(1, verify) if r <= bucket(dp * n, tile) for d in ds(dp * n)]
        prefill = span(per_shard * k1, c.max_num_batched_tokens + per_shard * engine.spec.k_max)
        out += [("round", dp * n, r, d) for n in prefill
                for r in span(verify, verify + max_draws) for d in ds(dp * n)]
    out.append(("logprobs", *engine._shape([0] * dp, 0, [], True)))
    if engine.programs.forget is not None:                 # an EAGLE head's features dropped
        out.append(("forget", 0, 0, 0))
    if c.enable_prefix_caching:               # a cache hit's skipped tokens into the history
        out.append(("history", 0, 0, 0))
    return out + [(kind, u, 0, 0) for kind in ("slots", "blocks")
                  for u in slots.buckets(c.max_num_seqs)]


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
