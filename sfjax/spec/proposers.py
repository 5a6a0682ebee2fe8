"""Draft proposers on the device: prompt lookup (n-gram) over the token history, with an n-gram
draft table as its fallback (``sfjax.spec.table``), and a draft model run by ``lax.scan`` over its
own paged cache on the target's block tables.

A proposer is a frozen dataclass with one method, ``propose(ctx, draft_weights, draft_cache)``
(``ctx``: the round's ``round.Context``), returning (drafts int32 [S, K], how many of each
row's drafts stand int32 [S], the draft's log-probabilities [S, K, V] where the acceptance rule
compares distributions else None, the draft cache).

Draft model: its cache uses the target's block tables. Every step feeds it the same prefill rows
as the target, plus two rows per decode slot (positions L-2 and L-1; re-feeding L-2 rewrites the
same bits, by row invariance), so after any outcome its cache is valid through L'-3 and the next
round's first draft step completes it. Then ``lax.scan`` draws d_1 .. d_K one row per slot (on a
mesh with dp > 1, those rows placed by data shard, ``sharding.slot_rows``), each draw over the
token history with the round's earlier drafts in it, as plain decoding's at that position. A
step draws its draft and then feeds it (an EAGLE head alike), so the draw and the logits are
compiled once: a first draw outside the loop was a second copy of them, 40% of the time to
compile a draft model's round.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from sfjax import model, rows, sampling, sharding
from sfjax.spec import eagle, table as T
from sfjax.step import keep_cache_sharding, record_tokens, replicated


def ngram(history, slots, length, k: int, n_min: int, n_max: int, table: T.NgramTable | None = None):
    """Prompt lookup: for each row, the longest suffix n-gram (n_max down to n_min) of its tokens
    [0, length) that occurred earlier, and the k tokens that followed its latest occurrence; a row
    with no match takes the ``table``'s continuation of its last two tokens, if given.

    A match p < k tokens back (its continuation runs into the row's end: the last p tokens)
    says the text repeats with period p, so its drafts go on around the period: token j is the
    one p * m tokens before it, continuation[j % p]. Without it a row in a loop of a few tokens
    (``a b a b``, a repeated line) could draft only p a round. With the table chained past its
    width (``table.lookup``), k = 7 decodes the demo target's 8 code prompts greedily at batch 1
    in 271 rounds instead of 325 (BENCHMARKS.md).

    Args:
      history: int32 [max_seqs, L] tokens by position; slots, length: int32 [S].
    Returns:
      (drafts int32 [S, k], available int32 [S]: how many of them exist, 0 if no match, and
      copied bool [S]: whether they are a match's, not the table's; adaptive k weighs the two
      kinds apart, ``spec.config.kind_counts``).
    """
    hist = history[jnp.maximum(slots, 0)]                       # [S, L]
    s, width = hist.shape
    e = jnp.arange(width)[None, :]                               # candidate ends of a match
    last = length[:, None] - 1
    n = min(n_max, width)
    padded = jnp.concatenate([jnp.zeros((s, n), hist.dtype), hist], axis=1)

    def back(i, carry):   # extend every candidate's match back by one token, where it holds
        run, m = carry
        here = lax.dynamic_slice_in_dim(padded, n - i, width, axis=1)      # token e - i
        there = jnp.take_along_axis(hist, jnp.maximum(last - i, 0), axis=1)
        run &= (e >= i) & (last >= i) & (here == there)
        return run, m + run

    # m[e]: how many tokens ending at e (e before the last token; at most n_max) equal the row's
    # last tokens, in order: linear in n_max (a loop past 16, so any n_max compiles in one body)
    _, m = lax.fori_loop(0, n, back, (e < last, jnp.zeros(hist.shape, jnp.int32)), unroll=n <= 16)
    longest = jnp.max(m, axis=1)                                 # the longest suffix that recurs
    latest = jnp.max(jnp.where(m >= longest[:, None], e, -1), axis=1)   # its latest occurrence
    best_start = jnp.where(longest >= n_min, latest + 1, -1)     # the first token after it
    period = jnp.maximum(length - best_start, 1)                  # the match's distance back
    idx = jnp.clip(best_start[:, None] + jnp.arange(k)[None, :] % period[:, None], 0, width - 1)
    drafts = jnp.take_along_axis(hist, idx, axis=1)
    available = jnp.where(best_start >= 0, k, 0)
    if table is not None:
        at = lambda i: jnp.take_along_axis(hist, jnp.clip(i, 0, width - 1)[:, None], axis=1)[:, 0]
        prev = jnp.where(length >= 2, at(length - 2), -1)
        t_drafts, t_available = T.lookup(table, prev, at(length - 1), k)
        none = best_start < 0
        drafts = jnp.where(none[:, None], t_drafts, drafts)
        available = jnp.where(none & (length >= 1), t_available, available)
    return drafts, available.astype(jnp.int32), best_start >= 0


@dataclasses.dataclass(frozen=True)
class Ngram:
    """Prompt lookup of the last ``n_min``..``n_max`` tokens (``ngram``); the draft weights are
    the n-gram table, or None."""
    k_max: int
    n_min: int = 1
    n_max: int = 4

    def propose(self, ctx, draft_weights, draft_cache):
        spec = ctx.spec
        if spec.drafts is not None:        # looked up before the layout (``functional._spec_k``)
            drafts, available = spec.drafts, spec.k
        else:
            drafts, available, _ = ngram(ctx.history, spec.slots, spec.length, self.k_max,
                                         self.n_min, self.n_max, table=draft_weights)
        logq = None
        if ctx.compares_distributions:        # a proposal is a point mass
            logq = jnp.where(jax.nn.one_hot(drafts, ctx.run.model.vocab_size, dtype=jnp.bool_), 0.0, -jnp.inf)
        return drafts, jnp.minimum(spec.k, available), logq, draft_cache


def _rows(b: sampling.SamplingBatch, idx):
    return jax.tree.map(lambda x: x[idx], b)


@dataclasses.dataclass(frozen=True)
class DraftModel:
    """A smaller Llama's k_max draws per slot (``ctx.run.draft``; its weights and cache are the
    round's draft arguments), with the target's keys (coupled: the exact rule) or its own
    (``ctx.compares_distributions``: rejection sampling needs independent drafts)."""
    k_max: int

    def propose(self, ctx, draft_weights, draft_cache):
        drafts, logq, draft_cache = _draft_model(draft_weights, draft_cache, ctx, self.k_max)
        return drafts, ctx.spec.k, (logq if ctx.compares_distributions else None), draft_cache


def _draw_draft(ctx, slots, length, k, live, s: int, logits, j, history):
    """Draft j of every slot from the drafter's ``logits`` [Sd, V] (slot rows padded to whole
    tiles, live ones first), drawn with the slot's settings at position L + j, and ``history``
    with it there: the next draft's penalties see it, as plain decoding's draw at that position
    sees the token before it. The target's keys (coupled: the exact rule) or the draft's own
    (``ctx.compares_distributions``: rejection sampling needs independent drafts, and gets
    their log-probabilities; else zeros [Sd, 1]). Returns (drafts [Sd], logq, history)."""
    run, independent, sd = ctx.run, ctx.compares_distributions, slots.shape[0]
    role = sampling.ROLE_DRAFT if independent else sampling.ROLE_TARGET
    grow = lambda x: jnp.concatenate([x, jnp.zeros((sd - s,), x.dtype)])
    r = ctx.sampling.temperature.shape[0]              # the verify row of position L-1+j
    b = _rows(ctx.sampling, grow(jnp.minimum(ctx.spec.verify_logit + jnp.minimum(j, ctx.spec.k),
                                             r - 1)))
    n = jnp.sum(live)                                # live slots come first
    d = sampling.draw(logits, b, history, n, run.row_tile, False, run.sampler, role).tokens
    logq = (sampling.log_probs(logits, b, history, n, run.row_tile, run.sampler)
            if independent else jnp.zeros((sd, 1), jnp.float32))
    history = record_tokens(history, jnp.where(live & (j < k), slots, -1), length + j, d)
    return d, logq, history


def _scan_drafts(ctx, step, carry, k, k_max: int):
    """``lax.scan(step, carry, [0, k_max))``: step j drawing draft j + 1 for the rows with
    j < ``k`` and feeding it. On the row-tile path (no matmul kernel: XLA:CPU) a step past every
    row's k is skipped (``lax.cond``; it would change nothing, as no row takes a draft there),
    so a round of adaptive k pays for the drafts it makes, not for k_max. The kernel path keeps
    every step: its round has no conditionals (an accelerator reads a branch's predicate on the
    host), and feeds the last draft to no row."""
    if ctx.run.matmul is None:
        body = step

        def step(carry, j):
            (_, outs), once = rows.traced(body, carry, j)
            none = lambda carry, j: (carry, jax.tree.map(lambda o: jnp.zeros(o.shape, o.dtype), outs))
            return lax.cond(jnp.any(j < k), once, none, carry, j)
    return lax.scan(step, carry, jnp.arange(k_max))


def _draft_model(dw, dcache, ctx, k_max: int):
    """k_max draft tokens per slot from the draft model. Returns (drafts [S, K], logq, cache)."""
    spec, history, run = ctx.spec, ctx.history, ctx.run
    dcfg, row_tile, tiling = run.draft, run.row_tile, run.draft_tiling
    attention, mesh = run.attention, run.draft_mesh
    s = spec.slots.shape[0]
    sd = -(-s // row_tile) * row_tile                 # slot rows padded to whole tiles
    grow = lambda x, fill: jnp.concatenate([x, jnp.full((sd - s, *x.shape[1:]), fill, x.dtype)])
    slots, length, k = grow(spec.slots, -1), grow(spec.length, 0), grow(spec.k, 0)
    live = slots >= 0
    h, dcache = model.forward(dw, dcache, spec.draft_tokens, spec.draft_positions, spec.draft_slots,
                              ctx.block_tables, dcfg, tiling, attention=attention, mesh=mesh)
    spread, gather = lambda x, fill: x, lambda h: h       # one row per slot, in slot order
    if sharding.dp_of(mesh) > 1:                           # ... or by data shard
        first, n = sharding.slot_rows(slots, live, ctx.block_tables.shape[0], mesh, 1, row_tile)
        spread = lambda x, fill: jnp.full((n,), fill, x.dtype).at[first].set(x, mode="drop")
        gather = lambda h: h[jnp.minimum(first, n - 1)]

    one = functools.partial(_draw_draft, ctx, slots, length, k, live, s)
    head = lambda h: replicated(model.logits(dw, h, dcfg, tiling, jnp.sum(live), mesh=mesh), mesh)

    def step(carry, j):
        """Draws draft j + 1 from the hidden row before it, then feeds it at L + j: the row
        draft j + 2 is drawn from (no row where j + 1 is past the slot's k)."""
        x, dcache, history = carry
        d, logq, history = one(head(x), j, history)
        pos = jnp.where(live & (j + 1 < k), length + j, -1)
        h, dcache = model.forward(dw, dcache, spread(d, 0), spread(pos, -1),
                                  spread(jnp.where(pos >= 0, slots, -1), -1), ctx.block_tables,
                                  dcfg, tiling, attention=attention, mesh=mesh)
        return (gather(h), dcache, history), (d, logq)

    # the first draft from the row of the newest token the round fed (a slot's L - 1)
    (_, dcache, _), (ds, qs) = _scan_drafts(ctx, step, (h[grow(spec.draft_last, 0)], dcache,
                                                        history), k, k_max)
    drafts = ds.T[:s]                                        # [S, K]
    logq = qs.transpose(1, 0, 2)[:s]                         # [S, K, V or 1]
    return drafts, logq, keep_cache_sharding(dcache, dcfg, mesh)


@dataclasses.dataclass(frozen=True)
class Eagle:
    """An EAGLE-3 head's k_max draws per slot (``sfjax.spec.eagle``; its placed weights and its
    ``HeadState`` are the round's draft arguments), keyed as ``DraftModel``'s.

    The head's row at position q reads the target's features at q and the token at q + 1, so a
    row can run only once that token is known. ``follow`` runs after the target's forward, in
    one pass of the head: for every row the round fed and kept (prefill rows, and verify rows up
    to the accepted ones) the head's row one position earlier, with the features of the row
    before it (or, for a slot's first row, those the state kept), except a slot's last token's
    row whose head row the previous round made; and for each slot's newest row whose next token
    the round drew, the head's row there with that token, kept with its output; then it keeps
    each slot's newest features. So the head's K/V at q is always computed from the features at
    q and the token at q + 1 alone, whatever the rounds were. ``propose`` then draws the first
    draft from the kept row's output (the head's logits alone, no layer), and feeds the head its
    own outputs for the other k - 1 drafts (``lax.scan``)."""
    k_max: int
    head: Any                 # eagle.HeadConfig

    @property
    def features(self) -> tuple[int, ...]:
        """The target layers whose input the round's forward returns for ``follow``."""
        return self.head.aux_layers

    def _paged(self, ctx, hw, cache, tokens, inputs, positions, slots, fused, with_logits=True):
        run = ctx.run
        return eagle.paged(hw, self.head, cache, tokens, inputs, positions, slots,
                           ctx.block_tables, fused=fused, with_logits=with_logits,
                           tiling=run.head_tiling, attention=run.attention)

    @staticmethod
    def _ready(hs, slots, length, last):
        """bool: each slot's row at its length - 2 with its last token is kept (``follow``)."""
        at = jnp.maximum(slots, 0)
        return (slots >= 0) & (hs.out_pos[at] == length - 2) & (hs.out_token[at] == last)

    def propose(self, ctx, hw, hs):
        spec, run = ctx.spec, ctx.run
        s = spec.slots.shape[0]
        sd = -(-s // run.row_tile) * run.row_tile            # slot rows padded to whole tiles
        grow = lambda x, fill: jnp.concatenate([x, jnp.full((sd - s, *x.shape[1:]), fill, x.dtype)])
        slots, length = grow(spec.slots, -1), grow(spec.length, 0)
        live, at = slots >= 0, jnp.maximum(slots, 0)
        last = ctx.history[at, jnp.maximum(length - 1, 0)]
        k = jnp.where(self._ready(hs, slots, length, last), grow(spec.k, 0), 0)
        one = functools.partial(_draw_draft, ctx, slots, length, k, live, s)
        h = hs.out[at]
        lg = eagle.paged_logits(hw, self.head, h, k > 0, tiling=run.head_tiling)

        def step(carry, j):
            """Draws draft j + 1 from the head's logits, then runs the head's row with it (at
            L - 1 + j): the logits of draft j + 2 (no row where j + 1 is past the slot's k)."""
            lg, h_prev, cache, history = carry
            d, logq, history = one(lg, j, history)
            pos = jnp.where(j + 1 < k, length - 1 + j, -1)
            h, lg, cache = self._paged(ctx, hw, cache, d, h_prev, pos,
                                       jnp.where(pos >= 0, slots, -1), fused=False)
            return (lg, h, cache, history), (d, logq)

        (_, _, cache, _), (ds, qs) = _scan_drafts(ctx, step, (lg, h, hs.cache, ctx.history), k,
                                                  self.k_max)
        drafts, logq = ds.T[:s], qs.transpose(1, 0, 2)[:s]
        return (drafts, k[:s], logq if ctx.compares_distributions else None,
                dataclasses.replace(hs, cache=cache))

    def follow(self, ctx, hw, hs, tokens, positions, slots, features, accepted, drawn):
        """The head's rows for what the round fed and kept (``tokens``, ``positions``, ``slots``:
        the round's rows, its verify rows filled; ``features``: the target's there;
        ``accepted`` [S] per speculating slot, or None; ``drawn`` int32: per row, the token the
        round drew after it, else -1), and each slot's newest features and row."""
        n, max_seqs = tokens.shape[0], hs.feature.shape[0]
        valid = (slots >= 0) & (positions >= 0)
        made = jnp.zeros(n, jnp.bool_)            # head rows the previous round made
        if accepted is not None:                       # rejected verify rows are not kept
            spec = ctx.spec
            j = jnp.arange(1, self.k_max + 1)[None, :]
            own = (spec.slots[:, None] >= 0) & (j <= spec.k[:, None])
            rows = jnp.where(own, spec.verify_row[:, None] + j, n)
            rejected = jnp.zeros(n, jnp.bool_).at[rows].set(j > accepted[:, None], mode="drop")
            valid &= ~rejected
            ready = self._ready(hs, spec.slots, spec.length, tokens[spec.verify_row])
            made = made.at[jnp.where(ready, spec.verify_row, n)].set(True, mode="drop")
        prev = lambda x, fill: jnp.concatenate([jnp.full((1, *x.shape[1:]), fill, x.dtype), x[:-1]])
        nxt = lambda x, fill: jnp.concatenate([x[1:], jnp.full((1, *x.shape[1:]), fill, x.dtype)])
        at = jnp.maximum(slots, 0)
        after_prev = prev(valid, False) & (prev(slots, -1) == slots) & (prev(positions, -2) == positions - 1)
        kept = hs.feature_pos[at] == positions - 1
        run = valid & (positions >= 1) & (after_prev | kept) & ~made
        feats = jnp.where(after_prev[:, None], prev(features, 0), hs.feature[at])
        newest = valid & ~(nxt(valid, False) & (nxt(slots, -1) == slots)
                           & (nxt(positions, -2) == positions + 1))
        ahead = newest & (drawn >= 0)
        # one pass: the rows one position back, then each slot's newest row with its drawn
        # token, packed to the front (tiles past the last row are skipped)
        pos = jnp.concatenate([jnp.where(run, positions - 1, -1), jnp.where(ahead, positions, -1)])
        m = n + min(n, -(-max_seqs // ctx.run.row_tile) * ctx.run.row_tile)
        to = jnp.where(pos >= 0, jnp.cumsum(pos >= 0) - 1, m)
        pack = lambda x, fill: jnp.full((m, *x.shape[1:]), fill, x.dtype).at[to].set(x, mode="drop")
        both = lambda a, b: jnp.concatenate([a, b])
        out, _, cache = self._paged(ctx, hw, hs.cache, pack(both(tokens, drawn), 0),
                                    pack(both(feats, features), 0), pack(pos, -1),
                                    pack(both(slots, slots), -1), fused=True, with_logits=False)
        out = out[jnp.minimum(to[n:], m - 1)]
        to = jnp.where(newest, slots, max_seqs)
        mine = jnp.where(ahead, slots, max_seqs)
        put = lambda x, v: x.at[mine].set(v, mode="drop")
        return eagle.HeadState(cache=cache, feature=hs.feature.at[to].set(features, mode="drop"),
                               feature_pos=hs.feature_pos.at[to].set(positions, mode="drop"),
                               out=put(hs.out, out.astype(hs.out.dtype)),
                               out_pos=put(hs.out_pos, positions),
                               out_token=put(hs.out_token, drawn))
