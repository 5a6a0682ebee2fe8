"""``AsyncLLM`` in process on the tiny model: concurrent callers equal ``LLM.generate``,
cancelling a consumer or ``abort`` frees the request's blocks, the loop sleeps when idle, a full
queue refuses at once, shutdown ends every live request; and the app's 400 / 503 answers that
need an engine of their own (a model with no chat template, an overloaded queue), and its 500 /
error event for a request that fails in the engine while others carry on."""

import json

import asyncio
import gc
import threading
import time

import httpx
import pytest

from sfjax import LLM, AsyncLLM, SamplingParams
from sfjax.async_llm import EngineOverloaded

GEOMETRY = dict(max_model_len=64, max_num_seqs=4, small_row_tiles=False)
PROMPTS = ["def fibonacci(n):", "The quick brown fox", "class Cache:", "import jax"]


@pytest.fixture(scope="module")
def llm(tiny_folder):
    return LLM(tiny_folder, **GEOMETRY)


def _params(i: int, n: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.8 if i % 2 else 0.0, seed=i, max_tokens=n, ignore_eos=True)


async def _collect(engine, prompt, params, rid):
    ids, last = [], None
    async for out in engine.generate(prompt, params, rid):
        ids += out.new_token_ids
        last = out
    assert ids == last.outputs[0].token_ids, "a token lost or repeated in the stream"
    return last


async def _until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


class _Gate:
    """A stat logger that, once armed, holds the engine thread after each step that gives
    ``request_id`` tokens (their outputs delivered) until released; ``step`` lets one more step
    run. ``holds`` counts the holds."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.armed, self.held, self.holds = False, threading.Event(), 0
        self._go = threading.Semaphore(0)

    def arm(self):
        self.armed = True

    def step(self):
        self._go.release()

    def release(self):
        self.armed = False
        self._go.release()

    def __call__(self, outputs, snapshot):
        if self.armed and any(o.request_id == self.request_id for o in outputs):
            self.holds += 1
            self.held.set()
            self._go.acquire(timeout=10)
            self.held.clear()


def _idle(engine) -> bool:
    s = engine.snapshot()
    return (engine.num_live_requests == 0 and s["num_running"] == 0 and s["num_waiting"] == 0
            and s["kv_blocks_free"] == s["kv_blocks_total"])


def test_async_llm(llm):
    """One engine through every case in turn (compiled once)."""
    jobs = [(PROMPTS[i % 4] * (1 + i % 3), _params(i)) for i in range(10)]
    ref = llm.generate([p for p, _ in jobs], [p for _, p in jobs], use_tqdm=False)
    gate = _Gate("q3")
    engine = AsyncLLM.from_llm(llm, max_waiting=2, stat_loggers=[gate])

    async def main():
        outs = await asyncio.wait_for(asyncio.gather(
            *(_collect(engine, p, sp, f"r{i}") for i, (p, sp) in enumerate(jobs[:6]))), 60)
        for out, want in zip(outs, ref):
            assert out.outputs[0].token_ids == want.outputs[0].token_ids
        # 4 running + 2 waiting admitted; the engine is held after the first step, so the
        # next is refused at once and the abort lands before q3 can finish
        gate.arm()
        gens = [engine.generate(p, _params(i, 40), f"q{i}") for i, (p, _) in enumerate(jobs[:6])]
        waiting = [asyncio.ensure_future(g.__anext__()) for g in gens[4:]]
        firsts = await asyncio.wait_for(asyncio.gather(*(g.__anext__() for g in gens[:4])), 60)
        assert [f.request_id for f in firsts] == ["q0", "q1", "q2", "q3"]
        assert await asyncio.to_thread(gate.held.wait, 10)
        with pytest.raises(EngineOverloaded):
            await engine.generate(jobs[6][0], jobs[6][1], "over").__anext__()
        await engine.abort("q3")                 # an abort reaches its consumer as a last output
        for g in gens[:3]:                       # consumers that leave abort their requests
            await g.aclose()
        gate.release()
        rest = [o async for o in gens[3]]
        assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
        assert len(rest[-1].outputs[0].token_ids) < 40
        await asyncio.gather(*waiting)
        for g in gens[4:]:
            async for _ in g:
                pass
        await _until(lambda: _idle(engine))
        steps = engine.snapshot()["stats"]["host_steps"]
        await asyncio.sleep(0.3)
        assert engine.snapshot()["stats"]["host_steps"] == steps, "the loop steps while idle"
        with pytest.raises(ValueError, match="max_model_len"):   # admission errors reach the caller
            await engine.generate("x " * 100, SamplingParams(), "long").__anext__()
        with pytest.raises(ValueError, match="stop_token_ids"):
            await engine.generate("x", SamplingParams(stop_token_ids=[10**6]), "v").__anext__()
        # shutdown: a live request is aborted once the grace time is up, and the thread ends
        live = engine.generate(jobs[0][0], SamplingParams(max_tokens=50, ignore_eos=True), "s")
        await live.__anext__()
        await engine.shutdown(timeout=0.0)
        assert not engine.is_running

    asyncio.run(main())


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_caller_leaving_before_admission_costs_no_one_else(llm):
    """A caller cancelled while its add waits behind a busy engine thread is never admitted, and
    the loop carries on; a loop that dies fails queued and new callers with EngineClosed at
    once, none left waiting."""
    from sfjax.async_llm import EngineClosed

    engine = AsyncLLM.from_llm(llm)
    busy, go = threading.Event(), threading.Event()

    async def main():
        engine._submit(lambda: (busy.set(), go.wait(10)))     # the thread is held here
        assert await asyncio.to_thread(busy.wait, 10)
        gone = asyncio.ensure_future(_collect(engine, PROMPTS[0], _params(0), "gone"))
        await _until(lambda: engine._admitting)                  # its add is queued
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        go.set()
        out = await asyncio.wait_for(_collect(engine, PROMPTS[1], _params(1), "next"), 60)
        assert out.finished and len(out.outputs[0].token_ids) == 12 and engine.is_running
        assert "gone" not in engine.engine.requests
        busy.clear()
        go.clear()
        engine._submit(lambda: (busy.set(), go.wait(10), 1 / 0))   # the loop dies
        assert await asyncio.to_thread(busy.wait, 10)
        queued = asyncio.ensure_future(engine.generate(PROMPTS[2], _params(2)).__anext__())
        await _until(lambda: engine._admitting)
        go.set()
        with pytest.raises(EngineClosed):
            await asyncio.wait_for(queued, 10)
        with pytest.raises(EngineClosed):
            await asyncio.wait_for(engine.generate(PROMPTS[3], _params(3)).__anext__(), 10)
        assert not engine.is_running

    asyncio.run(main())
    engine._thread.join(10)      # its exception is reported here, under this test's filter


def test_a_reused_id_never_gets_the_last_requests_output(llm):
    """A caller that leaves keeps its id taken until the engine has let go of it (a new request
    under it is refused meanwhile, then runs as itself: it never receives the old request's
    abort output, and no request is left running without a consumer)."""
    engine = AsyncLLM.from_llm(llm)

    async def main():
        for trial in range(3):
            g = engine.generate(PROMPTS[0], _params(0, 40), "dup")
            await asyncio.wait_for(g.__anext__(), 60)
            await g.aclose()                                  # leaves: the abort is queued
            while True:
                try:
                    out = await asyncio.wait_for(_collect(engine, PROMPTS[1], _params(1, 5), "dup"), 60)
                    break
                except ValueError as e:
                    assert "request_id 'dup' is already live" in str(e)
                    await asyncio.sleep(0.01)
            assert out.prompt == PROMPTS[1] and out.outputs[0].finish_reason == "length"
            assert len(out.outputs[0].token_ids) == 5
        await _until(lambda: _idle(engine))
        assert "dup" not in engine.engine.requests

    asyncio.run(main())
    engine.close()


def test_ids_a_refusal_or_the_caller_chose_are_free(llm):
    """A refused request leaves its id free at once (the engine never held it: a corrected retry
    under the same id was refused as "already live" while the engine was busy), and the ids
    made for requests without one never take an id a caller chose."""
    stepped = []           # each step's request ids; the thread stays busy a while

    def slow(outputs, snapshot):
        stepped.append({o.request_id for o in outputs})
        time.sleep(0.05)
    engine = AsyncLLM.from_llm(llm, stat_loggers=[slow])

    async def main():
        busy = asyncio.ensure_future(_collect(engine, PROMPTS[0], _params(0, 56), "async-0"))
        await _until(lambda: engine.engine.holds("async-0"))
        out = await asyncio.wait_for(_collect(engine, PROMPTS[2], _params(2, 4), None), 60)
        assert out.request_id == "async-1" and len(out.outputs[0].token_ids) == 4
        with pytest.raises(ValueError, match="stop_token_ids"):
            await _collect(engine, PROMPTS[1], SamplingParams(stop_token_ids=[10**6]), "r")
        out = await asyncio.wait_for(_collect(engine, PROMPTS[1], _params(1, 4), "r"), 60)
        assert len(out.outputs[0].token_ids) == 4
        assert len((await busy).outputs[0].token_ids) == 56
        assert any({"async-0", "r"} <= ids for ids in stepped), "r never ran beside async-0"

    asyncio.run(main())
    engine.close()


def test_a_failed_step_ends_its_requests_with_the_error(llm, monkeypatch):
    """A step that fails as a whole ends each request the engine held with EngineStepFailed,
    after the outputs it had delivered; a consumer reading late got the abort's final output
    instead, a truncated completion with no error. The engine serves the next requests alike."""
    from sfjax.async_llm import EngineStepFailed
    ref = llm.generate(PROMPTS[:2], [_params(0, 30), _params(1, 30)], use_tqdm=False)
    engine = AsyncLLM.from_llm(llm)
    collect, failed = llm.engine._collect, []

    def failing(call):        # the first call that decodes both (each has had its first token)
        if not failed and {r.request_id for r in call.decode} >= {"a", "b"}:
            failed.append(call)
            raise RuntimeError("injected device failure")
        return collect(call)

    monkeypatch.setattr(llm.engine, "_collect", failing)

    async def late(prompt, params, rid):
        g, ids = engine.generate(prompt, params, rid), []
        ids += (await asyncio.wait_for(g.__anext__(), 60)).new_token_ids
        await _until(lambda: failed and not llm.engine.holds(rid))   # failed, aborted
        with pytest.raises(EngineStepFailed, match="injected device failure"):
            async for out in g:
                assert not out.finished
                ids += out.new_token_ids
        return ids

    async def main():
        got = await asyncio.wait_for(asyncio.gather(
            late(PROMPTS[0], _params(0, 30), "a"), late(PROMPTS[1], _params(1, 30), "b")), 60)
        for ids, r in zip(got, ref):
            assert 0 < len(ids) < 30 and ids == r.outputs[0].token_ids[:len(ids)]
        again = await asyncio.wait_for(asyncio.gather(
            _collect(engine, PROMPTS[0], _params(0, 30), "a"),
            _collect(engine, PROMPTS[1], _params(1, 30), "b")), 60)
        assert [o.outputs[0].token_ids for o in again] == [r.outputs[0].token_ids for r in ref]
        await _until(lambda: _idle(engine))

    asyncio.run(main())
    engine.close()


def test_a_failed_step_keeps_an_ended_requests_final_output(llm, monkeypatch):
    """A request that ended before a step failed (aborted, its final output held for that step)
    still gets its final output from the next step, while the running one gets the error; the
    failed step dropped it, and its consumer waited forever, its id taken."""
    from sfjax.async_llm import EngineStepFailed
    gate = _Gate("a")
    gate.arm()
    engine = AsyncLLM.from_llm(llm, stat_loggers=[gate])
    collect, fail = llm.engine._collect, []

    def failing(call):
        if fail:
            fail.clear()
            raise RuntimeError("injected device failure")
        return collect(call)
    monkeypatch.setattr(llm.engine, "_collect", failing)

    def abort_b_and_fail_the_step():        # one command: nothing steps in between
        llm.engine.abort("b")
        fail.append(True)

    async def main():
        a = engine.generate(PROMPTS[0], _params(0, 40), "a")
        await asyncio.wait_for(a.__anext__(), 60)        # then the thread holds
        assert await asyncio.to_thread(gate.held.wait, 10)
        gb = engine.generate(PROMPTS[1], _params(1, 40), "b")
        b = asyncio.ensure_future(gb.__anext__())
        await _until(lambda: engine._admitting)
        engine._submit(abort_b_and_fail_the_step)       # after b's add
        gate.release()
        with pytest.raises(EngineStepFailed, match="injected device failure"):
            async for _ in a:
                pass
        last = await asyncio.wait_for(b, 10)
        assert last.finished and last.outputs[0].finish_reason == "abort"
        assert [out async for out in gb] == []
        await _until(lambda: _idle(engine))

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        gate.release()
        engine.close()


def test_a_failed_follow_call_keeps_the_final_outputs_read_before_it(llm, monkeypatch):
    """A step reads the call it sent ahead at once when a request ended in the first and others
    wait for its slot; that read failing kept none of the first call's outputs: the request that
    ended there never got its final one (its consumer waited forever), the others the error."""
    from sfjax.async_llm import EngineStepFailed
    from sfjax.engine.scheduler import Status
    engine = AsyncLLM.from_llm(llm)
    collect, failed = llm.engine._collect, []

    def failing(call):          # the follow, read because a request ended in the call before
        if not failed and call.waits and any(r.status is not Status.RUNNING for r in call.decode):
            failed.append(call)
            raise RuntimeError("injected device failure")
        return collect(call)
    monkeypatch.setattr(llm.engine, "_collect", failing)

    async def last(rid, n):
        async for out in engine.generate(PROMPTS[int(rid[1]) % 4], _params(0, n), rid):
            pass
        return out.outputs[0].finish_reason

    async def main():       # r0 ends first while r4 waits for a slot (max_num_seqs 4)
        got = await asyncio.gather(last("r0", 3), *(last(f"r{i}", 40) for i in range(1, 5)),
                                   return_exceptions=True)
        assert failed and got[0] == "length", got
        assert all(isinstance(e, EngineStepFailed) for e in got[1:]), got
        await _until(lambda: _idle(engine))

    asyncio.run(asyncio.wait_for(main(), 60))
    engine.close()


def test_a_consumer_behind_its_outputs_sees_the_close(llm):
    """Outputs delivered but not yet read when the engine closes come out, then EngineClosed
    (the next read waited forever)."""
    from sfjax.async_llm import EngineClosed
    gate = _Gate("slow")
    gate.arm()                  # the thread holds after each step that gives "slow" tokens
    engine = AsyncLLM.from_llm(llm, stat_loggers=[gate])

    async def main():
        g = engine.generate(PROMPTS[0], _params(0, 50), "slow")
        await asyncio.wait_for(g.__anext__(), 60)
        gate.step()                                     # one more output, delivered, not read
        await _until(lambda: gate.holds == 2 and engine._streams["slow"].pending)
        closing = asyncio.ensure_future(asyncio.to_thread(engine.close))
        await _until(lambda: engine._stopping)          # stops after the step it is in
        gate.release()
        await asyncio.wait_for(closing, 10)
        out = await asyncio.wait_for(g.__anext__(), 10)
        assert not out.finished and len(out.outputs[0].token_ids) < 50
        with pytest.raises(EngineClosed):
            await asyncio.wait_for(g.__anext__(), 10)

    try:
        asyncio.run(main())
    finally:
        gate.release()
        engine.close()


@pytest.mark.parametrize("step_ends", ["after the close", "before the close"])
def test_shutdown_ends_what_a_step_outlasting_its_grace_holds(llm, step_ends):
    """A step that outlasts shutdown's grace (a compile) holds the aborts: shutdown ends its
    requests itself once the grace is up, a started one with the last output it was given as
    the final one (finish_reason "abort", the tokens it had streamed), one still waiting to be
    admitted with EngineClosed; they waited for the step, and the server cancelled them with
    plain-text 500s. When the step ends, before the thread is told to stop or after, the queued
    add and abort find nothing to do, the thread stops, and the LLM holds no request."""
    from sfjax.async_llm import EngineClosed
    gate = _Gate("a")
    gate.arm()                      # the step that gives "a" its first tokens holds the thread
    engine = AsyncLLM.from_llm(llm, stat_loggers=[gate])
    ended = threading.Event()           # both consumers have their ends
    if step_ends == "before the close":
        close = engine.close

        def close_once_the_step_ends(timeout=30.0):
            engine.close = close
            assert ended.wait(10)
            gate.release()               # the queued add and abort run, then the abort's step
            deadline = time.monotonic() + 10
            while engine.engine.has_unfinished_requests() or engine._commands:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert engine._thread.is_alive(), "the engine loop died on the queued commands"
            close(timeout)
        engine.close = close_once_the_step_ends

    async def rest(gen) -> list:
        return [out async for out in gen]

    async def main():
        a, ids = engine.generate(PROMPTS[0], _params(0, 40), "a"), []
        ids += (await asyncio.wait_for(a.__anext__(), 60)).new_token_ids
        assert await asyncio.to_thread(gate.held.wait, 10)
        b = asyncio.ensure_future(engine.generate(PROMPTS[1], _params(1), "b").__anext__())
        shutdown = asyncio.ensure_future(engine.shutdown(timeout=0.0, grace=0.3))
        outs = await asyncio.wait_for(rest(a), 5)    # the gate holds the thread for 10 s
        ids += [t for out in outs for t in out.new_token_ids]
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        assert 0 < len(ids) < 40 and outs[-1].outputs[0].token_ids == ids
        with pytest.raises(EngineClosed, match="before the request started"):
            await asyncio.wait_for(b, 5)
        assert gate.held.is_set() and not shutdown.done()      # still in the step
        ended.set()
        gate.release()
        await asyncio.wait_for(shutdown, 30)
        assert not engine.is_running and engine.num_live_requests == 0
        assert not engine.engine.has_unfinished_requests() and not engine.engine.holds("a")

    try:
        asyncio.run(main())
    finally:
        gate.release()
        engine.close()


def test_admit_returns_once_admitted(llm):
    """``admit``: a refusal raises before any output; the generator it returns gives what
    ``generate`` gives; one dropped unread is closed by asyncio, which aborts its request."""
    ref = llm.generate(PROMPTS[1], _params(1), use_tqdm=False)[0].outputs[0].token_ids
    engine = AsyncLLM.from_llm(llm)

    async def main():
        with pytest.raises(ValueError, match="max_tokens"):
            await engine.admit(PROMPTS[0], SamplingParams(max_tokens=10**6), "a")
        outs = await engine.admit(PROMPTS[1], _params(1), "a")     # its id free again
        got = [out async for out in outs]
        assert got[-1].finished and got[-1].outputs[0].token_ids == ref
        left = await engine.admit(PROMPTS[2], _params(2, 60), "b")
        del left
        gc.collect()
        await _until(lambda: _idle(engine))             # aborted, its id and blocks freed

    try:
        asyncio.run(main())
    finally:
        engine.close()


def test_closes_share_the_first_ones_wait_for_a_step(llm, caplog):
    """A step outlasting close's wait (a compile) is logged and left to end on its own; a later
    close (the server's after its drain's) waits only what is left of the first one's timeout,
    not that long again. When the step ends the thread stops and the LLM holds no request."""
    gate = _Gate("a")
    gate.arm()
    engine = AsyncLLM.from_llm(llm, stat_loggers=[gate])

    async def first_tokens():
        gen = engine.generate(PROMPTS[0], _params(0, 40), "a")
        await asyncio.wait_for(gen.__anext__(), 60)
        assert await asyncio.to_thread(gate.held.wait, 10)

    try:
        asyncio.run(first_tokens())
        with caplog.at_level("WARNING", logger="sfjax"):
            t = time.monotonic()
            engine.close(timeout=0.5)
            first = time.monotonic() - t
            engine.close(timeout=30.0)
            both = time.monotonic() - t
        assert 0.4 < first and both < 5, (first, both)     # the second did not wait 30 s
        assert gate.held.is_set() and engine._thread.is_alive()
        assert [r.getMessage() for r in caplog.records if "still in a step" in r.getMessage()] == [
            "sfjax engine: the thread is still in a step 0.5 s after close (a compile?); it "
            "stops when the step ends"]
    finally:
        gate.release()
    engine._thread.join(30)
    assert not engine._thread.is_alive() and not engine.engine.holds("a")
    assert not engine.engine.has_unfinished_requests()


def test_app_refusals(tiny_folder, llm):
    """The tiny model has no chat template (400 naming messages); a full queue answers 503."""
    from sfjax.serve.app import build_app
    from sfjax.serve.metrics import ServerMetrics

    engine = AsyncLLM.from_llm(llm, max_waiting=0)
    metrics = ServerMetrics(engine, "tiny")
    engine.stat_loggers.append(metrics.record)
    app = build_app(engine, "tiny", tiny_folder, metrics)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=60) as c:
            r = await c.post("/v1/chat/completions",
                             json={"messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
            assert "chat template" in r.json()["error"]["message"]
            r = await c.post("/tokenize", content='{"prompt": "\\ud800"}',
                             headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"   # was 500
            r = await c.post("/v1/completions", json={"prompt": "def f", "max_tokens": 3,
                                                      "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            for body, param, message in (
                    ({"prompt": "def f", "n": 5}, "n", "n = 5: 5 sequences, more than this "
                     "server holds at once (4: max_num_seqs and --max-waiting)"),
                    ({"prompt": ["a", "b", "c"], "n": 2}, "prompt", "3 prompts x n = 2: 6 "
                     "sequences, more than")):
                r = await c.post("/v1/completions", json={**body, "max_tokens": 3})
                assert r.status_code == 400 and r.json()["error"]["param"] == param
                assert r.json()["error"]["message"].startswith(message)
            hold = [engine.generate(PROMPTS[0], SamplingParams(max_tokens=40, ignore_eos=True),
                                    f"h{i}") for i in range(4)]
            await asyncio.gather(*(g.__anext__() for g in hold))
            r = await c.post("/v1/completions", json={"prompt": "def f", "max_tokens": 3})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            for g in hold:
                await g.aclose()
            await _until(lambda: _idle(engine))
            text = (await c.get("/metrics")).text
            assert "sfjax:num_requests_running" in text and "sfjax:kv_cache_usage_perc" in text
        await engine.shutdown(timeout=1.0)

    asyncio.run(main())


def test_a_chat_template_in_chat_template_jinja_serves_chat(tiny_folder, tmp_path):
    """transformers 5 saves a tokenizer's chat template as ``chat_template.jinja`` beside
    tokenizer_config.json, not inside it: the server renders it as transformers does (it
    refused chat, 'no chat template'), and so does ``LLM.chat`` (vLLM's), one conversation or
    several, giving ``generate``'s tokens for the rendered ids."""
    import shutil

    from transformers import PreTrainedTokenizerFast

    from sfjax.chat import ChatTemplate

    folder = shutil.copytree(tiny_folder, tmp_path / "m")
    assert not ChatTemplate(str(folder)).available
    llm = LLM(str(folder), max_num_seqs=2, max_model_len=64)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="messages: this model has no chat template"):
        llm.chat(messages)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
        "{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}")
    want = PreTrainedTokenizerFast.from_pretrained(str(folder)).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert want == "<s>system: Be brief.\n<s>user: hi\nassistant:"
    assert ChatTemplate(str(folder)).render(messages) == want
    # vLLM's chat_template_kwargs: more of the template's variables (Qwen3's enable_thinking)
    quiet = ChatTemplate(str(folder)).render(messages, True, {"enable_thinking": False})
    assert quiet == want + " /no_think"
    with pytest.raises(ValueError, match="chat_template_kwargs: 'tokenize' is not offered"):
        ChatTemplate(str(folder)).render(messages, True, {"tokenize": True})
    parts = [{"type": "text", "text": t} for t in ("Be", "", "brief.")]   # as vLLM joins them
    assert ChatTemplate(str(folder)).render([{"role": "system", "content": parts},
                                             messages[1]]) == want.replace("Be ", "Be\n")
    llm = LLM(str(folder), max_num_seqs=2, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    other = [{"role": "user", "content": "def f"}]
    got = llm.chat([messages, other], params, use_tqdm=False)
    ids = [llm.get_tokenizer().encode(ChatTemplate(str(folder)).render(m),
                                      add_special_tokens=False).ids for m in (messages, other)]
    ref = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in got] == ids and ids[0][:1] == [0]    # one BOS
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert got[0].prompt == want
    assert llm.chat(messages, params, use_tqdm=False, chat_template_kwargs={
        "enable_thinking": False})[0].prompt == quiet
    with pytest.raises(ValueError, match=r"messages\[0\].role: 'robot' is not one of"):
        llm.chat([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match=r"messages\[0\].content: only text parts \(each a str\)"):
        llm.chat([{"role": "user", "content": [{"type": "text", "text": 5}]}])     # a TypeError
    with pytest.raises(ValueError, match=r"messages\[0\].content = .* is not valid text"):
        llm.chat([{"role": "user", "content": "\ud800"}])


def test_a_messages_name_and_tool_fields_reach_the_template(tiny_folder, tmp_path):
    """name, tool_call_id and tool_calls (their JSON arguments as dicts) reach the template as
    vLLM passes them (they were dropped: another prompt, no error); fields that are None (an
    SDK's message echoed back) are left out, and any other field is refused naming it."""
    import json
    import shutil

    from transformers import PreTrainedTokenizerFast

    from sfjax.chat import ChatTemplate

    folder = shutil.copytree(tiny_folder, tmp_path / "m")
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m.role }}{% if m.name %} name={{ m.name }}{% endif %}"
        "{% if m.tool_call_id %} id={{ m.tool_call_id }}{% endif %}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}[{{ c.function.name }}({{ c.function.arguments.x }})]"
        "{% endfor %}{% endfor %}")
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 7}'}}
    messages = [{"role": "user", "name": "alice", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None},
                {"role": "tool", "tool_call_id": "call_1", "content": "42"}]
    got = ChatTemplate(str(folder)).render(messages, add_generation_prompt=False)
    assert got == "<user name=alice>hi<assistant>[f(7)]<tool id=call_1>42"
    as_vllm = [messages[0], {"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "f", "arguments": {"x": 7}}}]}, messages[2]]
    assert got == PreTrainedTokenizerFast.from_pretrained(str(folder)).apply_chat_template(
        as_vllm, tokenize=False)
    assert json.loads(call["function"]["arguments"]) == {"x": 7}       # the caller's, unchanged
    for bad, match in (({"role": "user", "content": "x", "weight": 2}, r"messages\[0\]\.weight: "
                        r"not offered \(a message takes role, content, name, tool_call_id"),
                       ({"role": "assistant", "content": None, "tool_calls": [
                           {"function": {"name": "f", "arguments": "{x"}}]},
                        r"messages\[0\]\.tool_calls\[0\]\.function\.arguments: not JSON"),
                       ({"role": "user", "content": "x", "name": 3}, r"messages\[0\]\.name must be")):
        with pytest.raises(ValueError, match=match):
            ChatTemplate(str(folder)).render([bad])


BAD_PROMPT = "raise Failure"


class _Breaker:
    """A stat logger (so it runs on the engine thread, between steps) that makes the
    detokenizer of every request with BAD_PROMPT raise once the request has a token."""

    def __init__(self, engine):
        self.engine, self.broken = engine, set()

    def __call__(self, outputs, snapshot):
        for rid, req in list(self.engine.engine.requests.items()):
            if req.prompt == BAD_PROMPT and req.output_token_ids and rid not in self.broken:
                self.broken.add(rid)
                req.detok.add = _boom


def _boom(token):
    raise RuntimeError(f"injected detokenizer failure at token {token}")


def _events(text: str) -> list:
    lines = [ln for ln in text.split("\n") if ln]
    assert all(ln.startswith("data: ") for ln in lines), text
    return [ln[6:] if ln == "data: [DONE]" else json.loads(ln[6:]) for ln in lines]


def test_request_failure(tiny_folder, llm):
    """A request whose host work fails ends alone with finish_reason "error": AsyncLLM hands it
    over with RequestOutput.error; the app answers 500 (non-streamed) or an error event then
    [DONE] (streamed); concurrent good requests get exactly their tokens."""
    from sfjax.serve.app import build_app

    good = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = llm.generate(PROMPTS[:2], [good, _params(1)], use_tqdm=False)
    engine = AsyncLLM.from_llm(llm)
    breaker = _Breaker(engine)
    engine.stat_loggers.append(breaker)
    app = build_app(engine, "tiny", tiny_folder)
    body = {"prompt": BAD_PROMPT, "max_tokens": 40, "ignore_eos": True, "temperature": 0}

    async def bad_direct():
        outs = [o async for o in engine.generate(BAD_PROMPT, SamplingParams(max_tokens=40,
                                                 ignore_eos=True), "bad")]
        return outs[-1]

    async def main():
        last, g0, g1 = await asyncio.wait_for(asyncio.gather(
            bad_direct(), _collect(engine, PROMPTS[0], good, "g0"),
            _collect(engine, PROMPTS[1], _params(1), "g1")), 60)
        assert last.finished and last.outputs[0].finish_reason == "error"
        assert "RuntimeError: injected detokenizer failure" in last.error
        assert len(last.outputs[0].token_ids) < 40
        assert g0.outputs[0].token_ids == ref[0].outputs[0].token_ids
        assert g1.outputs[0].token_ids == ref[1].outputs[0].token_ids
        assert g0.outputs[0].finish_reason == g1.outputs[0].finish_reason == "length"

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=60) as c:
            plain, streamed, ok = await asyncio.gather(
                c.post("/v1/completions", json=body),
                c.post("/v1/completions", json={**body, "stream": True}),
                c.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 12,
                                                "ignore_eos": True, "temperature": 0,
                                                "return_token_ids": True}))
        assert plain.status_code == 500, plain.text
        err = plain.json()["error"]
        assert err["type"] == "internal_error"
        assert "injected detokenizer failure" in err["message"]
        assert streamed.status_code == 200
        events = _events(streamed.text)
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["type"] == "internal_error"
        assert "injected detokenizer failure" in events[-2]["error"]["message"]
        assert events[:-2] and all(e["choices"][0]["finish_reason"] is None for e in events[:-2])
        assert ok.status_code == 200
        assert ok.json()["choices"][0]["token_ids"] == ref[0].outputs[0].token_ids
        assert len(breaker.broken) == 3
        await _until(lambda: _idle(engine))
        await engine.shutdown(timeout=1.0)

    asyncio.run(main())


def test_a_stream_sends_what_a_failed_request_made_before_its_error():
    """A failed request's output is cumulative: when its consumer took none of the outputs
    before it (they merged into the error's), the stream still sends the text and ids it had
    made, then the error event. (test_request_failure's stream reads them as they come, so
    whether they merged there depends on timing.)"""
    from types import SimpleNamespace
    from sfjax.outputs import CompletionOutput, RequestOutput
    from sfjax.serve.app import _chunks

    failed = RequestOutput("r", None, [1, 2], [CompletionOutput(0, "ab", [7, 8],
                                                                finish_reason="error")],
                           finished=True, error="RuntimeError: boom")

    async def nothing_more():
        return
        yield

    async def events():
        return [c async for c in _chunks(
            SimpleNamespace(stream_options=None), None, [(failed, nothing_more())],
            dict, lambda out, text, ids, entries, offset, reason: {
                "text": text, "token_ids": ids, "finish_reason": reason},
            opening={"role": "assistant"})]

    got = asyncio.run(events())
    assert [c.get("choices") for c in got[:2]] == [
        [{"role": "assistant", "index": 0}],
        [{"text": "ab", "token_ids": [7, 8], "finish_reason": None, "index": 0}]]
    assert len(got) == 3 and got[2]["error"]["type"] == "internal_error"
    assert "RuntimeError: boom" in got[2]["error"]["message"]


def test_the_models_generation_config_sets_the_sampling_defaults(tiny_folder, tmp_path):
    """As in vLLM, generation_config.json's temperature, top_p, top_k, min_p,
    repetition_penalty and max_new_tokens are the defaults: of ``LLM.generate`` and
    ``AsyncLLM.generate`` given no SamplingParams, and of the server's requests for the fields
    they leave out (all ran at temperature 1, 16 tokens); a field a request sets wins, except
    that max_new_tokens caps max_tokens; a cap past the room a prompt leaves is no error; a bad
    value is refused when the model loads, naming the file."""
    import shutil

    from sfjax.serve.app import build_app

    folder = shutil.copytree(tiny_folder, tmp_path / "m")
    gen = {"eos_token_id": [1], "temperature": 0.0, "max_new_tokens": 5, "repetition_penalty": 1.3,
           "do_sample": True}
    (folder / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(str(folder), max_num_seqs=2, max_model_len=64)
    own = llm.get_default_sampling_params()
    assert (own.temperature, own.max_tokens, own.repetition_penalty) == (0.0, 5, 1.3)
    greedy = llm.generate("def f", own, use_tqdm=False)[0].outputs[0]
    assert llm.generate("def f", use_tqdm=False)[0].outputs[0].token_ids == greedy.token_ids
    sampled = llm.generate("def f", SamplingParams(temperature=1.0, seed=3, max_tokens=5,
                                                   repetition_penalty=1.3), use_tqdm=False)
    engine = AsyncLLM.from_llm(llm)
    app = build_app(engine, "m", str(folder))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=60) as c:
            post = lambda **body: c.post("/v1/completions", json={"prompt": "def f",
                                                                  "return_token_ids": True, **body})
            r = (await post()).json()["choices"][0]
            assert r["token_ids"] == greedy.token_ids
            r = (await post(temperature=1.0, seed=3, max_tokens=7)).json()["choices"][0]
            assert r["token_ids"] == sampled[0].outputs[0].token_ids      # capped at 5
            outs = [o async for o in engine.generate("def f", None, "none")]
            assert outs[-1].outputs[0].token_ids == greedy.token_ids
        await engine.shutdown(timeout=1.0)

    asyncio.run(main())
    (folder / "generation_config.json").write_text(json.dumps({**gen, "max_new_tokens": 100}))
    llm = LLM(str(folder), max_num_seqs=2, max_model_len=64)
    out = llm.generate({"prompt_token_ids": [5] * 60}, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"     # the room left
    (folder / "generation_config.json").write_text(json.dumps({**gen, "temperature": -1}))
    with pytest.raises(ValueError, match="generation_config.json: .*temperature"):
        LLM(str(folder), max_num_seqs=2, max_model_len=64)

def test_a_requests_max_tokens_as_vllms_server_takes_it():
    """Given: the request's, capped by the model's max_new_tokens (over the room left it is
    refused later, naming max_tokens); omitted: the least of 16 (completions; chat: none), that
    max_new_tokens and the room the prompt leaves; no room: None, for the engine to refuse the
    prompt."""
    from sfjax.serve.protocol import max_tokens_for

    cap = {"max_tokens": 100}
    assert max_tokens_for(200, 16, cap, 50) == 100 and max_tokens_for(200, 16, {}, 50) == 200
    assert max_tokens_for(None, 16, cap, 50) == 16 and max_tokens_for(None, 16, cap, 9) == 9
    assert max_tokens_for(None, None, cap, 500) == 100 and max_tokens_for(None, None, {}, 500) == 500
    assert max_tokens_for(None, None, {}, None) is None and max_tokens_for(None, 16, cap, 0) is None
