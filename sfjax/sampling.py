"""Sampling on the device: vLLM's logits processors, then Gumbel-max with counter-based keys.

A step's draws read one table of per-request settings by slot (``Sampling``, what a request's
``SamplingParams`` mean on the device) and, per logit row, which slot and position it draws at
(``Draws``); ``rows`` expands the two into the per-row arrays the sampler reads
(``SamplingBatch``). The engine and ``sfjax.functional`` build the table and the rows the same way.

The draw at output position t of a request uses ``fold_in(fold_in(request_key, t), role)``: it
depends on (request key, position, logits) only, never on the batch or on earlier draws. Every
row is processed inside the same fixed row tiles as the model (``sfjax.rows``), so its
token and logprobs are the same bits in any batch.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import sampling as kernels
from sfjax.checks import InvalidType, integer
from sfjax.rows import bucket, num_tiles_of, per_tile
from sfjax.sampling_params import F32_MAX, MAX_LOGPROBS, SamplingParams

INT32_MAX = 2**31 - 1

ROLE_TARGET = 0    # the token drawn from the target model at a position (and by coupled drafters)
ROLE_DRAFT = 1     # a draft model's own draw (rejection sampling needs independent drafts)
ROLE_ACCEPT = 2    # the uniform of a rejection-sampling acceptance test
ROLE_RESIDUAL = 3  # the draw from the residual distribution after a rejection


@dataclasses.dataclass
class _Filters:
    """The filters and penalties of a draw, the first fields of a request's settings
    (``Sampling``) and of a logit row's (``SamplingBatch``), with ``SamplingParams``' meanings."""
    temperature: jax.Array    # float32; 0 = greedy
    top_k: jax.Array          # int32; 0 = off
    top_p: jax.Array          # float32; 1 = off
    min_p: jax.Array          # float32; 0 = off
    presence: jax.Array       # float32 presence penalty
    frequency: jax.Array      # float32 frequency penalty
    repetition: jax.Array     # float32 repetition penalty; 1 = off


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingBatch(_Filters):
    """Per logit row; every field is [R] unless noted (the filters first: ``_Filters``)."""
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
class Sampling(_Filters):
    """Per-request sampling settings, one row per slot (or per row of ``sfjax.functional``'s
    batch); [B] unless noted, with ``SamplingParams``' (vLLM's) meanings (the filters first:
    ``_Filters``)."""
    key_data: jax.Array      # uint32 [B, 2] request keys (request_key_data(seed), or
                             # jax.random.key_data of a key made in the program)
    max_tokens: jax.Array    # int32 output tokens at most
    min_tokens: jax.Array    # int32 stop tokens can't end (or be drawn in) the first min_tokens
    stop_ids: jax.Array      # int32 [B, S] tokens that end the row (EOS + stop_token_ids); -1 pad
    bias_ids: jax.Array      # int32 [B, W] logit_bias ids; -1 pad
    bias: jax.Array          # float32 [B, W] their biases
    allowed: jax.Array       # int32 [B, A] allowed_token_ids; all -1 = no restriction

    @classmethod
    def from_params(cls, params: SamplingParams | Sequence[SamplingParams], *,
                    eos_token_ids: Sequence[int], batch: int | None = None,
                    vocab_size: int | None = None) -> "Sampling":
        """The table for a batch of ``sfjax.functional`` rows from ``SamplingParams`` (one for
        all ``batch`` rows, or one per row).

        ``eos_token_ids`` end a row unless its params ``ignore_eos`` (``LLM`` uses the model's
        generation_config). Sampled rows need a ``seed``. Fields that need the host between
        tokens (stop strings, logprobs, per-request speculation settings) are refused.
        ``vocab_size`` (the model's): token ids in the params past it are refused here, as
        ``LLM`` refuses them; without it they are checked only where the table reaches
        ``functional.prefill`` / ``generate`` as host arrays (not inside a caller's ``jit``,
        where an id past the vocabulary is dropped).
        """
        batch = integer("batch", batch, 1, optional=True)
        params = [params] * (batch or 1) if isinstance(params, SamplingParams) else list(params)
        if batch is not None and len(params) != batch:
            raise ValueError(f"batch: {batch} rows, but {len(params)} SamplingParams were given "
                             f"(one per row, or one SamplingParams for all)")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise InvalidType(f"params[{i}]: must be a SamplingParams, got {type(p).__name__}")
        params = [p.checked() for p in params]        # checked again: it may have been changed
        unsupported = {"n": 1, "stop": [], "logprobs": None, "prompt_logprobs": None,
                       "disable_spec_decode": False, "spec_strategy": None, "spec_exactness": None}
        for p in params:
            for name, off in unsupported.items():
                if getattr(p, name) != off:
                    raise ValueError(f"SamplingParams.{name}: not offered by sfjax.functional")
            if p.seed is None and p.temperature > 0:
                raise ValueError("SamplingParams.seed: sampled rows need a seed in sfjax.functional")
            p.check_draws(eos_token_ids)
            if vocab_size is not None:
                p.validate_for(integer("vocab_size", vocab_size, 1), eos_token_ids)
        return cls.placed(params, [request_key_data(p.seed or 0) for p in params],
                          [p.max_tokens or INT32_MAX for p in params],
                          eos_token_ids=eos_token_ids)

    @classmethod
    def placed(cls, params: Sequence[SamplingParams], key_data, max_tokens, *,
               eos_token_ids: Sequence[int], rows: Sequence[int] | None = None,
               num_rows: int | None = None, widths: tuple[int, int, int] | None = None) -> "Sampling":
        """The table (numpy) with ``params[i]`` (its request key data and its resolved
        ``max_tokens``) at row ``rows[i]`` (default i) of ``num_rows`` (default len(params));
        other rows are inert: greedy, no penalties, no stop ids, max_tokens 0. Unchecked
        (``from_params`` checks; the engine's requests are checked at admission). The id lists
        (stop ids, logit_bias, allowed ids) are ``widths`` wide, by default ``list_widths``'."""
        rows = list(range(len(params))) if rows is None else list(rows)
        n = len(params) if num_rows is None else num_rows
        stops, biases, allowed = _lists(params, eos_token_ids)
        widths = widths or _widths((stops, biases, allowed))
        ids = lambda w, fill, dtype: np.full((n, w), fill, dtype)
        stop_ids, bias_ids, bias = (ids(widths[0], -1, np.int32), ids(widths[1], -1, np.int32),
                                    ids(widths[1], 0, np.float32))
        allowed_ids = ids(widths[2], -1, np.int32)
        f32, i32 = (lambda v: np.full(n, v, np.float32)), (lambda v: np.full(n, v, np.int32))
        b = dict(temperature=f32(0), top_k=i32(0), top_p=f32(1), min_p=f32(0), presence=f32(0),
                 frequency=f32(0), repetition=f32(1), key_data=np.zeros((n, 2), np.uint32),
                 max_tokens=i32(0), min_tokens=i32(0))
        for r, p, key, most, stop, bs, al in zip(rows, params, key_data, max_tokens, stops, biases,
                                                 allowed):
            b["temperature"][r], b["top_k"][r], b["top_p"][r], b["min_p"][r] = (
                p.temperature, min(p.top_k, INT32_MAX), p.top_p, p.min_p)     # k >= V keeps all
            b["presence"][r], b["frequency"][r] = p.presence_penalty, p.frequency_penalty
            b["repetition"][r], b["key_data"][r] = p.repetition_penalty, key
            b["max_tokens"][r], b["min_tokens"][r] = min(most, INT32_MAX), min(p.min_tokens, INT32_MAX)
            stop_ids[r, :len(stop)] = stop
            bias_ids[r, :len(bs)] = [t for t, _ in bs]
            bias[r, :len(bs)] = [max(-100.0, min(100.0, v)) for _, v in bs]
            allowed_ids[r, :len(al)] = al
        return cls(**b, stop_ids=stop_ids, bias_ids=bias_ids, bias=bias, allowed=allowed_ids)


def _lists(params: Sequence[SamplingParams], eos_token_ids: Sequence[int]) -> tuple[list, list, list]:
    """Per request its stop ids (EOS unless ignored, then stop_token_ids), its sorted
    logit_bias items and its allowed ids; each id once (a list repeating an id asks nothing
    more, and must not widen the table)."""
    once = lambda ids: list(dict.fromkeys(ids))
    return ([once(([] if p.ignore_eos else list(eos_token_ids)) + list(p.stop_token_ids))
             for p in params],
            [sorted((p.logit_bias or {}).items()) for p in params],
            [once(p.allowed_token_ids or []) for p in params])


# The narrowest id lists a table has (stop ids with EOS, logit_bias entries, allowed ids): a
# request within them leaves every compiled program's shapes as they are, so ordinary requests
# never make a serving engine recompile its rounds. A wider list doubles its width (a new shape
# for every program, compiled once, until that request leaves; an engine keeps a few such
# widenings compiled, ``engine.programs.WIDE_PROGRAMS``). Their cost is gathers and scatters of
# [rows, width] beside [rows, vocab] logits.
MIN_LIST_WIDTHS = (8, 16, 64)


def list_widths(params: Sequence[SamplingParams], eos_token_ids: Sequence[int]) -> tuple[int, int, int]:
    """The widths of a table's id lists holding ``params``' (stop ids, logit_bias, allowed ids):
    ``rows.bucket``s of ``MIN_LIST_WIDTHS`` * 2**j, so few shapes compile."""
    return _widths(_lists(params, eos_token_ids))


def _widths(lists) -> tuple[int, int, int]:
    return tuple(bucket(max(map(len, x), default=0), least)
                 for x, least in zip(lists, MIN_LIST_WIDTHS))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Draws:
    """Which slot and position each of a step's logit rows draws at; [R]."""
    slot: jax.Array          # int32 the row's slot (its table row and token history); -1 padding
    seq_pos: jax.Array       # int32 position of the row's input token (the draw is the next one)
    prompt_len: jax.Array    # int32 the slot's prompt length
    target: jax.Array        # int32 a prompt-logprobs row's reported token (nothing is drawn);
                             # -1 for a draw

    @classmethod
    def padding(cls, r: int) -> "Draws":
        """``r`` padding rows (numpy)."""
        full = lambda v: np.full(r, v, np.int32)
        return cls(slot=full(-1), seq_pos=full(-1), prompt_len=full(0), target=full(-1))


def rows(table: Sampling, d: Draws) -> SamplingBatch:
    """The per-row arrays of a step's draws: each row gets its slot's settings, drawing output
    index ``seq_pos + 1 - prompt_len`` (its key's counter, and whether min_tokens still
    suppresses the stop ids). Prompt-logprobs rows (``target >= 0``) and padding rows
    (``slot < 0``) draw nothing: greedy and unprocessed."""
    draws = (d.slot >= 0) & (d.target < 0)
    slot = jnp.maximum(d.slot, 0)
    s = jax.tree.map(lambda x: x[slot], table)
    on = lambda x, off: jnp.where(draws.reshape(-1, *[1] * (x.ndim - 1)), x, jnp.asarray(off, x.dtype))
    position = jnp.where(draws, d.seq_pos + 1 - d.prompt_len, 0)
    suppress = jnp.where((position < s.min_tokens)[:, None], s.stop_ids, -1)
    return SamplingBatch(
        temperature=on(s.temperature, 0), top_k=on(s.top_k, 0), top_p=on(s.top_p, 1),
        min_p=on(s.min_p, 0), presence=on(s.presence, 0), frequency=on(s.frequency, 0),
        repetition=on(s.repetition, 1), key_data=on(s.key_data, 0), position=position, slot=slot,
        seq_pos=jnp.where(d.slot >= 0, d.seq_pos, -1), prompt_len=jnp.where(d.slot >= 0, d.prompt_len, 0),
        suppress=on(suppress, -1), bias_ids=on(s.bias_ids, -1), bias=on(s.bias, 0),
        allowed=on(s.allowed, -1), target=jnp.where(d.slot >= 0, d.target, -1))


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
    # a penalty that would take a seen logit past float32's range (a tiny or a huge one) is
    # bounded for its row so that the row's largest stays in range and the order is kept; any
    # other row's penalty is its own, so its bits are too (a masked -inf stays -inf)
    rep = b.repetition[:, None]
    finite = seen & (jnp.abs(logits) < jnp.inf)
    top = jnp.max(jnp.where(finite & (logits > 0), logits, 0.0), axis=-1, keepdims=True)
    low = jnp.max(jnp.where(finite & (logits < 0), -logits, 0.0), axis=-1, keepdims=True)
    # (powers of two: XLA turns / F32_MAX into * 1 / F32_MAX, a subnormal, flushed to 0)
    up, down = jnp.maximum(rep, top * 2.0 ** -126), jnp.minimum(rep, 2.0 ** 126 / low)
    scaled = jnp.where(logits > 0, jnp.minimum(logits / up, F32_MAX),
                       jnp.maximum(logits * down, -F32_MAX))
    logits = jnp.where(finite, scaled, logits)
    return logits - b.frequency[:, None] * counts - b.presence[:, None] * (counts > 0)


def process(logits, b: SamplingBatch, history, branch_free: bool = False):
    """Logit bias, allowed ids, min_tokens suppression and penalties; float32 [T, V]. Each is
    skipped by a ``lax.cond`` when no row asks for it, or with ``branch_free`` (the accelerator
    path: no control flow in the step) applied to every row, which leaves a row that asks for
    none of them unchanged, bit for bit (adds of 0, a division by a repetition of 1)."""
    rows = jnp.arange(logits.shape[0])[:, None]
    v = logits.shape[1]
    restricted = jnp.any(b.allowed >= 0, axis=1, keepdims=True)

    def masks(x):
        x = x.at[rows, jnp.where(b.bias_ids >= 0, b.bias_ids, v)].add(b.bias, mode="drop")
        allow = jnp.zeros(x.shape, jnp.bool_).at[rows, jnp.where(b.allowed >= 0, b.allowed, v)].set(
            True, mode="drop")
        x = jnp.where(restricted & ~allow, -jnp.inf, x)
        return _mask_ids(x, b.suppress, -jnp.inf)

    penalize = lambda x: _penalize(x, b, history)
    if branch_free:
        return penalize(masks(logits))
    any_mask = jnp.any(b.bias_ids >= 0) | jnp.any(restricted) | jnp.any(b.suppress >= 0)
    logits = lax.cond(any_mask, masks, lambda x: x, logits)
    penalized = (b.presence != 0) | (b.frequency != 0) | (b.repetition != 1)
    return lax.cond(jnp.any(penalized), penalize, lambda x: x, logits)


def _draw_tile(raw, b: SamplingBatch, history, with_logprobs, impl, role=ROLE_TARGET):
    """One tile (or, with the row kernels, all rows): process, draw, and (optionally) raw
    logprobs. With the row kernels (the accelerator path) nothing is skipped by a branch: a
    greedy row ignores its noise."""
    branch_free = kernels.runs_kernel(impl)
    x = process(raw, b, history, branch_free)
    v = raw.shape[1]
    noise = lambda: noise_bits(b.key_data, b.position, v, role)
    bits = noise() if branch_free else lax.cond(
        jnp.any(b.temperature > 0), noise, lambda: jnp.zeros(raw.shape, jnp.uint32))
    tokens = kernels.sample(x, bits, b.temperature, b.top_k, b.top_p, b.min_p, impl=impl)
    target = jnp.where(b.target >= 0, b.target, tokens)
    return Drawn(tokens, *raw_logprobs(raw, target, with_logprobs, impl))


def raw_logprobs(raw, target, wanted, impl: str = "reference"):
    """(logprob of ``target``, its 1-based rank, top-20 ids, top-20 logprobs) of the raw logits,
    computed only if ``wanted`` (a traced bool; zeros if not): with the row kernels computed
    anyway and selected (no branch in the step)."""
    def compute():
        lp = raw - kernels.logsumexp(raw, impl=impl)[:, None]
        tok = jnp.take_along_axis(lp, target[:, None], axis=1)[:, 0]
        rank = 1 + jnp.sum(lp > tok[:, None], axis=1).astype(jnp.int32)
        top_lp, top_ids = lax.top_k(lp, MAX_LOGPROBS)
        return tok, rank, top_ids.astype(jnp.int32), top_lp

    r = raw.shape[0]
    empty = lambda: (jnp.zeros((r,), jnp.float32), jnp.zeros((r,), jnp.int32),
                     jnp.zeros((r, MAX_LOGPROBS), jnp.int32), jnp.zeros((r, MAX_LOGPROBS), jnp.float32))
    if kernels.runs_kernel(impl):
        return tuple(jnp.where(wanted, a, z) for a, z in zip(compute(), empty()))
    return lax.cond(wanted, compute, empty)


def _over_rows(fn, logits, batch, num_rows, row_tile, impl):
    """``fn(raw, b)`` over the first ``num_rows`` rows: in row tiles (XLA's reductions keep a
    row's bits only on one tile shape), or with the row kernels (``impl`` runs them: their
    reductions are inside fixed-shape programs) over all rows at once."""
    if kernels.runs_kernel(impl):
        return fn(logits, batch)
    rows = jnp.arange(logits.shape[0]) < num_rows
    return per_tile(fn, row_tile, num_tiles_of(rows, row_tile), logits, batch)


def draw(logits, batch: SamplingBatch, history, num_rows, row_tile: int, with_logprobs,
         impl: str = "auto", role: int = ROLE_TARGET) -> Drawn:
    """Tokens (and raw logprobs) for the first ``num_rows`` rows of ``logits`` [R, V] (float32).

    ``history`` int32 [max_seqs, max_model_len] holds each slot's tokens by position;
    ``with_logprobs`` is a traced bool; ``impl`` picks the sampler (pallas_kernels.sampling.sample).
    """
    fn = lambda raw, b: _draw_tile(raw, b, history, with_logprobs, impl, role)
    return _over_rows(fn, logits, batch, num_rows, row_tile, impl)


def log_probs(logits, batch: SamplingBatch, history, num_rows, row_tile: int,
              impl: str = "auto"):
    """The processed distribution each row draws from, as log-probabilities [R, V] (a point mass
    for greedy rows); what rejection sampling and typical acceptance compare."""
    def fn(raw, b):
        return kernels.log_probs(process(raw, b, history, kernels.runs_kernel(impl)),
                                 b.temperature, b.top_k, b.top_p, b.min_p, impl=impl)
    return _over_rows(fn, logits, batch, num_rows, row_tile, impl)
