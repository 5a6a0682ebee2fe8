"""One round as one jitted, static-shaped function, for every path: plain decoding is k = 0,
speculation draft -> verify -> accept -> rollback with k >= 1, and prefill chunks are rows of
the same ragged batch.

Rows of the step: prefill chunks (and rows that don't speculate) as in a plain step, plus for each
speculating slot its k + 1 verify rows ``[last token, d_1 .. d_k]`` at positions ``L-1 .. L-1+k``,
which ``sfjax.functional._layout`` lays out on the device (after the engine's host's prefill
rows); the round fills in the drafts and turns the rows past the proposer's k into padding
(an n-gram lookup runs before the layout, so there its k already counts only the drafts found).
Rollback is a length: the caller moves its length by what was emitted, and K/V written past it is
dead (never attended, overwritten later).

``round_step`` is specialised on a ``RoundConfig``, or None for plain decoding: its proposer
(``spec.proposers``: ``Ngram``, ``DraftModel``, ``Eagle``) and its acceptance rule (``spec.accept``:
``Exact``, ``Rejection``, ``Typical``), frozen dataclasses with one method each; the round calls
them and never names a method.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from sfjax import model, sampling
from sfjax.spec import accept, proposers
from sfjax.step import DeviceState, StepBatch, keep_cache_sharding, record_tokens, replicated


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecBatch:
    """The speculating slots of a step (S padded to a bucket; padding slot -1)."""
    slots: jax.Array          # int32 [S]
    length: jax.Array         # int32 [S] sequence length L (last token at L-1)
    prompt_len: jax.Array     # int32 [S]
    k: jax.Array              # int32 [S] drafts wanted this round (0: verify only the last token)
    verify_row: jax.Array     # int32 [S] row of N holding position L-1; K drafts follow it
    draft_tokens: jax.Array   # int32 [NA] draft model rows: prefill rows + (L-2, L-1) per slot
    draft_positions: jax.Array
    draft_slots: jax.Array
    draft_last: jax.Array     # int32 [S] row of NA holding position L-1
    verify_logit: jax.Array   # int32 [S] the slot's first verify logit row; its k + 1 follow
    drafts: jax.Array | None = None   # int32 [S, K] the drafts where they were proposed before
                                      # the layout (ngram: ``k`` counts only drafts that exist)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class RoundConfig:
    """What a round is specialised on: its proposer and its acceptance rule."""
    proposer: Any             # proposers.Ngram | proposers.DraftModel | proposers.Eagle
    rule: Any                 # accept.Exact | accept.Rejection | accept.Typical

    @property
    def k_max(self) -> int:
        return self.proposer.k_max

    @classmethod
    def of(cls, spec) -> "RoundConfig":
        """The round of a ``SpeculativeConfig``."""
        k = spec.num_speculative_tokens
        if spec.method == "ngram":
            proposer = proposers.Ngram(k, spec.prompt_lookup_min, spec.prompt_lookup_max)
        elif spec.method == "eagle3":
            proposer = proposers.Eagle(k, spec.model)
        else:
            proposer = proposers.DraftModel(k)
        rule = accept.RULES[spec.acceptance_method]
        rule = (rule(spec.posterior_threshold, spec.posterior_alpha) if rule is accept.Typical
                else rule())
        return cls(proposer, rule)


@dataclasses.dataclass(frozen=True)
class Context:
    """What a round's proposer and rule read: this round's batch, its speculating slots, the
    token history, and the settings the step is specialised on."""
    batch: StepBatch
    spec: SpecBatch
    sampling: sampling.SamplingBatch   # the logit rows' (``sampling.rows`` of the batch's draws)
    history: jax.Array
    block_tables: jax.Array            # int32 [max_seqs, max_blocks] (the state's)
    k_max: int
    compares_distributions: bool   # the rule compares the draft's distribution (rejection)
    run: Any                       # the ``run.RunConfig``


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Verified:
    """What a speculative round gives per speculating slot [S] (padding slots: zeros)."""
    accepted: jax.Array       # int32 drafts accepted
    tokens: jax.Array         # int32 [S, K + 1] accepted drafts, then the target's token
    emitted: jax.Array        # int32 how many of ``tokens`` are emitted (stop tokens, budget)
    drafted: jax.Array        # int32 drafts proposed (the slot's k this round)


def _verify_rows(tokens, positions, slots, spec: SpecBatch, drafts, k):
    """The rows with each speculating slot's drafts [S, K] written into its verify rows (after
    its last token's row): its planned ``spec.k`` rows, those past the proposer's ``k`` made
    padding; the rows past ``spec.k`` are not the slot's (packed layouts) or padding already."""
    j = jnp.arange(1, drafts.shape[1] + 1)[None, :]
    live = (spec.slots >= 0)[:, None]
    keep = live & (j <= k[:, None])
    rows = jnp.where(live & (j <= spec.k[:, None]), spec.verify_row[:, None] + j, tokens.shape[0])
    return (tokens.at[rows].set(drafts, mode="drop"),
            positions.at[rows].set(jnp.where(keep, spec.length[:, None] - 1 + j, -1), mode="drop"),
            slots.at[rows].set(jnp.where(keep, spec.slots[:, None], -1), mode="drop"))


def _drawn_after(batch: StepBatch, drawn: sampling.Drawn, n: int):
    """int32 [n]: per row of the batch, the token drawn from its logits (a draw, not a prompt
    logprob's), else -1."""
    real = (jnp.arange(batch.logit_rows.shape[0]) < batch.num_logit_rows) & (batch.draws.target < 0)
    return jnp.full((n,), -1, jnp.int32).at[jnp.where(real, batch.logit_rows, n)].set(
        drawn.tokens, mode="drop")


def _target(weights, state: DeviceState, batch: StepBatch, tokens, positions, slots, draws,
            run, features: tuple):
    """The target's pass over a round's rows (their K/V written into ``state.cache``), its
    logits at the batch's logit rows and their draws over ``state.history``: (state, logits,
    drawn, the hidden ``features`` the proposer reads)."""
    cfg, mesh = run.model, run.mesh
    hidden, cache, *feats = model.forward(weights, state.cache, tokens, positions, slots,
                                          state.block_tables, cfg, run.tiling,
                                          attention=run.attention, mesh=mesh, features=features)
    logits = replicated(model.logits(weights, hidden[batch.logit_rows], cfg, run.tiling,
                                     batch.num_logit_rows, mesh=mesh), mesh)
    drawn = sampling.draw(logits, draws, state.history, batch.num_logit_rows, run.row_tile,
                          batch.with_logprobs, run.sampler)
    return (dataclasses.replace(state, cache=keep_cache_sharding(cache, cfg, mesh)), logits,
            drawn, feats)


@functools.partial(jax.jit, static_argnames=("run",), donate_argnames=("state",))
def round_step(weights, draft_weights, state: DeviceState, batch: StepBatch,
               spec: SpecBatch | None, *, run):
    """One round for every slot: the batch's rows through the model (their K/V written, their
    tokens recorded in the history), logits at its logit rows, each drawn with its slot's
    settings (``sampling.rows``); with a ``RoundConfig`` (and a ``SpecBatch``), the speculating
    slots' drafts proposed into their verify rows first (the proposer's state is
    ``state.draft_cache``), and accepted after. DONATES ``state``. ``run``: the
    ``run.RunConfig`` (its ``round``, None without speculation). ``draft_weights``: the draft
    model's, or for ``ngram`` its n-gram draft table (``sfjax.spec.table``) or None. On the
    run's ``mesh`` the models run under ``shard_map`` (the draft on ``draft_mesh``: the same
    devices, maybe a smaller tensor-parallel size) and everything else on whole arrays.

    Logit rows: the prefill completions and prompt logprobs, then each speculating slot's
    k + 1 verify rows from its ``spec.verify_logit`` (packed, by each slot's own k). Returns
    (state, drawn [R], ``Verified``, or None for plain decoding). The round leaves the progress
    to its caller.
    """
    rc, mesh = run.round, run.mesh
    draft_cache = state.draft_cache
    history = replicated(record_tokens(state.history, batch.slots, batch.positions, batch.tokens), mesh)
    draws = sampling.rows(state.table, batch.draws)
    tokens, positions, slots = batch.tokens, batch.positions, batch.slots
    ctx = None
    if rc is not None:
        ctx = Context(batch, spec, draws, history, state.block_tables, rc.k_max,
                      rc.rule.compares_distributions, run)
    if spec is not None:
        live = spec.slots >= 0
        drafts, k, logq, draft_cache = rc.proposer.propose(ctx, draft_weights, draft_cache)
        k = jnp.where(live, k, 0)
        tokens, positions, slots = _verify_rows(tokens, positions, slots, spec, drafts, k)
        history = replicated(record_tokens(history, slots, positions, tokens), mesh)
    features = getattr(rc.proposer, "features", ()) if rc is not None else ()
    state, logits, drawn, feats = _target(weights, dataclasses.replace(state, history=history),
                                          batch, tokens, positions, slots, draws, run, features)
    follow = lambda accepted, after: rc.proposer.follow(ctx, draft_weights, draft_cache, tokens,
                                                        positions, slots, feats[0], accepted, after)
    after = _drawn_after(batch, drawn, tokens.shape[0]) if features else None
    if spec is None:
        if features:                    # a round none of whose slots speculates
            draft_cache = follow(None, after)
        return dataclasses.replace(state, draft_cache=draft_cache), replicated(drawn, mesh), None
    accepted, out, drawn = rc.rule.accept(dataclasses.replace(ctx, history=history), drafts, k,
                                          logq, logits, drawn)
    if features:                        # a slot's newest kept row: its emitted token after it
        newest = jnp.where(live, spec.verify_row + accepted, tokens.shape[0])
        after = after.at[newest].set(jnp.take_along_axis(out, accepted[:, None], axis=1)[:, 0],
                                     mode="drop")
        draft_cache = follow(accepted, after)
    emitted = accept.truncate_at_stops(out, accepted, *accept.left(
        state.table, spec.slots, spec.length, spec.prompt_len, history.shape[1]))
    verified = Verified(accepted=jnp.where(live, accepted, 0), tokens=out,
                        emitted=jnp.where(live, emitted, 0), drafted=k)
    return (dataclasses.replace(state, draft_cache=draft_cache),
            *replicated((drawn, verified), mesh))