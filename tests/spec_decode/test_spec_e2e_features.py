"""Speculation keeps every output feature of plain decoding: EOS from generation_config, stop
tokens and max_tokens inside an accepted run, the draft's max_model_len, disable_by_batch_size,
per-request opt-out, logprobs, and detokenized text; nothing is left holding KV blocks."""

import dataclasses
import json
import os
import shutil

import pytest

from sfjax import LLM, SamplingParams
from spec_util import (BATCH8_SEED, GEOMETRY, SHORT, assert_same_outputs, delta, greedy, ids,
                       one_by_one, prompts, repeated_prompts, run, sampled, spec_counters)

ONE = SHORT[:1]


def _all_free(llm):
    return llm.engine.allocator.num_free == llm.engine.config.num_kv_blocks - 1


@pytest.fixture(scope="module")
def eos_folders(tiny_folder, plain_llm, tmp_path_factory):
    """A copy of the target whose generation_config EOS is a token the plain greedy output of
    the first prompt emits mid-way (first at index >= 3)."""
    ps = prompts(8, seed=BATCH8_SEED)
    base = ids(run(plain_llm, ps, greedy()))
    eos = next(t for i, t in enumerate(base[0]) if i >= 3 and base[0].index(t) == i)
    folder = str(tmp_path_factory.mktemp("eos") / "m")
    shutil.copytree(tiny_folder, folder)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [eos]}, f)
    return folder, eos, ps, base


@pytest.mark.parametrize("draft", ["same", "near"])
def test_eos_from_generation_config_ends_where_plain_ends(spec_llm, eos_folders, draft):
    folder, eos, ps, base = eos_folders
    plain = LLM(folder, **GEOMETRY)
    llm = spec_llm(draft, 3, folder=folder)
    stop = run(llm, ps, greedy(ignore_eos=False))
    assert_same_outputs(stop, run(plain, ps, greedy(ignore_eos=False)))
    first = base[0].index(eos)
    out = stop[0].outputs[0]
    assert out.token_ids == base[0][:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    for o, b in zip(stop, base):
        n = len(o.outputs[0].token_ids)
        assert o.outputs[0].token_ids == b[:n]
        assert (eos in b) == (o.outputs[0].finish_reason == "stop")
    # ignore_eos: the whole plain output, through the EOS
    assert_same_outputs(run(llm, ps, greedy()), run(plain, ps, greedy()))
    assert ids(run(llm, ps, greedy())) == base
    for params in (sampled(8, ignore_eos=False, seed=BATCH8_SEED), sampled(8, seed=BATCH8_SEED)):
        assert_same_outputs(run(llm, ps, params), run(plain, ps, params))
    assert _all_free(llm)


def test_stop_token_ids_and_max_tokens_inside_an_accepted_run(spec_llm, plain_llm):
    # the target drafts for itself: every round accepts all 8 drafts and emits 9 tokens, so the
    # stops and the max_tokens below fall inside accepted runs
    llm = spec_llm("same", 8)
    assert _all_free(llm)
    base = ids(run(plain_llm, ONE, greedy(30)))[0]
    steps = lambda: llm.get_metrics()["steps"]
    for i in (1, 4, 7, 9, 13):
        stop = base[i]
        first = base.index(stop)
        for min_tokens in (0, first + 2):
            params = greedy(30, stop_token_ids=[stop], min_tokens=min_tokens)
            s0 = steps()
            got = run(llm, ONE, params)
            assert_same_outputs(got, run(plain_llm, ONE, params))
            if min_tokens == 0:
                assert got[0].outputs[0].token_ids == base[:first + 1]
                assert (got[0].outputs[0].finish_reason, got[0].outputs[0].stop_reason) == ("stop", stop)
                # the prefill step, then rounds of 9 tokens: the stop came inside one of them
                assert steps() - s0 == 1 + -(-first // 9)
            assert _all_free(llm)
    for max_tokens in range(1, 13):
        for params in (greedy(max_tokens), sampled(1, max_tokens, seed=max_tokens)[0]):
            s0 = steps()
            got = run(llm, ONE, params)
            assert_same_outputs(got, run(plain_llm, ONE, params))
            assert len(got[0].outputs[0].token_ids) == max_tokens
            assert got[0].outputs[0].finish_reason == "length"
            if params.temperature == 0:
                assert steps() - s0 == 1 + -(-(max_tokens - 1) // 9)
            assert _all_free(llm)
    # a stop string: the host ends the text where plain decoding does
    text = run(plain_llm, ONE, greedy(30))[0].outputs[0].text
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[text[8:11]])
    assert_same_outputs(run(llm, ONE, params), run(plain_llm, ONE, params))
    assert _all_free(llm)


@pytest.mark.parametrize("draft", ["same", "near"])
def test_draft_max_model_len_32_with_64_tokens(spec_llm, plain_llm, draft):
    llm = spec_llm(draft, 3, max_model_len=32)
    for params in (greedy(64), sampled(1, 64, seed=32)[0]):
        before, steps = spec_counters(llm), llm.get_metrics()["steps"]
        got = run(llm, ONE, params)
        assert_same_outputs(got, run(plain_llm, ONE, params))
        assert len(got[0].outputs[0].token_ids) == 64
        d = delta(before, spec_counters(llm))
        rounds = llm.get_metrics()["steps"] - steps - 1       # the first step is the prefill
        assert 0 < d["num_drafts"] < rounds
        # no round drafted past the draft's limit: 5 prompt tokens + 64 output, drafts stop at 32
        assert d["num_drafts"] <= 32 - len(ONE[0]["prompt_token_ids"])
    assert _all_free(llm)


def test_disable_by_batch_size_2_at_batch_8(spec_llm, plain_llm):
    llm = spec_llm("near", 3, disable_by_batch_size=2)
    eng = llm.engine
    # one round per call here, so the running count before a call is its round's (several rounds
    # per call apply the rule round by round: tests/test_rounds.py gives the same counters)
    shared = eng.config
    eng.config = dataclasses.replace(shared, num_scheduler_steps=1)
    try:
        _disable_by_batch_size(llm, eng, plain_llm)
    finally:
        eng.config = shared


def _disable_by_batch_size(llm, eng, plain_llm):
    ps = prompts(8, seed=BATCH8_SEED)
    # the last request runs alone for its last tokens, and drafts then
    params = [greedy(6 + i) for i in range(7)] + [greedy(24)]
    ref = ids(run(plain_llm, ps, params))
    for i, (p, sp) in enumerate(zip(ps, params)):
        eng.add_request(f"dbs-{i}", p, sp)
    done, drafted_alone = {}, 0
    while eng.has_unfinished_requests():
        running = len(eng.scheduler.running) + len(eng.scheduler.waiting)
        before = spec_counters(llm)
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        d = delta(before, spec_counters(llm))
        if running >= 2:
            assert d["num_drafts"] == 0
        else:
            drafted_alone += d["num_drafts"]
    assert [done[f"dbs-{i}"] for i in range(8)] == ref
    assert drafted_alone > 0
    assert _all_free(llm)


def test_opt_out_in_a_mixed_batch(spec_llm, plain_llm):
    llm = spec_llm("near", 3)
    ps = prompts(8, seed=BATCH8_SEED)
    for base in (greedy(), None):
        params = [greedy() for _ in ps] if base else sampled(8, seed=BATCH8_SEED)
        params = [SamplingParams(**{**vars(p), "disable_spec_decode": i % 2 == 1})
                  for i, p in enumerate(params)]
        before = spec_counters(llm)
        got = run(llm, ps, params)
        assert_same_outputs(got, run(plain_llm, ps, params))
        for i, o in enumerate(got):
            if i % 2:
                assert o.certificate.strategy == "none"
            else:
                assert (o.certificate.strategy, o.certificate.exactness) == ("draft_model/exact", "path-exact")
        assert delta(before, spec_counters(llm))["num_drafts"] > 0
    assert _all_free(llm)


def _check_logprobs(got, ref):
    assert_same_outputs(got, ref)
    for g, r in zip(got, ref):
        g, r = g.outputs[0], r.outputs[0]
        assert len(g.logprobs) == len(g.token_ids)
        assert g.logprobs == r.logprobs                  # dicts of Logprob, exactly
        assert g.cumulative_logprob == r.cumulative_logprob
        assert all(len(lp) in (5, 6) and t in lp for lp, t in zip(g.logprobs, g.token_ids))


def test_logprobs_equal_plain_draft_model(spec_llm, plain_llm):
    llm = spec_llm("near", 3)
    ps = prompts(8, seed=BATCH8_SEED)
    for params in ([greedy(logprobs=5)] * 8, sampled(8, seed=BATCH8_SEED, logprobs=5)):
        _check_logprobs(run(llm, ps, params), run(plain_llm, ps, params))


def test_logprobs_equal_plain_ngram(spec_llm, plain_llm):
    llm = spec_llm(None, 3, "ngram", prompt_lookup_min=1, prompt_lookup_max=3)
    ps = repeated_prompts(3, seed=3, short=True)
    params = [greedy(logprobs=5)] + sampled(3, seed=3, logprobs=5)
    before = spec_counters(llm)
    _check_logprobs(one_by_one(llm, ps, params), one_by_one(plain_llm, ps, params))
    assert delta(before, spec_counters(llm))["num_accepted_tokens"] > 0


def test_text_is_the_decode_of_the_tokens(spec_llm, plain_llm):
    llm = spec_llm("near", 3)
    tok = llm.get_tokenizer()
    texts = ["def fibonacci(n):", "The quick brown fox", "Once upon a time", "class Cache:"]
    params = [greedy(ignore_eos=False)] + sampled(3, seed=4, ignore_eos=False)
    got = one_by_one(llm, texts, params)
    assert_same_outputs(got, one_by_one(plain_llm, texts, params))
    for o in got:
        assert o.prompt_token_ids == tok.encode(o.prompt).ids
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)
