"""Acceptance rules over one round. Shapes: S rows, K = k_max drafts, K + 1 verified positions.

Each rule returns ``(accepted [S], tokens [S, K + 1])``: the row emits ``tokens[:, :accepted + 1]``
(the accepted drafts, then the correction or bonus token). Rows draft only their first ``k[s]``
positions; the rest are masked.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.sampling import argmax


def _prefix(ok, k):
    """Length of the leading run of True among the first k[s] columns (a cumulative mask)."""
    live = ok & (jnp.arange(ok.shape[1])[None, :] < k[:, None])
    return jnp.sum(jnp.cumprod(live.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def _with_correction(drafts, accepted, correction):
    """drafts up to ``accepted``, then ``correction[s, accepted]``."""
    s, k1 = correction.shape
    j = jnp.arange(k1)[None, :]
    padded = jnp.concatenate([drafts, jnp.zeros((s, 1), drafts.dtype)], axis=1)
    return jnp.where(j < accepted[:, None], padded, correction)


def exact(drafts, target, k):
    """Path-exact: ``target`` [S, K+1] are the tokens plain decoding draws at each position with
    the same keys; accept drafts while they equal them, then emit the target's token."""
    accepted = _prefix(drafts == target[:, :-1], k)
    return accepted, target


def typical(drafts, target, logp, k, greedy, threshold: float, alpha: float):
    """Medusa's typical acceptance (lossy): accept a draft whose target probability exceeds
    min(threshold, alpha * exp(-entropy)); the replacement at the first rejection is the target's
    argmax; after k accepted drafts the bonus is the target's sample. Greedy rows accept exactly
    the target's argmax, so at temperature 0 this is plain greedy decoding.

    logp: float32 [S, K+1, V] the target's processed log-probabilities.
    """
    p = jnp.exp(logp[:, :-1])                                              # [S, K, V]
    p_draft = jnp.take_along_axis(p, drafts[..., None], axis=2)[..., 0]
    entropy = -jnp.sum(jnp.where(p > 0, p * logp[:, :-1], 0.0), axis=2)
    ok = p_draft > jnp.minimum(threshold, alpha * jnp.exp(-entropy))
    best = argmax(logp.reshape(-1, logp.shape[-1])).reshape(logp.shape[:2])  # [S, K+1]
    ok = jnp.where(greedy[:, None], drafts == best[:, :-1], ok)
    accepted = _prefix(ok, k)
    correction = jnp.where(jnp.arange(target.shape[1])[None, :] < k[:, None], best, target)
    return accepted, _with_correction(drafts, accepted, correction)


def accept_probability(logp_target, logq_draft, drafts):
    """min(1, p(d) / q(d)) per drafted position. logp/logq [..., V]; drafts [...]."""
    lp = jnp.take_along_axis(logp_target, drafts[..., None], axis=-1)[..., 0]
    lq = jnp.take_along_axis(logq_draft, drafts[..., None], axis=-1)[..., 0]
    return jnp.minimum(1.0, jnp.exp(lp - lq))


def residual_logits(logp_target, logq_draft):
    """log of max(0, p - q), the distribution drawn from after a rejection (p where p <= q
    everywhere, which only happens when p == q and rejection has probability 0)."""
    r = jnp.maximum(jnp.exp(logp_target) - jnp.exp(logq_draft), 0.0)
    empty = jnp.sum(r, axis=-1, keepdims=True) <= 0
    return jnp.where(empty, logp_target, jnp.log(r))


def rejection(drafts, logp, logq, uniforms, residual_noise, bonus, k):
    """Leviathan/Chen rejection sampling (distribution-exact): accept draft j with probability
    min(1, p/q) using a counter-keyed uniform; at the first rejection draw from the residual
    max(0, p - q) with counter-keyed Gumbel noise; after k accepted drafts emit ``bonus`` (the
    target's own draw at position k).

    logp: [S, K+1, V] target log-probs; logq: [S, K, V] the draft's (one-hot for n-gram drafts);
    uniforms: [S, K]; residual_noise: [S, K, V] Gumbel; bonus: [S, K+1] target draws.
    """
    ok = uniforms < accept_probability(logp[:, :-1], logq, drafts)
    accepted = _prefix(ok, k)
    res = residual_logits(logp[:, :-1], logq) + residual_noise
    fixes = argmax(res.reshape(-1, res.shape[-1])).reshape(drafts.shape)
    j = jnp.arange(bonus.shape[1])[None, :]
    correction = jnp.where(j < k[:, None], jnp.concatenate([fixes, bonus[:, -1:]], axis=1), bonus)
    return accepted, _with_correction(drafts, accepted, correction)


def truncate_at_stops(tokens, accepted, stop_ids, min_left, budget):
    """How many of ``tokens[:, :accepted + 1]`` are emitted: up to and including the first stop
    token allowed at its index (index >= min_left), and at most ``budget``.

    stop_ids: int32 [S, B] (-1 pad); min_left, budget: int32 [S].
    """
    j = jnp.arange(tokens.shape[1])[None, :]
    is_stop = jnp.any(tokens[..., None] == jnp.where(stop_ids >= 0, stop_ids, -2)[:, None, :], axis=2)
    stop_at = jnp.min(jnp.where(is_stop & (j >= min_left[:, None]), j, tokens.shape[1]), axis=1)
    return jnp.minimum(jnp.minimum(accepted + 1, stop_at + 1), budget).astype(jnp.int32)
