"""Hostile requests mixed with good ones on a live engine (hypothesis, a fixed corpus in CI).

Each example adds three good requests and a few hostile ones: fields of every type (wrong
types, NaN and infinities, huge and negative ints, lone surrogates, junk lists), set at
construction or changed after it, bad prompts and request ids. Each hostile request is either
refused by ``add_request`` with an error naming a field, or served to completion; the good
requests' tokens equal a clean run's; no block leaks; the engine serves on."""

import collections
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from engine_checks import check_idle
from sfjax import LLM, SamplingParams

FIELDS = [f.name for f in SamplingParams.__dataclass_fields__.values() if f.name != "n"]
NAMED = re.compile(r"SamplingParams\.n\b|\b(" + "|".join(
    FIELDS + ["prompt", "prompt_token_ids", "prompts", "request_id", "sampling_params"]) + r")\b")
COUNTS = collections.Counter()

junk = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=3),
    st.sampled_from(["\udcff", "0.5", "", "-1"]), st.lists(st.integers(-5, 600), max_size=5),
    st.dictionaries(st.integers(-5, 600), st.floats(allow_nan=True), max_size=3))
GOOD = {
    "temperature": st.sampled_from([0.0, 0.7, 1.0]), "top_p": st.sampled_from([1.0, 0.9, 0.5]),
    "top_k": st.sampled_from([0, -1, 5, 511, 512, 2**31]), "min_p": st.sampled_from([0.0, 0.1]),
    "presence_penalty": st.sampled_from([0.0, 1.5]), "frequency_penalty": st.sampled_from([0.0, -1.0]),
    "repetition_penalty": st.sampled_from([1.0, 1.3]), "seed": st.integers(0, 2**64 - 1),
    "max_tokens": st.integers(1, 8), "min_tokens": st.integers(0, 3),
    "logit_bias": st.dictionaries(st.integers(0, 511), st.floats(-200, 200), max_size=3),
    "allowed_token_ids": st.lists(st.integers(0, 511), min_size=1, max_size=5),
    "stop": st.lists(st.sampled_from(["a", "\n", "def"]), max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 511), max_size=3),
    "logprobs": st.sampled_from([None, 0, 3]), "prompt_logprobs": st.sampled_from([None, 2]),
    "ignore_eos": st.booleans(), "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(), "disable_spec_decode": st.booleans(),
}
fields = st.dictionaries(st.sampled_from(sorted(GOOD) + ["n", "spec_exactness"]), st.none(),
                         max_size=4).flatmap(lambda d: st.fixed_dictionaries(
                             {k: st.one_of(GOOD.get(k, junk), GOOD.get(k, junk), junk) for k in d}))
good_ids = st.fixed_dictionaries(
    {"prompt_token_ids": st.lists(st.integers(0, 511), min_size=1, max_size=30)})
prompts = st.one_of(
    st.text(max_size=12), good_ids, good_ids,
    st.sampled_from([None, 3, [], {"prompt": None}, "ab\udcff"]),
    st.fixed_dictionaries({"prompt_token_ids": st.one_of(st.lists(junk, max_size=3), junk)}))
hostile = st.fixed_dictionaries({"prompt": prompts, "fields": fields, "mutate": st.booleans(),
                                 "rid": st.one_of(st.none(), st.sampled_from([7, "good-0", ""]))})


def _good():
    rng = np.random.default_rng(0)
    ps = [{"prompt_token_ids": rng.integers(2, 512, n).tolist()} for n in (5, 17, 9)]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, presence_penalty=1.0,
                             repetition_penalty=1.2, seed=11, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=7, seed=12, max_tokens=8, stop_token_ids=[9])]
    return ps, params


@pytest.fixture(scope="module")
def live(tiny_folder):
    llm = LLM(tiny_folder, max_num_seqs=4, max_model_len=64, num_kv_blocks=40, block_size=8,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    ps, params = _good()
    refs = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
    yield llm, ps, params, refs
    print(f"\nfuzz corpus: {dict(COUNTS)}")


def _params(fields: dict, mutate: bool):
    """The request's params: built from the fields, or valid ones changed afterwards."""
    if not mutate:
        try:
            return SamplingParams(**fields)
        except ValueError as e:                       # InvalidType is one too
            assert NAMED.search(str(e)), f"no field named in: {e}"
            COUNTS["refused at construction"] += 1
    params = SamplingParams(max_tokens=4)
    for k, v in fields.items():
        setattr(params, k, v)
    return params


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(hostile, min_size=1, max_size=3))
def test_hostile_requests_are_refused_or_served(live, requests):
    llm, ps, params, refs = live
    eng = llm.engine
    n = COUNTS["examples"]
    COUNTS["examples"] += 1
    for i, (p, sp) in enumerate(zip(ps, params)):
        eng.add_request(f"good-{i}", p, sp)
    served = set()
    for j, h in enumerate(requests):
        COUNTS["cases"] += 1
        rid = h["rid"] if h["rid"] is not None else f"hostile-{n}-{j}"
        try:
            eng.add_request(rid, h["prompt"], _params(h["fields"], h["mutate"]))
        except ValueError as e:
            assert NAMED.search(str(e)), f"no field named in: {e}"
            COUNTS["refused at add_request"] += 1
            continue
        served.add(rid)
    done = {}
    for _ in range(400):
        if not eng.has_unfinished_requests():
            break
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert not eng.has_unfinished_requests()
    assert [done[f"good-{i}"].outputs[0].token_ids for i in range(3)] == refs
    for rid in served:
        assert done[rid].outputs[0].finish_reason in ("stop", "length"), done[rid]
        COUNTS["served"] += 1
    check_idle(eng)
