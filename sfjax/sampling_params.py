"""``SamplingParams`` with vLLM's names, defaults and semantics, validated at construction."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from sfjax import checks as C

MAX_LOGPROBS = 20
MAX_N = 1024            # completions per prompt (vLLM's parallel sampling; LLM.generate)
F32_MAX = 3.4028234663852886e38    # the largest float32: the device's sampling table holds them


@dataclasses.dataclass
class SamplingParams:
    """How to generate for one request (vLLM's field names and meanings).

    n: completions per prompt (``LLM.generate``; vLLM's parallel sampling): n requests with
        this prompt and these params, seeded with seed + i where a seed is given, as in vLLM;
        one ``RequestOutput`` with their n completions (``index`` i); the server's n choices
        alike. The engine and ``sfjax.functional`` take one sequence per request.
    temperature: 0 is greedy; > 0 samples by Gumbel-max with a counter-based key per position.
    top_k: keep the k most likely tokens; 0 or -1 turns it off, and so does any k at least the
        vocabulary's size (every token is kept).
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p; 1 is off.
    min_p: keep tokens with probability >= min_p * the top probability; 0 is off.
    presence_penalty, frequency_penalty: in [-2, 2], subtracted per output token seen (once, or
        per occurrence); repetition_penalty: > 0, divides positive (multiplies negative) logits of
        tokens seen in the prompt or the output; 1 is off.
        Each processor is vLLM's; they apply in vLLM's order: logit_bias, allowed_token_ids and
        min_tokens, then the penalties; greedy is the argmax of the result; then temperature,
        min_p, top_k, top_p and the Gumbel-max draw.
    logit_bias: {token id: bias}, added to the logits, each bias (finite) clamped to [-100, 100];
        token ids may be given as ints or decimal strings (JSON's keys).
    allowed_token_ids: only these tokens can be drawn.
    seed: the request's draws depend on this seed only (not on the engine seed, the batch,
        speculation or preemption). Without it the key comes from the engine seed and the
        request's arrival number.
    max_tokens: new tokens at most (vLLM's default is 16). min_tokens: no EOS, stop token or stop
        string can end the output before this many tokens (stop tokens cannot be drawn); a stop
        string counts only where a token past them completes it, as in vLLM.
    stop: strings that end the output (excluded from the text unless
        include_stop_str_in_output). stop_token_ids: tokens that end it (kept in token_ids;
        in the text, as EOS, only with include_stop_str_in_output).
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
        self.validate()

    def validate(self) -> None:
        """Checks every field's type and range (TypeError / ValueError naming the field) and puts
        it in canonical form (``stop`` a list, ``top_k`` -1 as 0, ...). Runs at construction, and
        again on the engine's own copy when a request is added, so a params object changed
        after construction is checked too."""
        f = lambda name: f"SamplingParams.{name}"
        self.n = C.integer(f("n"), self.n, 1, MAX_N)
        self.temperature = C.real(f("temperature"), self.temperature, 0.0, F32_MAX,
                                  allowed=f"a number in [0, {F32_MAX:.4g}] (0 is greedy)")
        self.top_p = C.real(f("top_p"), self.top_p, 0.0, 1.0, lo_open=True)
        self.top_k = C.integer(f("top_k"), self.top_k, -1,
                               allowed="an int >= 1, or 0 / -1 for off (k >= the vocabulary is off)")
        self.top_k = max(self.top_k, 0)
        self.min_p = C.real(f("min_p"), self.min_p, 0.0, 1.0)
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, C.real(f(name), getattr(self, name), -2.0, 2.0))
        self.repetition_penalty = C.real(f("repetition_penalty"), self.repetition_penalty, 0.0,
                                         F32_MAX, lo_open=True)
        self.logit_bias = self._bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = C.int_list(f("allowed_token_ids"), self.allowed_token_ids, 0)
            _check(len(self.allowed_token_ids) > 0, "allowed_token_ids", self.allowed_token_ids,
                   "a non-empty list")
        self.seed = C.integer(f("seed"), self.seed, 0, 2**64 - 1, allowed="an int in [0, 2**64)",
                              optional=True)
        self.max_tokens = C.integer(f("max_tokens"), self.max_tokens, 1, optional=True)
        self.min_tokens = C.integer(f("min_tokens"), self.min_tokens, 0)
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is None:
            stop = []
        if not isinstance(stop, (list, tuple)):
            raise C.InvalidType(f"SamplingParams.stop = {self.stop!r}: must be a str or a list of str")
        self.stop = [C.text(f(f"stop[{i}]"), x) for i, x in enumerate(stop)]
        _check(all(self.stop), "stop", self.stop, "non-empty strings")
        stop_ids = [] if self.stop_token_ids is None else self.stop_token_ids
        self.stop_token_ids = C.int_list(f("stop_token_ids"), stop_ids, 0)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "disable_spec_decode"):
            setattr(self, name, C.boolean(f(name), getattr(self, name)))
        for name in ("logprobs", "prompt_logprobs"):
            setattr(self, name, C.integer(f(name), getattr(self, name), 0, MAX_LOGPROBS,
                                          optional=True))
        self.spec_strategy = C.text(f("spec_strategy"), self.spec_strategy, optional=True)
        _check(self.spec_exactness in (None, "lossy", "distribution-exact", "path-exact"),
               "spec_exactness", self.spec_exactness, "None, lossy, distribution-exact or path-exact")

    @staticmethod
    def _bias(bias) -> dict[int, float]:
        """{token id: bias}; each bias finite, clamped to [-100, 100] (vLLM's range)."""
        if bias is None:
            return {}
        if not isinstance(bias, dict):
            raise C.InvalidType(f"SamplingParams.logit_bias = {bias!r}: must be a dict of token id -> bias")
        out = {}
        for k, v in bias.items():
            t = C.integer("SamplingParams.logit_bias key", int(k) if isinstance(k, str) and
                          k.lstrip("-").isdigit() else k, 0)
            out[t] = min(100.0, max(-100.0, C.real(f"SamplingParams.logit_bias[{t}]", v)))
        return out

    def children(self) -> list["SamplingParams"]:
        """The ``n`` single-sequence params ``n`` asks for (vLLM's: child i seeded seed + i)."""
        if self.n == 1:
            return [self]
        return [dataclasses.replace(self, n=1, seed=None if self.seed is None else
                                    (self.seed + i) % 2**64) for i in range(self.n)]

    def checked(self) -> "SamplingParams":
        """A validated copy (what the engine keeps for a request: later changes to this object
        do not reach it)."""
        return dataclasses.replace(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate_for(self, vocab_size: int, eos_token_ids: Sequence[int] = ()) -> None:
        """Checks what depends on the model; raises ValueError naming the field. A top_k of at
        least the vocabulary keeps every token: it becomes 0 (off)."""
        if self.top_k >= vocab_size:
            self.top_k = 0
        ids = [("stop_token_ids", t) for t in self.stop_token_ids]
        ids += [("logit_bias", t) for t in self.logit_bias]
        ids += [("allowed_token_ids", t) for t in self.allowed_token_ids or []]
        for field, t in ids:
            _check(0 <= t < vocab_size, field, t, f"token ids in [0, {vocab_size})")
        self.check_draws(eos_token_ids)

    def check_draws(self, eos_token_ids: Sequence[int]) -> None:
        """Some token can be drawn at every position: while ``min_tokens`` holds the stop ids
        (``stop_token_ids``, and ``eos_token_ids`` unless ``ignore_eos``) back, not every allowed
        token may be one (every logit would be masked, and the draw would be no allowed token)."""
        if not (self.min_tokens and self.allowed_token_ids):
            return
        stops = set(self.stop_token_ids) | (set() if self.ignore_eos else
                                            {int(t) for t in eos_token_ids})
        if set(self.allowed_token_ids) <= stops:
            raise ValueError(f"SamplingParams.min_tokens = {self.min_tokens} is out of range: every "
                             f"allowed_token_ids entry is a stop token, so none could be drawn "
                             f"before min_tokens; must be 0 here")


def _check(ok: bool, field: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{field} = {value!r} is out of range: must be {allowed}")
