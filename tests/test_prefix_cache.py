"""Prefix caching: full blocks shared by content hash, outputs identical with and without it."""

import numpy as np
import pytest

from sfjax import LLM, SamplingParams
from sfjax.engine.allocator import BlockAllocator, hash_blocks
from engine_checks import check_engine, check_idle

BS = 8


def _shared_prefix_prompts(n, prefix_len=37, seed=0):
    """``n`` prompts sharing a first ``prefix_len`` tokens, each with its own tail."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(2, 512, prefix_len).tolist()
    return [{"prompt_token_ids": prefix + rng.integers(2, 512, rng.integers(1, 12)).tolist()}
            for _ in range(n)]


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_hash_names_the_whole_prefix():
    a, b, c = [], [], []
    hash_blocks([1] * 8 + [2] * 8 + [3] * 3, 8, a)
    hash_blocks([9] * 8 + [2] * 8, 8, b)
    hash_blocks([1] * 8 + [2] * 8, 8, c)
    assert len(a) == 2 and a == c                 # the partial block is not hashed
    assert a[1] != b[1]                           # same tokens, other prefix: another block


def test_a_lookahead_hash_covers_the_next_token():
    """With an EAGLE head (lookahead 1) a block's hash also names the token after it: the head's
    K/V at the block's last position reads it."""
    a, b, c = [], [], []
    hash_blocks([1] * 8 + [2] * 8, 8, a, lookahead=1)
    hash_blocks([1] * 8 + [3] * 8, 8, b, lookahead=1)
    hash_blocks([1] * 8 + [2] * 8 + [4], 8, c, lookahead=1)
    assert len(a) == 1 and len(c) == 2            # a block is hashed once its next token is known
    assert a[0] != b[0] and a[0] == c[0]          # the next token is in the hash


def test_allocator_shares_caches_and_evicts_oldest_first():
    alloc = BlockAllocator(5, prefix_caching=True)
    x = alloc.allocate(2)
    hashes = []
    hash_blocks(list(range(16)), 8, hashes)
    for b, h in zip(x, hashes):
        alloc.register(b, h)
    assert alloc.lookup(hashes) == x
    alloc.acquire(x)                              # a second request shares both
    assert [alloc.refs(b) for b in x] == [2, 2]
    alloc.free(x)
    alloc.free(x)
    assert alloc.num_free == 4 and alloc.cached_ids() == set(x)
    assert alloc.num_evictable(x) == 2
    y = alloc.allocate(3)                         # 2 never-used blocks, then the oldest freed:
    assert x[1] in y and x[0] not in y            # the tail was freed first
    assert alloc.lookup(hashes) == [x[0]]
    alloc.free(y)
    alloc.reset_prefix_cache()
    assert alloc.cached_ids() == set() and alloc.num_free == 4
    with pytest.raises(RuntimeError, match="freed more often"):
        alloc.free([y[0]])


@pytest.fixture(scope="module")
def engines(tiny_folder):
    geometry = dict(block_size=BS, max_num_seqs=8, max_model_len=128)
    return {on: LLM(tiny_folder, enable_prefix_caching=on, **geometry) for on in (False, True)}


PARAMS = [
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    # penalties read the prompt's tokens from the device history, which the cache skipped
    SamplingParams(temperature=0.9, seed=5, max_tokens=20, ignore_eos=True, repetition_penalty=3.0,
                   presence_penalty=0.5, frequency_penalty=0.2),
]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "sampled-penalties"])
def test_outputs_identical_with_and_without_prefix_caching(engines, params):
    prompts = _shared_prefix_prompts(6, seed=1)
    ref = _ids(engines[False].generate(prompts, params, use_tqdm=False))
    on = LLM(engines[True].model_path, enable_prefix_caching=True,   # fresh slots: no stale history
             block_size=BS, max_num_seqs=8, max_model_len=128)
    first = _ids(on.generate(prompts[:1], params, use_tqdm=False))   # fills the cache
    rest = _ids(on.generate(prompts[1:], params, use_tqdm=False))   # hits it
    again = _ids(on.generate(prompts, params, use_tqdm=False))      # prompt + output cached too
    assert first + rest == ref and again == ref
    m = on.get_metrics()["prefix_cache"]
    assert m["hit_tokens"] >= 5 * 32 and 0 < m["hit_rate"] < 1
    eng = on.engine
    assert eng.allocator.num_free == eng.config.num_kv_blocks - 1     # cached blocks are free
    assert eng.allocator.cached_ids()


def test_prompt_logprobs_requests_compute_their_whole_prompt(engines):
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2, ignore_eos=True)
    prompts = _shared_prefix_prompts(2, seed=2)
    ref = engines[False].generate(prompts, params, use_tqdm=False)
    on = engines[True]
    on.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)   # cache the prefix
    got = on.generate(prompts, params, use_tqdm=False)
    for a, b in zip(got, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [None if d is None else sorted(d) for d in a.prompt_logprobs] == \
               [None if d is None else sorted(d) for d in b.prompt_logprobs]


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
    {"method": "draft_model", "num_speculative_tokens": 3},
], ids=["ngram", "draft"])
def test_speculation_with_prefix_caching_under_preemption(tiny_folder, engines, spec):
    """Shared prefixes, speculation and a cache small enough to preempt: identical outputs, and
    the same acceptance as without the prefix cache (the draft's pages are shared too)."""
    if spec["method"] == "draft_model":
        spec = dict(spec, model=tiny_folder)
    prompts = [{"prompt_token_ids": p["prompt_token_ids"] * 2}
               for p in _shared_prefix_prompts(6, prefix_len=21, seed=3)]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=9, max_tokens=40, ignore_eos=True)] * 3
    ref = _ids(engines[False].generate(prompts, params, use_tqdm=False))
    runs = {}
    for on in (False, True):
        llm = LLM(tiny_folder, block_size=BS, num_kv_blocks=24, max_num_seqs=6,
                  max_num_batched_tokens=32, max_model_len=128, enable_prefix_caching=on,
                  speculative_config=spec)
        assert _ids(llm.generate(prompts, params, use_tqdm=False)) == ref
        m = llm.get_metrics()
        assert m["num_preemptions"] > 0
        runs[on] = m
        assert llm.engine.allocator.num_free == 23
    assert runs[True]["prefix_cache"]["hit_tokens"] > 0
    if spec["method"] == "draft_model":      # the draft is the target: everything is accepted
        d = runs[True]["spec_decode"]
        assert d["num_accepted_tokens"] == d["num_draft_tokens"]


def test_ngram_proposals_see_the_cached_prompt(tiny_folder, engines):
    """The n-gram proposer looks up the device history, part of which the prefix cache skipped:
    each request drafts and accepts exactly what it does without the cache (no preemption, so
    every request's rounds fall at the same lengths)."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2}
    prompts = _shared_prefix_prompts(4, prefix_len=19, seed=4)
    for p in prompts:
        p["prompt_token_ids"] += p["prompt_token_ids"][4:6]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = {}
    for on in (False, True):
        llm = LLM(tiny_folder, block_size=BS, max_num_seqs=8, max_model_len=128,
                  enable_prefix_caching=on, speculative_config=spec)
        llm.generate(prompts[:1], params, use_tqdm=False)
        outs = llm.generate(prompts, params, use_tqdm=False)
        got[on] = [(o.outputs[0].token_ids, o.metrics.spec_decode) for o in outs]
    assert got[True] == got[False]
    assert sum(m["num_accepted_tokens"] for _, m in got[True]) > 0


def test_invariants_after_every_step_with_a_draft(tiny_folder):
    """Requests sharing prefixes arrive while others decode with a draft equal to the target.
    After every step the engine's invariants hold, and the two caches agree bit for bit on every
    block the prefix cache offers: a block is registered only once the draft's pages are written
    too (the draft trails the target by a position after a fully accepted round)."""
    llm = LLM(tiny_folder, block_size=BS, max_num_seqs=4, max_model_len=128, enable_prefix_caching=True,
              num_kv_blocks=40, speculative_config={"method": "draft_model", "model": tiny_folder,
                                                    "num_speculative_tokens": 3})
    eng = llm.engine
    prompts = _shared_prefix_prompts(8, prefix_len=13, seed=5)
    checked = set()
    for step in range(400):
        if step < len(prompts):        # one arrival per call: with several rounds per call,
            eng.add_request(f"r{step}", prompts[step],   # a request lasts only a few calls
                            SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        eng.step()
        check_engine(eng)
        blocks = sorted(eng.allocator.cached_ids())
        target, draft = (np.asarray(c.k[:, blocks]) for c in (eng.state.cache, eng.state.draft_cache))
        assert np.array_equal(target, draft)
        checked.update(blocks)
        if not eng.has_unfinished_requests() and step >= len(prompts):
            break
    check_idle(eng)
    assert len(checked) >= 12 and eng.allocator.hit_tokens > 0
