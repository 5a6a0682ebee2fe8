"""``speculative_config`` with vLLM's names, validated once."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from sfjax import checks as C
from sfjax.config import ModelConfig

METHODS = ("draft_model", "ngram")
ACCEPTANCE = ("exact", "rejection_sampler", "typical_acceptance_sampler")
MAX_SPECULATIVE_TOKENS = 128


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """method: "draft_model" (a smaller Llama with its own paged cache on the same block tables)
    or "ngram" (prompt lookup over the sequence's own tokens, on the device).
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
        for field in ("method", "num_speculative_tokens"):
            if field not in d:
                raise ValueError(f"speculative_config.{field} is required")
        return cls(**d)

    def __post_init__(self):
        f = lambda name: f"speculative_config.{name}"
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method = {self.method!r}: must be one of {METHODS}")
        if self.acceptance_method not in ACCEPTANCE:
            raise ValueError(f"speculative_config.acceptance_method = {self.acceptance_method!r}: "
                             f"must be one of {ACCEPTANCE}")
        C.integer(f("num_speculative_tokens"), self.num_speculative_tokens, 1,
                  MAX_SPECULATIVE_TOKENS)
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.model: a draft model folder is required for draft_model")
        if self.model is not None and not isinstance(self.model, (str, os.PathLike, ModelConfig)):
            raise C.InvalidType(f"speculative_config.model = {self.model!r}: must be a folder path "
                                "(sfjax.functional also takes a ModelConfig)")
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
        draft's max_position_embeddings)."""
        limit = self.max_model_len or max_model_len
        return min(limit, draft.max_position_embeddings) if draft is not None else limit

    def speculates_at(self, num_running):
        """Whether a step with ``num_running`` requests (an int, or a traced count) speculates
        (``disable_by_batch_size``)."""
        n = self.disable_by_batch_size
        return True if n is None else num_running < n


def drafts_for(k_max: int, budget, length, limit, xp=np):
    """Drafts for a row this round: k_max, at most one less than the tokens it may still emit
    (``budget``), none once length + k passes the draft's ``limit``. On host ints (``xp`` numpy)
    or traced arrays (``xp`` jax.numpy): one rule for the engine and ``sfjax.functional``."""
    k = xp.clip(xp.minimum(k_max, budget - 1), 0, None)
    return xp.where(length + k <= limit, k, 0)
