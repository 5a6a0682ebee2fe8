"""``sfjax serve`` as a real subprocess on 127.0.0.1, driven by the real ``openai`` client.

Every token that comes back over HTTP, streamed or not, must equal ``LLM.generate``'s for the
same prompt and params in this process: the server speculates (the embedded pair's default,
n-gram with its table, path-exact), the reference does not, and requests that opt out of
speculation (``disable_spec_decode``) run plain in the same batches. One server serves the whole
module; the last test SIGTERMs it while requests stream.
"""

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from engine_checks import RUNS_LONG
from sfjax import LLM, SamplingParams

GEOMETRY = dict(max_model_len=128, max_num_seqs=16, small_row_tiles=False)
# The server and the offline engine it is compared with compile as users' do, at the default
# -O2 (RUNS_LONG): they run the 200 streams faster than at the suite's -O0.
SERVE_FLAGS = ["--max-model-len", "128", "--max-num-seqs", "16", "--no-small-row-tiles",
               "--max-waiting", "1024", "--log-level", "warning", "--shutdown-timeout", "0",
               "--compiler-options", json.dumps(RUNS_LONG)]
MODEL = "sfjax-default"
PROMPTS = ["def fib(n):", "class Cache:\n    def __init__(self", "import os\nimport sys\n",
           "for i in range(10):", "    return self.", "if __name__ == '__main__':"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    log = tmp_path_factory.mktemp("server") / "log"      # a file: a full pipe would block it
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "sfjax", "serve", "--port", str(port),
                                 *SERVE_FLAGS], env=env, stdout=out, stderr=subprocess.STDOUT)
    proc.log = lambda whole=False: log.read_text()[0 if whole else -20000:]
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited: {proc.log()}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("the server did not come up in 120 s")
    proc.url = url
    yield proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def offline():
    return LLM(**GEOMETRY, compiler_options=RUNS_LONG)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def _sampling(kw: dict) -> SamplingParams:
    """The offline SamplingParams of a request's fields."""
    names = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "presence_penalty",
             "frequency_penalty", "repetition_penalty", "stop", "ignore_eos", "min_tokens",
             "stop_token_ids", "disable_spec_decode")
    return SamplingParams(**{k: v for k, v in kw.items() if k in names})


def _split(kw: dict) -> tuple[dict, dict]:
    """OpenAI's own arguments, and the extras that go in extra_body."""
    own = ("temperature", "top_p", "seed", "max_tokens", "presence_penalty", "frequency_penalty",
           "stop", "logprobs", "top_logprobs")
    return ({k: v for k, v in kw.items() if k in own},
            {k: v for k, v in kw.items() if k not in own} | {"return_token_ids": True})


CASES = [
    dict(temperature=0.0, max_tokens=24),
    dict(temperature=0.8, seed=7, max_tokens=24),
    dict(temperature=0.8, seed=11, top_p=0.9, top_k=40, min_p=0.02, presence_penalty=0.5,
         frequency_penalty=0.3, repetition_penalty=1.1, max_tokens=20),
    dict(temperature=0.8, seed=3, max_tokens=16, disable_spec_decode=True),
    dict(temperature=0.0, max_tokens=30, stop=["\n\n", ")"], min_tokens=2),
    dict(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[7]),
]


def _complete(client, prompt, kw, stream):
    own, extra = _split(kw)
    if not stream:
        r = client.completions.create(model=MODEL, prompt=prompt, extra_body=extra, **own)
        c = r.choices[0]
        return c.text, c.model_extra["token_ids"], c.finish_reason, r.usage
    text, ids, reason, usage = "", [], None, None
    for chunk in client.completions.create(model=MODEL, prompt=prompt, stream=True,
                                           stream_options={"include_usage": True},
                                           extra_body=extra, **own):
        for c in chunk.choices:
            text += c.text
            ids += c.model_extra.get("token_ids") or []
            reason = c.finish_reason or reason
        usage = chunk.usage or usage
    return text, ids, reason, usage


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_equal_offline(client, offline, stream):
    prompts = PROMPTS[:2]
    jobs = [(p, kw) for kw in CASES for p in prompts]
    ref = offline.generate([p for p, _ in jobs], [_sampling(kw) for _, kw in jobs], use_tqdm=False)
    for (prompt, kw), r in zip(jobs, ref):
        text, ids, reason, usage = _complete(client, prompt, kw, stream)
        want = r.outputs[0]
        assert ids == want.token_ids, (prompt, kw)
        assert text == want.text and reason == want.finish_reason, (prompt, kw)
        assert usage.prompt_tokens == len(r.prompt_token_ids)
        assert usage.completion_tokens == len(want.token_ids)
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def _chat_ids(offline, messages) -> list[int]:
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast.from_pretrained(offline.model_path)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return offline.get_tokenizer().encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_equals_offline(client, offline, stream):
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "def fib(n):"}]
    ids = _chat_ids(offline, messages)
    for kw in CASES[:4]:
        want = offline.generate({"prompt_token_ids": ids}, _sampling(kw), use_tqdm=False)[0].outputs[0]
        own, extra = _split(kw)
        if not stream:
            r = client.chat.completions.create(model=MODEL, messages=messages, extra_body=extra, **own)
            c = r.choices[0]
            got, text, reason = c.model_extra["token_ids"], c.message.content, c.finish_reason
            assert c.message.role == "assistant"
            assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(got))
            assert r.model_extra["sfjax"]["certificate"]["exactness"] == "path-exact"
        else:
            got, text, reason, roles = [], "", None, []
            for chunk in client.chat.completions.create(model=MODEL, messages=messages,
                                                        stream=True, extra_body=extra, **own):
                for c in chunk.choices:
                    roles += [c.delta.role] if c.delta.role else []
                    text += c.delta.content or ""
                    got += c.model_extra.get("token_ids") or []
                    reason = c.finish_reason or reason
            assert roles == ["assistant"]
        assert got == want.token_ids and text == want.text and reason == want.finish_reason, kw


def test_logprobs_shapes(client, offline):
    prompt = PROMPTS[0]
    want = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=8, logprobs=3),
                            use_tqdm=False)[0].outputs[0]
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    for i, (t, entry) in enumerate(zip(want.token_ids, want.logprobs)):
        assert lp.token_logprobs[i] == pytest.approx(entry[t].logprob, abs=1e-4)
        assert 3 <= len(lp.top_logprobs[i]) <= 4
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x = 1"}],
                                       temperature=0, max_tokens=5, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 5
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.bytes == list(e.token.encode()) and e.logprob <= 0
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8,
                                            logprobs=2, stream=True))
    assert sum(len(ch.choices[0].logprobs.tokens) for ch in chunks if ch.choices) == 8
    # a stop string holds text back while streaming; the offsets are the whole response's
    kw = dict(model=MODEL, prompt=prompt, temperature=0, max_tokens=8, logprobs=1, stop=["@@@@"])
    whole = client.completions.create(**kw).choices[0]
    streamed = [c for ch in client.completions.create(**kw, stream=True) for c in ch.choices]
    assert whole.finish_reason == "length"
    assert [o for c in streamed for o in c.logprobs.text_offset] == whole.logprobs.text_offset


BAD_COMPLETIONS = [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=2.0), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(n=0), "n"), (dict(n=1025), "n"),
    (dict(logprobs=21), "logprobs"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(seed=-1), "seed"),
    (dict(logit_bias={"abc": 1.0}), "logit_bias"),
    (dict(logit_bias={"999999": 1.0}), "logit_bias"),
    (dict(max_tokens=1000), "max_tokens"),
    (dict(extra_body={"stop_token_ids": [-3]}), "stop_token_ids"),
    (dict(extra_body={"top_k": -5}), "top_k"),
    (dict(extra_body={"min_tokens": 20}, max_tokens=10), "min_tokens"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    (dict(temperature="hot"), "temperature"),
]


@pytest.mark.parametrize("kw,param", BAD_COMPLETIONS, ids=[p for _, p in BAD_COMPLETIONS])
def test_bad_completions_get_400(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="def f():", **kw)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param, e.value.body
    assert e.value.body["type"] == "invalid_request_error" and e.value.body["message"]


def test_other_bad_requests_get_400(client, server):
    """400 naming the field (an unknown model: 404)."""
    with pytest.raises(openai.NotFoundError) as e:        # 404, as OpenAI's and vLLM's
        client.completions.create(model="no-such-model", prompt="x")
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    cases = [
        (lambda: client.completions.create(model=MODEL, prompt="def f():\n" * 200), "prompt"),
        (lambda: client.completions.create(model=MODEL, prompt=["a", "def f():\n" * 200]),
         "prompt"),                                    # the batch's second prompt is too long
        (lambda: client.completions.create(model=MODEL, prompt=[[5], [1] * 300], max_tokens=2),
         "prompt"),                                    # refused by the engine
        (lambda: client.completions.create(model=MODEL, prompt="x", stream=True,
                                           temperature=-1), "temperature"),
        (lambda: client.chat.completions.create(model=MODEL, messages=[]), "messages"),
        (lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "robot", "content": "hi"}]), "messages"),
        (lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], logprobs=True,
            top_logprobs=25), "top_logprobs"),
        (lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}],
            max_completion_tokens=-1), "max_completion_tokens"),
        (lambda: client.chat.completions.create(       # prompt + it over max_model_len (128)
            model=MODEL, messages=[{"role": "user", "content": "hi"}],
            max_completion_tokens=127), "max_completion_tokens"),
    ]
    chat = lambda **kw: client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, **kw)
    cases += [   # asked-for behaviour sfjax does not offer: refused, not quietly ignored
        (lambda: chat(response_format={"type": "json_object"}), "response_format"),
        (lambda: chat(tool_choice="required"), "tool_choice"),
        (lambda: chat(extra_body={"chat_template": "{{ messages }}"}), "chat_template"),
        (lambda: client.completions.create(model=MODEL, prompt="x", extra_body={
            "guided_json": {"type": "object"}}), "guided_json"),
        (lambda: client.completions.create(model=MODEL, prompt="x", extra_body={
            "prompt_logprobs": 1}), "prompt_logprobs"),
        (lambda: chat(modalities=["text", "audio"]), "modalities"),
        (lambda: chat(audio={"voice": "alloy", "format": "wav"}), "audio"),
        (lambda: chat(extra_body={"length_penalty": 2.0}), "length_penalty"),
        (lambda: chat(extra_body={"chat_template_kwargs": {"tokenize": True}}),
         "chat_template_kwargs"),
        (lambda: chat(stream=True, stream_options={"include_usage": True, "per_token": True}),
         "stream_options"),
        (lambda: chat(stream=True, stream_options={"include_obfuscation": True}),
         "stream_options"),
        (lambda: chat(stream_options={"include_usage": True}), "stream_options"),  # not streamed
    ]
    for j, (call, param) in enumerate(cases):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["param"] == param, e.value.body
        assert e.value.body["message"].startswith("prompt[1]: ") == (j in (1, 2)), e.value.body
    # what asks for nothing passes: text format, no tool choice, unknown fields
    for kw in (dict(response_format={"type": "text"}, tool_choice="none"),
               dict(tool_choice="auto", user="u", extra_body={"metadata_of_mine": 1}),
               dict(extra_body={"chat_template_kwargs": {"enable_thinking": False}})):
        assert chat(**kw).choices[0].message.content is not None
    for body in (b'{"prompt": "x"', b"[1, 2", b"not json",
                 b'{"prompt":' + b"[" * 100_000 + b"]" * 100_000 + b"}"):   # a RecursionError
        r = httpx.post(f"{server.url}/v1/completions", content=body, timeout=10)
        assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    raw = [   # bodies the typed client would not send: (body, param, words of the message)
        ({"prompt": "x", "max_tokens": True}, "max_tokens", "integer"),      # not 1 token
        ({"prompt": [True, False]}, "prompt", "a list of token ids"),         # not ids [1, 0]
        ({"prompt": [1, "a"]}, "prompt", "a list of token ids"),
        ({"prompt": {"a": 1}}, "prompt", "a list of token ids"),
        ({"prompt": "x", "n": 2, "best_of": 1}, "best_of", "must be n (2) or null"),
        ({"prompt": "x", "echo": True}, "echo", "sfjax allows false or null"),
        ({"prompt": "x", "suffix": ""}, "suffix", "sfjax allows null"),
        ({"prompt": "a\ud800b" * 5000}, "prompt", "not valid text"),
    ]
    for body, param, words in raw:        # json.dumps escapes the lone surrogate; httpx can't
        r = httpx.post(f"{server.url}/v1/completions", content=json.dumps(body), timeout=10)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param and words in err["message"], err
        assert len(err["message"]) < 400, err                      # the value is not echoed whole
    r = httpx.post(f"{server.url}/v1/completions", timeout=30,     # best_of = n: n's choices
                   json={"prompt": "x", "n": 2, "best_of": 2, "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    for body in ({"max_tokens": 3}, {"prompt": None, "max_tokens": 3}):   # null, not missing
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert ("required" in r.json()["error"]["message"]) == ("prompt" not in body)


def test_vllm_fields_are_honoured_and_nulls_are_defaults(client, server, offline):
    """vLLM's add_special_tokens (completions: BOS by default; chat: none), its
    return_tokens_as_token_ids and stream_options.continuous_usage_stats are honoured (each was
    accepted and ignored), and OpenAI's nullable fields sent as null take their defaults (they
    were refused)."""
    tok = offline.get_tokenizer()
    kw = dict(model=MODEL, prompt="def fib(n):", max_tokens=4, temperature=0)
    for add, ids in ((True, tok.encode("def fib(n):").ids),
                     (False, tok.encode("def fib(n):", add_special_tokens=False).ids)):
        r = client.completions.create(**kw, extra_body={"add_special_tokens": add,
                                                        "return_token_ids": True})
        assert r.choices[0].model_extra["prompt_token_ids"] == ids
    messages = [{"role": "user", "content": "hi"}]
    counts = {}
    for add in (False, True):
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                           extra_body={"add_special_tokens": add})
        t = httpx.post(f"{server.url}/tokenize", json={"messages": messages,
                                                       "add_special_tokens": add}, timeout=10)
        counts[add] = r.usage.prompt_tokens
        assert counts[add] == t.json()["count"]
    assert counts[True] == counts[False] + 1                    # the tokenizer's BOS
    r = client.completions.create(**kw, logprobs=2, extra_body={
        "return_tokens_as_token_ids": True, "return_token_ids": True})
    c = r.choices[0]
    assert c.logprobs.tokens == [f"token_id:{t}" for t in c.model_extra["token_ids"]]
    assert all(k.startswith("token_id:") for top in c.logprobs.top_logprobs for k in top)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, logprobs=True,
                                       top_logprobs=2, extra_body={
                                           "return_tokens_as_token_ids": True,
                                           "return_token_ids": True})
    ids = r.choices[0].model_extra["token_ids"]
    assert [e.token for e in r.choices[0].logprobs.content] == [f"token_id:{t}" for t in ids]
    for options in ({"include_usage": True, "continuous_usage_stats": True},
                    {"continuous_usage_stats": True}):          # asks for usage on its own
        usages = [chunk.usage for chunk in client.completions.create(
            **kw, stream=True, stream_options=options)]
        assert all(u is not None for u in usages) and len(usages) >= 3
        done = [u.completion_tokens for u in usages]
        assert done == sorted(done) and usages[-1].completion_tokens == 4
    chunks = list(client.completions.create(**kw, stream=True, stream_options={
        "include_usage": True, "include_obfuscation": False}))     # OpenAI's, asking nothing
    assert chunks[-1].usage.completion_tokens == 4
    whole = client.completions.create(**kw).choices[0].text
    nulls = dict(n=None, stream=None, echo=None, presence_penalty=None, frequency_penalty=None)
    r = httpx.post(f"{server.url}/v1/completions", json={**kw, **nulls}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == whole, r.text
    r = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "max_tokens": 2, "logprobs": None, **nulls,
        "echo": None}, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_n_choices_are_vllms_parallel_sampling(client, server, offline, stream):
    """n > 1 and a batch of prompts (OpenAI's list): prompt k's choice i, at index 3k + i, is
    the offline request seeded seed + i (vLLM's parallel sampling), whole or streamed (each
    choice's chunks carry its index); usage counts each prompt once and every choice's tokens;
    a refusal admits none of them. (A batch was refused: "send one prompt per request".)"""
    kw = dict(temperature=0.9, seed=21, max_tokens=12)
    prompts = ["def fib(n):", "class Cache:"]
    ref = [offline.generate(p, _sampling({**kw, "seed": 21 + i}), use_tqdm=False)[0]
           for p in prompts for i in range(3)]
    want = [o.outputs[0] for o in ref]
    assert len({tuple(w.token_ids) for w in want}) > 3
    extra = {"return_token_ids": True}
    if not stream:
        r = client.completions.create(model=MODEL, prompt=prompts, n=3, extra_body=extra, **kw)
        got = [(c.index, c.text, c.model_extra["token_ids"]) for c in r.choices]
        usage = r.usage
        assert all(c.model_extra["sfjax"]["certificate"] for c in r.choices)   # each its own
    else:
        got, usage = {i: [i, "", []] for i in range(6)}, None
        for chunk in client.completions.create(model=MODEL, prompt=prompts, n=3,
                                               stream=True, extra_body=extra,
                                               stream_options={"include_usage": True}, **kw):
            for c in chunk.choices:
                got[c.index][1] += c.text
                got[c.index][2] += c.model_extra.get("token_ids") or []
            usage = chunk.usage or usage
        got = [tuple(v) for v in got.values()]
    assert got == [(i, w.text, w.token_ids) for i, w in enumerate(want)]
    assert usage.completion_tokens == sum(len(w.token_ids) for w in want)
    assert usage.prompt_tokens == len(ref[0].prompt_token_ids) + len(ref[3].prompt_token_ids)
    chat = client.chat.completions.create(model=MODEL, n=2, messages=[
        {"role": "user", "content": "hi"}], temperature=0.9, seed=5, max_tokens=4, stream=stream)
    if stream:
        roles = [c.index for chunk in chat for c in chunk.choices if c.delta.role]
        assert sorted(roles) == [0, 1]                      # a role chunk per choice
    else:
        assert [c.index for c in chat.choices] == [0, 1]
    with pytest.raises(openai.BadRequestError) as e:      # prompt + max_tokens over the context
        client.completions.create(model=MODEL, prompt="def fib(n):", n=2, max_tokens=125)
    assert e.value.body["param"] == "max_tokens"
    deadline = time.monotonic() + 30
    while _metrics(server.url)["sfjax:num_requests_live"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _metrics(server.url)["sfjax:num_requests_live"] == 0


def test_a_stream_of_more_choices_than_slots_starts_with_the_first(client, server, offline):
    """n = max_num_seqs + 1, streamed: the choices that have slots stream at once, while the
    last waits for one (the response began only when that one had its first token, the first
    16 choices' tokens sent in one burst once they had finished); every choice ends as it would
    offline."""
    kw = dict(temperature=0.9, seed=3, max_tokens=40)
    want = [offline.generate("class Cache:", _sampling({**kw, "seed": 3 + i, "ignore_eos": True}),
                             use_tqdm=False)[0].outputs[0].token_ids for i in range(17)]
    got, waiting = {}, None
    for chunk in client.completions.create(model=MODEL, prompt="class Cache:", n=17, stream=True,
                                           extra_body={"return_token_ids": True,
                                                       "ignore_eos": True}, **kw):
        if waiting is None:
            waiting = _metrics(server.url)["sfjax:num_requests_waiting"]
        for c in chunk.choices:
            got.setdefault(c.index, []).extend(c.model_extra.get("token_ids") or [])
    assert waiting == 1                          # the 17th: 16 slots hold the others
    assert [got[i] for i in range(17)] == want


def test_models_tokenize_detokenize(client, server, offline):
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "def fib(n):"}, timeout=10).json()
    assert r["tokens"] == offline.get_tokenizer().encode("def fib(n):").ids
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 128
    d = httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"][1:]}, timeout=10).json()
    assert d["prompt"] == "def fib(n):"
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [10**6]}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    messages = [{"role": "user", "content": "hi"}]
    for agp in (True, False):   # the ids the chat request itself uses, generation prompt or not
        from transformers import PreTrainedTokenizerFast
        text = PreTrainedTokenizerFast.from_pretrained(offline.model_path).apply_chat_template(
            messages, tokenize=False, add_generation_prompt=agp)
        r = httpx.post(f"{server.url}/tokenize", json={"messages": messages,
                                                       "add_generation_prompt": agp}, timeout=10)
        assert r.json()["tokens"] == offline.get_tokenizer().encode(text, add_special_tokens=False).ids


def test_a_long_tokenization_leaves_the_server_answering(server, offline):
    """The server tokenizes off its event loop: while a prompt of 2.3 MB or more tokenizes
    (more than a second; 1.6 s on the 2-core box), /health keeps answering. tokenizers'
    single-text encode held the GIL for the whole text, so every route and stream waited for
    it (the longest gap was the whole tokenization); now no gap comes near half of it."""
    import sfjax.engine.engine as source
    with open(source.__file__) as f:
        text = f.read() * 60
    tok = offline.get_tokenizer()
    while True:                # long enough to take a second here, however fast the machine
        t0 = time.monotonic()
        tok.encode(text)
        if time.monotonic() - t0 > 1.0:
            break
        text *= 2
    result = {}

    def tokenize():
        t0 = time.monotonic()
        r = httpx.post(f"{server.url}/tokenize", json={"prompt": text}, timeout=120)
        result.update(status=r.status_code, count=r.json().get("count"),
                      seconds=time.monotonic() - t0)

    worker = threading.Thread(target=tokenize)
    answered = [time.monotonic()]
    with httpx.Client(timeout=60) as h:
        worker.start()
        while worker.is_alive():
            assert h.get(f"{server.url}/health").status_code == 200
            answered.append(time.monotonic())
            time.sleep(0.01)
    worker.join()
    assert result["status"] == 200 and result["count"] > 500_000, result
    gap = max(b - a for a, b in zip(answered, answered[1:]))
    assert gap < result["seconds"] / 2, (gap, result)


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = name.split("{")[0]                 # summed over labels
            out[name] = out.get(name, 0.0) + float(value)
    return out


def _concurrent_jobs(n: int) -> list[dict]:
    rng = random.Random(0)
    jobs = []
    for i in range(n):
        kw = dict(max_tokens=rng.randint(2, 40), temperature=rng.choice([0.0, 0.8]))
        if kw["temperature"]:
            kw["seed"] = i
        if i % 7 == 0:
            kw["disable_spec_decode"] = True
        if i % 11 == 0:
            kw["top_k"] = 20
        prompt = rng.choice(PROMPTS) + rng.choice(["", " x", "\n", "  # note\n"])
        jobs.append(dict(prompt=prompt, kw=kw, cancel_after=rng.randint(1, 3) if i % 10 == 3 else None))
    return jobs


async def _stream_one(client, job, results):
    own, extra = _split(job["kw"])
    text, ids, reason = "", [], None
    stream = await client.completions.create(model=MODEL, prompt=job["prompt"], stream=True,
                                             extra_body=extra, **own)
    chunks = 0
    async for chunk in stream:
        for c in chunk.choices:
            text += c.text
            ids += c.model_extra.get("token_ids") or []
            reason = c.finish_reason or reason
        chunks += 1
        if job["cancel_after"] is not None and chunks >= job["cancel_after"] and reason is None:
            await stream.close()          # the client goes away mid-stream
            results.append(None)
            return
    results.append((job, text, ids, reason))


async def _health_while(url: str, done: asyncio.Event, seen: list):
    async with httpx.AsyncClient(timeout=5) as h:
        while not done.is_set():
            seen.append((await h.get(f"{url}/health")).status_code)
            await asyncio.sleep(0.25)


def test_200_concurrent_streams(server, offline):
    jobs = _concurrent_jobs(200)
    ref = offline.generate([j["prompt"] for j in jobs], [_sampling(j["kw"]) for j in jobs],
                           use_tqdm=False)

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                                    timeout=150, http_client=httpx.AsyncClient(
                                        limits=httpx.Limits(max_connections=256), timeout=150))
        results, health, done = [], [], asyncio.Event()
        poller = asyncio.create_task(_health_while(server.url, done, health))
        await asyncio.wait_for(asyncio.gather(*(_stream_one(client, j, results) for j in jobs)), 150)
        done.set()
        await poller
        await client.close()
        return results, health

    t0 = time.monotonic()
    results, health = asyncio.run(main())
    elapsed = time.monotonic() - t0
    completed = [r for r in results if r is not None]
    assert len(results) == 200 and len(completed) >= 175
    mismatches = []
    for job, text, ids, reason in completed:
        want = ref[jobs.index(job)].outputs[0]
        if (ids, text, reason) != (want.token_ids, want.text, want.finish_reason):
            mismatches.append((job, ids, want.token_ids))
    assert not mismatches, mismatches[:3]
    assert health and set(health) == {200}, health
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:            # aborts land within a step or two
        m = _metrics(server.url)
        if m["sfjax:num_requests_live"] == 0 and m["sfjax:num_requests_running"] == 0:
            break
        time.sleep(0.2)
    assert m["sfjax:num_requests_live"] == 0 and m["sfjax:num_requests_waiting"] == 0
    assert m["sfjax:kv_cache_free_blocks"] == m["sfjax:kv_cache_total_blocks"], "a KV block leaked"
    assert m["sfjax:kv_cache_usage_perc"] == 0.0
    assert m["sfjax:request_success_total"] >= len(completed)
    assert m["sfjax:time_to_first_token_seconds_count"] >= len(completed)
    assert m["sfjax:spec_decode_num_drafts_total"] > 0
    print(f"200 streams in {elapsed:.1f} s, {200 - len(completed)} cancelled")


def test_bench_drives_the_server_and_names_its_failures(server, capsys):
    """``sfjax bench --base-url`` against the running server: every request's tokens counted;
    when the server refuses them all, exit 2 with the server's reason (it printed throughput
    over failed prompts and exited 0); engine flags, which build nothing without
    --compare-offline, are refused naming the flag."""
    from sfjax.cli import main
    base = ["bench", "--base-url", server.url, "--num-prompts", "4", "--input-len", "8",
            "--output-len", "8", "--repeats", "1"]
    assert main(base + ["--json"]) == 0
    r = json.loads(capsys.readouterr().out)["server"]
    assert r["failed"] == 0 and r["output_tokens"] == 32 and r["input_tokens"] == 32
    for extra, message in ((["--input-len", "300"], "--base-url: all 4 requests failed; the first: "
                            "400: prompt has 300 tokens; max_model_len is 128"),
                           (["--block-size", "32"], "--block-size: an engine flag")):
        assert main(base + extra) == 2
        assert message in capsys.readouterr().err


def test_sigterm_while_streaming(server):
    """Last: SIGTERM (--shutdown-timeout 0: the drain aborts at once) with 64 requests in the
    engine: every request ends as OpenAI's clients expect, each stream with a last chunk
    ("abort", or "length" for one that finished first) and [DONE], each non-streamed one a 200
    with its finish reason; one the engine had not started when the grace ran out (its step
    was compiling) a 503 saying so (uvicorn cancelled the handlers: plain-text 500s and
    streams cut without [DONE]); and the server exits 0 in bounded time."""
    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                                    timeout=60)
        ask = dict(model=MODEL, max_tokens=110, temperature=0.8, seed=1,
                   extra_body={"ignore_eos": True})

        async def unstarted_as_503(reasons):
            try:
                return await reasons
            except openai.APIStatusError as e:
                assert e.status_code == 503, e
                assert "the engine shut down before the request started" in e.message, e
                return ["503"]

        async def streamed(i):
            stream = await client.completions.create(prompt=PROMPTS[i % len(PROMPTS)],
                                                     stream=True, **ask)
            return [c.finish_reason async for chunk in stream for c in chunk.choices
                    if c.finish_reason]

        async def whole(i):
            out = await client.completions.create(prompt=PROMPTS[i % len(PROMPTS)], **ask)
            return [c.finish_reason for c in out.choices]

        ended = lambda m: m.get("sfjax:request_success_total", 0.0)    # every finish reason
        started = lambda m: m.get("sfjax:time_to_first_token_seconds_count", 0.0)
        m0 = _metrics(server.url)

        async def signal_once_all_are_in():      # live or ended, none still to connect; a slot
            while True:                          # each with its first token given out
                m = await asyncio.to_thread(_metrics, server.url)
                if (m["sfjax:num_requests_live"] + ended(m) - ended(m0) >= 64
                        and started(m) - started(m0) >= 16):
                    break
                await asyncio.sleep(0.01)
            server.send_signal(signal.SIGTERM)
            return ended(m) - ended(m0)

        got = await asyncio.wait_for(asyncio.gather(
            *(unstarted_as_503(streamed(i)) for i in range(56)),
            *(unstarted_as_503(whole(i)) for i in range(8)), signal_once_all_are_in()), 60)
        await client.close()
        return got[:-1], got[-1]

    t0, logged = time.monotonic(), len(server.log(whole=True))
    try:
        got, finished_before = asyncio.run(main())
        assert server.wait(30) == 0
        assert time.monotonic() - t0 < 45
        assert all(len(r) == 1 and r[0] in ("length", "abort", "503") for r in got), got
        assert sum(r != ["503"] for r in got) >= 16, got      # the started ones end as they ran
        # past those that had finished at the signal, each of the 16 slots may finish its
        # request in the step in flight; the rest were aborted (a new one needs 3 steps)
        assert sum(r == ["length"] for r in got) <= finished_before + 16, (got, finished_before)
        assert "Traceback" not in server.log(whole=True)[logged:]
    except BaseException:
        print(server.log())
        raise
