"""The non-default acceptance methods through the engine: rejection sampling repeats exactly under
seeds; typical acceptance is greedy at temperature 0; certificates ride on the outputs."""

import numpy as np
import pytest

from sfjax import LLM, SamplingParams, toy


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(2, 500, rng.integers(4, 20)).tolist()} for _ in range(n)]


@pytest.fixture(scope="module")
def pair(model_folder):
    target = model_folder(toy.tiny_config(), seed=0, std=0.1)
    draft = model_folder(toy.tiny_config(), seed=0, std=0.1, norm_jitter=0.3)
    return target, draft


def _spec(draft, method):
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": 3, "acceptance_method": method}


def test_rejection_sampler_seeded_runs_repeat_and_are_certified(pair):
    target, draft = pair
    llm = LLM(target, max_num_seqs=8, max_model_len=128, speculative_config=_spec(draft, "rejection_sampler"))
    params = [SamplingParams(temperature=1.0, top_k=40, seed=i, max_tokens=24, ignore_eos=True) for i in range(6)]
    a = llm.generate(_prompts(6), params, use_tqdm=False)
    b = llm.generate(_prompts(6), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    cert = a[0].certificate
    assert (cert.strategy, cert.exactness) == ("draft_model/rejection_sampler", "distribution-exact")
    m = llm.get_metrics()["spec_decode"]
    assert 0 < m["num_accepted_tokens"] < m["num_draft_tokens"]
    # greedy rows under rejection sampling are plain greedy decoding
    plain = LLM(target, max_num_seqs=8, max_model_len=128)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert ([o.outputs[0].token_ids for o in llm.generate(_prompts(6), greedy, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in plain.generate(_prompts(6), greedy, use_tqdm=False)])


def test_typical_acceptance_is_greedy_at_temperature_0_and_refused_for_exactness(pair):
    target, draft = pair
    llm = LLM(target, max_num_seqs=8, max_model_len=128,
              speculative_config=_spec(draft, "typical_acceptance_sampler"))
    plain = LLM(target, max_num_seqs=8, max_model_len=128)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = llm.generate(_prompts(5, 1), greedy, use_tqdm=False)
    assert ([o.outputs[0].token_ids for o in got]
            == [o.outputs[0].token_ids for o in plain.generate(_prompts(5, 1), greedy, use_tqdm=False)])
    assert got[0].certificate.exactness == "lossy"
    with pytest.raises(ValueError, match="spec_exactness"):
        llm.generate(_prompts(1)[0], SamplingParams(temperature=1.0, spec_exactness="path-exact"),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="spec_exactness"):
        llm.generate(_prompts(1)[0], SamplingParams(temperature=1.0, spec_exactness="distribution-exact"),
                     use_tqdm=False)
    # a sampled request that demands nothing, or opts out, is admitted
    out = llm.generate(_prompts(2), [SamplingParams(temperature=1.0, seed=1, max_tokens=8),
                                     SamplingParams(temperature=1.0, seed=1, max_tokens=8, disable_spec_decode=True,
                                                    spec_exactness="path-exact")], use_tqdm=False)
    assert out[1].certificate.strategy == "none"
    with pytest.raises(ValueError, match="not granted"):
        llm.generate(_prompts(1)[0], SamplingParams(spec_strategy="ngram/exact"), use_tqdm=False)


def test_registration_is_refused_where_the_backend_cannot_hold_the_class():
    from sfjax.spec.registry import Registry, Strategy

    ok = Registry()
    slot = ok.register(Strategy("ngram", "exact"))
    assert ok.slots[slot].covers("path-exact", greedy=False)
    with pytest.raises(ValueError, match="verify at every drafted position"):
        Registry({"every_position": False, "partial_rollback": True}).register(Strategy("ngram", "exact"))
    with pytest.raises(ValueError, match="roll back partially"):
        Registry({"every_position": True, "partial_rollback": False}).register(
            Strategy("draft_model", "rejection_sampler"))
    typical = ok.slots[ok.register(Strategy("draft_model", "typical_acceptance_sampler"))]
    assert typical.covers("path-exact", greedy=True) and not typical.covers("distribution-exact", greedy=False)
    assert typical.covers("lossy", greedy=False)
