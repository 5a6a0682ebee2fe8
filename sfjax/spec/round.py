"""One speculative round as one jitted, static-shaped function: draft -> verify -> accept -> rollback.

Rows of the step: prefill chunks (and rows that don't speculate) as in the plain step, plus for each
speculating slot K + 1 verify rows ``[last token, d_1 .. d_K]`` at positions ``L-1 .. L-1+K``. The
host lays the verify rows out with their positions; the device fills in the drafts and turns the
rows past a slot's own k into padding. Rollback is a length: the host moves ``num_computed`` by
what was emitted, and K/V written past it is dead (never attended, overwritten later).

Draft model: its cache uses the target's block tables. Every step feeds it the same prefill rows
as the target, plus two rows per decode slot (positions L-2 and L-1; re-feeding L-2 rewrites the
same bits, by row invariance), so after any outcome its cache is valid through L'-3 and the next
round's first draft step completes it. Then ``lax.scan`` draws d_1 .. d_K one row per slot (on a
mesh with dp > 1, those rows placed by data shard, ``sharding.slot_rows``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.sampling import gumbel_from_bits
from sfjax import model, sampling, sharding
from sfjax.config import ModelConfig
from sfjax.spec import accept, proposers
from sfjax.step import DeviceState, StepBatch, keep_cache_sharding, record_tokens, replicated


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecBatch:
    """The speculating slots of a step (S padded to a bucket; padding slot -1)."""
    slots: jax.Array          # int32 [S]
    length: jax.Array         # int32 [S] sequence length L (last token at L-1)
    k: jax.Array              # int32 [S] drafts wanted this round (0: verify only the last token)
    verify_row: jax.Array     # int32 [S] row of N holding position L-1; K drafts follow it
    stop_ids: jax.Array       # int32 [S, B] tokens that end the sequence (-1 pad)
    min_left: jax.Array       # int32 [S] emitted index from which stop tokens count
    budget: jax.Array         # int32 [S] tokens the slot may still emit (max_tokens, max_model_len)
    draft_tokens: jax.Array   # int32 [NA] draft model rows: prefill rows + (L-2, L-1) per slot
    draft_positions: jax.Array
    draft_slots: jax.Array
    draft_last: jax.Array     # int32 [S] row of NA holding position L-1
    verify_start: jax.Array   # int32 scalar: the first verify logit row (they come last)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class RoundConfig:
    method: str               # "draft_model" | "ngram"
    acceptance: str
    k_max: int
    ngram_min: int = 1
    ngram_max: int = 4
    threshold: float = 0.09
    alpha: float = 0.3

    @classmethod
    def of(cls, spec) -> "RoundConfig":
        """What a round is specialised on, from a ``SpeculativeConfig``."""
        return cls(method=spec.method, acceptance=spec.acceptance_method,
                   k_max=spec.num_speculative_tokens, ngram_min=spec.prompt_lookup_min,
                   ngram_max=spec.prompt_lookup_max, threshold=spec.posterior_threshold,
                   alpha=spec.posterior_alpha)


def _rows(b: sampling.SamplingBatch, idx):
    return jax.tree.map(lambda x: x[idx], b)


def _draft_model(dw, dcache, history, batch: StepBatch, spec: SpecBatch, rc: RoundConfig,
                 dcfg: ModelConfig, row_tile: int, sampler: str, attention: str, mesh):
    """k_max draft tokens per slot from the draft model. Returns (drafts [S, K], logq, cache)."""
    role = sampling.ROLE_DRAFT if rc.acceptance == "rejection_sampler" else sampling.ROLE_TARGET
    s = spec.slots.shape[0]
    sd = -(-s // row_tile) * row_tile                 # slot rows padded to whole tiles
    grow = lambda x, fill: jnp.concatenate([x, jnp.full((sd - s, *x.shape[1:]), fill, x.dtype)])
    slots, length, k = grow(spec.slots, -1), grow(spec.length, 0), grow(spec.k, 0)
    live = slots >= 0
    h, dcache = model.forward(dw, dcache, spec.draft_tokens, spec.draft_positions, spec.draft_slots,
                              batch.block_tables, dcfg, row_tile, attention=attention, mesh=mesh)
    spread, gather = lambda x, fill: x, lambda h: h       # one row per slot, in slot order
    if sharding.dp_of(mesh) > 1:                           # ... or by data shard
        first, n = sharding.slot_rows(slots, live, batch.block_tables.shape[0], mesh, 1, row_tile)
        spread = lambda x, fill: jnp.full((n,), fill, x.dtype).at[first].set(x, mode="drop")
        gather = lambda h: h[jnp.minimum(first, n - 1)]

    def one(h_rows, j, history):
        """Draft j of every slot, and ``history`` with it at position L + j: the next draft's
        penalties see it, as plain decoding's draw at that position sees the token before it."""
        lg = replicated(model.logits(dw, h_rows, dcfg, row_tile, jnp.sum(live), mesh=mesh), mesh)
        b = _rows(batch.sampling, spec.verify_start + grow(jnp.arange(s) * (rc.k_max + 1) + j, 0))
        n = jnp.sum(live)                                # live slots come first
        d = sampling.draw(lg, b, history, n, row_tile, False, sampler, role).tokens
        logq = (sampling.log_probs(lg, b, history, n, row_tile)
                if rc.acceptance == "rejection_sampler" else jnp.zeros((sd, 1), jnp.float32))
        history = record_tokens(history, jnp.where(live & (j < k), slots, -1), length + j, d)
        return d, logq, history

    d0, q0, history = one(h[grow(spec.draft_last, 0)], 0, history)

    def step(carry, j):
        d_prev, dcache, history = carry
        pos = jnp.where(live & (j < k), length - 1 + j, -1)
        h, dcache = model.forward(dw, dcache, spread(d_prev, 0), spread(pos, -1),
                                  spread(jnp.where(pos >= 0, slots, -1), -1), batch.block_tables,
                                  dcfg, row_tile, attention=attention, mesh=mesh)
        d, logq, history = one(gather(h), j, history)
        return (d, dcache, history), (d, logq)

    (_, dcache, _), (ds, qs) = lax.scan(step, (d0, dcache, history), jnp.arange(1, rc.k_max))
    drafts = jnp.concatenate([d0[None], ds], axis=0).T[:s]                    # [S, K]
    logq = jnp.concatenate([q0[None], qs], axis=0).transpose(1, 0, 2)[:s]      # [S, K, V or 1]
    return drafts, logq, keep_cache_sharding(dcache, dcfg, mesh)


@functools.partial(jax.jit, static_argnames=("cfg", "dcfg", "rc", "row_tile", "sampler",
                                             "attention", "mesh", "draft_mesh"),
                   donate_argnames=("state", "draft_cache"))
def spec_step(weights, draft_weights, state: DeviceState, draft_cache, batch: StepBatch,
              spec: SpecBatch, *, cfg: ModelConfig, dcfg: ModelConfig | None, rc: RoundConfig,
              row_tile: int, sampler: str = "auto", attention: str = "auto", mesh=None,
              draft_mesh=None):
    """One round for every slot. DONATES ``state`` and ``draft_cache``. ``draft_weights``: the
    draft model's, or for ``ngram`` its n-gram draft table (``sfjax.spec.table``) or None. On a
    ``mesh`` the models run under ``shard_map`` (the draft on ``draft_mesh``: the same devices,
    maybe a smaller tensor-parallel size) and everything else on whole arrays.

    Logit rows: the plain step's (prefill completions, prompt logprobs), then from
    ``spec.verify_start`` the S * (K + 1) verify rows, slot-major, live slots first. Returns (state, draft_cache, drawn [R],
    accepted [S], tokens [S, K+1], emitted [S], drafted [S]).
    """
    k1 = rc.k_max + 1
    s = spec.slots.shape[0]
    live = spec.slots >= 0
    history = replicated(record_tokens(state.history, batch.slots, batch.positions, batch.tokens), mesh)
    start = spec.verify_start
    vrows = _rows(batch.sampling, start + jnp.arange(s) * k1)              # verify row j = 0
    if rc.method == "ngram":
        drafts, available = proposers.ngram(history, spec.slots, spec.length, rc.k_max,
                                            rc.ngram_min, rc.ngram_max, table=draft_weights)
        k = jnp.minimum(spec.k, available)
        logq = None
        if rc.acceptance == "rejection_sampler":      # a proposal is a point mass
            logq = jnp.where(jax.nn.one_hot(drafts, cfg.vocab_size, dtype=jnp.bool_), 0.0, -jnp.inf)
    else:
        drafts, logq, draft_cache = _draft_model(draft_weights, draft_cache, history, batch, spec,
                                                 rc, dcfg, row_tile, sampler, attention,
                                                 draft_mesh)
        k = spec.k
    k = jnp.where(live, k, 0)
    # fill the verify rows: drafts past a slot's k become padding
    j = jnp.arange(1, k1)[None, :]
    rows = spec.verify_row[:, None] + j                                    # [S, K]
    keep = live[:, None] & (j <= k[:, None])
    rows = jnp.where(live[:, None], rows, batch.tokens.shape[0])
    tokens = batch.tokens.at[rows].set(drafts, mode="drop")
    positions = batch.positions.at[rows].set(jnp.where(keep, spec.length[:, None] - 1 + j, -1), mode="drop")
    slots = batch.slots.at[rows].set(jnp.where(keep, spec.slots[:, None], -1), mode="drop")
    history = replicated(record_tokens(history, slots, positions, tokens), mesh)
    hidden, cache = model.forward(weights, state.cache, tokens, positions, slots,
                                  batch.block_tables, cfg, row_tile, attention=attention, mesh=mesh)
    logits = replicated(model.logits(weights, hidden[batch.logit_rows], cfg, row_tile,
                                     batch.num_logit_rows, mesh=mesh), mesh)
    drawn = sampling.draw(logits, batch.sampling, history, batch.num_logit_rows, row_tile,
                          batch.with_logprobs, sampler)
    target = lax.dynamic_slice(drawn.tokens, (start,), (s * k1,)).reshape(s, k1)
    greedy = vrows.temperature == 0
    if rc.acceptance == "exact":
        accepted, out = accept.exact(drafts, target, k)
    else:
        logp = sampling.log_probs(logits, batch.sampling, history, batch.num_logit_rows, row_tile)
        logp = lax.dynamic_slice_in_dim(logp, start, s * k1).reshape(s, k1, -1)
        if rc.acceptance == "typical_acceptance_sampler":
            accepted, out = accept.typical(drafts, target, logp, k, greedy, rc.threshold, rc.alpha)
        else:
            keys = vrows.key_data
            pos = vrows.position[:, None] + jnp.arange(rc.k_max)[None, :]      # [S, K]
            flat_keys = jnp.repeat(keys, rc.k_max, axis=0)
            u = jax.vmap(lambda kd, t: jax.random.uniform(
                sampling.draw_keys(kd[None], t[None], sampling.ROLE_ACCEPT)[0]))(flat_keys, pos.reshape(-1))
            g = sampling.noise_bits(flat_keys, pos.reshape(-1), cfg.vocab_size, sampling.ROLE_RESIDUAL)
            noise = gumbel_from_bits(g).reshape(s, rc.k_max, -1)
            accepted, out = accept.rejection(drafts, logp, logq, u.reshape(s, rc.k_max), noise, target, k)
        # report the logprobs of the tokens emitted, which may differ from the target's draws
        flat = out.reshape(-1)
        rows = lax.dynamic_slice_in_dim(logits, start, s * k1)
        new = sampling.raw_logprobs(rows, flat, batch.with_logprobs)
        put = lambda old, v: lax.dynamic_update_slice_in_dim(old, v.astype(old.dtype), start, 0)
        drawn = sampling.Drawn(drawn.tokens, *[put(o, v) for o, v in zip(
            (drawn.logprob, drawn.rank, drawn.top_ids, drawn.top_logprobs), new)])
    emitted = accept.truncate_at_stops(out, accepted, spec.stop_ids, spec.min_left, spec.budget)
    emitted = jnp.where(live, emitted, 0)
    outs = replicated((drawn, jnp.where(live, accepted, 0), out, emitted, k), mesh)
    return (DeviceState(cache=keep_cache_sharding(cache, cfg, mesh), history=history), draft_cache,
            *outs)
