"""The asyncio engine (vLLM's ``AsyncLLM`` shape): ``async for out in engine.generate(prompt,
params, request_id)`` yields ``RequestOutput``s as tokens arrive.

One background thread owns the ``Engine``: it admits and aborts requests between steps and steps
while any request is live, sleeping on a condition when none is. The device step therefore never
runs on the event loop's thread, and every engine call happens on one thread (the engine is not
thread-safe). Callers on the event loop talk to it through a command list; its outputs come back
through ``loop.call_soon_threadsafe``, one call per loop per step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from typing import Any, AsyncGenerator, AsyncIterator, Callable

from sfjax.outputs import RequestOutput, merge_outputs
from sfjax.sampling_params import SamplingParams

logger = logging.getLogger("sfjax")


class EngineOverloaded(RuntimeError):
    """More requests wait than ``max_waiting`` allows (a server answers 503)."""


class EngineClosed(RuntimeError):
    """The engine is shutting down or has stopped, and takes no new request."""


class EngineStepFailed(RuntimeError):
    """A step failed as a whole (not one request's fault): every live request ends with it
    (those still being admitted go on; one that had ended gets its final output)."""


class _Stream:
    """One request's outputs on its event loop. The engine may deliver faster than the consumer
    reads; pending outputs are cumulative, so ``merge_outputs`` makes them one (the latest, with
    the new tokens of all of them)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.pending: list[RequestOutput] = []
        self.event = asyncio.Event()
        self.error: BaseException | None = None
        self.last: RequestOutput | None = None     # the latest output put
        # its consumer left before the finished output (``_abandon``), a failed step ended it
        # (``_step``), or shutdown did (``end``): the engine's outputs for it are dropped, the id
        # freed by the final one
        self.abandoned = False

    def put(self, out: RequestOutput) -> None:
        if self.last is not None and self.last.finished:
            return                  # ended by ``end``: the engine's late outputs are dropped
        self.last = out
        self.pending.append(out)
        self.event.set()

    def end(self, error: BaseException) -> None:
        """Ends the stream without the engine (at shutdown, while a step outlasts the grace):
        the last output it was given becomes the final one, with finish_reason "abort" (the
        tokens and text it had given out: text held back for a stop string stays out, and the
        stat loggers never see it), or it fails with ``error`` if it was given none. A stream
        already abandoned (its consumer left, or a failed step's error is on its way) or ended
        is left as it is."""
        if self.abandoned or self.error is not None or (self.last is not None
                                                        and self.last.finished):
            return
        self.abandoned = True
        if self.last is None:
            self.fail(error)
        else:
            last = self.last
            metrics = last.metrics and dataclasses.replace(last.metrics,
                                                           finished_time=time.monotonic())
            self.put(dataclasses.replace(last, finished=True, new_token_ids=[], metrics=metrics,
                                         outputs=[dataclasses.replace(c, finish_reason="abort",
                                                                      stop_reason=None)
                                                  for c in last.outputs]))

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.event.set()

    async def get(self) -> RequestOutput:
        await self.event.wait()
        if self.error is not None and not self.pending:
            raise self.error
        outs, self.pending = self.pending, []
        if self.error is None:          # else the next get raises it at once
            self.event.clear()
        return merge_outputs(outs)[0]       # all of one request


class AsyncLLM:
    """``LLM``'s engine behind an event-loop API; many concurrent ``generate`` callers share its
    continuous batching.

    ``max_waiting`` bounds the requests admitted beyond ``max_num_seqs`` (None: no bound); one
    more raises ``EngineOverloaded`` at once instead of queueing. ``stat_loggers`` are called on
    the engine thread after each step with (outputs, ``snapshot()``), where they may read the
    outputs' timings (``sfjax.serve.metrics``).
    """

    def __init__(self, model: str | None = None, *, max_waiting: int | None = None,
                 stat_loggers: list[Callable] | None = None, llm=None, **llm_kwargs):
        if llm is None:
            from sfjax.llm import LLM
            llm = LLM(model, **llm_kwargs)
        self.llm = llm
        self.engine = llm.engine
        self.max_waiting = max_waiting
        self.stat_loggers = list(stat_loggers or [])
        self._streams: dict[str, _Stream] = {}
        self._commands: list[Callable[[], None]] = []
        self._cv = threading.Condition()
        self._stopping = False
        self._accepting = True
        self._shutting_down: asyncio.Future | None = None
        self._close_deadline: float | None = None      # the first close's (``close``)
        self._left_running = False
        self._admitting: set[concurrent.futures.Future] = set()    # adds queued, not yet run
        self._ids = itertools.count()
        self._snapshot = self._take_snapshot()
        self._thread = threading.Thread(target=self._run, name="sfjax-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_llm(cls, llm, **kwargs) -> "AsyncLLM":
        return cls(llm=llm, **kwargs)

    def get_tokenizer(self):
        return self.llm.get_tokenizer()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    @property
    def num_live_requests(self) -> int:
        return len(self._streams)

    def snapshot(self) -> dict:
        """The engine's counters as of its last step (read without touching the engine)."""
        return self._snapshot

    # -- the caller's side (event loop) -------------------------------------------------------

    async def generate(self, prompt: Any, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Admits the request (ValueError / TypeError naming the field if it is refused) and
        yields its RequestOutputs (cumulative; ``new_token_ids`` since the last one yielded)
        until the finished one. Leaving early (cancelled, closed) aborts it."""
        outputs = await self.admit(prompt, sampling_params, request_id)
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                yield out

    async def admit(self, prompt: Any, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> AsyncGenerator[RequestOutput, None]:
        """``generate`` in two parts: returns once the request is admitted (or raises as
        ``generate`` does), with the generator of its outputs. Closing that generator before
        its finished output (or dropping it: asyncio closes it) aborts the request; a server
        answers a refusal before it starts a response, then streams what comes."""
        outputs = self._outputs(prompt, sampling_params, request_id)
        await outputs.__anext__()               # None once admitted; a refusal raises here
        return outputs

    async def _outputs(self, prompt, sampling_params, request_id):
        if not self._accepting:
            raise EngineClosed("the engine is shutting down")
        waiting = len(self._streams) - self.engine.config.max_num_seqs
        if self.max_waiting is not None and waiting >= self.max_waiting:
            raise EngineOverloaded(f"{waiting} requests are waiting (max_waiting is {self.max_waiting})")
        if request_id is None:       # never one a caller chose for a live request
            request_id = next(i for i in map("async-{}".format, self._ids) if i not in self._streams)
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already live")
        stream = self._streams[request_id] = _Stream(asyncio.get_running_loop())
        admitted: concurrent.futures.Future = concurrent.futures.Future()
        finished = False
        try:
            self._submit(lambda: self._add(request_id, prompt, sampling_params, admitted),
                         admitted)
            await asyncio.wrap_future(admitted)
            yield None
            while not finished:
                out = await stream.get()
                finished = out.finished
                yield out
        finally:
            refused = admitted.done() and not admitted.cancelled() and admitted.exception()
            if finished or refused:     # refused: the engine never held the id
                self._streams.pop(request_id, None)
            else:   # the id stays taken until the engine has let go of it (``_abandon``)
                stream.abandoned = True
                try:
                    self._submit(lambda: self._abandon(request_id, stream))
                except EngineClosed:                          # a stopped engine holds nothing
                    self._streams.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        """Aborts a live request: its consumer gets a last output with finish_reason "abort"."""
        self._submit(lambda: self._abort(request_id))

    async def shutdown(self, timeout: float = 10.0, grace: float = 2.0) -> None:
        """Takes no new request, lets the live ones finish for up to ``timeout`` seconds, aborts
        the rest, gives the engine up to ``grace`` seconds more to report the aborts (it takes
        them after the step it is in), and stops the engine thread. A request it has not
        reported by then (the step outlasts the grace: a compile) ends here: its consumer gets
        the last output it was given with finish_reason "abort", or EngineClosed if it was given
        none. A call while one runs waits for that one."""
        if self._shutting_down is None:
            self._shutting_down = asyncio.ensure_future(self._shutdown(timeout, grace))
        await asyncio.shield(self._shutting_down)

    async def _shutdown(self, timeout: float, grace: float) -> None:
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for rid in list(self._streams):
            self._submit(lambda rid=rid: self._abort(rid))
        while self._streams and time.monotonic() < deadline + grace:   # consumers see the aborts
            await asyncio.sleep(0.02)
        if self._streams:          # the engine is still in a step (a compile): they end here
            why = "the engine shut down before the request started"
            self._fail_admissions(why)
            for stream in list(self._streams.values()):
                self._call(stream, stream.end, EngineClosed(why))
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def close(self, timeout: float = 30.0) -> None:
        """Stops the engine thread (blocking); live requests fail with EngineClosed, and the
        engine drops every request it holds (this loop owns the engine while it runs). Waits up
        to ``timeout`` seconds for the step it is in, counted from the first close: a later
        close (the server's, after its drain's) does not wait that long again. A thread still
        in its step then (a compile) is logged and left to stop when the step ends."""
        self._accepting = False
        with self._cv:
            self._stopping = True
            self._cv.notify()
            if self._close_deadline is None:
                self._close_deadline = time.monotonic() + timeout
            deadline = self._close_deadline
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive() and not self._left_running:
            self._left_running = True
            logger.warning("sfjax engine: the thread is still in a step %g s after close "
                           "(a compile?); it stops when the step ends", timeout)

    def _submit(self, command: Callable[[], None],
                admitted: concurrent.futures.Future | None = None) -> None:
        """Queues ``command`` for the engine thread (``admitted``: the future an add sets, which
        fails with EngineClosed if the thread stops first); EngineClosed once it has stopped."""
        with self._cv:
            if self._stopping:
                raise EngineClosed("the engine has stopped")
            self._commands.append(command)
            if admitted is not None:
                self._admitting.add(admitted)
            self._cv.notify()

    # -- the engine thread --------------------------------------------------------------------

    def _add(self, request_id: str, prompt, params, admitted: concurrent.futures.Future) -> None:
        with self._cv:          # whoever takes it from ``_admitting`` sets it
            if admitted not in self._admitting:     # failed by a shutdown (``_fail_admissions``)
                return
            self._admitting.discard(admitted)
        if not admitted.set_running_or_notify_cancel():
            return           # its caller left while the add was queued: nothing to admit
        try:
            cap = None
            if params is None:       # the model's defaults (``LLM.default_request``)
                params, cap = self.llm.default_request()
            self.engine.add_request(request_id, prompt, params, cap)
        except Exception as e:   # ValueError / TypeError naming the field go back to the caller
            admitted.set_exception(e)
        else:
            admitted.set_result(None)

    def _abort(self, request_id: str) -> None:
        # The engine reports every abort of a request it holds (its next step returns the final
        # output, and has_unfinished_requests() stays True until then), so nothing is made up
        # here. An abort never overtakes its add: generate() queues the add before it can be
        # cancelled or aborted, and commands run in order. An id the engine no longer holds
        # (refused at admission, or already finished and reported) is ignored by the engine.
        self.engine.abort(request_id)

    def _abandon(self, request_id: str, stream: _Stream) -> None:
        """Its consumer left: abort the request; its stream stays registered until the engine's
        final output for it has come (``_deliver`` drops it then), so a new request reusing the
        id can't receive this one's last output. If the engine no longer holds the id (refused,
        cancelled before admission, or finished), the stream goes now."""
        self.engine.abort(request_id)
        if not self.engine.holds(request_id) and self._streams.get(request_id) is stream:
            del self._streams[request_id]

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._commands or self._stopping
                               or self.engine.has_unfinished_requests()):
                        self._cv.wait()
                    commands, self._commands = self._commands, []
                    if self._stopping:
                        break
                for command in commands:
                    command()
                if self.engine.has_unfinished_requests():
                    self._step()
                else:                        # the commands alone changed what is held
                    self._snapshot = self._take_snapshot()
        except BaseException as e:      # a bug in the loop itself: fail every caller, loudly
            logger.exception("sfjax engine loop died")
            self._fail_all(e)
            raise
        finally:
            self._accepting = False
            with self._cv:
                self._stopping = True
            self._fail_admissions("the engine has stopped")
            self._fail_all(EngineClosed("the engine has stopped"))
            self._streams.clear()           # nothing holds their ids any more
            try:                # nor runs their requests on in the LLM's later calls
                self.engine.drop_all()
            except Exception:
                logger.exception("sfjax engine: dropping the requests left failed")

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception as e:   # not one request's fault: every live request ends with it
            logger.exception("sfjax engine step failed")
            error = EngineStepFailed(f"engine step failed: {e}")
            for rid, stream in list(self._streams.items()):
                if rid in self.engine.requests:     # live: not those whose add is still queued,
                    self.engine.abort(rid)          # nor an ended one's final output, held
                    stream.abandoned = True     # its consumer gets the error, not the abort's
                    self._call(stream, stream.fail, error)
            outs = []
        self._snapshot = self._take_snapshot()
        self._deliver(outs)
        for log in self.stat_loggers:
            try:
                log(outs, self._snapshot)
            except Exception:
                logger.exception("stat logger failed")

    def _deliver(self, outs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is not None and stream.abandoned:     # no one reads it: the id is free
                if out.finished:        # (an ended stream's caller may have freed it already)
                    self._streams.pop(out.request_id, None)
            elif stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_dispatch, items)
            except RuntimeError:        # the caller's loop has closed
                pass

    def _fail_admissions(self, why: str) -> None:
        """Fails the queued adds with EngineClosed(``why``): their commands will not run, or
        will find them gone."""
        with self._cv:
            waiting, self._admitting = self._admitting, set()
        for admitted in waiting:
            if admitted.set_running_or_notify_cancel():       # else its caller left
                admitted.set_exception(EngineClosed(why))

    def _fail_all(self, error: BaseException) -> None:
        for stream in list(self._streams.values()):
            self._call(stream, stream.fail, error)

    @staticmethod
    def _call(stream: _Stream, method: Callable, *args) -> None:
        """Runs ``method(*args)`` on the stream's loop (its caller's, perhaps not this one)."""
        try:
            stream.loop.call_soon_threadsafe(method, *args)
        except RuntimeError:        # the caller's loop has closed
            pass

    def _take_snapshot(self) -> dict:
        eng = self.engine
        pools = eng.scheduler.pools
        spec = eng.spec.metrics.as_dict() if eng.spec is not None else None
        return {"num_running": len(eng.scheduler.running), "num_waiting": len(eng.scheduler.waiting),
                "kv_blocks_free": sum(p.num_free for p in pools),
                "kv_blocks_total": sum(p.num_blocks - 1 for p in pools),
                "num_preemptions": eng.scheduler.num_preemptions, "stats": dict(eng.stats),
                "spec_decode": spec, "time": time.monotonic()}


def _dispatch(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.put(out)
