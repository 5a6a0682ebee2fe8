"""Acceptance rules over one round. Shapes: S rows, K = k_max drafts, K + 1 verified positions.

Each rule returns ``(accepted [S], tokens [S, K + 1])``: the row emits ``tokens[:, :accepted + 1]``
(the accepted drafts, then the correction or bonus token). Rows draft only their first ``k[s]``
positions; the rest are masked.

The rules as a round uses them are frozen dataclasses with one method, ``accept(ctx, drafts, k,
logq, logits, drawn)`` (``ctx``: the round's ``round.Context``), returning (accepted,
tokens, the step's ``Drawn`` with the emitted tokens' logprobs), each with the exactness class it
holds per sampling mode (``modes``: the registry's certificates) and whether it compares the
draft's distribution with the target's (``compares_distributions``: the draft then draws with
its own keys and reports its log-probabilities).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from pallas_kernels import sampling as kernels
from pallas_kernels.sampling import argmax, gumbel_from_bits
from sfjax import sampling


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


def typical(drafts, target, logp, k, greedy, threshold: float, alpha: float,
            impl: str = "reference"):
    """Medusa's typical acceptance (lossy): accept a draft whose target probability exceeds
    min(threshold, alpha * exp(-entropy)); the replacement at the first rejection is the target's
    argmax; after k accepted drafts the bonus is the target's sample. Greedy rows accept exactly
    the target's argmax, so at temperature 0 this is plain greedy decoding.

    logp: float32 [S, K+1, V] the target's processed log-probabilities; ``impl``: the sampler's
    (its row kernels sum the entropy, ``pallas_kernels.sampling.entropy``).
    """
    p = jnp.exp(logp[:, :-1])                                              # [S, K, V]
    p_draft = jnp.take_along_axis(p, drafts[..., None], axis=2)[..., 0]
    entropy = kernels.entropy(logp[:, :-1], impl=impl)
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


def left(table, slots, length, prompt_len, max_model_len: int):
    """Each slot's request's stop rule at sequence length ``length``: (stop ids [S, B], the
    index of the next emitted tokens from which they count (min_tokens), tokens it may still
    emit (max_tokens, max_model_len)). ``table``: the ``sampling.Sampling`` by slot."""
    s = jax.tree.map(lambda x: x[jnp.maximum(slots, 0)], table)
    out = length - prompt_len
    return (s.stop_ids, jnp.maximum(s.min_tokens - out, 0),
            jnp.minimum(s.max_tokens - out, max_model_len - length))


def truncate_at_stops(tokens, accepted, stop_ids, min_left, budget):
    """How many of ``tokens[:, :accepted + 1]`` are emitted: up to and including the first stop
    token allowed at its index (index >= min_left), and at most ``budget``.

    stop_ids: int32 [S, B] (-1 pad); min_left, budget: int32 [S].
    """
    j = jnp.arange(tokens.shape[1])[None, :]
    is_stop = jnp.any(tokens[..., None] == jnp.where(stop_ids >= 0, stop_ids, -2)[:, None, :], axis=2)
    stop_at = jnp.min(jnp.where(is_stop & (j >= min_left[:, None]), j, tokens.shape[1]), axis=1)
    return jnp.minimum(jnp.minimum(accepted + 1, stop_at + 1), budget).astype(jnp.int32)


def ends(tokens, emitted, stop_ids, min_left, budget):
    """Whether emitting ``tokens[:, :emitted]`` ends each row's request (the arguments as
    ``truncate_at_stops``'): its last token is a stop token at an index >= min_left, or the
    row used its budget."""
    last = emitted - 1
    token = jnp.take_along_axis(tokens, jnp.maximum(last, 0)[:, None], axis=1)[:, 0]
    stopped = jnp.any(token[:, None] == jnp.where(stop_ids >= 0, stop_ids, -2), axis=1)
    return (stopped & (last >= min_left) & (emitted > 0)) | (emitted >= budget)


# -- the rules as a round calls them ---------------------------------------------------------


def verify_logit_rows(ctx):
    """int32 [S, K + 1]: each slot's verify logit rows, its own k + 1 (``spec.k``), then its last
    again (a slot reads only its own rows; the rules ignore those past its k)."""
    j = jnp.arange(ctx.k_max + 1)[None, :]
    return ctx.spec.verify_logit[:, None] + jnp.minimum(j, ctx.spec.k[:, None])


def _target_rows(ctx, x):
    """The verify rows of ``x`` (a [R, ...] array over the step's logit rows) as [S, K + 1, ...]."""
    return jnp.take(x, verify_logit_rows(ctx), axis=0, mode="clip")


def _target_log_probs(ctx, logits):
    b = ctx.batch
    return _target_rows(ctx, sampling.log_probs(logits, ctx.sampling, ctx.history, b.num_logit_rows,
                                                ctx.run.row_tile, ctx.run.sampler))


def _report_emitted(ctx, logits, drawn, out):
    """``drawn`` with the verify rows' logprobs of the tokens emitted (``out``), which may differ
    from the target's draws."""
    idx = verify_logit_rows(ctx)
    rows = jnp.take(logits, idx.reshape(-1), axis=0, mode="clip")
    new = sampling.raw_logprobs(rows, out.reshape(-1), ctx.batch.with_logprobs, ctx.run.sampler)
    mine = jnp.arange(idx.shape[1])[None, :] <= ctx.spec.k[:, None]       # the slot's own rows
    to = jnp.where(mine, idx, drawn.logprob.shape[0]).reshape(-1)
    put = lambda old, v: old.at[to].set(v.astype(old.dtype), mode="drop")
    return sampling.Drawn(drawn.tokens, *[put(o, v) for o, v in zip(
        (drawn.logprob, drawn.rank, drawn.top_ids, drawn.top_logprobs), new)])


@dataclasses.dataclass(frozen=True)
class Exact:
    """Path-exact (``exact``): drafts equal to the target's own draws are kept."""
    name: ClassVar[str] = "exact"
    modes: ClassVar[tuple] = (("greedy", "path-exact"), ("gumbel", "path-exact"))
    compares_distributions: ClassVar[bool] = False

    def accept(self, ctx, drafts, k, logq, logits, drawn):
        accepted, out = exact(drafts, _target_rows(ctx, drawn.tokens), k)
        return accepted, out, drawn


@dataclasses.dataclass(frozen=True)
class Rejection:
    """Leviathan/Chen rejection sampling (``rejection``), its uniforms and residual noise from
    the request's counter keys."""
    name: ClassVar[str] = "rejection_sampler"
    # greedy rows under rejection sampling accept exactly the target's argmax
    modes: ClassVar[tuple] = (("greedy", "path-exact"), ("gumbel", "distribution-exact"))
    compares_distributions: ClassVar[bool] = True

    def accept(self, ctx, drafts, k, logq, logits, drawn):
        s, k_max = drafts.shape
        vrows = jax.tree.map(lambda x: jnp.take(x, ctx.spec.verify_logit, axis=0, mode="clip"),
                             ctx.sampling)                              # verify row j = 0
        pos = (vrows.position[:, None] + jnp.arange(k_max)[None, :]).reshape(-1)   # [S * K]
        keys = jnp.repeat(vrows.key_data, k_max, axis=0)
        u = jax.vmap(lambda kd, t: jax.random.uniform(
            sampling.draw_keys(kd[None], t[None], sampling.ROLE_ACCEPT)[0]))(keys, pos)
        g = sampling.noise_bits(keys, pos, ctx.run.model.vocab_size, sampling.ROLE_RESIDUAL)
        noise = gumbel_from_bits(g).reshape(s, k_max, -1)
        accepted, out = rejection(drafts, _target_log_probs(ctx, logits), logq, u.reshape(s, k_max),
                                  noise, _target_rows(ctx, drawn.tokens), k)
        return accepted, out, _report_emitted(ctx, logits, drawn, out)


@dataclasses.dataclass(frozen=True)
class Typical:
    """Medusa's typical acceptance (``typical``)."""
    threshold: float = 0.09
    alpha: float = 0.3
    name: ClassVar[str] = "typical_acceptance_sampler"
    # Medusa's typical acceptance equals plain decoding at temperature 0 only
    modes: ClassVar[tuple] = (("greedy", "path-exact"), ("gumbel", "lossy"))
    compares_distributions: ClassVar[bool] = False

    def accept(self, ctx, drafts, k, logq, logits, drawn):
        greedy = jnp.take(ctx.sampling.temperature, ctx.spec.verify_logit, mode="clip") == 0
        accepted, out = typical(drafts, _target_rows(ctx, drawn.tokens),
                                _target_log_probs(ctx, logits), k, greedy, self.threshold,
                                self.alpha, ctx.run.sampler)
        return accepted, out, _report_emitted(ctx, logits, drawn, out)


RULES = {rule.name: rule for rule in (Exact, Rejection, Typical)}
