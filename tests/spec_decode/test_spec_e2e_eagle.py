"""EAGLE-3 speculation (``"method": "eagle3"``) equals plain decoding token for token: k at every
row-tile boundary and 63, batch sizes 1..32, block sizes 8..32, greedy and seeded sampling with
penalties; under ``rejection_sampler`` a seeded request's tokens do not depend on its batch, the
scheduler steps or the prefix cache; heads that cannot draft are refused naming the field."""

import json
import os

import pytest

from engine_checks import RUNS_LONG
from sfjax import LLM, SamplingParams
from spec_util import (BATCH8_SEED, GEOMETRY, SHORT, assert_same_outputs, delta,
                       greedy, ids, one_by_one, prompts, run, sampled, spec_counters)
from test_spec_e2e_draft import check_counters


def _eagle(spec_llm, head, k, **kw):
    return spec_llm(None, k, "eagle3", model=head, **kw)


# k + 1 verify rows: a tile of 2 (k 1), part of a tile of 8 (4), two tiles of 8 (8); the
# draft-model matrix walks every boundary with the same round, and k 63 is below
@pytest.mark.parametrize("k", [1, 4, 8])
def test_k_sweep_equals_plain_at_batch_1(spec_llm, plain_llm, eagle_head, k):
    params = [greedy()] + sampled(4, seed=10 * k)
    llm = _eagle(spec_llm, eagle_head, k)
    before = spec_counters(llm)
    assert_same_outputs(one_by_one(llm, SHORT, params), one_by_one(plain_llm, SHORT, params))
    d = delta(before, spec_counters(llm))
    check_counters(d, k)
    assert d["num_drafts"] > 0
    cert = llm.generate(SHORT[0], greedy(2), use_tqdm=False)[0].certificate
    assert (cert.strategy, cert.exactness) == ("eagle3/exact", "path-exact")


def test_batch_8_and_32_equal_plain(spec_llm, plain_llm, eagle_head):
    llm = _eagle(spec_llm, eagle_head, 3)
    before = spec_counters(llm)
    ps = prompts(8, seed=BATCH8_SEED)
    for params in (greedy(), sampled(8, seed=BATCH8_SEED)):
        assert_same_outputs(run(llm, ps, params), run(plain_llm, ps, params))
    ps = prompts(32, seed=32, lo=2, hi=9)
    params = sampled(32, 12, seed=32)
    ref = [out for p, sp in zip(ps, params) for out in run(plain_llm, [p], sp)]
    assert_same_outputs(run(llm, ps, params), ref)
    d = delta(before, spec_counters(llm))
    check_counters(d, 3)
    assert 0 < d["num_accepted_tokens"] < d["num_draft_tokens"]


@pytest.mark.parametrize("block_size", [8, 32])
def test_block_sizes_equal_plain(spec_llm, plain_llm, eagle_head, block_size):
    ps = [{"prompt_token_ids": [480, 2, 2, 2]}, {"prompt_token_ids": [17, 250, 9]}]
    llm = _eagle(spec_llm, eagle_head, 3, block_size=block_size)
    for params in (greedy(40), sampled(2, 40, seed=3)):
        assert_same_outputs(run(llm, ps, params), run(plain_llm, ps, params))
    assert llm.engine.allocator.num_free == llm.engine.config.num_kv_blocks - 1


@pytest.mark.slow
def test_k_63_equals_plain_at_batch_1(spec_llm, plain_llm, eagle_head):
    params = [greedy(70)] + sampled(2, 70, seed=63)
    llm = _eagle(spec_llm, eagle_head, 63, compiler_options=RUNS_LONG)   # 64 rows a round
    before = spec_counters(llm)
    assert_same_outputs(one_by_one(llm, SHORT, params), one_by_one(plain_llm, SHORT, params))
    check_counters(delta(before, spec_counters(llm)), 63)


def test_rejection_sampler_tokens_do_not_depend_on_batch_steps_or_prefix_cache(tiny_folder,
                                                                                eagle_head):
    """A seeded, penalised request under rejection sampling draws its drafts from the head's
    state, which is a function of its own tokens alone: the same tokens alone or after others,
    with 1 or 8 scheduler steps, and with a prefix cache shared with another prompt."""
    spec = {"method": "eagle3", "model": eagle_head, "num_speculative_tokens": 3,
            "acceptance_method": "rejection_sampler"}
    shared = prompts(1, seed=5, lo=20, hi=21)[0]["prompt_token_ids"]
    ps = [{"prompt_token_ids": shared + [7, 9]}, {"prompt_token_ids": shared + [11]}]
    params = SamplingParams(temperature=0.8, seed=4, max_tokens=30, ignore_eos=True,
                            presence_penalty=0.7, repetition_penalty=1.3)
    got = {}
    for steps, cache in ((1, False), (8, True)):
        llm = LLM(tiny_folder, block_size=8, num_scheduler_steps=steps,
                  enable_prefix_caching=cache, speculative_config=spec, **GEOMETRY)
        alone = ids(run(llm, [ps[1]], params))
        run(llm, [ps[0]], params)                         # fills the prefix cache
        after = ids(run(llm, [ps[1]], params))
        together = ids(run(llm, ps, params))[1]
        got[steps, cache] = (alone[0], after[0], together)
        if cache:
            assert llm.get_metrics()["prefix_cache"]["hit_tokens"] > 0
    first = next(iter(got.values()))[0]
    assert all(v == (first, first, first) for v in got.values())
    m = llm.get_metrics()["spec_decode"]
    assert 0 < m["num_accepted_tokens"] < m["num_draft_tokens"]


def test_a_cache_hit_reads_nothing_the_slots_last_request_left(tiny_folder, eagle_head):
    """The head's row before a cache hit's first computed position is the cached request's:
    the features the slot's last request kept are dropped at admission (``eagle.forget``),
    whatever position they were at. So a seeded request under rejection sampling gets the
    tokens and acceptance it gets without the cache, after requests of every length near the
    hit's end (one slot's worth at a time: each runs in slot 0)."""
    spec = {"method": "eagle3", "model": eagle_head, "num_speculative_tokens": 3,
            "acceptance_method": "rejection_sampler"}
    shared = prompts(1, seed=6, lo=24, hi=25)[0]["prompt_token_ids"]
    params = SamplingParams(temperature=0.8, seed=4, max_tokens=12, ignore_eos=True)
    kw = dict(block_size=8, speculative_config=spec, **GEOMETRY)
    fresh, llm = LLM(tiny_folder, enable_prefix_caching=False, **kw), LLM(tiny_folder, **kw)
    run(llm, [{"prompt_token_ids": shared}], greedy(4))         # the cached blocks
    for n in range(13, 20):               # the slot's last request ends at length n
        run(llm, prompts(1, seed=n, lo=n - 4, hi=n - 3), greedy(4))
        p = {"prompt_token_ids": shared[:17] + [n, 2 * n, 3 * n]}   # hits 16 tokens, then its own
        hits = llm.get_metrics()["prefix_cache"]["hit_tokens"]
        got, want = run(llm, [p], params)[0], run(fresh, [p], params)[0]
        assert llm.get_metrics()["prefix_cache"]["hit_tokens"] - hits == 16
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, n
        assert got.metrics.spec_decode == want.metrics.spec_decode, n


def test_prefix_caching_under_preemption_equals_plain(tiny_folder, eagle_head):
    spec = {"method": "eagle3", "model": eagle_head, "num_speculative_tokens": 3}
    shared = prompts(1, seed=3, lo=21, hi=22)[0]["prompt_token_ids"]
    ps = [{"prompt_token_ids": (shared + p["prompt_token_ids"]) * 2}
          for p in prompts(6, seed=3, lo=1, hi=12)]
    params = [greedy(40), SamplingParams(temperature=1.0, seed=9, max_tokens=40, ignore_eos=True,
                                         frequency_penalty=0.5)] * 3
    ref = ids(LLM(tiny_folder, block_size=8, max_num_seqs=6, max_model_len=128,
                  enable_prefix_caching=False).generate(ps, params, use_tqdm=False))
    for on in (False, True):
        llm = LLM(tiny_folder, block_size=8, num_kv_blocks=24, max_num_seqs=6,
                  max_num_batched_tokens=32, max_model_len=128, enable_prefix_caching=on,
                  speculative_config=spec)
        assert ids(llm.generate(ps, params, use_tqdm=False)) == ref
        m = llm.get_metrics()
        assert m["num_preemptions"] > 0
        assert llm.engine.allocator.num_free == 23
    assert m["prefix_cache"]["hit_tokens"] > 0


def _edit_config(src, dst, **changes):
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
            g.write(f.read())
    with open(os.path.join(dst, "config.json")) as f:
        hf = json.load(f)
    hf.update(changes)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(hf, f)
    return dst


def test_bad_heads_and_settings_are_refused_naming_the_field(tiny_folder, eagle_head, tmp_path):
    spec = lambda **kw: {"method": "eagle3", "model": eagle_head, "num_speculative_tokens": 3, **kw}
    with pytest.raises(ValueError, match="speculative_config.model: an EAGLE-3 head folder is required"):
        LLM(tiny_folder, speculative_config={"method": "eagle3", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(tiny_folder, speculative_config=spec(num_speculative_tokens=0))
    with pytest.raises(ValueError, match="is not a folder"):
        LLM(tiny_folder, speculative_config=spec(model=str(tmp_path / "missing")))
    wide = _edit_config(eagle_head, str(tmp_path / "wide"), target_hidden_size=128)
    with pytest.raises(ValueError, match=r"target_hidden_size = 128"):
        LLM(tiny_folder, speculative_config=spec(model=wide), **GEOMETRY)
    with pytest.raises(ValueError, match="runs on one device"):
        LLM(tiny_folder, speculative_config=spec(), tensor_parallel_size=2)
