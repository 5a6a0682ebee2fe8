"""Draft-model speculation equals plain decoding token for token: draft kinds (the target itself,
a near copy, another seed, a larger model), k at every row-tile boundary and 63, batch sizes 1..64, block sizes."""

import pytest

from engine_checks import RUNS_LONG
from sfjax import SamplingParams
from spec_util import (BATCH8_SEED, MAX_MODEL_LEN, SHORT, assert_same_outputs, delta, greedy,
                       one_by_one, prompts, run, sampled, spec_counters)


def check_counters(d, k):
    """The spec-decode counters of a run are consistent with k drafts per round at most."""
    assert len(d["accepted_per_pos"]) <= k
    assert d["accepted_per_pos"] == sorted(d["accepted_per_pos"], reverse=True)  # a prefix rule
    assert sum(d["accepted_per_pos"]) == d["num_accepted_tokens"] <= d["num_draft_tokens"]
    assert d["num_drafts"] <= d["num_draft_tokens"] <= k * d["num_drafts"]


# k + 1 verify rows: a tile of 2 (k 1), of 4 partly and wholly filled (2, 3), of 8 likewise (4, 7),
# and two tiles of 8 (8); k 63 below
@pytest.mark.parametrize("k", [1, 2, 3, 4, 7, 8])
def test_k_sweep_equals_plain_at_batch_1(spec_llm, plain_llm, k):
    params = [greedy()] + sampled(4, seed=10 * k)
    ref = one_by_one(plain_llm, SHORT, params)
    for draft in ("same", "near"):
        llm = spec_llm(draft, k)
        before = spec_counters(llm)
        assert_same_outputs(one_by_one(llm, SHORT, params), ref)
        d = delta(before, spec_counters(llm))
        check_counters(d, k)
        assert d["num_drafts"] > 0
        if draft == "near":
            assert 0 < d["num_accepted_tokens"] < d["num_draft_tokens"]
    # the target as its own draft, greedy: every draft is the target's own token
    llm = spec_llm("same", k)
    before = spec_counters(llm)
    one_by_one(llm, SHORT, [greedy()])
    d = delta(before, spec_counters(llm))
    assert d["num_accepted_tokens"] == d["num_draft_tokens"] > 0
    m = spec_counters(llm)
    assert m["mean_acceptance_length"] == pytest.approx(1 + m["num_accepted_tokens"] / m["num_drafts"])
    assert m["acceptance_rate"] == pytest.approx(m["num_accepted_tokens"] / m["num_draft_tokens"])


def test_batch_8_equals_plain(spec_llm, plain_llm):
    ps = prompts(8, seed=BATCH8_SEED)
    llm = spec_llm("near", 3)
    before = spec_counters(llm)
    for params in (greedy(), sampled(8, seed=BATCH8_SEED)):
        assert_same_outputs(run(llm, ps, params), run(plain_llm, ps, params))
    d = delta(before, spec_counters(llm))
    check_counters(d, 3)
    assert 0 < d["num_accepted_tokens"] < d["num_draft_tokens"]


@pytest.mark.parametrize("batch, max_tokens", [(32, 12), (64, 8)])
def test_batch_32_and_64_equal_plain(spec_llm, plain_llm, batch, max_tokens):
    # short prompts: the whole batch prefills in one step. The reference is plain decoding of
    # each prompt alone (plain decoding gives the same tokens in any batch).
    ps = prompts(batch, seed=batch, lo=2, hi=9)
    runs = [("same", greedy(max_tokens)),
            # no penalties: the target drafting for itself accepts every sampled draft too
            ("same", [SamplingParams(temperature=t, top_k=k, top_p=p, seed=i, max_tokens=max_tokens,
                                     ignore_eos=True)
                      for i, (t, k, p) in enumerate([(1.0, 0, 1.0), (0.1, 20, 1.0), (1.0, 0, 0.8),
                                                     (0.5, 5, 0.9)] * (batch // 4))])]
    if batch == 32:
        runs.append(("near", greedy(max_tokens)))       # partial acceptance: ragged rounds
    for draft, params in runs:
        llm = spec_llm(draft, 3)
        per_row = params if isinstance(params, list) else [params] * batch
        ref = [out for p, sp in zip(ps, per_row) for out in run(plain_llm, [p], sp)]
        before = spec_counters(llm)
        assert_same_outputs(run(llm, ps, params), ref)
        d = delta(before, spec_counters(llm))
        check_counters(d, 3)
        if draft == "same":
            assert d["num_accepted_tokens"] == d["num_draft_tokens"] > 0
        else:
            assert 0 < d["num_accepted_tokens"] < d["num_draft_tokens"]


@pytest.mark.parametrize("draft", ["same", "other"])
def test_draft_kinds_equal_plain_at_batch_8(spec_llm, plain_llm, draft):
    ps = prompts(8, seed=BATCH8_SEED)
    llm = spec_llm(draft, 3)
    before = spec_counters(llm)
    for params in (greedy(), sampled(8, seed=BATCH8_SEED)):
        assert_same_outputs(run(llm, ps, params), run(plain_llm, ps, params))
    d = delta(before, spec_counters(llm))
    check_counters(d, 3)
    assert d["num_drafts"] > 0


@pytest.mark.slow
def test_larger_draft_equals_plain(spec_llm, plain_llm, drafts):
    # deeper and wider than the target, with other head counts: its own cache geometry
    llm = spec_llm("larger", 3)
    assert llm.engine.spec.draft_cfg.num_layers > llm.model_config.num_layers
    params = [greedy()] + sampled(4, seed=5)
    before = spec_counters(llm)
    assert_same_outputs(one_by_one(llm, SHORT, params), one_by_one(plain_llm, SHORT, params))
    d = delta(before, spec_counters(llm))
    check_counters(d, 3)
    assert d["num_drafts"] > 0


@pytest.mark.parametrize("block_size", [8, 32])
def test_block_sizes_equal_plain(spec_llm, plain_llm, block_size):
    # the reference runs at block size 16 (the block size changes no output); 40 tokens cross
    # block boundaries, and rounds reserve blocks for drafts that are then rolled back
    ps = [{"prompt_token_ids": [480, 2, 2, 2]}, {"prompt_token_ids": [17, 250, 9]}]
    llm = spec_llm("near", 3, block_size=block_size)
    assert llm.engine.config.block_size == block_size
    before = spec_counters(llm)
    for params in (greedy(40), sampled(2, 40, seed=3)):
        assert_same_outputs(run(llm, ps, params), run(plain_llm, ps, params))
    d = delta(before, spec_counters(llm))
    assert 0 < d["num_accepted_tokens"] < d["num_draft_tokens"]
    assert llm.engine.allocator.num_free == llm.engine.config.num_kv_blocks - 1


@pytest.mark.slow
def test_k_63_equals_plain_at_batch_1(spec_llm, plain_llm):
    max_tokens = 70                       # room for a full round of 63 drafts; later rounds
    assert max(len(p["prompt_token_ids"]) for p in SHORT) + max_tokens <= MAX_MODEL_LEN  # are capped
    params = [greedy(max_tokens)] + sampled(2, max_tokens, seed=63)
    ref = one_by_one(plain_llm, SHORT, params)
    for draft in ("same", "near"):
        llm = spec_llm(draft, 63, compiler_options=RUNS_LONG)       # 64 rows a round
        before = spec_counters(llm)
        assert_same_outputs(one_by_one(llm, SHORT, params), ref)
        d = delta(before, spec_counters(llm))
        check_counters(d, 63)
        if draft == "same":               # 63 drafts accepted in one round
            assert len(d["accepted_per_pos"]) == 63 and d["accepted_per_pos"][62] > 0
