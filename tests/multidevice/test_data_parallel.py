"""Slots over data: each data shard serves max_num_seqs / dp slots from its own pages. Under pool
pressure (preemption inside a shard) and with prefix caching, two data shards give the
single-device tokens and the engine's invariants hold after every step; sizes that don't split
over the shards are refused naming them."""

import numpy as np
import pytest

from sfjax import LLM, SamplingParams
from conftest import GEOMETRY
from engine_checks import check_engine, check_idle


def _requests():
    """Six requests over four slots, sharing a first block; up to 4 blocks each."""
    rng = np.random.default_rng(2)
    shared = rng.integers(2, 512, 8).tolist()
    prompts = [{"prompt_token_ids": shared + rng.integers(2, 512, rng.integers(2, 6)).tolist()}
               for _ in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=12, ignore_eos=True)
              for i in range(6)]
    return prompts, params


def test_pool_pressure_and_prefix_caching_over_two_data_shards(folder, engines):
    prompts, params = _requests()
    want = [o.outputs[0].token_ids for o in engines().generate(prompts, params, use_tqdm=False)]
    eng = LLM(folder, data_parallel_size=2, num_kv_blocks=2 * 6, **GEOMETRY).engine  # 5 a shard
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        eng.add_request(str(i), prompt, p)
    got, shards = {}, set()
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
        check_engine(eng)
        shards |= {eng.scheduler.shard_of(r.slot) for r in eng.scheduler.running}
    check_idle(eng)
    assert [got[str(i)] for i in range(6)] == want
    assert shards == {0, 1} and eng.scheduler.num_preemptions > 0
    assert eng.get_metrics()["prefix_cache"]["hit_tokens"] > 0


@pytest.mark.parametrize("kw, match", [
    (dict(max_num_seqs=3), r"max_num_seqs \(3\) must be divisible by data_parallel_size \(2\)"),
    (dict(num_kv_blocks=7), r"num_kv_blocks \(7\) must be a multiple of data_parallel_size \(2\)"),
    (dict(num_kv_blocks=2), r"with >= 2 blocks per data shard"),
])
def test_sizes_that_do_not_split_over_the_data_shards(folder, kw, match, monkeypatch):
    import sfjax.llm                                    # refused before the weights load
    monkeypatch.setattr(sfjax.llm, "load", lambda *a, **k: pytest.fail("the weights loaded"))
    with pytest.raises(ValueError, match=match):
        LLM(folder, data_parallel_size=2, **dict(GEOMETRY, **kw))
