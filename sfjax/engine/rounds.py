"""The engine's one program (``call``): a round the host laid out, or up to
``num_scheduler_steps`` rounds the device lays out, both through ``sfjax.functional``'s rounds
over the engine's own cache, history and blocks, traced once per shape bucket.

When every running request decodes, the device lays out its rows itself (``functional._layout``)
in a bucket the engine has compiled (``Engine._rounds_shape``): one round per call while a
waiting request could be admitted, else up to ``num_scheduler_steps`` in one ``lax.while_loop``,
left once every row has ended, or once one has while others wait for a slot. Steps with prefill
chunks (or a request that opted out of the engine's strategy) run the host's rows
(``from_host``) as the call's one round, in the same program. Each row's bits do not depend on
the layout (row tiles), and draws use the same counter keys, so the tokens are the same either
way; the host reads back only the new tokens.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sfjax import functional as F
from sfjax.engine.scheduler import Request
from sfjax.run import RunConfig
from sfjax.sampling import Drawn
from sfjax.round import SpecBatch
from sfjax.step import DeviceState, StepBatch


def eligible(req: Request, strategy_slot: int) -> bool:
    """Whether the device alone can run the request's rounds: its strategy is the engine's own
    (a per-request opt-out decodes one step at a time). Stop strings are the host's: it reads the
    rounds' tokens in order and drops those past the one that completes a stop string
    (``taken``); logprobs come back with the tokens."""
    return req.strategy_slot == strategy_slot


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
def call(weights, draft_weights, state: DeviceState, batch: StepBatch, spec: SpecBatch | None,
         num_rounds, until_one_ends, from_host, *, run: RunConfig, max_rounds: int,
         with_logprobs: bool = False):
    """The engine's one program: a call of one round laid out by the host, or of up to
    ``num_rounds`` rounds the device lays out for the slots its progress marks live
    (``state.progress``, a ``step.Progress``), in the host batch's shapes
    (``functional.run_rounds``, over the same state pytree). DONATES ``state``.

    ``from_host``: run ``batch`` (and ``spec``, a speculating engine's) as the call's one round
    (no slot live); the host reads its drawn rows and ``Verified``. Otherwise ``batch`` and
    ``spec`` are padding of the bucket the rounds run in (one the engine has compiled, whose
    shapes hold every live slot's rows), and ``until_one_ends``: return once any request ends
    (others wait for its slot). A live slot's progress gives its prompt length, its length and
    newest token (drawn, not yet fed: the engine's history records tokens as they are fed), and
    its request's drafts and accepted drafts so far (adaptive_k reads them); the call advances
    them. A row that ends stays live: the host reads the end back and sends the slot's next
    row. ``with_logprobs`` (static: a
    program of its own, so the rounds without it compute and carry nothing more): record each
    new token's raw logprobs.

    Returns (state, out, logprobs, drawn, verified). ``out``, int32 [slots, 2 + W +
    2 * max_rounds]: per slot its new length, the rounds run, its W = max_rounds * (k + 1) tokens
    from its old length on, and the drafts proposed and the accepted drafts emitted in each round
    (``unpack``): one array, so the host reads everything back in one transfer. ``logprobs``,
    int32 [slots, 2, W, 21] with ``with_logprobs`` (else None): per token its rank and top-20
    ids, then (as float32 bits) its logprob and the top 20 (``unpack_logprobs``). ``drawn`` and
    ``verified``: the last round's (``round.round_step``'s), the host's with ``from_host``."""
    p = state.progress
    live = p.live & ~from_host
    length = p.length
    slots = jnp.where(live, jnp.arange(length.shape[0]), length.shape[0])
    history = state.history.at[slots, length - 1].set(p.last, mode="drop")
    st = dataclasses.replace(state, history=history, progress=dataclasses.replace(p, live=live))
    st, n, drafted, accepted, ids, vals, drawn, verified = F.run_rounds(
        weights, draft_weights, st, run, num_rounds, max_rounds, until_one_ends, with_logprobs,
        (batch, spec), from_host)
    width = max_rounds * (run.k_max + 1)
    pos = jnp.minimum(length[:, None] + jnp.arange(width)[None, :], st.history.shape[1] - 1)
    tokens = jnp.take_along_axis(st.history, pos, axis=1)
    new_len = st.progress.length
    out = jnp.concatenate([new_len[:, None], jnp.broadcast_to(n, length.shape)[:, None], tokens,
                           drafted.T, accepted.T], axis=1)
    logprobs = (jnp.stack([ids, lax.bitcast_convert_type(vals, jnp.int32)], axis=1)
                if with_logprobs else None)
    return (dataclasses.replace(st, progress=dataclasses.replace(st.progress, live=p.live)),
            out, logprobs, drawn, verified)


def unpack(out, max_rounds: int):
    """``call``'s read-back on the host: (rounds run, tokens [slots, W], new lengths
    [slots], drafts and accepted drafts [max_rounds, slots])."""
    width = out.shape[1] - 2 - 2 * max_rounds
    rec = out[:, 2 + width:]
    return (int(out[0, 1]), out[:, 2:2 + width], out[:, 0], rec[:, :max_rounds].T,
            rec[:, max_rounds:].T)


def unpack_logprobs(logprobs, slot: int) -> Drawn:
    """One slot's tokens' raw logprobs from ``call``'s second array (on the host), as a
    ``sampling.Drawn`` of numpy arrays over its W tokens (no tokens field)."""
    ids, vals = logprobs[slot, 0], np.ascontiguousarray(logprobs[slot, 1]).view(np.float32)
    return Drawn(tokens=None, logprob=vals[:, 0], rank=ids[:, 0], top_ids=ids[:, 1:],
                 top_logprobs=vals[:, 1:])
