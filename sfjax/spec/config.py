"""``speculative_config`` with vLLM's names, validated once."""

from __future__ import annotations

import dataclasses
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
ADAPTIVE_PRIOR = (2, 4)   # (accepted, drafted) counted before a request's own: an estimate of 1/2
VERIFY_COST = 0.02        # one more verify row, in units of a target step (rows share tiles)


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
    adaptive_k: each request drafts, every round, the k in 1..num_speculative_tokens that
    maximises its expected tokens per unit of cost (``k_table``), from its own acceptance so
    far; ``num_speculative_tokens: "auto"`` is adaptive_k up to ``ADAPTIVE_MAX``. One compiled
    round serves every k (drafts past a row's k are masked), so nothing recompiles.
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

    def k_table(self, target: ModelConfig) -> np.ndarray | None:
        """With ``adaptive_k``, the k for each acceptance estimate a = i / ADAPTIVE_LEVELS
        (int32 [ADAPTIVE_LEVELS + 1]): the k in 1..num_speculative_tokens maximising expected
        tokens (1 - a**(k+1)) / (1 - a) per cost 1 + k * (cost + VERIFY_COST) (each draft
        accepted with probability a, as Leviathan et al. model it). None without adaptive_k."""
        if not self.adaptive_k:
            return None
        a = np.arange(ADAPTIVE_LEVELS + 1, dtype=np.float64)[:, None] / ADAPTIVE_LEVELS
        k = np.arange(1, self.num_speculative_tokens + 1, dtype=np.float64)[None, :]
        tokens = np.where(a < 1, (1 - a ** (k + 1)) / np.maximum(1 - a, 1e-12), k + 1)
        value = tokens / (1 + k * (self.cost(target) + VERIFY_COST))
        return (1 + np.argmax(value, axis=1)).astype(np.int32)


def adaptive_k(table, drafted, accepted, xp=np):
    """Each row's k from its acceptance so far (``accepted`` of ``drafted`` draft tokens, with
    ``ADAPTIVE_PRIOR``), read off ``SpeculativeConfig.k_table``'s ``table`` in integer steps, so
    the engine's host and the device pick the same k."""
    a0, d0 = ADAPTIVE_PRIOR
    level = (ADAPTIVE_LEVELS * (xp.asarray(accepted) + a0)) // (xp.asarray(drafted) + d0)
    return xp.asarray(table)[xp.clip(level, 0, ADAPTIVE_LEVELS)]


def drafts_for(k_max, budget, length, limit, xp=np):
    """Drafts for a row this round: k_max (an int, or per row), at most one less than the tokens
    it may still emit (``budget``), none once length + k passes the draft's ``limit``. On host ints (``xp`` numpy)
    or traced arrays (``xp`` jax.numpy): one rule for the engine and ``sfjax.functional``."""
    k = xp.clip(xp.minimum(k_max, budget - 1), 0, None)
    return xp.where(length + k <= limit, k, 0)
