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
    finish_reason: str | None = None       # "stop" | "length" | "abort" | "error"
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
    error: str | None = None   # why the request was ended with finish_reason "error"


def merge_outputs(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """One output per request, in the order each first appears: its latest (outputs are
    cumulative), carrying every listed output's ``new_token_ids`` in order."""
    merged: dict[str, RequestOutput] = {}
    for out in outputs:
        prev = merged.get(out.request_id)
        if prev is not None:
            out = dataclasses.replace(out, new_token_ids=prev.new_token_ids + out.new_token_ids,
                                      error=out.error or prev.error)
        merged[out.request_id] = out
    return list(merged.values())
