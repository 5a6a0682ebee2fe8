"""Request outputs with vLLM's names."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Logprob:
    """A token's logprob (of the raw model logits), its 1-based rank, and its text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None   # per output position
    finish_reason: str | None = None       # "stop" | "length" | "abort"
    stop_reason: int | str | None = None   # the stop token id or string (None for EOS/length)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    spec_decode: dict | None = None       # this request's drafts / draft tokens / accepted tokens


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None   # [None, then per token]
    certificate: object | None = None   # sfjax.spec.Certificate of the strategy that served it
    new_token_ids: list[int] = dataclasses.field(default_factory=list)  # this step's tokens
