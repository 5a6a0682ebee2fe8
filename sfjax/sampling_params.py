"""``SamplingParams`` with vLLM's names, defaults and semantics, validated at construction."""

from __future__ import annotations

import dataclasses

MAX_LOGPROBS = 20


@dataclasses.dataclass
class SamplingParams:
    """How to generate for one request (vLLM's field names and meanings).

    temperature: 0 is greedy; > 0 samples by Gumbel-max with a counter-based key per position.
    top_k: keep the k most likely tokens; 0 or -1 turns it off.
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p; 1 is off.
    min_p: keep tokens with probability >= min_p * the top probability; 0 is off.
    presence_penalty, frequency_penalty: in [-2, 2], subtracted per output token seen (once, or
        per occurrence); repetition_penalty: > 0, divides positive (multiplies negative) logits of
        tokens seen in the prompt or the output; 1 is off.
        Each processor is vLLM's; they apply in vLLM's order: logit_bias, allowed_token_ids and
        min_tokens, then the penalties; greedy is the argmax of the result; then temperature,
        min_p, top_k, top_p and the Gumbel-max draw.
    logit_bias: {token id: bias}, added to the logits, each bias clamped to [-100, 100].
    allowed_token_ids: only these tokens can be drawn.
    seed: the request's draws depend on this seed only (not on the engine seed, the batch,
        speculation or preemption). Without it the key comes from the engine seed and the
        request's arrival number.
    max_tokens: new tokens at most (vLLM's default is 16). min_tokens: no EOS, stop token or stop
        string can end the output before this many tokens (stop tokens cannot be drawn).
    stop: strings that end the output (excluded from the text unless
        include_stop_str_in_output). stop_token_ids: tokens that end it (kept in token_ids).
    ignore_eos: keep going past EOS.
    logprobs: the sampled token's logprob and the top N (N <= 20) at each output position;
        prompt_logprobs: likewise for each prompt token after the first. Both are of the raw
        model logits (log_softmax before any processing), as in vLLM.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    disable_spec_decode: bool = False
    spec_strategy: str | None = None
    spec_exactness: str | None = None

    def __post_init__(self):
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]
        if self.top_k == -1:
            self.top_k = 0
        _check(self.n == 1, "n", self.n, "1 (n > 1 is not offered)")
        _check(self.temperature >= 0.0, "temperature", self.temperature, ">= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "(0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", self.top_k,
               "an int >= 1, or 0 / -1 for off")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "[0, 1]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty, "[-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", self.frequency_penalty, "[-2, 2]")
        _check(0.0 < self.repetition_penalty < float("inf"), "repetition_penalty",
               self.repetition_penalty, "> 0 (and finite)")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", self.max_tokens, ">= 1")
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, ">= 0")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        _check(self.seed is None or 0 <= self.seed < 2**64, "seed", self.seed, "[0, 2**64)")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            _check(v is None or 0 <= v <= MAX_LOGPROBS, name, v, f"[0, {MAX_LOGPROBS}]")
        _check(all(self.stop), "stop", self.stop, "non-empty strings")
        _check(self.spec_exactness in (None, "lossy", "distribution-exact", "path-exact"),
               "spec_exactness", self.spec_exactness, "None, lossy, distribution-exact or path-exact")
        _check(self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
               "allowed_token_ids", self.allowed_token_ids, "a non-empty list")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def validate_for(self, vocab_size: int) -> None:
        """Checks what depends on the model; raises ValueError naming the field."""
        ids = [("stop_token_ids", t) for t in self.stop_token_ids]
        ids += [("logit_bias", t) for t in self.logit_bias]
        ids += [("allowed_token_ids", t) for t in self.allowed_token_ids or []]
        for field, t in ids:
            _check(0 <= t < vocab_size, field, t, f"token ids in [0, {vocab_size})")


def _check(ok: bool, field: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{field} = {value!r} is out of range: must be {allowed}")
