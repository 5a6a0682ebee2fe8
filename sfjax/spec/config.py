"""``speculative_config`` with vLLM's names, validated once."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import numpy as np

from sfjax import checks as C
from sfjax.config import ModelConfig
from sfjax.spec.eagle import HeadConfig

METHODS = ("draft_model", "ngram", "eagle3")
ACCEPTANCE = ("exact", "rejection_sampler", "typical_acceptance_sampler")
MAX_SPECULATIVE_TOKENS = 128
ADAPTIVE_MAX = 7          # "auto" drafts up to this many: k + 1 verify rows fill one 8-row tile
ADAPTIVE_LEVELS = 64      # acceptance estimates are read to 1/64 (integers: host == device)
ADAPTIVE_PRIOR = (2, 2)   # (accepted, rejected) counted before a request's own: an estimate of 1/2
COPY_PRIOR = (8, 1)       # the same for its drafts that copy its own tokens (``ngram``'s match)
VERIFY_COST = 0.02        # one more verify row where a call's rows share one kernel launch
SLOT_COST = 0.35          # a live slot's own work in a round (its attention, draws), in row tiles
ADAPTIVE_PROBE = 8        # a request adaptive k keeps at 0 drafts 1 each time its output reaches
                          # a multiple of this, so its acceptance is still measured


def _check_method(method) -> None:
    if method not in METHODS:
        raise ValueError(f"speculative_config.method = {method!r}: must be one of {METHODS}")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """method: "draft_model" (a smaller Llama with its own paged cache on the same block tables),
    "ngram" (prompt lookup over the sequence's own tokens, on the device) or "eagle3" (an EAGLE-3
    head folder, ``sfjax.spec.eagle``, drafting from the target's own features).
    num_speculative_tokens: k, the drafts per round (1..128).
    acceptance_method: "exact" (default; path-exact: the tokens plain decoding would draw with
    the same keys), "rejection_sampler" (Leviathan/Chen; distribution-exact) or
    "typical_acceptance_sampler" (Medusa's rule; lossy: equal to plain decoding at temperature 0).
    prompt_lookup_table: for "ngram", an n-gram draft table (``sfjax.spec.table``; the embedded
    target ships one, distilled from its own greedy tokens) whose continuation of the last two
    tokens is the draft when the sequence's own tokens hold no match.
    max_model_len: the draft's limit; rows past it decode without speculation.
    draft_tensor_parallel_size: the draft's tensor-parallel size (dividing the target's; default
    the target's); the draft is replicated over the rest of the target's model axis.
    disable_by_batch_size: no speculation in a step with at least this many running requests.
    adaptive_k: each request drafts, every round, the k in 0..num_speculative_tokens that
    maximises its expected tokens per unit of cost (``k_table``), from its own acceptance so
    far and the round's live rows (one that drafts none still drafts one now and then,
    ``ADAPTIVE_PROBE``); ``num_speculative_tokens: "auto"`` is adaptive_k up to
    ``ADAPTIVE_MAX``. One compiled round serves every k (drafts past a row's k are masked), so
    nothing recompiles.
    draft_cost: the cost of one draft token in units of a target step (default: the drafter's
    parameters over the target's; 0 for ngram), which adaptive_k weighs.
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    prompt_lookup_table: str | None = None
    max_model_len: int | None = None
    disable_by_batch_size: int | None = None
    acceptance_method: str = "exact"
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3
    draft_tensor_parallel_size: int | None = None
    adaptive_k: bool = False
    draft_cost: float | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | "SpeculativeConfig") -> "SpeculativeConfig":
        if isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; known: {sorted(known)}")
        if "method" not in d and "model" in d:
            d = {**d, "method": "draft_model"}
        if "method" in d:                     # an unknown method is named before k is asked
            _check_method(d["method"])
        for field in ("method", "num_speculative_tokens"):
            if field not in d:
                raise ValueError(f"speculative_config.{field} is required")
        if d["num_speculative_tokens"] == "auto":
            d = {**d, "num_speculative_tokens": ADAPTIVE_MAX, "adaptive_k": True}
        return cls(**d)

    def __post_init__(self):
        f = lambda name: f"speculative_config.{name}"
        _check_method(self.method)
        if self.acceptance_method not in ACCEPTANCE:
            raise ValueError(f"speculative_config.acceptance_method = {self.acceptance_method!r}: "
                             f"must be one of {ACCEPTANCE}")
        C.integer(f("num_speculative_tokens"), self.num_speculative_tokens, 1,
                  MAX_SPECULATIVE_TOKENS)
        if self.method in ("draft_model", "eagle3") and not self.model:
            what = "a draft model folder" if self.method == "draft_model" else "an EAGLE-3 head folder"
            raise ValueError(f"speculative_config.model: {what} is required for {self.method}")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config.model: method 'ngram' drafts from the sequence "
                             "(and prompt_lookup_table), not from a model")
        if self.draft_tensor_parallel_size not in (None, 1) and self.method != "draft_model":
            raise ValueError(f"speculative_config.draft_tensor_parallel_size = "
                             f"{self.draft_tensor_parallel_size!r}: only method 'draft_model' shards "
                             f"its drafter; must be 1 or None for {self.method!r}")
        if self.model is not None and not isinstance(self.model, (str, os.PathLike, ModelConfig,
                                                                  HeadConfig)):
            raise C.InvalidType(f"speculative_config.model = {self.model!r}: must be a folder path "
                                "(sfjax.functional also takes a ModelConfig, or for eagle3 an "
                                "eagle.HeadConfig)")
        if self.method == "eagle3" and isinstance(self.model, ModelConfig):
            raise ValueError("speculative_config.model: eagle3 takes an EAGLE-3 head folder (or an "
                             "eagle.HeadConfig), not a ModelConfig")
        if self.method == "draft_model" and isinstance(self.model, HeadConfig):
            raise ValueError("speculative_config.model: an eagle.HeadConfig is for method 'eagle3'")
        C.integer(f("prompt_lookup_min"), self.prompt_lookup_min, 1)
        C.integer(f("prompt_lookup_max"), self.prompt_lookup_max, 1)
        if self.method == "ngram" and self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be "
                             f"<= prompt_lookup_max ({self.prompt_lookup_max})")
        if self.prompt_lookup_table is not None:
            if self.method != "ngram":
                raise ValueError(f"speculative_config.prompt_lookup_table is for method 'ngram', not "
                                 f"{self.method!r}")
            if not isinstance(self.prompt_lookup_table, (str, os.PathLike)):
                raise C.InvalidType(f"speculative_config.prompt_lookup_table = "
                                    f"{self.prompt_lookup_table!r}: must be a file path")
        C.integer(f("disable_by_batch_size"), self.disable_by_batch_size, 1, optional=True)
        C.integer(f("max_model_len"), self.max_model_len, 1, optional=True)
        C.integer(f("draft_tensor_parallel_size"), self.draft_tensor_parallel_size, 1, optional=True)
        C.real(f("posterior_threshold"), self.posterior_threshold, 0.0, 1.0)
        C.real(f("posterior_alpha"), self.posterior_alpha, 0.0, 1.0)
        C.boolean(f("adaptive_k"), self.adaptive_k)
        if self.draft_cost is not None:
            C.real(f("draft_cost"), self.draft_cost, 0.0, 100.0)

    def check_draft(self, target: ModelConfig, max_model_len: int, draft: ModelConfig | None) -> None:
        """The draft (its config, for ``draft_model``) against the target; raises ValueError
        naming the field."""
        if self.method == "draft_model":
            if draft is None:
                raise ValueError("speculative_config.model: the draft's ModelConfig (or folder) is "
                                 "needed")
            if draft.vocab_size != target.vocab_size:
                raise ValueError(f"speculative_config.model: the draft's vocabulary "
                                 f"({draft.vocab_size}) differs from the target's ({target.vocab_size})")
        if self.max_model_len is not None and self.max_model_len > max_model_len:
            raise ValueError(f"speculative_config.max_model_len ({self.max_model_len}) must be <= "
                             f"the target's max_model_len ({max_model_len})")

    def draft_limit(self, max_model_len: int, draft: ModelConfig | None) -> int:
        """A row drafts only while length + k stays within this (``max_model_len``, and the
        draft's ``ModelConfig.context``)."""
        limit = self.max_model_len or max_model_len
        return min(limit, draft.context[0]) if draft is not None else limit

    def speculates_at(self, num_running):
        """Whether a step with ``num_running`` requests (an int, or a traced count) speculates
        (``disable_by_batch_size``)."""
        n = self.disable_by_batch_size
        return True if n is None else num_running < n


    def cost(self, target: ModelConfig) -> float:
        """A draft token's cost in target steps: ``draft_cost``, else the drafter's parameters
        over the target's (a draft model's, an EAGLE head's), 0 for ngram."""
        if self.draft_cost is not None:
            return float(self.draft_cost)
        if isinstance(self.model, (ModelConfig, HeadConfig)):
            return self.model.num_params() / target.num_params()
        return 0.0

    def k_table(self, target: ModelConfig, slots: int = 1, *, row_tile: int = 8,
                small: tuple[int, ...] = (), tiled: bool = True, dp: int = 1) -> np.ndarray | None:
        """With ``adaptive_k``, each row's k for a round of b live rows (of ``slots``) at each
        acceptance estimate a = i / ADAPTIVE_LEVELS, when it may draft at most c (int16 [slots +
        1, ADAPTIVE_LEVELS + 1, num_speculative_tokens + 1], read [b, i, c]): the k in 0..c
        maximising its ``expected_tokens`` per cost: the round's when every live row verifies
        k + 1 rows over its cost at one row each (``round_cost``, by the rows of a data shard),
        plus k * ``cost``. A verify row costs little at batch 1 and as much as a slot's whole
        share where the rows fill tiles, so k falls with b, to 0 where no k pays. The cap c (its
        budget, the draft's context, the drafts an n-gram lookup found) is weighed, not clipped:
        a row that may draft 4 where 7 would fill a tile drafts 3 if a smaller tile pays more.
        None without adaptive_k."""
        if not self.adaptive_k:
            return None
        a = np.arange(ADAPTIVE_LEVELS + 1, dtype=np.float64) / ADAPTIVE_LEVELS
        k = np.arange(self.num_speculative_tokens + 1)
        tokens = expected_tokens(a, self.num_speculative_tokens)
        drafts = k * self.cost(target)
        value = np.zeros((slots + 1, ADAPTIVE_LEVELS + 1, k.size))
        for b in range(1, slots + 1):
            n = -(-b // dp)                       # the live rows of a data shard
            cost = lambda rows: round_cost(rows, n, row_tile, small, tiled)  # noqa: E731
            value[b] = tokens / (cost(n * (k + 1)) / cost(n) + drafts)
        value[0] = value[1]
        out = np.zeros(value.shape, np.int16)     # the best k of 0..c, c by c
        best = value[..., 0]
        for c in k[1:]:                           # ties: the fewer drafts
            out[..., c] = np.where(value[..., c] > best, c, out[..., c - 1])
            best = np.maximum(best, value[..., c])
        return out


def expected_tokens(a, k_max: int, xp=np):
    """The tokens a round of k drafts emits on average, for k = 0..k_max (the last axis, after
    ``a``'s): its accepted drafts and the target's token, each draft accepted with probability
    ``a`` after the ones before it were (Leviathan et al.'s model)."""
    terms = xp.asarray(a)[..., None] ** np.arange(1, k_max + 1, dtype=np.float32)
    return 1 + xp.concatenate([xp.zeros_like(terms[..., :1]), xp.cumsum(terms, axis=-1)], axis=-1)


def round_cost(rows, slots, row_tile: int, small: tuple[int, ...], tiled: bool, xp=np):
    """A round's cost in row tiles, for a model of its time: ``rows`` rows (those of ``slots``
    live slots; ints, or traced with ``xp`` jax.numpy) through the weights, and each slot's own
    work (``SLOT_COST``). On the row-tile path rows up to ``row_tile`` run in the smallest
    certified tile of ``small`` that holds them, a tile of t rows costing sqrt(t / row_tile) of
    a full one, and more rows in full tiles; with a kernel (``tiled`` False) every row is one
    launch, a row ``VERIFY_COST`` more. Fitted to the demo target on the CPU box
    (BENCHMARKS.md): batch-1 rounds of 1, 4 and 8 rows in 2-, 4- and 8-row tiles take
    1 : 1.23 : 1.55, batch-8 rounds of 8, 16 and 32 rows 1 : 1.30 : 1.81."""
    if not tiled:
        return slots * SLOT_COST + 1 + VERIFY_COST * (rows - 1)
    fit = (np.array(tile_holding(row_tile, tuple(small))) / row_tile) ** 0.5
    weights = xp.where(rows <= row_tile, xp.asarray(fit)[xp.minimum(rows, row_tile)],
                       -(-rows // row_tile))
    return slots * SLOT_COST + weights


@functools.lru_cache(maxsize=64)
def tile_holding(row_tile: int, small: tuple[int, ...]) -> tuple[int, ...]:
    """For r = 0..row_tile rows, the tile a call of r rows runs in: the smallest certified tile
    of ``small`` that holds them, else ``row_tile``."""
    return tuple(min((t for t in small if t >= r), default=row_tile) for r in range(row_tile + 1))


def acceptance_level(accepted, rejected, xp=np, copy=False):
    """A row's acceptance so far in integer steps of 1 / ADAPTIVE_LEVELS: a = accepted /
    (accepted + rejected), over its ``accepted`` drafts and the ``rejected`` rounds that
    rejected one (with ``ADAPTIVE_PRIOR``, or ``COPY_PRIOR`` where ``copy``: the counts are
    its copies', ``kind_counts``), the estimate of a draft's chance to be accepted after the
    drafts before it were, which ``SpeculativeConfig.k_table``'s model assumes. (Accepted over
    drafted would count the drafts after a rejected one as rejected: low at a large k, high at
    a small one.)"""
    a0, r0 = (xp.where(copy, c, a) for c, a in zip(COPY_PRIOR, ADAPTIVE_PRIOR))
    accepted = xp.asarray(accepted) + a0
    return xp.clip((ADAPTIVE_LEVELS * accepted) // (accepted + xp.asarray(rejected) + r0),
                   0, ADAPTIVE_LEVELS)


def kind_counts(accepted, rejected, copy_accepted, copy_rejected, copy, xp=np):
    """The (accepted drafts, rejecting rounds) of a row's drafts of this round's kind: its
    copies' where it drafts a copy (``copy``, bool: ``ngram``'s match in the row's own
    tokens), else its other drafts' (the table's, a draft model's). The two predict apart: on
    the demo target's code prompts at T = 0 a copy's drafts are taken in runs of 2.3-6.3 of 7
    on average, the table's in runs of 1.3-3.0 (BENCHMARKS.md), so one estimate over both gives
    a copy too few drafts and a guess too many."""
    return (xp.where(copy, copy_accepted, xp.asarray(accepted) - copy_accepted),
            xp.where(copy, copy_rejected, xp.asarray(rejected) - copy_rejected))


def adaptive_k(table, accepted, rejected, live, generated, cap, xp=np, copy=False):
    """Each row's k in a round of ``live`` live rows, at most its ``cap`` (``draft_cap``), read
    off ``SpeculativeConfig.k_table``'s ``table`` at its ``acceptance_level`` (its counts of
    this round's kind, ``kind_counts``, and ``copy``), in integer steps, so the engine's host
    and the device pick the same k; a row the table gives 0 drafts 1 when its ``generated``
    output tokens are a multiple of ``ADAPTIVE_PROBE`` (and it may draft)."""
    table, cap = xp.asarray(table), xp.clip(xp.asarray(cap), 0, table.shape[2] - 1)
    k = table[xp.clip(live, 0, table.shape[0] - 1), acceptance_level(accepted, rejected, xp, copy),
              cap].astype(np.int32)
    return xp.where((k == 0) & (cap > 0) & (xp.asarray(generated) % ADAPTIVE_PROBE == 0), 1, k)


def drafts_pay(k, level, live, k_max: int, draft_cost: float, row_tile: int,
               small: tuple[int, ...], tiled: bool, dp: int = 1, taken=0):
    """Whether a round's drafts pay, on the device (traced): its ``live`` rows' (bool [B])
    expected tokens, each at its final k (``k`` int32 [B]) and ``acceptance_level``, per the
    round's cost with the drafts (``round_cost`` of a data shard's rows, the ``taken`` rows of
    the host's prefill chunks among them, over its cost at one row each, and ``draft_cost`` a
    draft) above one token a row at the cost without. The table counts a verify row at a share
    of the tiles; this catches drafts that alone open a tile (a few rows drafting one each over
    a full tile of rows)."""
    import jax.numpy as jnp

    by_k = expected_tokens(level.astype(jnp.float32) / ADAPTIVE_LEVELS, k_max, jnp)
    tokens = jnp.take_along_axis(by_k, k[:, None], axis=1)[:, 0]
    n, drafts = jnp.sum(live.astype(jnp.int32)), jnp.sum(jnp.where(live, k, 0))
    def cost(rows):             # of a data shard's rows, the host's among them
        return round_cost(-(-(taken + rows) // dp), -(-n // dp), row_tile, small, tiled, jnp)
    ratio = cost(n + drafts) / cost(n) + draft_cost * drafts / jnp.maximum(n, 1)
    return jnp.sum(jnp.where(live, tokens, 0.0)) > ratio * n


def round_drafts(k, cap, level, live, taken, k_max: int, draft_cost: float, row_tile: int,
                 small: tuple[int, ...], tiled: bool, dp: int = 1, fill: bool = False):
    """A round's drafts, row by row (traced), from each live row's ``adaptive_k`` (``k``, int32
    [B]). With ``fill`` (drafts that add no draft step, on the row-tile path of one data shard:
    ``ngram``), the rows the round's last tile leaves empty first go to more drafts
    (``fill_tile``, up to each row's ``cap``). The drafts are then kept if they pay
    (``drafts_pay``, the fill's drafts counted), else dropped; with ``fill``, the empty rows of
    the tiles the round runs without drafts are still filled.

    Judged before the fill, rows whose k open a last tile by a row or two (eight live rows of
    k 2, 1, ..., 1: 17 rows, three 8-row tiles) did not pay, and every draft was dropped; the
    acceptance counts then never moved again, and the requests decoded without speculation
    to the end. Filled, those three tiles verify 16 drafts, and they pay."""
    import jax.numpy as jnp

    if not fill:
        return jnp.where(drafts_pay(k, level, live, k_max, draft_cost, row_tile, small, tiled,
                                    dp, taken), k, 0)
    filled = fill_tile(k, cap, level, live, taken, row_tile, small)
    none = fill_tile(jnp.zeros_like(k), cap, level, live, taken, row_tile, small)
    return jnp.where(drafts_pay(filled, level, live, k_max, draft_cost, row_tile, small, tiled,
                                dp, taken), filled, none)


def fill_tile(k, cap, level, live, taken, row_tile: int, small: tuple[int, ...]):
    """On the row-tile path, one data shard, drafts that cost no draft step (``ngram``): ``k``
    (int32 [B], traced) with the rows the round's last tile leaves empty given to more drafts,
    up to each row's ``cap``, the rows of highest acceptance ``level`` first. ``taken``: the
    round's rows before the live rows' (the host's prefill chunks). The tiles the round runs
    are the same; its rows verify more drafts in them."""
    import jax.numpy as jnp

    rows = taken + jnp.sum(live.astype(jnp.int32)) + jnp.sum(k)
    fit = jnp.asarray(tile_holding(row_tile, tuple(small)))
    held = jnp.where(rows <= row_tile, fit[jnp.minimum(rows, row_tile)],
                     -(-rows // row_tile) * row_tile)
    more = jnp.where(live, jnp.maximum(cap - k, 0), 0)
    best = jnp.argsort(-level, stable=True)
    ahead = jnp.cumsum(more[best]) - more[best]
    give = jnp.clip(held - rows - ahead, 0, more[best])
    return k + jnp.zeros_like(k).at[best].set(give)


def draft_cap(k_max: int, budget, length, limit, xp=np):
    """The most drafts adaptive k may give a row this round: ``k_max``, at most one less than
    the tokens it may still emit (``budget``), and length + k within the draft's ``limit``
    (host ints, or traced arrays with ``xp`` jax.numpy)."""
    return xp.clip(xp.minimum(xp.minimum(k_max, budget - 1), limit - length), 0, None)


def drafts_for(k_max, budget, length, limit, xp=np):
    """Drafts for a row this round: k_max (an int, or per row), at most one less than the tokens
    it may still emit (``budget``), none once length + k passes the draft's ``limit``. On host ints (``xp`` numpy)
    or traced arrays (``xp`` jax.numpy): one rule for the engine and ``sfjax.functional``."""
    k = xp.clip(xp.minimum(k_max, budget - 1), 0, None)
    return xp.where(length + k <= limit, k, 0)
