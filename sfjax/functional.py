"""Generation as pure functions for JAX programs: under the caller's ``jit``, ``lax.scan`` or AOT
``lower().compile()``, with the weights the caller holds.

``prefill`` builds the cache and slot state for a batch of prompts and draws each row's first
token; ``decode`` runs N rounds; ``generate`` runs rounds until every row is done; ``outputs``
reads back tokens, lengths and acceptance counts. Weights, caches and state are pytrees; ``Config``
is static and hashable; everything runs on the device (``lax`` loops, masks for finished rows).

A round is the engine's own (``round.round_step``), traced inside the caller's program, over
the batch the engine's host would build, laid out here on the device: one row per live sequence
(plain) or K + 1 verify rows (speculative), live rows first, drawing from the same per-request
table (``sampling.Sampling``, this module's ``Sampling``) and stop rule (``spec.accept.left``). Row
invariance (every op in fixed tiles of ``row_tile`` rows) makes a row's logits the same bits in
either layout, and draws use the engine's counter keys (request key, output index), so the tokens
equal ``LLM.generate``'s for the same weights, prompts, seeds and speculative settings.

``draft_weights`` are the draft model's ``Weights`` (``draft_model``), the n-gram table or None
(``ngram``), or the head's ``eagle.HeadWeights`` (``eagle3``, with the ``eagle.HeadConfig`` as
the speculative config's "model"; ``State.draft_cache`` then holds its ``eagle.HeadState``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sfjax import checks as C, model, rows, sampling_params, sharding
from sfjax import weights as W
from sfjax.cache import KVCache
from sfjax.sampling import Draws, Sampling
from sfjax.spec import accept, eagle, proposers
from sfjax.spec.config import (acceptance_level, adaptive_k, draft_cap, drafts_for, kind_counts,
                               round_drafts)
from sfjax.round import SpecBatch, round_step
from sfjax.run import RunConfig
from sfjax.spec.table import NgramTable
from sfjax.step import DeviceState, Progress, StepBatch



Config = RunConfig      # a generation program's static settings (``run.RunConfig``)


# A batch of B rows between calls, the engine's own slot state (``step.DeviceState``): row b
# owns slot b and its own contiguous KV blocks; ``progress`` holds each row's prompt length,
# length, newest token, counters and live flag (``done`` is its negation: ended at a stop token,
# max_tokens or max_model_len, or an empty row); ``draft_cache`` the proposer's state.
State = DeviceState


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Outputs:
    token_ids: jax.Array         # int32 [B, width] output tokens, the first width; -1 past num_tokens
    num_tokens: jax.Array        # int32 [B]
    finished: jax.Array          # bool [B]
    num_drafts: jax.Array        # int32 [B]
    num_draft_tokens: jax.Array  # int32 [B]
    num_accepted_tokens: jax.Array  # int32 [B]


def pad_prompts(prompts: Sequence[Sequence[int]], length: int | None = None,
                batch: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [batch, length], lengths int32 [batch]) on the host. ``length`` defaults to the
    smallest power of two >= 8 holding the longest prompt, so similar batches share one bucket;
    rows past the prompts (up to ``batch``) are empty."""
    batch = len(prompts) if batch is None else C.integer("batch", batch, 1)
    need = max(map(len, prompts), default=1)
    length = (max(8, 1 << (need - 1).bit_length()) if length is None
              else C.integer("length", length, 1))
    if need > length or len(prompts) > batch:
        raise ValueError(f"prompts: {len(prompts)} of up to {need} tokens don't fit [{batch}, {length}]")
    ids = np.zeros((batch, length), np.int32)
    for i, p in enumerate(prompts):
        row = np.asarray(p)         # a list, a range, a numpy or jax array
        if row.size and (row.ndim != 1 or not np.issubdtype(row.dtype, np.integer)
                         or row.min() < 0 or row.max() >= 2**31):
            raise ValueError(f"prompts[{i}]: must be token ids in [0, 2**31), got {p!r}")
        ids[i, :len(row)] = row
    return ids, np.array([len(p) for p in prompts] + [0] * (batch - len(prompts)), np.int32)


def _tiles(n: int, tile: int) -> int:
    return -(-n // tile) * tile


def place_weights(weights: W.Weights, cfg: Config, draft: bool = False) -> W.Weights:
    """``weights`` (the draft's if ``draft``) checked against the config and laid out as a round
    uses them (``sharding.place_weights``: matrices in column blocks, layers split on CPU).

    ``prefill``, ``decode`` and ``generate`` do this once per call, before their loops. A loop of
    your own that calls ``decode`` a round at a time should place the weights once before it:
    laid-out weights are taken as they are (and checked by their plain shapes), while plain ones
    would be laid out again every round. Raises ValueError naming the first array whose shape or
    dtype does not fit the config.
    """
    mcfg = cfg.draft if draft else cfg.model
    try:
        plain = rows.plain_shapes(weights)
        if mcfg.tie_word_embeddings and plain.lm_head is not None:   # placed: the head is embed.T
            plain = dataclasses.replace(plain, lm_head=None)
        W.check(plain, mcfg)
    except ValueError as e:
        raise ValueError(f"draft_{e}" if draft else str(e)) from None
    return sharding.place_weights(weights, mcfg, split=model.unrolled(cfg.layer_loop))


def _weights(weights, draft_weights, cfg: Config):
    if not isinstance(cfg, Config):
        raise C.InvalidType(f"cfg: must be a functional.Config, got {type(cfg).__name__}")
    if not isinstance(weights, W.Weights):
        raise C.InvalidType(f"weights: must be a sfjax.weights.Weights, got "
                            f"{type(weights).__name__}")
    weights = place_weights(weights, cfg)
    spec = cfg.speculative_config
    if spec is not None and spec.method == "ngram":     # draft_weights: the n-gram table, if any
        if spec.prompt_lookup_table is not None and not isinstance(draft_weights, NgramTable):
            raise ValueError("draft_weights: speculative_config.prompt_lookup_table names an n-gram "
                             "table; pass it, as sfjax.spec.table.load(path)")
        return weights, draft_weights if isinstance(draft_weights, NgramTable) else None
    if cfg.head is not None:
        if not isinstance(draft_weights, eagle.HeadWeights):
            raise ValueError("draft_weights: the eagle3 method needs the head's weights "
                             "(sfjax.spec.eagle.load(folder, target)[1])")
        return weights, eagle.place(draft_weights, weights.embed)
    if cfg.draft is None:
        if draft_weights is not None:
            raise ValueError("draft_weights: given, but cfg has no speculative method that "
                             "drafts from weights (it would be ignored)")
        return weights, None
    if draft_weights is None:
        raise ValueError("draft_weights: the draft_model method needs the draft's weights")
    return weights, place_weights(draft_weights, cfg, draft=True)


def _draws(slot, length, prompt_len, k1: int, n: int) -> Draws:
    """K1 draw rows per sequence, sequence-major, padded to n: row (r, j) draws after the token
    at position ``length - 1 + j`` of slot ``slot[r]``."""
    rep = lambda x: jnp.repeat(x, k1, axis=0)
    j = jnp.tile(jnp.arange(k1, dtype=jnp.int32), slot.shape[0])
    pad = lambda x, fill: jnp.concatenate([x, jnp.full(n - x.shape[0], fill, jnp.int32)])
    return Draws(slot=pad(rep(slot), -1), seq_pos=pad(rep(length - 1) + j, -1),
                 prompt_len=pad(rep(prompt_len), 0), target=jnp.full(n, -1, jnp.int32))


def _commit(st: State, order, live, out, emitted, accepted, drafted, copied=None) -> State:
    """Appends each live row's ``out[r, :emitted[r]]`` (row r is sequence ``order[r]``), ends rows
    at a stop token, max_tokens or max_model_len (``accept.ends`` with the rows' ``accept.left``,
    the round's own rule), and counts drafts, in the rows' progress: those of the rows that
    drafted a copy (``copied`` bool [B], ``ngram``'s match) apart too."""
    p = st.progress
    s, max_len = st.history.shape
    length = p.length[order]
    j = jnp.arange(out.shape[1])[None, :]
    keep = live[:, None] & (j < emitted[:, None])
    history = st.history.at[jnp.where(keep, order[:, None], s), length[:, None] + j].set(
        out, mode="drop")
    ended = accept.ends(out, emitted, *accept.left(st.table, order, length, p.prompt_len[order],
                                                   max_len))
    newest = jnp.take_along_axis(out, jnp.maximum(emitted - 1, 0)[:, None], axis=1)[:, 0]
    spec = drafted > 0
    taken = jnp.where(spec, jnp.minimum(accepted, emitted), 0)
    put = lambda old, new: old.at[order].set(jnp.where(live, new, old[order]))
    rejected = spec & (taken < drafted)
    copied = jnp.zeros_like(spec) if copied is None else copied & spec
    return dataclasses.replace(st, history=history, progress=dataclasses.replace(
        p, length=put(p.length, length + emitted), live=put(p.live, ~ended),
        last=put(p.last, jnp.where(emitted > 0, newest, p.last[order])),
        spec_rounds=put(p.spec_rounds, p.spec_rounds[order] + spec),
        drafted=put(p.drafted, p.drafted[order] + drafted),
        accepted=put(p.accepted, p.accepted[order] + taken),
        rejected=put(p.rejected, p.rejected[order] + rejected),
        copy_accepted=put(p.copy_accepted, p.copy_accepted[order] + jnp.where(copied, taken, 0)),
        copy_rejected=put(p.copy_rejected, p.copy_rejected[order] + (copied & rejected))))


def prefill(weights: W.Weights, prompt_ids, prompt_lens, sampling: Sampling, cfg: Config,
            draft_weights: W.Weights | None = None) -> State:
    """Builds the state for B prompts and draws each row's first token.

    prompt_ids: int32 [B, P] (P a fixed bucket, < max_model_len); prompt_lens: int32 [B], 0 for an
    empty row, in [0, P]: checked where they are on the host; traced ones are clipped to it (a
    program can't raise). Raises ValueError (at trace time) naming the first weight array whose
    shape or dtype does not fit the config. ``sampling``'s arrays are copied, never donated.
    """
    w, dw = _weights(weights, draft_weights, cfg)
    return _prefill(w, dw, prompt_ids, prompt_lens, sampling, cfg)


# each Sampling field's trailing shape ("*": any width) and kind of dtype
_SAMPLING_SHAPES = {"key_data": ((2,), "uint32"), "stop_ids": (("*",), "int"),
                    "bias_ids": (("*",), "int"), "bias": (("*",), "float"),
                    "allowed": (("*",), "int"), "top_k": ((), "int"), "max_tokens": ((), "int"),
                    "min_tokens": ((), "int")}
_KINDS = {"int": (jnp.integer, "an integer type"), "float": (jnp.floating, "a float type"),
          "uint32": (jnp.uint32, "uint32")}


def _rows_agree(prompt_ids, prompt_lens, sampling: Sampling, vocab_size: int) -> None:
    """``prompt_ids`` int [B, P] (B >= 1); ``prompt_lens`` and every ``sampling`` field one row
    per prompt row (a gather past a table's last row would silently take that row's settings),
    each of its shape and kind of dtype; the table's token ids in the vocabulary where the
    table is on the host (as ``Sampling.from_params`` gives it). ValueError naming the first
    field that does not fit."""
    if not isinstance(sampling, Sampling):
        raise C.InvalidType(f"sampling: must be a functional.Sampling, got {type(sampling).__name__}")
    if not hasattr(prompt_ids, "shape") or len(prompt_ids.shape) != 2 or not prompt_ids.shape[0]:
        raise ValueError(f"prompt_ids: must be an int array [B, P] with B >= 1, got "
                         f"{getattr(prompt_ids, 'shape', type(prompt_ids).__name__)}")
    s, p = prompt_ids.shape
    if isinstance(prompt_lens, (list, tuple)):
        try:
            prompt_lens = np.asarray(prompt_lens)
        except jax.errors.TracerArrayConversionError:       # a list of traced values
            prompt_lens = jnp.asarray(prompt_lens)
    if isinstance(prompt_lens, np.ndarray) and prompt_lens.size:    # on the host: checked here
        if not (prompt_lens.min() >= 0 and prompt_lens.max() <= p):
            raise ValueError(f"prompt_lens: {prompt_lens.tolist()} must lie in [0, {p}] "
                             f"(prompt_ids' width)")
    fields = [("prompt_ids", prompt_ids, (p,), "int"), ("prompt_lens", prompt_lens, (), "int")] + [
        (f"sampling.{f.name}", getattr(sampling, f.name),
         *_SAMPLING_SHAPES.get(f.name, ((), "float"))) for f in dataclasses.fields(sampling)]
    for name, x, tail, kind in fields:
        shape = tuple(np.shape(x))
        want = (s, *(shape[1] if w == "*" and len(shape) > 1 else w for w in tail))
        if shape != want:
            raise ValueError(f"{name}: shape {shape} must be {want} (one row per prompt row of "
                             f"prompt_ids, {tuple(prompt_ids.shape)})")
        dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
        if not jnp.issubdtype(dtype, _KINDS[kind][0]):
            raise C.InvalidType(f"{name}: dtype {dtype} must be {_KINDS[kind][1]}")
    if np.shape(sampling.bias) != np.shape(sampling.bias_ids):
        raise ValueError(f"sampling.bias: shape {np.shape(sampling.bias)} must be "
                         f"sampling.bias_ids' {np.shape(sampling.bias_ids)} (a bias per id)")
    for name in ("stop_ids", "bias_ids", "allowed"):
        ids = getattr(sampling, name)
        if isinstance(ids, np.ndarray) and ids.size and not (
                ids.min() >= -1 and ids.max() < vocab_size):
            raise ValueError(f"sampling.{name}: token ids must lie in [0, {vocab_size}) (-1: "
                             f"none), got {ids.min()} .. {ids.max()}")


def _prefill(w, dw, prompt_ids, prompt_lens, sampling: Sampling, cfg: Config) -> State:
    _rows_agree(prompt_ids, prompt_lens, sampling, cfg.model.vocab_size)
    s, p = prompt_ids.shape
    if p >= cfg.max_model_len:
        raise ValueError(f"prompt_ids: width {p} leaves no room for output under max_model_len "
                         f"({cfg.max_model_len})")
    prompt_lens = jnp.clip(jnp.asarray(prompt_lens, jnp.int32), 0, p)
    dp = sharding.dp_of(cfg.mesh)
    if s % dp:
        raise ValueError(f"prompt_ids: a batch of {s} rows can't be split over the mesh's "
                         f"{dp} data shards")
    per_seq = -(-cfg.max_model_len // cfg.block_size)
    num_blocks = dp * (1 + s // dp * per_seq)       # each data shard: its null block 0, its rows'
    local = jnp.arange(s, dtype=jnp.int32) % (s // dp)
    st = State(
        cache=KVCache.zeros(cfg.model, num_blocks, cfg.block_size, mesh=cfg.mesh),
        history=jnp.zeros((s, cfg.max_model_len), jnp.int32),
        block_tables=1 + local[:, None] * per_seq + jnp.arange(per_seq, dtype=jnp.int32)[None, :],
        table=jax.tree.map(jnp.array, sampling),      # a copy: the rounds donate the state
        progress=Progress.start(prompt_lens))
    pos = jnp.arange(p, dtype=jnp.int32)[None, :]
    real = pos < prompt_lens[:, None]
    rows = jnp.arange(s, dtype=jnp.int32)
    first, n = sharding.slot_rows(rows, rows >= 0, s, cfg.mesh, p, cfg.row_tile)   # by data shard
    at = (first[:, None] + pos).reshape(-1)
    flat = lambda x, fill: jnp.full(n, fill, jnp.int32).at[at].set(x.reshape(-1))
    tokens = flat(jnp.asarray(prompt_ids, jnp.int32), 0)
    positions = flat(jnp.where(real, pos, -1), -1)
    slots = flat(jnp.where(real, rows[:, None], -1), -1)
    r = _tiles(s, cfg.row_tile)
    logit_rows = jnp.concatenate([first + jnp.maximum(prompt_lens - 1, 0),
                                  jnp.zeros(r - s, jnp.int32)])
    batch = StepBatch(tokens=tokens, positions=positions, slots=slots, logit_rows=logit_rows,
                      num_logit_rows=jnp.int32(s), with_logprobs=jnp.bool_(False),
                      draws=_draws(rows, prompt_lens, prompt_lens, 1, r))
    # an EAGLE head follows the prompt rows in the round; the draft model's cache gets them after
    # (the round donates the state it is given, a call outside jit: keep what it returns)
    st = dataclasses.replace(st, draft_cache=_draft_state(cfg, num_blocks, s))
    if cfg.head is not None:
        st, drawn, _ = _round_step(st, batch)(w, dw, st, batch, None, run=cfg)
    else:
        dcache = st.draft_cache
        st, drawn, _ = _round_step(st, batch)(w, None, dataclasses.replace(
            st, draft_cache=None), batch, None, run=cfg.plain())
        if cfg.draft is not None:
            _, dcache = model.forward(dw, dcache, tokens, positions, slots, st.block_tables,
                                      cfg.draft, cfg.draft_tiling, attention=cfg.attention,
                                      mesh=cfg.draft_mesh)
        st = dataclasses.replace(st, draft_cache=dcache)
    live, zeros = st.progress.live, jnp.zeros_like(prompt_lens)
    return _commit(st, rows, live, drawn.tokens[:s, None], live.astype(jnp.int32), zeros, zeros)


# what a traced value is (``jax.core`` is shedding names across releases; this one's home)
_TRACER = getattr(jax.core, "Tracer", None) or __import__("jax._src.core", fromlist=["Tracer"]).Tracer


def _round_step(*args):
    """``round.round_step`` for a call on ``args``: inside a trace, jitted afresh for it. JAX
    keeps what it traced a jitted function at (the jaxpr, per shape and static argument) in
    caches keyed weakly on the Python function it wraps, one of them unbounded
    (``trace_to_jaxpr``): called as the module-level function inside the engine's programs,
    every shape a process ever traced a round at (each widened sampling table's, each logprobs
    bucket's) stayed for the process's life, after the engine had let those programs go
    (``engine.programs``: about 2 MB a shape on the tiny model). A fresh ``functools.partial``
    dies with the trace that made it, and its entries with it; the round is traced as before,
    so the program is the same. Called eagerly (``prefill`` outside a jit), the module-level
    function, whose compiled shapes jit keeps as it keeps any jitted function's."""
    if not any(isinstance(x, _TRACER) for x in jax.tree.leaves(args)):
        return round_step
    return jax.jit(functools.partial(round_step.__wrapped__), static_argnames=("run",),
                   donate_argnames=("state",))


def _draft_state(cfg: Config, num_blocks: int, rows: int):
    """The proposer's state: the draft model's cache, the EAGLE head's ``HeadState``, or None."""
    if cfg.head is not None:
        return eagle.HeadState.zeros(cfg.head, num_blocks, cfg.block_size, rows)
    if cfg.draft is not None:
        return KVCache.zeros(cfg.draft, num_blocks, cfg.block_size, mesh=cfg.draft_mesh)
    return None


def _round(w, dw, st: State, cfg: Config) -> State:
    """One round for every live row (``round.round_step``): plain (one token each) or
    speculative (up to k + 1)."""
    return _round_reported(w, dw, st, cfg, False)[0]


def _round_reported(w, dw, st: State, cfg: Config, with_logprobs: bool):
    """``_round``, and with ``with_logprobs`` (static) the raw logprobs of the tokens each row may
    emit (``sampling.raw_logprobs``): (state, (logprob float32 [B, K1], rank, top ids and top
    logprobs [B, K1, 20]) by slot, entry j for the row's j-th token of the round, or None)."""
    batch, sb, laid = _layout(st, cfg, with_logprobs, dw=dw)
    return _finish(*_round_step(st, batch)(w, dw, st, batch, sb, run=cfg), cfg, laid,
                   with_logprobs)


def _layout(st: State, cfg: Config, with_logprobs: bool, shape: tuple | None = None, host=None,
            dw=None):
    """A round's batch for every live row, laid out on the device as the step wants it: live rows
    first, one row each (plain) or each slot's k + 1 verify rows packed by its own k, the padding
    all at the end. ``shape``: the (rows, logit rows, draft rows) to lay them in (a bucket the
    caller compiled that holds every live row's), else the fewest that hold them.

    ``host``: rows the engine's host laid out for this round too (``Host``: prefill chunks), at
    the head of each data shard's segment and of the logit rows; the live rows follow them.
    ``dw``: the draft weights (for ``ngram``, its table: the lookup runs before the layout).
    Returns (batch, spec batch or None, what ``_finish`` reads of the layout)."""
    p = st.progress
    s = p.length.shape[0]
    order = jnp.argsort(~p.live, stable=True).astype(jnp.int32)   # live rows first, as the step wants
    live = p.live[order]
    n_live = jnp.sum(live.astype(jnp.int32))
    length, plen, last = p.length[order], p.prompt_len[order], p.last[order]
    slot = jnp.where(live, order, -1)
    spec = cfg.speculative_config
    k1 = spec.num_speculative_tokens + 1 if spec else 1
    n_rows, r, na = shape or (None, _tiles(s * k1, cfg.row_tile), None)
    after, hr = (None, 0) if host is None else (host.rows, host.batch.num_logit_rows)
    if spec is None:
        first, n = sharding.slot_rows(slot, live, s, cfg.mesh, 1, cfg.row_tile, rows=n_rows,
                                      after=after)
        k = None
        logit_first = hr + jnp.arange(s, dtype=jnp.int32)
        wide = max(s, r)                 # r < s: only the live entries (first) need logit rows
        logit_rows = jnp.concatenate([jnp.where(first < n, first, 0), jnp.arange(s, wide)])[:r]
        num_logit_rows = n_live
        draws = jax.tree.map(lambda x: x[:r], _draws(order, length, plen, 1, wide))
    else:       # each slot's k + 1 rows packed, by its own k: the padding all at the end
        k, drafts, copied = _spec_k(st, cfg, order, live, length, plen,
                                    0 if host is None else host.running,
                                    0 if host is None else jnp.sum(host.rows), dw)
        first, n = sharding.slot_rows(slot, live, s, cfg.mesh, k1, cfg.row_tile, counts=k + 1,
                                      rows=n_rows, after=after)
        logit_first, logit_rows, num_logit_rows, draws = _packed_logit_rows(
            order, live, length, plen, first, k, r)
        logit_first = hr + logit_first
    hb = host.batch if host is not None else None
    put = lambda fill, x, name: (jnp.full(n, fill, jnp.int32) if hb is None else getattr(hb, name)
                                 ).at[first].set(x, mode="drop")      # after the host's rows
    if host is not None:          # the host's logit rows first, the live rows' after them
        logit_rows, draws = _after(hr, (hb.logit_rows, hb.draws), (logit_rows, draws))
        num_logit_rows = hr + num_logit_rows
    logprobs = jnp.bool_(with_logprobs) | (False if hb is None else hb.with_logprobs)
    batch = StepBatch(
        tokens=put(0, last, "tokens"),
        positions=put(-1, jnp.where(live, length - 1, -1), "positions"),
        slots=put(-1, slot, "slots"), logit_rows=logit_rows,
        num_logit_rows=num_logit_rows, with_logprobs=logprobs, draws=draws)
    sb = None if spec is None else _spec_batch(st, cfg, order, live, length, last, first, k,
                                               jnp.where(live, logit_first, r), na, host, drafts)
    return batch, sb, (order, live, k, logit_first, None if spec is None else copied)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Host:
    """The rows the engine's host lays out for a round beside the device's (``_layout``): its
    prefill chunks, packed by data shard at the head of each segment (``rows`` of them per
    shard, int32 [dp]), their logit rows first (``batch.num_logit_rows``), and for a draft
    model the same rows for it (``draft``: tokens, positions, slots int32 [NA], laid out
    alike in its own row count). ``running``: requests the speculation threshold
    (``disable_by_batch_size``) counts beyond the live rows."""
    batch: StepBatch
    draft: tuple | None
    rows: jax.Array
    running: jax.Array

    def only_first(self, first) -> "Host":
        """These rows in the first round of a call (``first``, traced), none after it."""
        b = self.batch
        keep = lambda x, fill: jnp.where(first, x, fill)
        batch = dataclasses.replace(b, tokens=keep(b.tokens, 0), positions=keep(b.positions, -1),
                                    slots=keep(b.slots, -1),
                                    num_logit_rows=keep(b.num_logit_rows, 0),
                                    with_logprobs=first & b.with_logprobs)
        draft = None if self.draft is None else tuple(
            keep(x, fill) for x, fill in zip(self.draft, (0, -1, -1)))
        return Host(batch, draft, keep(self.rows, 0), self.running)


def _after(n, head, tail):
    """``head``'s first ``n`` (traced) entries, then ``tail``'s from its first on (pytrees of
    arrays of one length, which the result keeps)."""
    def merge(h, t):
        i = jnp.arange(h.shape[0])
        return jnp.where(i < n, h, jnp.take(t, jnp.maximum(i - n, 0), axis=0, mode="clip"))
    return jax.tree.map(merge, head, tail)


def _finish(st: State, drawn, v, cfg: Config, laid, with_logprobs: bool):
    """The state after a round laid out by ``_layout`` (``laid``) gave ``st``, ``drawn`` and
    ``v`` (``round.round_step``'s), and its tokens' logprobs (``_round_reported``)."""
    order, live, k, logit_first, copied = laid
    s = order.shape[0]
    spec = cfg.speculative_config
    k1 = spec.num_speculative_tokens + 1 if spec else 1
    report = None
    if with_logprobs:         # entry r (slot order[r]) has logit rows at[r]: its own k + 1
        at = (logit_first[:, None] if spec is None else
              logit_first[:, None] + jnp.minimum(jnp.arange(k1)[None, :], k[:, None]))
        by_slot = lambda x: jnp.zeros((s, k1, *x.shape[1:]), x.dtype).at[order].set(
            jnp.take(x, at, axis=0, mode="clip"))
        report = tuple(map(by_slot, (drawn.logprob, drawn.rank, drawn.top_ids, drawn.top_logprobs)))
    if v is None:
        zero = jnp.zeros(s, jnp.int32)
        tokens = jnp.take(drawn.tokens, logit_first, mode="clip")   # live entries first
        return _commit(st, order, live, tokens[:, None], live.astype(jnp.int32), zero,
                       zero), report
    return _commit(st, order, live, v.tokens, v.emitted, v.accepted, v.drafted, copied), report


def _spec_k(st: State, cfg: Config, order, live, length, plen, running=0, taken=0, dw=None):
    """Each entry's drafts this round (``drafts_for``; adaptive_k reads its acceptance so far),
    0 for the entries that are not live, whose request does not draft, or whose pages do not
    hold its k drafts (the engine's host grows them first, when it can); the speculation
    threshold counts the live entries and ``running`` more. ``taken``: the round's rows before
    the entries' (the host's). For ``ngram``, the lookup (over ``st.history``, which holds each
    live entry's tokens through its newest; ``dw``: the table) runs here, before the layout, and
    an entry's k counts only the drafts it found: no verify row is laid out for a draft that does
    not exist; adaptive_k weighs a copy (a match in the entry's own tokens) by its copies'
    acceptance and the table's guesses by theirs (``kind_counts``). Returns (k, those drafts
    int32 [B, k_max], or None for the other proposers, and whether each entry's are a copy)."""
    spec = cfg.speculative_config
    p = st.progress
    _, _, budget = accept.left(st.table, order, length, plen, cfg.max_model_len)
    k_max, limit = spec.num_speculative_tokens, spec.draft_limit(cfg.max_model_len, cfg.draft)
    drafts, found, copied = None, k_max, jnp.zeros(order.shape, bool)
    if spec.method == "ngram":
        drafts, found, copied = proposers.ngram(st.history, order, length, k_max,
                                                spec.prompt_lookup_min, spec.prompt_lookup_max,
                                                table=dw)
    room = jnp.sum(st.block_tables[order] != 0, axis=1) * cfg.block_size - length
    n_live = jnp.sum(live.astype(jnp.int32))
    drafting = live & p.drafts[order] & spec.speculates_at(n_live + running)
    table = cfg.k_table(order.shape[0])
    if table is None:
        k = jnp.minimum(drafts_for(k_max, budget, length, limit, xp=jnp), found)
        return jnp.where(drafting & (k <= room), k, 0), drafts, copied
    # adaptive_k: each row's k from its own acceptance so far (of this round's kind of draft),
    # weighed up to what it may draft
    counts = kind_counts(p.accepted[order], p.rejected[order], p.copy_accepted[order],
                         p.copy_rejected[order], copied, jnp)
    cap = jnp.where(drafting, jnp.minimum(draft_cap(k_max, budget, length, limit, jnp), found), 0)
    k = adaptive_k(table, *counts, n_live, length - plen, cap, jnp, copied)
    k = jnp.where(k <= room, k, 0)
    # the fill of free drafts and whether the round's drafts pay (the host's k is a bound)
    level = acceptance_level(*counts, jnp, copied)
    cost, tiled, dp = spec.cost(cfg.model), cfg.matmul is None, sharding.dp_of(cfg.mesh)
    free = spec.method == "ngram" and not cost and tiled and dp == 1     # no draft step to add
    k = round_drafts(k, jnp.minimum(cap, jnp.maximum(room, 0)), level, live, taken, k_max, cost,
                     cfg.row_tile, cfg.small_tiles, tiled, dp, fill=free)
    return k, drafts, copied


def _packed_logit_rows(order, live, length, plen, first, k, r: int):
    """The verify logit rows of a round whose entry e (slot ``order[e]``, live ones first) has
    k[e] + 1 rows from row ``first[e]``: packed in entry order, padding from the last on. Returns
    (each entry's first logit row, logit rows [r], how many are real, their ``Draws``)."""
    count = jnp.where(live, k + 1, 0)
    end = jnp.cumsum(count)
    logit_first = (end - count).astype(jnp.int32)
    i = jnp.arange(r, dtype=jnp.int32)
    owner = jnp.minimum(jnp.searchsorted(end, i, side="right"), order.shape[0] - 1)
    j = i - logit_first[owner]
    real = i < end[-1]
    on = lambda x, fill: jnp.where(real, x, fill).astype(jnp.int32)
    draws = Draws(slot=on(order[owner], -1), seq_pos=on(length[owner] - 1 + j, -1),
                  prompt_len=on(plen[owner], 0), target=jnp.full(r, -1, jnp.int32))
    return logit_first, on(first[owner] + j, 0), end[-1].astype(jnp.int32), draws


def _spec_batch(st: State, cfg: Config, order, live, length, last, first, k, logit_first,
                na: int | None = None, host=None, drafts=None) -> SpecBatch:
    """The speculating rows of a round (``order``: live rows first, each with its verify rows
    from ``first`` and its logit rows from ``logit_first``, by its ``k``) and the draft model's
    rows at L-2, L-1 (in ``na`` rows if given), after the ``host``'s draft rows (``Host``)."""
    s = order.shape[0]
    plen = st.progress.prompt_len[order]
    slot = jnp.where(live, order, -1)
    mine = host is not None and host.draft is not None       # the draft model's prefill rows
    two, na = sharding.slot_rows(slot, live, s, cfg.draft_mesh, 2, cfg.row_tile, rows=na,
                                 after=host.rows if mine else None)
    prev = st.history[order, jnp.maximum(length - 2, 0)]
    base = lambda fill, i: host.draft[i] if mine else jnp.full(na, fill, jnp.int32)
    put = lambda fill, i, a, b: (base(fill, i).at[two].set(a, mode="drop")
                                 .at[two + 1].set(b, mode="drop"))
    on = lambda x: jnp.where(live, x, -1)
    return SpecBatch(slots=slot, length=jnp.where(live, length, 0), prompt_len=plen, k=k,
                     verify_row=first, verify_logit=logit_first,
                     draft_tokens=put(0, 0, prev, last),
                     draft_positions=put(-1, 1, on(length - 2), on(length - 1)),
                     draft_slots=put(-1, 2, slot, slot),
                     draft_last=jnp.minimum(two + 1, na - 1), drafts=drafts)


def decode(weights: W.Weights, state: State, cfg: Config, num_rounds,
           draft_weights: W.Weights | None = None) -> State:
    """Runs ``num_rounds`` rounds (plain: one token per live row; speculative: up to k + 1).
    Finished rows take no part; ``num_rounds`` may be traced."""
    w, dw = _weights(weights, draft_weights, cfg)
    _state_fits(state, cfg)
    if not isinstance(num_rounds, (jax.Array, np.ndarray)):   # a Python value: checked here
        num_rounds = C.integer("num_rounds", num_rounds, 0)
    return lax.fori_loop(0, num_rounds, lambda _, st: _round(w, dw, st, cfg), state)


def _state_fits(state, cfg: Config) -> None:
    """A state ``prefill`` built for another config (its max_model_len, block size, or whether
    a proposer keeps a cache) is refused naming what differs; the rounds read it as this one."""
    if not isinstance(state, State):
        raise C.InvalidType(f"state: must be a functional.State, got {type(state).__name__}")
    built = {"max_model_len": state.history.shape[1], "block_size": state.cache.k.shape[2],
             "a proposer's cache": state.draft_cache is not None}
    wants = {"max_model_len": cfg.max_model_len, "block_size": cfg.block_size,
             "a proposer's cache": cfg.draft is not None or cfg.head is not None}
    for what, have in built.items():
        if have != wants[what]:
            raise ValueError(f"state: built with {what} {have}, but cfg has {wants[what]} (a "
                             f"state is decoded with the config prefill built it with)")


def run_rounds(w, dw, state: State, cfg: Config, num_rounds, max_rounds: int, until_one_ends=False,
               with_logprobs=False, host: Host | None = None):
    """Up to ``num_rounds`` (traced, at most the static ``max_rounds``) rounds, stopping as soon as
    every row is done, or (``until_one_ends``, traced) once any row that was live has ended;
    weights as ``_weights`` returns them. Returns (state, rounds run, per round and row the
    drafts proposed and the accepted drafts emitted, int32 [max_rounds, B], with the static
    ``with_logprobs`` the raw logprobs of each row's new tokens in order: ids int32 [B, W, 21]
    (the token's rank, then the top 20 ids) and values float32 [B, W, 21] (its logprob, then the
    top 20), W = max_rounds * (k + 1), else None, None; and the last round's drawn rows and
    ``Verified``): the engine's calls (``engine.rounds.call``).

    ``host``: rows the caller laid out (``Host``: the engine's prefill chunks), run in the first
    round beside the live rows (which follow them); every round is laid out in its shapes. The
    caller reads the host rows' draws from the drawn rows (the last round's: a call with host
    rows runs one round, or more that add only live rows)."""
    b = state.progress.length.shape[0]
    rec = jnp.zeros((max_rounds, b), jnp.int32)
    spec = cfg.speculative_config
    k1 = spec.num_speculative_tokens + 1 if spec else 1
    width = max_rounds * k1
    shape = (b, width, 1 + sampling_params.MAX_LOGPROBS) if with_logprobs else (b, 0)
    ids, vals = jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.float32)
    laid_in = None if host is None else (
        host.batch.tokens.shape[0], host.batch.logit_rows.shape[0],
        None if host.draft is None else host.draft[0].shape[0])
    step = _round_step(state)

    def round_i(i, st):
        mine = None if host is None else host.only_first(i == 0)
        batch, sb, laid = _layout(st, cfg, with_logprobs, laid_in, mine, dw)
        new, drawn, v = step(w, dw, st, batch, sb, run=cfg)
        return _finish(new, drawn, v, cfg, laid, with_logprobs), (drawn, v)

    # the round traced once: the loop's body replays it, and the last round's drawn rows and
    # Verified start as zeros of its shapes
    (_, shapes), one = rows.traced(round_i, jnp.int32(0), state)

    def body(c):
        i, st, drafted, accepted, ids, vals, _ = c
        (new, report), out = one(i, st)
        p, q = st.progress, new.progress
        if with_logprobs:
            ids, vals = _record(report, p.length - state.progress.length, q.length - p.length,
                                ids, vals)
        return (i + 1, new, drafted.at[i].set(q.drafted - p.drafted),
                accepted.at[i].set(q.accepted - p.accepted), ids, vals, out)

    last = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
    was_live = ~state.done
    first = False if host is None else jnp.any(host.rows > 0)    # the host's rows: a round
    more = lambda c: ((c[0] < jnp.minimum(num_rounds, max_rounds))
                      & ((first & (c[0] == 0)) | jnp.any(~c[1].done))
                      & ~(until_one_ends & jnp.any(c[1].done & was_live)))
    n, state, drafted, accepted, ids, vals, last = lax.while_loop(
        more, body, (jnp.int32(0), state, rec, rec, ids, vals, last))
    return (state, n, drafted, accepted) + ((ids, vals) if with_logprobs else (None, None)) + last


def _record(report, start, emitted, ids, vals):
    """``run_rounds``' logprob record with a round's ``report`` (``_round_reported``'s, [B, K1]
    per row) written at each row's ``start`` (its tokens so far in the call) for the ``emitted``
    tokens it took; the rest dropped."""
    lp, rank, top_ids, top_lps = report
    j = jnp.arange(lp.shape[1])[None, :]
    at = jnp.where(j < emitted[:, None], start[:, None] + j, ids.shape[1])   # [B, K1]
    rows = jnp.arange(ids.shape[0])[:, None]
    ids = ids.at[rows, at].set(jnp.concatenate([rank[..., None], top_ids], -1), mode="drop")
    vals = vals.at[rows, at].set(jnp.concatenate([lp[..., None], top_lps], -1), mode="drop")
    return ids, vals


def outputs(state: State, width: int) -> Outputs:
    """The first ``width`` output tokens of each row, with lengths and acceptance counts."""
    width = C.integer("width", width, 0)
    p = state.progress
    n = p.length - p.prompt_len
    j = jnp.arange(width)[None, :]
    pos = jnp.minimum(p.prompt_len[:, None] + j, state.history.shape[1] - 1)
    ids = jnp.take_along_axis(state.history, pos, axis=1)
    return Outputs(token_ids=jnp.where(j < n[:, None], ids, -1), num_tokens=n,
                   finished=~p.live, num_drafts=p.spec_rounds, num_draft_tokens=p.drafted,
                   num_accepted_tokens=p.accepted)


def generate(weights: W.Weights, prompt_ids, prompt_lens, sampling: Sampling, cfg: Config,
             draft_weights: W.Weights | None = None, width: int | None = None) -> Outputs:
    """prefill, then rounds until every row is done. ``width``: the output columns, by default
    max_model_len - 1, what a one-token prompt may give (a narrower one cuts rows' tokens past
    it; ``num_tokens`` still counts them)."""
    w, dw = _weights(weights, draft_weights, cfg)
    width = cfg.max_model_len - 1 if width is None else C.integer("width", width, 0)
    state = _prefill(w, dw, prompt_ids, prompt_lens, sampling, cfg)
    state = lax.while_loop(lambda st: jnp.any(~st.done), lambda st: _round(w, dw, st, cfg), state)
    return outputs(state, width)
