"""The OpenAI-compatible FastAPI app over an ``AsyncLLM``: /v1/completions, /v1/chat/completions
(streamed as server-sent events or not), /v1/models, /health, /metrics, /tokenize, /detokenize.

Every refused request gets OpenAI's error body naming the field; admission happens before the
response starts, so a streamed request that the engine refuses still gets its 400 (or a 503 when
the queue is full) rather than an error inside a 200 stream. A request that the engine ends with
finish_reason "error" gets a 500 ("internal_error", the message naming the failure) or, once its
stream has started, that error body as its last event before ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from sfjax import checks as C
from sfjax.async_llm import AsyncLLM, EngineClosed, EngineOverloaded, EngineStepFailed
from sfjax.serve import protocol as P
from sfjax.serve.protocol import APIError
from sfjax.tokenizer import encode


class Delta:
    """What one stream has sent of its request (its outputs' text only grows: the engine holds
    back what a stop string may still cut, ``OutputProcessor.text``)."""

    def __init__(self):
        self.text_sent = 0
        self.tokens_sent = 0
        self.pieces_sent = 0      # characters of the sent tokens' pieces (logprobs' text_offset)

    def take(self, out) -> tuple[str, list[int], list, int]:
        """(new text, new token ids, their (id, logprob entry) pairs, the first one's text
        offset: the sent tokens' pieces' length, as the whole response counts it, which the
        text held back for stop strings does not change)."""
        c = out.outputs[0]
        text = c.text[self.text_sent:]
        self.text_sent = len(c.text)
        ids = c.token_ids[self.tokens_sent:]
        entries = list(zip(ids, c.logprobs[self.tokens_sent:])) if c.logprobs else []
        self.tokens_sent = len(c.token_ids)
        offset = self.pieces_sent
        self.pieces_sent += sum(len(entry[i].decoded_token or "") for i, entry in entries)
        return text, ids, entries, offset


def _error_of(out) -> APIError | None:
    """The APIError (500, "internal_error") of an output that the engine ended with
    finish_reason "error", naming the failure (``RequestOutput.error``); None for any other."""
    reason = out.outputs[0].finish_reason if out.outputs else None
    if reason != "error" and out.error is None:
        return None
    return APIError(f"the request failed in the engine: {out.error or 'no detail given'}",
                    status=500, type="internal_error")


def _engine_error(e: Exception) -> APIError:
    """The APIError of a request the engine stopped serving: 503 once it has stopped (or is
    shutting down), 500 for a step that failed as a whole."""
    if isinstance(e, EngineClosed):
        return APIError(str(e), status=503, type="service_unavailable")
    return APIError(str(e), status=500, type="internal_error")


async def _disconnected(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(raw: Request, coro):
    """Runs ``coro``; a client that leaves first, or the handler's cancellation, cancels it
    (its request is aborted)."""
    task, watch = asyncio.ensure_future(coro), asyncio.ensure_future(_disconnected(raw))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled():
        raise APIError("the client disconnected", status=499, type="client_closed")
    return task.result()


class Server:
    """The routes' state: the engine, the served name, the chat template, the metrics."""

    def __init__(self, engine: AsyncLLM, model_name: str, model_path: str, metrics=None):
        self.engine, self.model_name, self.model_path = engine, model_name, model_path
        self.chat_template = engine.llm.chat_template       # the tokenizer folder's
        self.defaults = engine.llm.generation_defaults      # the model's, as vLLM takes them
        self.metrics = metrics
        self.tokenizer = engine.get_tokenizer()

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(f"model {name!r} is not served here; this server serves "
                           f"{self.model_name!r}", "model", status=404, code="model_not_found")

    async def start(self, prompts: list[tuple], request_id: str, renames: dict) -> list[tuple]:
        """Admits the sequences of the request's ``prompts`` [(prompt, params)] (vLLM's ids:
        "<id>-k" the k-th of a batch, "i_<id>" its i-th of ``n`` (parallel sampling: child i
        seeded seed + i, ``SamplingParams.children``)), all together: [(first output or None,
        its generator)], prompt by prompt. A request of one sequence waits for its first output
        (an engine that stops before it gives one is a 503); one of several starts once all are
        admitted, so that one waiting for a slot (n past max_num_seqs) holds up none of the
        others. A refusal of any aborts them all."""
        batch = len(prompts) > 1
        seqs = []                       # (prompt, params, id, label for its errors)
        for k, (prompt, params) in enumerate(prompts):
            rid = f"{request_id}-{k}" if batch else request_id
            label = f"prompt[{k}]: " if batch else ""
            seqs += [(prompt, child, rid if params.n == 1 else f"{i}_{rid}", label)
                     for i, child in enumerate(params.children())]
        if len(seqs) == 1:
            return [await self._start_one(*seqs[0], renames, first=True)]
        held = self.engine.engine.config.max_num_seqs + (self.engine.max_waiting or 0)
        if self.engine.max_waiting is not None and len(seqs) > held:
            field, n = ("n", "") if len(prompts) == 1 else ("prompt", f"{len(prompts)} prompts x ")
            raise APIError(f"{n}n = {prompts[0][1].n}: {len(seqs)} sequences, more than this "
                           f"server holds at once ({held}: max_num_seqs and --max-waiting)", field)
        tasks = [asyncio.ensure_future(self._start_one(*seq, renames, first=False))
                 for seq in seqs]                           # admitted together, as vLLM does
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            for got in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(got, tuple):
                    await got[1].aclose()
            raise

    async def _start_one(self, prompt, params, request_id: str, label: str, renames: dict,
                         first: bool):
        """Admits one sequence (``label``: its prompt's place in a batch, for its errors) and,
        if ``first``, waits for its first output."""
        try:
            gen = await self.engine.admit(prompt, params, request_id)
            out = await gen.__anext__() if first else None
        except (ValueError, TypeError) as e:
            raise APIError(label + str(e), P.error_param(str(e), renames)) from None
        except EngineOverloaded as e:
            raise APIError(f"the server is overloaded: {e}; retry later", status=503,
                           type="service_unavailable") from None
        except (EngineClosed, EngineStepFailed) as e:
            raise _engine_error(e) from None
        return out, gen

    def _room(self, ids) -> int | None:
        """The tokens max_model_len leaves after a prompt of ``ids`` (None: not counted)."""
        return None if ids is None else self.engine.engine.config.max_model_len - len(ids)

    # -- completions ---------------------------------------------------------------------------

    async def completions(self, req: P.CompletionRequest, raw: Request):
        self.check_model(req.model)
        prompts, batch = [], P.completion_prompts(req)
        for prompt in batch:
            if isinstance(prompt, str):      # counted here for max_tokens; the engine checks it
                try:
                    prompt = {"prompt": prompt, "prompt_token_ids": await self._encode(
                        prompt, req.add_special_tokens)}
                except Exception:
                    pass
            ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
            try:
                prompts.append((prompt, P.completion_params(req, self.defaults, self._room(ids))))
            except APIError as e:                  # which prompt of a batch
                if len(batch) > 1:
                    e.message = f"prompt[{len(prompts)}]: {e.message}"
                raise
        params = prompts[0][1]          # the prompts' params differ in max_tokens alone
        rid = f"cmpl-{uuid.uuid4().hex}"
        started = await _unless_disconnected(raw, self.start(prompts, rid, {}))
        if req.stream:
            return _sse(self._completion_chunks(req, params, rid, started))
        return await self._whole(req, raw, rid, "text_completion", started, lambda c: {
            "index": 0, "text": c.text, "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
            "logprobs": (P.completion_logprobs(list(zip(c.token_ids, c.logprobs)), 0,
                                               req.return_tokens_as_token_ids)
                         if params.logprobs is not None else None)})

    async def _whole(self, req, raw: Request, rid: str, kind: str, started, choice):
        """A non-streamed response: each sequence's last output as ``choice(completion)`` (index
        i the i-th), with the token ids if asked, usage and sfjax's fields (the first choice's;
        for n > 1 each choice carries its own too)."""
        try:
            outs = await _unless_disconnected(raw, _lasts(started))
        except (EngineClosed, EngineStepFailed) as e:
            raise _engine_error(e) from None
        for out in outs:
            if (err := _error_of(out)) is not None:
                raise err
        choices = []
        for i, out in enumerate(outs):
            c = out.outputs[0]
            choices.append({**choice(c), "index": i})
            if req.return_token_ids:
                choices[-1].update(prompt_token_ids=out.prompt_token_ids, token_ids=c.token_ids)
            if len(outs) > 1:
                choices[-1]["sfjax"] = P.sfjax_info(out)
        body = {**P.envelope(kind, rid, self.model_name), "choices": choices,
                "usage": P.usage(outs, n=req.n), "sfjax": P.sfjax_info(outs[0])}
        return JSONResponse(body, headers=_certificate_header(outs[0]))

    def _completion_chunks(self, req, params, rid, started) -> AsyncIterator[dict]:
        def choice(out, text, ids, entries, offset, reason) -> dict:
            c = out.outputs[0]
            choice = {"index": 0, "text": text, "finish_reason": reason,
                      "stop_reason": c.stop_reason if reason else None,
                      "logprobs": (P.completion_logprobs(entries, offset,
                                                         req.return_tokens_as_token_ids)
                                   if params.logprobs is not None else None)}
            if req.return_token_ids:
                choice["token_ids"] = ids
                if offset == 0 and len(ids) == len(c.token_ids):
                    choice["prompt_token_ids"] = out.prompt_token_ids
            return choice
        return _chunks(req, params, started, _head("text_completion", rid, self.model_name),
                       choice)

    # -- chat ----------------------------------------------------------------------------------

    async def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s ids, tokenized off the event loop (streams go on meanwhile)."""
        return await asyncio.to_thread(encode, self.tokenizer, text, add_special_tokens)

    async def _render(self, req, add_special_tokens: bool) -> dict:
        """The request's conversation as an engine prompt (``ChatTemplate.prompt``), rendered
        and tokenized off the event loop."""
        try:
            return await asyncio.to_thread(
                self.chat_template.prompt, self.tokenizer, req.messages,
                req.add_generation_prompt, req.chat_template_kwargs, add_special_tokens)
        except ValueError as e:
            field = str(e).split(":")[0]
            raise APIError(str(e), field if field == "chat_template_kwargs" else "messages"
                           ) from None

    async def chat(self, req: P.ChatCompletionRequest, raw: Request):
        self.check_model(req.model)
        prompt = await self._render(req, req.add_special_tokens)
        params = P.chat_params(req, self.defaults, self._room(prompt["prompt_token_ids"]))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        started = await _unless_disconnected(
            raw, self.start([(prompt, params)], rid, P.chat_renames(req)))
        top = req.top_logprobs or 0
        if req.stream:
            return _sse(self._chat_chunks(req, params, rid, started, top))
        return await self._whole(req, raw, rid, "chat.completion", started, lambda c: {
            "index": 0, "message": {"role": "assistant", "content": c.text},
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
            "logprobs": (P.chat_logprobs(list(zip(c.token_ids, c.logprobs)), top,
                                         req.return_tokens_as_token_ids)
                         if req.logprobs else None)})

    def _chat_chunks(self, req, params, rid, started, top) -> AsyncIterator[dict]:
        def choice(out, text, ids, entries, offset, reason) -> dict:
            c = out.outputs[0]
            choice = {"index": 0, "delta": {"content": text} if text or reason is None else {},
                      "finish_reason": reason, "stop_reason": c.stop_reason if reason else None,
                      "logprobs": (P.chat_logprobs(entries, top, req.return_tokens_as_token_ids)
                                   if req.logprobs else None)}
            if req.return_token_ids:
                choice["token_ids"] = ids
            return choice
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}
        return _chunks(req, params, started,
                       _head("chat.completion.chunk", rid, self.model_name), choice, opening=role)

    # -- the rest ------------------------------------------------------------------------------

    def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "sfjax", "root": self.model_path,
            "max_model_len": self.engine.engine.config.max_model_len,
            "vocab_size": self.engine.engine.cfg.vocab_size}]}

    async def tokenize(self, req: P.TokenizeRequest) -> dict:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of prompt and messages", "prompt")
        if req.messages is not None:
            ids = (await self._render(req, bool(req.add_special_tokens)))["prompt_token_ids"]
        else:
            try:
                prompt = C.text("prompt", req.prompt)
            except ValueError as e:
                raise APIError(str(e), "prompt") from None
            ids = await self._encode(prompt, req.add_special_tokens is not False)
        return {"count": len(ids), "max_model_len": self.engine.engine.config.max_model_len,
                "tokens": ids}

    async def detokenize(self, req: P.DetokenizeRequest) -> dict:
        self.check_model(req.model)
        vocab = self.engine.engine.cfg.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"tokens: {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
        text = await asyncio.to_thread(self.tokenizer.decode, req.tokens, skip_special_tokens=False)
        return {"prompt": text}


def _head(kind: str, rid: str, model: str):
    """A stream's chunk envelope (a fresh dict a call), all created at the same time."""
    created = int(time.time())
    return lambda: P.envelope(kind, rid, model, created)


async def _chunks(req, params, started, head, choice, opening: dict | None = None
                  ) -> AsyncIterator[dict]:
    """A streamed response's chunks: for each sequence i (choice index i), ``opening`` (a first
    choice, if given), then one per output with new text, tokens or the end (``choice(out,
    text, ids, logprob entries, text offset, finish reason or None)``), the sequences' chunks
    as they come; then with include_usage a last chunk with the usage of all of them (with
    continuous_usage_stats, also each chunk's choice's usage so far, as vLLM gives it). An
    output the engine failed, or an engine that stopped serving it (``_engine_error``), ends
    the stream with OpenAI's error body as its event (before [DONE]), the other sequences
    aborted."""
    options = req.stream_options
    continuous = bool(options and options.continuous_usage_stats)
    include_usage = continuous or bool(options and options.include_usage)
    lasts = [first for first, _ in started]          # each sequence's latest output (or None)
    counts = [0] * len(started)                      # its tokens sent so far

    def chunk(i: int, choice: dict, **extra) -> dict:   # vLLM's: the choice's own usage
        usage = P.usage(lasts[i:i + 1], counts[i]) if continuous else None
        return {**head(), "choices": [{**choice, "index": i}],
                **({"usage": usage} if include_usage else {}), **extra}

    async def one(i: int, first, gen) -> AsyncIterator[dict]:
        opened, delta = opening is None, Delta()
        async with contextlib.aclosing(_chain(first, gen)) as outs:
            try:
                async for out in outs:
                    err = _error_of(out)
                    text, ids, entries, offset = delta.take(out)
                    if err is None or text or ids:  # a failed output: first what it made
                        lasts[i] = out
                        if not opened:              # with the sequence's first output
                            opened = True
                            yield chunk(i, opening)
                        counts[i] += len(ids)
                        reason = out.outputs[0].finish_reason if out.finished and not err else None
                        if text or ids or reason is not None:
                            yield chunk(i, choice(out, text, ids, entries, offset, reason), **(
                                {"sfjax": P.sfjax_info(out)} if reason is not None else {}))
                    if err is not None:
                        yield err.body()
                        return
            except (EngineClosed, EngineStepFailed) as e:
                yield _engine_error(e).body()

    async with contextlib.aclosing(_merged([one(i, f, g) for i, (f, g) in enumerate(started)])
                                   ) as chunks:
        async for c in chunks:
            yield c
            if "error" in c:
                return
    if include_usage:
        yield {**head(), "choices": [], "usage": P.usage(lasts, n=params.n)}


async def _merged(streams: list) -> AsyncIterator:
    """The items of several async generators as they come (each one's in its order); closing
    it closes them all."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for item in only:
                yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream):
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    await queue.put(item)
        except Exception as e:           # raised where the items are read
            await queue.put(e)
        finally:
            await queue.put(done)
    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        await _cancel(tasks)


async def _lasts(started) -> list:
    """Each sequence's last output; leaving early (cancelled, an error) closes them all."""
    tasks = [asyncio.ensure_future(_last(first, gen)) for first, gen in started]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        await _cancel(tasks)


async def _cancel(tasks) -> None:
    """Cancels ``tasks`` and waits until each has ended (its error, if any, dropped)."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _certificate_header(out) -> dict:
    cert = out.certificate
    return {} if cert is None else {"x-sfjax-certificate": f"{cert.strategy}; {cert.exactness}"}


async def _chain(first, gen) -> AsyncIterator:
    """The first output (if it came already), then the rest; closing it closes (and so aborts)
    the request."""
    try:
        if first is not None:
            yield first
            if first.finished:
                return
        async for out in gen:
            yield out
    finally:
        await gen.aclose()


async def _last(first, gen):
    out = first
    async for out in _chain(first, gen):
        pass
    return out


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def events():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await chunks.aclose()
    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"cache-control": "no-cache"})


async def _parse(raw: Request, model):
    """The body as ``model``: malformed JSON or a field at fault is a 400 naming it (whatever
    the content type says, as OpenAI's clients and curl -d both send JSON)."""
    try:
        data = json.loads(await raw.body())
    except RecursionError:
        raise APIError("malformed JSON: nested too deeply") from None
    except ValueError as e:
        raise APIError(f"malformed JSON: {e}") from None
    try:
        return model.model_validate(data)
    except RecursionError:
        raise APIError("the body is nested too deeply") from None
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(x) for x in err.get("loc", ())]
        if loc[:1] == ["prompt"] and model is P.CompletionRequest and err["type"] != "missing":
            raise APIError("prompt: must be a string, a list of strings, a list of token ids "
                           "or a list of token-id lists", "prompt") from None    # not one form's
        path = ".".join(loc) or "body"
        raise APIError(f"{path}: {err.get('msg')}", loc[0] if loc else None) from None


def build_app(engine: AsyncLLM, model_name: str, model_path: str, metrics=None,
              shutdown_timeout: float = 10.0) -> FastAPI:
    """The app; its lifespan's end shuts the engine down (live requests finish or abort)."""
    server = Server(engine, model_name, model_path, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        yield
        await engine.shutdown(shutdown_timeout)

    app = FastAPI(title="sfjax", lifespan=lifespan)
    app.state.server = server
    app.add_exception_handler(APIError, lambda _, e: JSONResponse(
        e.body(), status_code=e.status, headers={"retry-after": "1"} if e.status == 503 else None))

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await server.completions(await _parse(raw, P.CompletionRequest), raw)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request):
        return await server.chat(await _parse(raw, P.ChatCompletionRequest), raw)

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.get("/health")
    async def health():
        return Response(status_code=200 if engine.is_running else 503)

    @app.get("/metrics")
    async def metrics_route():
        if metrics is None:
            return Response(status_code=404)
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.post("/tokenize")
    async def tokenize(raw: Request):
        # rendered off the event loop (streams go on meanwhile): FastAPI's encoder, walking a
        # long prompt's ids in Python on the loop, took five times as long as json.dumps does
        body = await server.tokenize(await _parse(raw, P.TokenizeRequest))
        text = await asyncio.to_thread(json.dumps, body, separators=(",", ":"))
        return Response(text, media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(raw: Request):
        return await server.detokenize(await _parse(raw, P.DetokenizeRequest))

    return app
