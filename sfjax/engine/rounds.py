"""The engine's one program (``call``): up to ``num_scheduler_steps`` rounds the device lays
out for the slots its progress marks live, the first of them with the rows the host laid out
(prefill chunks) ahead of theirs, through ``sfjax.functional``'s rounds over the engine's own
cache, history and blocks, traced once per shape bucket.

Every decoding request is a live slot: the device lays out its rows (``functional._layout``)
after the host's, in a bucket the engine has compiled (``compile.Buckets.shape``). A call with host
rows, or while a waiting request could be admitted, runs one round; else up to
``num_scheduler_steps`` in one ``lax.while_loop``, left once every row has ended, or once one
has while others wait for a slot. Each row's bits do not depend on the layout (row tiles), and
draws use the same counter keys, so the tokens are the same either way; the host reads back
only the new tokens and its own rows' draws.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sfjax import functional as F
from sfjax.run import RunConfig
from sfjax.sampling import Drawn
from sfjax.step import DeviceState, StepBatch


def taken(drafted, accepted, num_tokens: int) -> list[tuple[int, int]]:
    """(drafts, accepted drafts) of the rounds that emitted a slot's first ``num_tokens`` tokens,
    from its per-round counts (``unpack``): a round emits its accepted drafts and the target's
    token, and the last round taken counts only the drafts taken (a stop string cut it on the
    host), as a single step counts the round a stop string cuts."""
    out = []
    for d, a in zip(drafted, accepted):
        if num_tokens <= 0:
            break
        out.append((int(d), min(int(a), num_tokens)))
        num_tokens -= int(a) + 1
    return out


@functools.partial(jax.jit, static_argnames=("run", "max_rounds", "with_logprobs"),
                   donate_argnames=("state",))
def call(weights, draft_weights, state: DeviceState, batch: StepBatch, draft: tuple | None,
         host_rows, running, num_rounds, until_one_ends, expect_live, *, run: RunConfig,
         max_rounds: int, with_logprobs: bool = False):
    """The engine's one program: up to ``num_rounds`` rounds the device lays out for the slots
    its progress marks live (``state.progress``, a ``step.Progress``), the first with the host's
    rows ahead of theirs (``functional.Host``), in the host batch's shapes
    (``functional.run_rounds``, over the same state pytree). DONATES ``state``.

    ``batch``: the host's rows, ``host_rows`` (int32 [dp]) at the head of each data shard's
    segment (its prefill chunks; for a draft model ``draft``, the same rows' tokens, positions
    and slots laid out alike in the draft's row count), its logit rows first, then padding; the
    shapes hold every live slot's rows after them. ``running``: requests the speculation
    threshold counts beyond the live slots. ``until_one_ends``: return once any request ends
    (others wait for its slot). ``expect_live``: the live slots the host expects (a call it sent
    before reading the last back, ``Engine._follow``); with ``until_one_ends``, fewer at the
    start mean a request ended in the last call, and this one runs no round (its slot goes to a
    waiting request first). 0: no such check. A live slot's progress gives its prompt length,
    its length and newest token (drawn, not yet fed: the engine's history records tokens as they
    are fed), and its request's drafts and accepted drafts so far (adaptive_k reads them); the
    call advances them. A row that ends is left not live (a call sent before the host reads the
    end back lays out nothing for it: ``Engine`` under ``async_scheduling``). ``with_logprobs``
    (static: a program of its own, so the rounds without it compute and carry nothing more):
    record each new token's raw logprobs.

    Returns (state, out, logprobs, drawn). ``out``, int32 [slots, 5 + W + 2 * max_rounds]: per
    slot its new length, the rounds run, whether it is still live, its W = max_rounds * (k + 1)
    tokens from its old length on, the drafts proposed and the accepted drafts emitted in each
    round, and its copies' counts after them (``step.Progress.copy_accepted``, ``copy_rejected``)
    (``unpack``): one array, so the host reads everything back in one transfer.
    ``logprobs``, int32 [slots, 2, W, 21] with ``with_logprobs`` (else None): per token its rank
    and top-20 ids, then (as float32 bits) its logprob and the top 20 (``unpack_logprobs``).
    ``drawn``: the last round's drawn rows, whose first ``batch.num_logit_rows`` are the
    host's."""
    p = state.progress
    length = p.length
    slots = jnp.where(p.live, jnp.arange(length.shape[0]), length.shape[0])
    history = state.history.at[slots, length - 1].set(p.last, mode="drop")
    st = dataclasses.replace(state, history=history)
    ended = until_one_ends & (jnp.sum(p.live.astype(jnp.int32)) < expect_live)
    st, n, drafted, accepted, ids, vals, drawn, _ = F.run_rounds(
        weights, draft_weights, st, run, jnp.where(ended, 0, num_rounds), max_rounds,
        until_one_ends, with_logprobs,
        F.Host(batch, draft, host_rows, running))
    width = max_rounds * (run.k_max + 1)
    pos = jnp.minimum(length[:, None] + jnp.arange(width)[None, :], st.history.shape[1] - 1)
    tokens = jnp.take_along_axis(st.history, pos, axis=1)
    q = st.progress
    out = jnp.concatenate([q.length[:, None], jnp.broadcast_to(n, length.shape)[:, None],
                           q.live[:, None].astype(jnp.int32), tokens, drafted.T, accepted.T,
                           q.copy_accepted[:, None], q.copy_rejected[:, None]], axis=1)
    logprobs = (jnp.stack([ids, lax.bitcast_convert_type(vals, jnp.int32)], axis=1)
                if with_logprobs else None)
    return st, out, logprobs, drawn


def unpack(out, max_rounds: int):
    """``call``'s read-back on the host: (rounds run, tokens [slots, W], new lengths [slots],
    live flags [slots], drafts and accepted drafts [max_rounds, slots], and the copies' accepted
    drafts and rejecting rounds so far [slots, 2])."""
    width = out.shape[1] - 5 - 2 * max_rounds
    rec = out[:, 3 + width:-2]
    return (int(out[0, 1]), out[:, 3:3 + width], out[:, 0], out[:, 2].astype(bool),
            rec[:, :max_rounds].T, rec[:, max_rounds:].T, out[:, -2:])


def unpack_logprobs(logprobs, slot: int) -> Drawn:
    """One slot's tokens' raw logprobs from ``call``'s second array (on the host), as a
    ``sampling.Drawn`` of numpy arrays over its W tokens (no tokens field)."""
    ids, vals = logprobs[slot, 0], np.ascontiguousarray(logprobs[slot, 1]).view(np.float32)
    return Drawn(tokens=None, logprob=vals[:, 0], rank=ids[:, 0], top_ids=ids[:, 1:],
                 top_logprobs=vals[:, 1:])
