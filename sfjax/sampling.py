"""Sampling on the device: vLLM's logits processors, then Gumbel-max with counter-based keys.

The draw at output position t of a request uses ``fold_in(fold_in(request_key, t), role)``: it
depends on (request key, position, logits) only, never on the batch or on earlier draws. Every
row is processed inside the same fixed row tiles as the model (``sfjax.rows``), so its
token and logprobs are the same bits in any batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import sampling as kernels
from sfjax.rows import num_tiles_of, per_tile
from sfjax.sampling_params import MAX_LOGPROBS

ROLE_TARGET = 0    # the token drawn from the target model at a position (and by coupled drafters)
ROLE_DRAFT = 1     # a draft model's own draw (rejection sampling needs independent drafts)
ROLE_ACCEPT = 2    # the uniform of a rejection-sampling acceptance test
ROLE_RESIDUAL = 3  # the draw from the residual distribution after a rejection


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingBatch:
    """Per logit row; every field is [R] unless noted."""
    temperature: jax.Array    # float32; 0 = greedy
    top_k: jax.Array          # int32; 0 = off
    top_p: jax.Array          # float32; 1 = off
    min_p: jax.Array          # float32; 0 = off
    presence: jax.Array       # float32 presence penalty
    frequency: jax.Array      # float32 frequency penalty
    repetition: jax.Array     # float32 repetition penalty; 1 = off
    key_data: jax.Array       # uint32 [R, 2] raw threefry request keys
    position: jax.Array       # int32 output position t of the draw
    slot: jax.Array           # int32 the row's slot (its token history)
    seq_pos: jax.Array        # int32 position of the row's input token: history [0, seq_pos] is known
    prompt_len: jax.Array     # int32 history [prompt_len, seq_pos] is output
    suppress: jax.Array       # int32 [R, S] ids that can't be drawn (min_tokens); -1 = none
    bias_ids: jax.Array       # int32 [R, B] logit_bias ids; -1 = none
    bias: jax.Array           # float32 [R, B]
    allowed: jax.Array        # int32 [R, A] allowed_token_ids; all -1 = no restriction
    target: jax.Array         # int32 the token whose logprob is reported; -1 = the drawn one


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Drawn:
    tokens: jax.Array         # int32 [R]
    logprob: jax.Array        # float32 [R] of the target (or drawn) token, raw logits
    rank: jax.Array           # int32 [R] its 1-based rank
    top_ids: jax.Array        # int32 [R, 20]
    top_logprobs: jax.Array   # float32 [R, 20]


def request_key_data(seed: int) -> tuple[int, int]:
    """Raw threefry key data for a 64-bit seed (high word, low word), computed on the host."""
    return (seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF


def draw_keys(key_data, position, role: int):
    keys = jax.random.wrap_key_data(key_data, impl="threefry2x32")
    return jax.vmap(lambda k, t: jax.random.fold_in(jax.random.fold_in(k, t), role))(keys, position)


def noise_bits(key_data, position, vocab: int, role: int = ROLE_TARGET):
    """uint32 [R, vocab]: row r depends only on its key and position."""
    keys = draw_keys(key_data, position, role)
    return jax.vmap(lambda k: jax.random.bits(k, (vocab,), jnp.uint32))(keys)


def _mask_ids(logits, ids, value):
    """Sets logits[r, ids[r, j]] = value where ids >= 0."""
    rows = jnp.arange(logits.shape[0])[:, None]
    ids = jnp.where(ids >= 0, ids, logits.shape[1])
    return logits.at[rows, ids].set(value, mode="drop")


def _penalize(logits, b: SamplingBatch, history):
    """vLLM's repetition (prompt + output), frequency and presence (output) penalties."""
    r, v = logits.shape
    hist = history[b.slot]                                          # [T, L]
    j = jnp.arange(hist.shape[1])[None, :]
    known = j <= b.seq_pos[:, None]
    out = known & (j >= b.prompt_len[:, None])
    rows = jnp.arange(r)[:, None]
    counts = jnp.zeros((r, v), jnp.float32).at[rows, hist].add(out.astype(jnp.float32))
    seen = jnp.zeros((r, v), jnp.bool_).at[rows, hist].max(known)
    rep = b.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - b.frequency[:, None] * counts - b.presence[:, None] * (counts > 0)


def process(logits, b: SamplingBatch, history):
    """Logit bias, allowed ids, min_tokens suppression and penalties; float32 [T, V]."""
    rows = jnp.arange(logits.shape[0])[:, None]
    v = logits.shape[1]
    restricted = jnp.any(b.allowed >= 0, axis=1, keepdims=True)

    def masks(x):
        x = x.at[rows, jnp.where(b.bias_ids >= 0, b.bias_ids, v)].add(b.bias, mode="drop")
        allow = jnp.zeros(x.shape, jnp.bool_).at[rows, jnp.where(b.allowed >= 0, b.allowed, v)].set(
            True, mode="drop")
        x = jnp.where(restricted & ~allow, -jnp.inf, x)
        return _mask_ids(x, b.suppress, -jnp.inf)

    any_mask = jnp.any(b.bias_ids >= 0) | jnp.any(restricted) | jnp.any(b.suppress >= 0)
    logits = lax.cond(any_mask, masks, lambda x: x, logits)
    penalized = (b.presence != 0) | (b.frequency != 0) | (b.repetition != 1)
    return lax.cond(jnp.any(penalized), lambda x: _penalize(x, b, history), lambda x: x, logits)


def _draw_tile(raw, b: SamplingBatch, history, with_logprobs, impl, role=ROLE_TARGET):
    """One tile: process, draw, and (optionally) raw logprobs."""
    x = process(raw, b, history)
    v = raw.shape[1]
    sampled = (b.temperature > 0)
    bits = lax.cond(jnp.any(sampled), lambda: noise_bits(b.key_data, b.position, v, role),
                    lambda: jnp.zeros(raw.shape, jnp.uint32))
    tokens = kernels.sample(x, bits, b.temperature, b.top_k, b.top_p, b.min_p, impl=impl)
    return Drawn(tokens, *raw_logprobs(raw, jnp.where(b.target >= 0, b.target, tokens), with_logprobs))


def raw_logprobs(raw, target, wanted):
    """(logprob of ``target``, its 1-based rank, top-20 ids, top-20 logprobs) of the raw logits,
    computed only if ``wanted`` (a traced bool)."""
    def compute():
        lp = raw - jax.nn.logsumexp(raw, axis=-1, keepdims=True)
        tok = jnp.take_along_axis(lp, target[:, None], axis=1)[:, 0]
        rank = 1 + jnp.sum(lp > tok[:, None], axis=1).astype(jnp.int32)
        top_lp, top_ids = lax.top_k(lp, MAX_LOGPROBS)
        return tok, rank, top_ids.astype(jnp.int32), top_lp

    r = raw.shape[0]
    empty = lambda: (jnp.zeros((r,), jnp.float32), jnp.zeros((r,), jnp.int32),
                     jnp.zeros((r, MAX_LOGPROBS), jnp.int32), jnp.zeros((r, MAX_LOGPROBS), jnp.float32))
    return lax.cond(wanted, compute, empty)


def draw(logits, batch: SamplingBatch, history, num_rows, row_tile: int, with_logprobs,
         impl: str = "auto", role: int = ROLE_TARGET) -> Drawn:
    """Tokens (and raw logprobs) for the first ``num_rows`` rows of ``logits`` [R, V] (float32).

    ``history`` int32 [max_seqs, max_model_len] holds each slot's tokens by position;
    ``with_logprobs`` is a traced bool; ``impl`` picks the sampler (pallas_kernels.sampling.sample).
    """
    rows = jnp.arange(logits.shape[0]) < num_rows
    fn = lambda raw, b: _draw_tile(raw, b, history, with_logprobs, impl, role)
    return per_tile(fn, row_tile, num_tiles_of(rows, row_tile), logits, batch)


def log_probs(logits, batch: SamplingBatch, history, num_rows, row_tile: int):
    """The processed distribution each row draws from, as log-probabilities [R, V] (a point mass
    for greedy rows); what rejection sampling and typical acceptance compare."""
    rows = jnp.arange(logits.shape[0]) < num_rows

    def fn(raw, b):
        x = kernels.processed_logits(process(raw, b, history), b.temperature, b.top_k, b.top_p, b.min_p)
        m = jnp.max(x, axis=-1, keepdims=True)
        return x - (m + jnp.log(jnp.sum(jnp.exp(x - m), axis=-1, keepdims=True)))

    return per_tile(fn, row_tile, num_tiles_of(rows, row_tile), logits, batch)
