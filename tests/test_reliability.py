"""Nothing a user does wedges the engine: whole validation at admission, one request's failure
isolated, aborts and foreign requests' outputs delivered, distinct unseeded samples, and engines
that free what they compiled."""

import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from engine_checks import check_engine, check_idle
from sfjax import LLM, SamplingParams
from sfjax.checks import InvalidType

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=10, ignore_eos=True)


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(2, 512, rng.integers(3, 20)).tolist()} for _ in range(n)]


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _drain(eng, limit=500):
    done = {}
    for _ in range(limit):
        if not eng.has_unfinished_requests():
            return done
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    raise AssertionError("the engine did not finish its requests")


GEOMETRY = dict(max_num_seqs=8, max_model_len=96, num_kv_blocks=48, block_size=8)


@pytest.fixture(scope="module")
def llm(tiny_folder):
    return LLM(tiny_folder, **GEOMETRY)


@pytest.fixture(scope="module", params=["one round per call", "rounds", "ngram"])
def each_path(request, tiny_folder, llm):
    """An engine for each way a step runs: a single plain round, several rounds per call, and
    speculative rounds."""
    if request.param == "rounds":
        return llm
    kw = dict(GEOMETRY, num_scheduler_steps=1) if request.param == "one round per call" else dict(
        GEOMETRY, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    return LLM(tiny_folder, **kw)


# -- unseeded keys --------------------------------------------------------------------------

def test_unseeded_requests_of_one_generate_get_their_own_keys(tiny_folder):
    kw = dict(max_num_seqs=4, max_model_len=64, num_scheduler_steps=1)
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    prompt = _prompts(1, seed=1)[0]
    batch = _ids(LLM(tiny_folder, **kw).generate([prompt] * 4, params, use_tqdm=False))
    assert len({tuple(t) for t in batch}) == 4
    # the counter advances per request: the same keys as four requests added one by one
    eng = LLM(tiny_folder, **kw).engine
    for i in range(4):
        eng.add_request(f"r{i}", prompt, params)
    done = _drain(eng)
    assert [done[f"r{i}"].outputs[0].token_ids for i in range(4)] == batch


# -- validation at admission -----------------------------------------------------------------

HOSTILE = [
    (dict(top_k=2.0), InvalidType, "top_k"), (dict(top_k="5"), InvalidType, "top_k"),
    (dict(top_k=-2), ValueError, "top_k"), (dict(logprobs=2.5), InvalidType, "logprobs"),
    (dict(logprobs=True), InvalidType, "logprobs"), (dict(logprobs=21), ValueError, "logprobs"),
    (dict(logit_bias={5: math.nan}), ValueError, r"logit_bias\[5\]"),
    (dict(logit_bias={5: "x"}), InvalidType, r"logit_bias\[5\]"),
    (dict(logit_bias=[1, 2]), InvalidType, "logit_bias"),
    (dict(logit_bias={-3: 1.0}), ValueError, "logit_bias key"),
    (dict(temperature=math.inf), ValueError, "temperature"),
    (dict(temperature=math.nan), ValueError, "temperature"),
    (dict(temperature="0.5"), InvalidType, "temperature"),
    (dict(top_p=math.nan), ValueError, "top_p"), (dict(min_p=-0.1), ValueError, "min_p"),
    (dict(presence_penalty=math.inf), ValueError, "presence_penalty"),
    (dict(repetition_penalty=math.inf), ValueError, "repetition_penalty"),
    (dict(max_tokens=8.5), InvalidType, "max_tokens"), (dict(max_tokens=0), ValueError, "max_tokens"),
    (dict(min_tokens=-1), ValueError, "min_tokens"), (dict(min_tokens=1.0), InvalidType, "min_tokens"),
    (dict(seed=1.5), InvalidType, "seed"), (dict(seed=-1), ValueError, "seed"),
    (dict(seed=2**64), ValueError, "seed"), (dict(seed="7"), InvalidType, "seed"),
    (dict(n=0), ValueError, "n"), (dict(n=1025), ValueError, "n"),
    (dict(stop=[3]), InvalidType, r"stop\[0\]"),
    (dict(stop="\udcff"), ValueError, r"stop\[0\]"), (dict(stop=5), InvalidType, "stop"),
    (dict(stop_token_ids=[1.0]), InvalidType, r"stop_token_ids\[0\]"),
    (dict(allowed_token_ids=[]), ValueError, "allowed_token_ids"),
    (dict(allowed_token_ids=[3, -1]), ValueError, r"allowed_token_ids\[1\] = -1"),
    (dict(ignore_eos="yes"), InvalidType, "ignore_eos"),
    (dict(spec_exactness="exact-ish"), ValueError, "spec_exactness"),
]


@pytest.mark.parametrize("kwargs, error, field", HOSTILE)
def test_hostile_params_are_refused_naming_the_field(kwargs, error, field):
    with pytest.raises(error, match=rf"SamplingParams\.{field}.* must be"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, error, field", HOSTILE[::6])
def test_params_changed_after_construction_are_checked_when_added(llm, kwargs, error, field):
    good = _prompts(2, seed=2)
    ref = _ids(llm.generate(good, GREEDY, use_tqdm=False))
    params = SamplingParams(max_tokens=10, seed=1)
    for name, value in kwargs.items():
        setattr(params, name, value)
    eng = llm.engine
    eng.add_request("keep-0", good[0], GREEDY)
    with pytest.raises(error, match=rf"SamplingParams\.{field}"):
        eng.add_request("bad", good[1], params)
    with pytest.raises(error, match=rf"prompt 1: SamplingParams\.{field}"):
        llm.generate([good[0], good[1]], [GREEDY, params], use_tqdm=False)
    eng.add_request("keep-1", good[1], GREEDY)
    done = _drain(eng)
    assert [done["keep-0"].outputs[0].token_ids, done["keep-1"].outputs[0].token_ids] == ref
    check_idle(eng)


def test_the_engine_keeps_its_own_copy_of_the_params(llm):
    prompt = _prompts(1, seed=3)[0]
    ref = _ids(llm.generate(prompt, SEEDED, use_tqdm=False))
    params = SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=10, ignore_eos=True)
    llm.engine.add_request("copied", prompt, params)
    llm.engine.step()
    params.top_p, params.temperature = 0.0, -1          # changed while it runs: not seen
    assert _drain(llm.engine)["copied"].outputs[0].token_ids == ref[0]


def test_allowed_tokens_that_are_all_stops_under_min_tokens_are_refused(llm):
    """Every allowed token held back by min_tokens would leave no token to draw (the draw gave
    id 0, which allowed_token_ids excludes): refused at admission, here and in sfjax.functional;
    with ignore_eos the EOS id is no stop, and without min_tokens the stop may come first."""
    from sfjax import functional as F
    eos = sorted(llm.engine.eos_token_ids)
    bad = [dict(stop_token_ids=[7], allowed_token_ids=[7], min_tokens=3),
           dict(allowed_token_ids=eos, min_tokens=1)]
    for kw in bad:
        params = SamplingParams(temperature=0, max_tokens=4, **kw)
        with pytest.raises(ValueError, match=r"^prompt 0: SamplingParams\.min_tokens = \d is out of "
                                             r"range: every allowed_token_ids entry is a stop token"):
            llm.generate("x", params, use_tqdm=False)
        with pytest.raises(ValueError, match=r"^SamplingParams\.min_tokens = \d is out of range"):
            F.Sampling.from_params(params, eos_token_ids=eos)
    fine = [dict(allowed_token_ids=eos, min_tokens=2, ignore_eos=True),
            dict(stop_token_ids=[7], allowed_token_ids=[7, 9], min_tokens=2),
            dict(stop_token_ids=[7], allowed_token_ids=[7])]
    outs = llm.generate(["x"] * 3, [SamplingParams(temperature=0, max_tokens=4, **kw) for kw in fine],
                        use_tqdm=False)
    assert outs[0].outputs[0].token_ids == eos[:1] * 4
    assert outs[1].outputs[0].token_ids[:2] == [9, 9]
    assert outs[2].outputs[0].token_ids == [7] and outs[2].outputs[0].finish_reason == "stop"


def test_top_k_at_least_the_vocabulary_is_off(llm):
    prompts = _prompts(3, seed=4)
    off = _ids(llm.generate(prompts, SamplingParams(temperature=0.8, seed=5, max_tokens=10,
                                                    ignore_eos=True), use_tqdm=False))
    for k in (512, 2**31, 2**70):
        params = SamplingParams(temperature=0.8, top_k=k, seed=5, max_tokens=10, ignore_eos=True)
        assert _ids(llm.generate(prompts, params, use_tqdm=False)) == off


@pytest.mark.parametrize("prompt, error, match", [
    (None, InvalidType, "prompts: must be"), (12, InvalidType, "prompts: must be"),
    ([12], InvalidType, "prompt 0: prompt must be a str"),
    (["ok", "bad \udcff"], ValueError, r"prompt 1: prompt = 'bad \\udcff' is not valid text"),
    ([{"prompt_token_ids": [3, 4.0]}], InvalidType, r"prompt_token_ids\[1\] = 4.0"),
    ([{"prompt_token_ids": [3, True]}], InvalidType, r"prompt_token_ids\[1\] = True"),
    ([{"prompt_token_ids": "abc"}], InvalidType, "prompt_token_ids"),
    ([{"prompt_token_ids": [3, 512]}], ValueError, r"prompt_token_ids\[1\] = 512 .*\[0, 512\)"),
    ([{"prompt_token_ids": []}], ValueError, "empty"),
    ([{"prompt": 5}], InvalidType, "prompt = 5"),
    ([{"prompt": "x", "multi_modal_data": {"image": 1}}], ValueError,   # was dropped unread
     "prompt 0: prompt: 'multi_modal_data' is not offered"),
])
def test_bad_prompts_name_the_prompt(llm, prompt, error, match):
    with pytest.raises(error, match=match):
        llm.generate(prompt, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_the_empty_string_is_a_prompt(llm):
    [out] = llm.generate("", GREEDY, use_tqdm=False)
    assert out.prompt_token_ids == [0] and len(out.outputs[0].token_ids) == 10      # <s> alone


def test_use_tqdm_may_be_the_progress_bar_class(llm):
    """vLLM's ``use_tqdm`` takes the tqdm class to draw the bar with (it drew sfjax's own)."""
    from tqdm import tqdm
    made = []

    class Bar(tqdm):
        def __init__(self, *args, **kwargs):
            made.append(kwargs["total"])
            super().__init__(*args, **kwargs)
    [out] = llm.generate("x", GREEDY, use_tqdm=Bar)
    assert made == [10] and len(out.outputs[0].token_ids) == 10


def test_bad_request_ids(llm):
    with pytest.raises(InvalidType, match="request_id = 7"):
        llm.engine.add_request(7, "x", GREEDY)
    llm.engine.add_request("dup", "x", GREEDY)
    with pytest.raises(ValueError, match="'dup' is already in the engine"):
        llm.engine.add_request("dup", "x", GREEDY)
    _drain(llm.engine)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(max_model_len=0), ValueError, "max_model_len = 0"),
    (dict(num_kv_blocks=0), ValueError, "num_kv_blocks = 0"),
    (dict(seed=-1), ValueError, "seed = -1"), (dict(seed=1.5), InvalidType, "seed = 1.5"),
    (dict(max_num_seqs=2.0), InvalidType, "max_num_seqs = 2.0"),
    (dict(block_size="16"), InvalidType, "block_size"),
    (dict(num_scheduler_steps=True), InvalidType, "num_scheduler_steps"),
    (dict(enable_prefix_caching="no"), InvalidType, "enable_prefix_caching"),
    (dict(kv_cache_bytes=0), ValueError, "kv_cache_bytes"),
    (dict(attention="fast"), ValueError, "attention = 'fast'"),
    (dict(sampler="bogus"), ValueError, "EngineConfig.sampler = 'bogus': must be one of 'auto'"),
    (dict(matmul="cublas"), ValueError, "EngineConfig.matmul = 'cublas': must be one of None, 'auto', 'interpret'"),
    (dict(dtype="int8"), ValueError, "dtype = 'int8'"),
    (dict(compiler_options={"xla_no_such_option": 1}), ValueError,
     "compiler_options = .*No such compile option: 'xla_no_such_option'"),
    (dict(compiler_options={"xla_backend_optimization_level": "high"}), ValueError,
     "compiler_options = .*xla_backend_optimization_level"),
    (dict(compiler_options=[1]), InvalidType, r"compiler_options = \[1\]"),
    (dict(tensor_parallel_size=0), ValueError, "tensor_parallel_size = 0"),
    (dict(model=3), InvalidType, "model = 3"),
    (dict(speculative_config={}), ValueError, r"speculative_config\.method is required"),
    # upper bounds: past them numpy or XLA ran out of memory, naming nothing
    (dict(block_size=2**30), ValueError, r"EngineConfig\.block_size = 1073741824 is out of range"),
    (dict(block_size=3), ValueError, r"EngineConfig\.block_size = 3 is out of range: must be a "
                                     r"power of two in \[1, 4096\]"),
    (dict(row_tile=10**6), ValueError, r"EngineConfig\.row_tile = 1000000 is out of range"),
    (dict(max_num_seqs=10**9), ValueError, r"EngineConfig\.max_num_seqs = 1000000000 is out of"),
    (dict(tokenizer=123), ValueError, r"tokenizer = 123: must be a folder"),
    (dict(tokenizer="/nonexistent"), ValueError, r"tokenizer = '/nonexistent': must be a folder"),
    (dict(speculative_config={"method": "foo"}), ValueError,
     r"speculative_config\.method = 'foo': must be one of"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": True}), InvalidType,
     r"speculative_config\.num_speculative_tokens = True"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                              "posterior_alpha": math.nan}), ValueError, "posterior_alpha = nan"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                              "max_model_len": 0}), ValueError, r"speculative_config\.max_model_len"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "model": "x"}),
     ValueError, r"speculative_config\.model: method 'ngram' drafts from the sequence"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                              "draft_tensor_parallel_size": 2}), ValueError,
     r"speculative_config\.draft_tensor_parallel_size = 2: only method 'draft_model' shards its "
     r"drafter; must be 1 or None for 'ngram'"),
    (dict(speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": "x",
                              "draft_tensor_parallel_size": 2}), ValueError,
     r"speculative_config\.draft_tensor_parallel_size \(2\) must divide the target's "
     r"tensor_parallel_size \(1\)"),
])
def test_bad_engine_settings_are_refused_before_loading(tiny_folder, kwargs, error, match):
    kwargs = {"model": tiny_folder, **kwargs}
    with pytest.raises(error, match=match):
        LLM(**kwargs)


def test_what_config_json_decides_is_refused_before_the_weights_load(tiny_folder, monkeypatch):
    """max_model_len past the model's context was refused only once the engine was built, after
    the tokenizer and every weight had loaded (minutes for a large model)."""
    import sfjax.llm

    def load(*args, **kwargs):
        raise AssertionError("the weights loaded before the settings were checked")
    monkeypatch.setattr(sfjax.llm, "load", load)
    with pytest.raises(ValueError, match=r"max_model_len \(1025\) must be <= the model's "
                                         r"max_position_embeddings \(1024\)"):
        LLM(tiny_folder, max_model_len=1025)


def test_a_context_past_the_default_cache_serves_what_the_cache_holds(tiny_folder, caplog):
    """A model whose context outgrows kv_cache_bytes (a 128K-context model and the default 1
    GiB) refused every request that asks for the rest of the context (a chat without
    max_tokens): max_model_len, left to the model, is now what one sequence's cache holds. A
    length given outright is kept, with a warning (a request needing more is refused)."""
    from sfjax import toy
    from sfjax.cache import KVCache

    cache = 16 * KVCache.bytes_per_block(toy.tiny_config(), 16)       # 256 of its 1024 tokens
    with caplog.at_level("WARNING", logger="sfjax"):
        llm = LLM(tiny_folder, kv_cache_bytes=cache, small_row_tiles=False)
        kept = LLM(tiny_folder, kv_cache_bytes=cache, max_model_len=512, small_row_tiles=False)
    assert (llm.engine.config.max_model_len, kept.engine.config.max_model_len) == (256, 512)
    said = [r.getMessage() for r in caplog.records]
    assert any("the model's context (1024) needs more KV cache than kv_cache_bytes" in m
               and "serving at max_model_len 256" in m for m in said), said
    assert any("holds 256 tokens of one sequence, fewer than max_model_len (512)" in m
               for m in said), said
    out = llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=None,
                                                                     ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert (len(out.token_ids), out.finish_reason) == (254, "length")


def test_a_head_folder_given_as_a_draft_model_is_named(tiny_folder):
    from sfjax.default_model import default_eagle_path
    with pytest.raises(ValueError, match=r"^speculative_config\.model: '.*eagle3': unsupported "
                                         r"architecture \['LlamaForCausalLMEagle3'\]"):
        LLM(tiny_folder, speculative_config={"method": "draft_model", "num_speculative_tokens": 2,
                                             "model": default_eagle_path()})


def test_a_request_the_cache_can_never_hold_names_what_to_change(tiny_folder):
    llm = LLM(tiny_folder, num_kv_blocks=4, block_size=8, max_model_len=64, small_row_tiles=False)
    for params, match in ((SamplingParams(max_tokens=30), r"max_tokens \(30\) needs 4 KV blocks"),
                          (SamplingParams(max_tokens=None), r"max_tokens \(62, the room left under "
                                                            r"max_model_len\) needs 8 KV blocks")):
        with pytest.raises(ValueError, match=r"^prompt 0: prompt \(2 tokens\) \+ " + match + r"; the cache "
                           r"has only 3 \(raise num_kv_blocks or kv_cache_bytes, or ask for fewer"):
            llm.generate({"prompt_token_ids": [5, 6]}, params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_the_token_budget_defaults_to_at_least_the_slots():
    """``max_num_batched_tokens`` None is max(512, max_num_seqs), for ``LLM`` and a bare
    ``EngineConfig`` alike (a step must hold one token of every slot)."""
    from sfjax.engine.engine import EngineConfig
    assert EngineConfig().max_num_batched_tokens == 512
    assert EngineConfig(max_num_seqs=1000).max_num_batched_tokens == 1000
    with pytest.raises(ValueError, match=r"max_num_batched_tokens = 4 is out of range: must be "
                                         r"an int >= max_num_seqs \(8\)"):
        EngineConfig(max_num_seqs=8, max_num_batched_tokens=4)


# -- one request's failure -------------------------------------------------------------------

class Hostile(SamplingParams):
    """Params whose temperature cannot be read once armed: building the request's rows fails."""
    armed = False

    def __getattribute__(self, name):
        if name == "temperature" and object.__getattribute__(self, "armed"):
            raise RuntimeError("boom while building rows")
        return super().__getattribute__(name)


def _fails_detokenizing(req):
    def add(token):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "boom while detokenizing")
    req.detok.add = add


def _fails_building(req):
    req.params.armed = True


@pytest.mark.parametrize("inject", [_fails_detokenizing, _fails_building])
def test_a_failing_request_ends_alone(each_path, inject):
    llm = each_path
    good = _prompts(4, seed=6)
    params = [GREEDY, SEEDED, GREEDY, SEEDED]
    ref = _ids(llm.generate(good, params, use_tqdm=False))
    eng = llm.engine
    for i, (p, sp) in enumerate(zip(good, params)):
        eng.add_request(f"good-{i}", p, sp)
    eng.add_request("bad", _prompts(1, seed=7)[0], Hostile(temperature=0, max_tokens=10))
    eng.step()
    check_engine(eng)
    inject(eng.requests["bad"])
    done = _drain(eng)
    bad = done.pop("bad")
    assert bad.outputs[0].finish_reason == "error" and "boom" in bad.error
    assert [done[f"good-{i}"].outputs[0].token_ids for i in range(4)] == ref
    check_idle(eng)
    assert _ids(llm.generate(good, params, use_tqdm=False)) == ref          # it steps on


# -- the two APIs together, aborts ----------------------------------------------------------

def test_an_interrupted_generate_leaves_nothing_running(llm, monkeypatch):
    """Ctrl-C (or any error) inside generate's loop aborts its requests and forgets their
    outputs: they held every slot in later calls, and their outputs stayed held for ever."""
    step, calls = llm.engine.step, []

    def interrupted():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(_prompts(3, seed=1), SamplingParams(temperature=0, max_tokens=30),
                     use_tqdm=False)
    monkeypatch.undo()
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()
    check_idle(llm.engine)
    out = llm.generate("x", GREEDY, use_tqdm=False)
    assert len(out) == 1 and out[0].finished


def test_generate_returns_its_own_and_keeps_the_others(llm):
    eng = llm.engine
    mine, theirs = _prompts(2, seed=8)
    ref_mine, ref_theirs = _ids(llm.generate([mine, theirs], GREEDY, use_tqdm=False))
    eng.add_request("0", theirs, GREEDY)                # an id generate could have made before
    outs = llm.generate(mine, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [ref_mine] and outs[0].request_id != "0"
    [kept] = eng.step()                                 # ran to the end inside generate
    assert kept.request_id == "0" and kept.finished and kept.outputs[0].token_ids == ref_theirs
    assert kept.new_token_ids == ref_theirs             # every step's new tokens, in order
    assert not eng.has_unfinished_requests()


def test_abort_gives_a_final_output(llm):
    eng = llm.engine
    free = eng.allocator.num_free
    a, b = _prompts(2, seed=9)
    eng.add_request("running", a, GREEDY)
    eng.step()
    eng.add_request("waiting", b, GREEDY)
    eng.abort("running")
    eng.abort("waiting")
    eng.abort("unknown")
    assert eng.allocator.num_free == free
    outs = {o.request_id: o for o in eng.step()}
    assert set(outs) == {"running", "waiting"}
    for out in outs.values():
        assert out.finished and out.outputs[0].finish_reason == "abort"
    assert len(outs["running"].outputs[0].token_ids) >= 1 and not eng.has_unfinished_requests()
    assert eng.step() == []
    check_idle(eng)


# -- engines free what they compiled ---------------------------------------------------------

MEMORY_SCRIPT = textwrap.dedent("""
    import gc, json, sys
    import jax.numpy as jnp
    from sfjax import LLM, SamplingParams

    def maps():
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)

    def rss_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    folder, n = sys.argv[1], int(sys.argv[2])
    jnp.ones(3).block_until_ready()                     # the backend's own start-up first
    base, seen = (maps(), rss_mib()), {}
    for i in range(n):
        shape = i // 10 % 3                             # runs of ten: A B C A B C
        llm = LLM(folder, max_num_seqs=2, max_model_len=32 + 16 * shape, num_scheduler_steps=1,
                  small_row_tiles=False, enable_prefix_caching=False)
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=2),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
        del llm, out
        gc.collect()
        if i in (0, 10, n - 1):
            seen[i] = (maps(), rss_mib())
    print(json.dumps({"base": base, "seen": seen}))
""")


def test_a_round_traced_leaves_nothing_in_jaxs_trace_cache(tiny_folder):
    """An engine's round programs trace ``round.round_step`` inside them; JAX keeps what it
    traced a jitted function at, per shape, in a cache keyed weakly on the Python function
    (``trace_to_jaxpr``, unbounded). Traced as the module-level function, every shape a
    process ever ran a round at (each widened sampling table's, each logprobs bucket's) stayed
    there after the engine had let its programs go: a serving process grew about 1.7 MB per
    shape on the tiny model (500 MiB over a few hundred varied requests). Each trace jits its
    own wrapper (``functional._round_step``), which dies with the trace. JAX's cache is read
    through its internals, as nothing public shows it."""
    import gc
    from jax._src.interpreters import partial_eval as pe

    def round_step_entries() -> int:
        fns = [k[0]() for k in pe.trace_to_jaxpr.cache_keys()]
        return sum(getattr(getattr(f, "func", f), "__name__", "") == "round_step" for f in fns)

    gc.collect()
    before = round_step_entries()     # an eager F.prefill elsewhere in this process keeps its own
    llm = LLM(tiny_folder, max_num_seqs=3, max_model_len=56)    # shapes no other test compiles
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 2,
                        [SamplingParams(temperature=0, max_tokens=4, logprobs=1),
                         SamplingParams(temperature=0.8, seed=1, max_tokens=4,
                                        allowed_token_ids=list(range(2, 300)))],  # widened
                        use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    gc.collect()
    assert round_step_entries() == before


@pytest.mark.slow
def test_sixty_engines_stay_bounded(tiny_folder):
    """60 engines, one at a time, in runs of ten of three shapes (A B C A B C), with room for
    two shapes' programs in the program cache: an engine of a cached shape compiles nothing, and each run
    of a new shape compiles and frees the oldest shape's programs (four times after engine 10).
    The growth from engine 10 to the last is under two engines' footprint, in memory maps and in
    resident memory (with module-level jits each of those runs would keep a footprint)."""
    env = {**os.environ, "SFJAX_PROGRAM_CACHE": "6", "JAX_PLATFORMS": "cpu"}   # 3 per shape
    run = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, tiny_folder, "60"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    r = __import__("json").loads(run.stdout.strip().splitlines()[-1])
    (base_maps, base_rss), seen = r["base"], {int(k): v for k, v in r["seen"].items()}
    footprint = [seen[0][j] - (base_maps, base_rss)[j] for j in range(2)]
    growth = [seen[59][j] - seen[10][j] for j in range(2)]
    print(f"footprint of one engine: {footprint[0]} maps, {footprint[1]:.1f} MiB; "
          f"engine 10 -> 59: {growth[0]} maps, {growth[1]:.1f} MiB")
    assert footprint[0] > 0 and growth[0] < 2 * footprint[0]
    assert growth[1] < 2 * footprint[1]
