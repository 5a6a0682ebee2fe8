"""``SamplingParams`` with vLLM's names and defaults, validated at construction."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SamplingParams:
    """How to generate for one request (vLLM's field names).

    temperature: 0 is greedy; > 0 samples by Gumbel-max with a counter-based key per position.
    seed: makes the request's draws depend on this seed only (not on the engine seed, the batch,
        or preemption). Without it the key comes from the engine seed and the arrival number.
    max_tokens: new tokens at most (vLLM's default is 16).
    min_tokens: no EOS or stop token ends the output before this many tokens.
    ignore_eos: keep going past EOS.
    stop_token_ids: extra token ids that end the output (kept in token_ids, like EOS).
    skip_special_tokens: drop special tokens from the text.
    """

    n: int = 1
    temperature: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True

    def __post_init__(self):
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.n != 1:
            raise ValueError(f"n must be 1 (n > 1 is not offered yet), got {self.n}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")

    def validate_for(self, vocab_size: int) -> None:
        """Checks what depends on the model; raises ValueError naming the field."""
        for t in self.stop_token_ids:
            if not 0 <= t < vocab_size:
                raise ValueError(f"stop_token_ids: {t} is outside the vocabulary [0, {vocab_size})")
