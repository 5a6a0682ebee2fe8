"""The OpenAI request bodies (pydantic), their mapping onto ``SamplingParams``, and the response
and error shapes (OpenAI's, with vLLM's extra fields where vLLM has them)."""

from __future__ import annotations

import json
import re
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from sfjax.checks import shown
from sfjax.sampling_params import SamplingParams

# JSON has no -inf; vLLM reports a masked token's logprob as this
MIN_LOGPROB = -9999.0


class APIError(Exception):
    """An error answered with OpenAI's body: {"error": {message, type, param, code}}."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class _Request(BaseModel):
    """A request body: an optional field sent as null takes its default (OpenAI's fields are
    nullable); a required one sent as null is refused as null."""

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data):
        if isinstance(data, dict):
            fields = cls.model_fields
            return {k: v for k, v in data.items()
                    if v is not None or k not in fields or fields[k].is_required()}
        return data


class StreamOptions(_Request):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False        # vLLM's: the usage so far on every chunk
    include_obfuscation: Literal[False] = False   # OpenAI's padding: not offered


# Fields OpenAI or vLLM define that change what comes back and sfjax does not offer, with the
# values that ask for nothing (a field these allow, or one no table names, is ignored):
# anything else is a 400 naming the field, not an answer that quietly ignores it.
_NOT_OFFERED = {
    "response_format": (None, {"type": "text"}),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []), "function_call": (None, "none", "auto"),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,), "structured_outputs": (None,),
    "use_beam_search": (None, False), "prompt_logprobs": (None,), "bad_words": (None, []),
    "logits_processors": (None, []), "truncate_prompt_tokens": (None,),
    "guided_decoding_backend": (None,), "echo": (None, False),     # chat's echo (completions': its own)
    "continue_final_message": (None, False), "chat_template": (None,), "reasoning_effort": (None,),
    "modalities": (None, ["text"]), "audio": (None,), "documents": (None, []),
    "spaces_between_special_tokens": (None, True), "length_penalty": (None, 1.0),
    "priority": (None, 0), "cache_salt": (None,), "mm_processor_kwargs": (None,),
    "prompt_embeds": (None,), "guided_whitespace_pattern": (None,), "vllm_xargs": (None,),
}


class _SamplingRequest(_Request):
    """Fields shared by completions and chat: OpenAI's, then vLLM's extras, then sfjax's;
    others are kept aside (``model_extra``) for ``_NOT_OFFERED``."""
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    user: str | None = None
    # vLLM's extras
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: StrictInt = 0
    ignore_eos: bool = False
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[StrictInt] | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False   # logprobs' tokens as "token_id:N"
    # sfjax's: speculation per request
    disable_spec_decode: bool = False
    spec_strategy: str | None = None
    spec_exactness: Literal["lossy", "distribution-exact", "path-exact"] | None = None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    logprobs: StrictInt | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: StrictInt | None = None
    add_special_tokens: bool = True             # vLLM's: the tokenizer's BOS before a text prompt


class ChatCompletionRequest(_SamplingRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    add_generation_prompt: bool = True          # vLLM's
    add_special_tokens: bool = False            # vLLM's: the template writes them
    chat_template_kwargs: dict[str, Any] | None = None    # vLLM's: more template variables
    tools: list | None = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None      # as the completion's (prompt) or chat's (messages)
    add_generation_prompt: bool = True          # with messages: as the chat request's
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[StrictInt]


# -- requests to SamplingParams -----------------------------------------------------------------

_FIELD = re.compile(r"^(?:SamplingParams\.)?([a-z_]+)")


def error_param(message: str, renames: dict[str, str]) -> str | None:
    """The request field an engine or SamplingParams message names (its first word)."""
    if "+ max_tokens" in message:            # prompt + max_tokens over max_model_len
        return renames.get("max_tokens", "max_tokens")
    m = _FIELD.match(message)
    if m is None:
        return None
    field = {"prompt_token_ids": "prompt"}.get(m.group(1), m.group(1))
    return renames.get(field, field)


def sampling_params(req: _SamplingRequest, defaults: dict[str, Any], *, max_tokens: int | None,
                    logprobs: int | None, renames: dict[str, str]) -> SamplingParams:
    """The request's SamplingParams, a field it leaves out taken from ``defaults`` (the model's
    generation_config.json, ``config.sampling_defaults``) as vLLM does, else vLLM's default; a
    refused value raises APIError(400) naming its field."""
    for field, value in (req.model_extra or {}).items():
        if field in _NOT_OFFERED and value not in _NOT_OFFERED[field]:
            raise APIError(f"{field} = {shown(value, json.dumps)} is not offered (sfjax allows "
                           f"{' or '.join(map(json.dumps, _NOT_OFFERED[field]))})", field)
    if req.stream_options is not None and not req.stream:      # as OpenAI and vLLM refuse it
        raise APIError("stream_options is only allowed with stream = true", "stream_options")
    try:
        bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
    except ValueError:
        raise APIError("logit_bias: keys must be token ids (integers as strings)", "logit_bias") from None
    given = {f: getattr(req, f) for f in ("temperature", "top_p", "top_k", "min_p",
                                          "repetition_penalty") if getattr(req, f) is not None}
    try:
        return SamplingParams(
            **{**defaults, **given, "max_tokens": max_tokens},
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            logit_bias=bias, allowed_token_ids=req.allowed_token_ids, seed=req.seed,
            min_tokens=req.min_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output, ignore_eos=req.ignore_eos,
            logprobs=logprobs, skip_special_tokens=req.skip_special_tokens,
            n=req.n, disable_spec_decode=req.disable_spec_decode, spec_strategy=req.spec_strategy,
            spec_exactness=req.spec_exactness)
    except (ValueError, TypeError) as e:
        raise APIError(str(e), error_param(str(e), renames)) from None


def max_tokens_for(given: int | None, base: int | None, defaults: dict[str, Any],
                   room: int | None) -> int | None:
    """A request's max_tokens as vLLM's server takes it: the request's (``given``), at most the
    model's max_new_tokens (generation_config.json); without one, the least of ``base`` (16
    for completions), that max_new_tokens and the ``room`` the prompt leaves in max_model_len
    (None: the rest of the context, or a prompt with no room, which the engine refuses)."""
    cap = defaults.get("max_tokens")
    if given is not None:
        return given if cap is None else min(given, cap)
    if room is not None and room < 1:
        return None
    return min((x for x in (base, cap, room) if x is not None), default=None)


def completion_params(req: CompletionRequest, defaults: dict[str, Any],
                      room: int | None) -> SamplingParams:
    if req.echo:
        raise APIError("echo = true is not offered (sfjax allows false or null)", "echo")
    if req.suffix is not None:
        raise APIError(f"suffix = {shown(req.suffix, json.dumps)} is not offered (sfjax allows "
                       "null)", "suffix")
    if req.best_of is not None and req.best_of != req.n:     # best_of == n: n's choices
        raise APIError(f"best_of = {req.best_of}: must be n ({req.n}) or null (sfjax returns "
                       "every sequence it samples)", "best_of")
    return sampling_params(req, defaults, max_tokens=max_tokens_for(req.max_tokens, 16, defaults,
                                                                    room),
                           logprobs=req.logprobs, renames={})


def chat_params(req: ChatCompletionRequest, defaults: dict[str, Any],
                room: int | None) -> SamplingParams:
    if req.tools:
        raise APIError("tools are not offered", "tools")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs needs logprobs = true", "top_logprobs")
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return sampling_params(req, defaults, max_tokens=max_tokens_for(limit, None, defaults, room),
                           logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                           renames={"logprobs": "top_logprobs", **chat_renames(req)})


def chat_renames(req: ChatCompletionRequest) -> dict[str, str]:
    """The chat request's names of the fields an engine message names (``error_param``)."""
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    return {"max_tokens": field, "prompt": "messages"}


def completion_prompts(req: CompletionRequest) -> list[str | dict]:
    """The request's prompts, each a str or token ids: one, or a batch (a list of them, as
    OpenAI's and vLLM's completions take, each prompt's choices after the last one's)."""
    p = req.prompt
    batch = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
    return [{"prompt_token_ids": q} if isinstance(q, list) else q for q in batch]


# -- outputs to responses ------------------------------------------------------------------------

def _lp(x: float) -> float:
    return max(x, MIN_LOGPROB)


def _token(token_id: int, lp, as_ids: bool) -> str:
    """A logprob entry's token as the response names it: its text, or (vLLM's
    ``return_tokens_as_token_ids``) "token_id:N"."""
    return f"token_id:{token_id}" if as_ids else lp.decoded_token or ""


def completion_logprobs(entries: list[dict], offset: int, as_ids: bool = False) -> dict:
    """OpenAI's completions logprobs for output positions whose entries are given, the first at
    ``offset`` characters into the text; ``as_ids``: tokens named "token_id:N"."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in entries:
        chosen = entry[token_id]
        out["tokens"].append(_token(token_id, chosen, as_ids))
        out["token_logprobs"].append(_lp(chosen.logprob))
        out["top_logprobs"].append({_token(t, lp, as_ids): _lp(lp.logprob)
                                    for t, lp in entry.items()})
        out["text_offset"].append(offset)
        offset += len(chosen.decoded_token or "")
    return out


def chat_logprobs(entries: list[dict], top: int, as_ids: bool = False) -> dict:
    """OpenAI's chat logprobs: {"content": [{token, logprob, bytes, top_logprobs}]};
    ``as_ids``: tokens named "token_id:N"."""
    def one(token_id, lp):
        token = _token(token_id, lp, as_ids)
        return {"token": token, "logprob": _lp(lp.logprob), "bytes": list(token.encode())}
    content = []
    for token_id, entry in entries:
        tops = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None
                       and lp.rank <= top), key=lambda item: item[1].rank)
        content.append({**one(token_id, entry[token_id]),
                        "top_logprobs": [one(t, lp) for t, lp in tops]})
    return {"content": content}


def usage(outs: list, n_out: int | None = None, n: int = 1) -> dict:
    """OpenAI's usage of a request's sequences' outputs ``outs``, ``n`` a prompt (each prompt
    counted once, the output tokens of them all): ``n_out`` output tokens if given, else
    theirs."""
    n_in = sum(len(o.prompt_token_ids) for o in outs[::n])
    if n_out is None:
        n_out = sum(len(o.outputs[0].token_ids) for o in outs if o.outputs)
    return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}


def sfjax_info(out) -> dict:
    """The request's exactness certificate and its speculation counters."""
    cert = out.certificate
    certificate = None if cert is None else {
        "strategy": cert.strategy, "exactness": cert.exactness, "modes": dict(cert.modes)}
    spec = out.metrics.spec_decode if out.metrics is not None else None
    return {"certificate": certificate, "spec_decode": spec}


def envelope(kind: str, request_id: str, model: str, created: int | None = None) -> dict:
    return {"id": request_id, "object": kind, "created": created or int(time.time()), "model": model}
