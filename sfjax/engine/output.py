"""Tokens into requests and requests into ``RequestOutput``s: detokenization, logprob entries
and the stop rules (EOS, stop ids, stop strings, max_tokens, max_model_len)."""

from __future__ import annotations

import time
from typing import Callable

from sfjax.engine.scheduler import Request, Status
from sfjax.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


class OutputProcessor:
    """Appends a request's tokens and builds its outputs; ``release(req)`` (the engine's) frees a
    finished request's slot and blocks."""

    def __init__(self, tokenizer, *, eos_token_ids: frozenset[int], max_model_len: int,
                 stats: dict, release: Callable[[Request], None]):
        self.tokenizer, self.eos_token_ids, self.max_model_len = tokenizer, eos_token_ids, max_model_len
        self.stats, self.release = stats, release

    def append(self, req: Request, token: int, logprob: dict[int, Logprob] | None) -> bool:
        """Appends one token (detokenized, its logprob entry kept) and applies the stop rules;
        returns whether the request finished. Callers build one ``output`` per step."""
        now = time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = now
            self.stats["prompt_tokens"] += len(req.prompt_token_ids)
        piece = req.detok.add(token)        # first: if it fails, the token is not the output's
        req.output_token_ids.append(token)
        if logprob is not None:
            req.logprobs.append(logprob)
            req.cumulative_logprob += logprob[token].logprob
        self.stats["generation_tokens"] += 1
        n, p = len(req.output_token_ids), req.params
        stop = self.stop_string(req, piece) if n > p.min_tokens else None    # vLLM's rule
        if n >= p.min_tokens and not p.ignore_eos and token in self.eos_token_ids:
            self.finish(req, "stop", None, on_token=True)
        elif n >= p.min_tokens and token in p.stop_token_ids:
            self.finish(req, "stop", token, on_token=True)
        elif stop is not None:
            self.finish(req, "stop", stop[0], text=stop[1])
        elif n >= req.max_tokens or req.num_tokens >= self.max_model_len:
            self.finish(req, "length", None)
        return req.status is Status.FINISHED

    @staticmethod
    def stop_string(req: Request, piece: str) -> tuple[str, str] | None:
        """(stop string, truncated text) if the new text completes a stop string: each is
        looked for where it would end in the new text (vLLM's window; a shorter one that ended
        before it, inside min_tokens, does not count)."""
        if not req.params.stop or not piece:
            return None
        text = req.detok.text
        start = len(text) - len(piece) + 1
        hits = [(text.find(st, max(0, start - len(st))), st) for st in req.params.stop]
        hits = [(i, st) for i, st in hits if i >= 0]
        if not hits:
            return None
        i, st = min(hits)
        return st, text[:i + len(st)] if req.params.include_stop_str_in_output else text[:i]

    def finish(self, req: Request, reason: str, stop_reason, text: str | None = None,
               on_token: bool = False) -> None:
        """Ends ``req``: its text is ``text`` (a stop string's cut), else its tokens' text; a
        request that ``on_token`` (EOS or a stop token id) ended leaves that token out of the text
        (it stays in token_ids) unless include_stop_str_in_output, as vLLM does."""
        req.status = Status.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
        req.finished_time = time.monotonic()
        if text is None:
            req.detok.finish(drop_last=on_token and not req.params.include_stop_str_in_output)
        else:
            req.detok.text = text
        self.release(req)

    def logprob_entry(self, req: Request, drawn, i: int, pos: int, token: int) -> dict[int, Logprob] | None:
        """{token: Logprob} for the reported token and the top N, or None if not asked for."""
        n = req.params.prompt_logprobs if pos >= 0 else req.params.logprobs
        if n is None:
            return None
        token = req.prompt_token_ids[pos + 1] if pos >= 0 else token
        entry = {token: Logprob(float(drawn.logprob[i]), int(drawn.rank[i]), self.piece(token))}
        for rank, (t, v) in enumerate(zip(drawn.top_ids[i, :n], drawn.top_logprobs[i, :n]), 1):
            entry.setdefault(int(t), Logprob(float(v), rank, self.piece(int(t))))
        return entry

    def piece(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    @staticmethod
    def text(req: Request) -> str:
        """The request's text as an output gives it: while a stop string may still cut it, the
        last (longest stop - 1) characters held back (vLLM's rule), so what a stream has given
        is always the start of the final text."""
        p, text = req.params, req.detok.text
        if req.status is Status.FINISHED or not p.stop or p.include_stop_str_in_output:
            return text
        return text[:max(0, len(text) - (max(map(len, p.stop)) - 1))]

    def output(self, req: Request, new_token_ids=()) -> RequestOutput:
        wants = req.params.logprobs is not None
        completion = CompletionOutput(
            index=0, text=self.text(req), token_ids=list(req.output_token_ids),
            cumulative_logprob=req.cumulative_logprob if wants else None,
            logprobs=list(req.logprobs) if wants else None,
            finish_reason=req.finish_reason, stop_reason=req.stop_reason)
        metrics = RequestMetrics(arrival_time=req.arrival_time,
                                 first_scheduled_time=req.first_scheduled_time,
                                 first_token_time=req.first_token_time,
                                 finished_time=req.finished_time, num_preemptions=req.num_preemptions,
                                 spec_decode=req.spec_metrics.as_dict() if req.spec_metrics else None)
        return RequestOutput(request_id=req.request_id, prompt=req.prompt,
                             prompt_token_ids=list(req.prompt_token_ids), outputs=[completion],
                             prompt_logprobs=([None] + req.prompt_logprobs
                                              if req.params.prompt_logprobs is not None else None),
                             finished=req.status is Status.FINISHED, metrics=metrics,
                             new_token_ids=list(new_token_ids), certificate=req.certificate)
