"""Bad speculative configs raise ValueError naming the field; admission refuses requests a
strategy cannot serve, before anything runs."""

import pytest

from sfjax import LLM, SamplingParams, toy
from spec_util import GEOMETRY, SHORT, greedy, ids, one_by_one, run


@pytest.fixture(scope="module")
def small_vocab_draft(model_folder):
    return model_folder(toy.tiny_config(vocab_size=384), seed=3, std=0.1)


@pytest.mark.parametrize("spec, match", [
    (dict(num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(num_speculative_tokens=200), "num_speculative_tokens"),
    (dict(num_speculative_tokens=-1), "num_speculative_tokens"),
    (dict(max_model_len=256), "max_model_len"),
    (dict(method="medusa"), "method"),
    (dict(acceptance_method="nope"), "acceptance_method"),
    (dict(method="ngram", prompt_lookup_min=4, prompt_lookup_max=2), "prompt_lookup_min"),
    (dict(method="ngram", prompt_lookup_min=0), "prompt_lookup_min"),
    (dict(prompt_lookup_table="table.safetensors"), "prompt_lookup_table"),    # draft_model
    (dict(method="ngram", prompt_lookup_table="/no/such/table.safetensors"), "prompt_lookup_table"),
    (dict(disable_by_batch_size=0), "disable_by_batch_size"),
    (dict(num_speculative_tokens=3, bogus=1), "bogus"),
    (dict(model=None), "model"),
])
def test_bad_speculative_config(tiny_folder, drafts, spec, match):
    config = {"method": "draft_model", "model": drafts["near"], "num_speculative_tokens": 3, **spec}
    if config["method"] != "draft_model" or config["model"] is None:
        config.pop("model")
    with pytest.raises(ValueError, match=match):
        LLM(tiny_folder, speculative_config=config, **GEOMETRY)


def test_draft_with_another_vocabulary_is_refused(tiny_folder, small_vocab_draft):
    with pytest.raises(ValueError, match=r"speculative_config\.model.*vocabulary"):
        LLM(tiny_folder, speculative_config={"model": small_vocab_draft, "num_speculative_tokens": 3},
            **GEOMETRY)


def test_draft_folder_missing(tiny_folder, tmp_path):
    with pytest.raises(ValueError, match=r"speculative_config\.model"):
        LLM(tiny_folder, speculative_config={"model": str(tmp_path / "nope"), "num_speculative_tokens": 3},
            **GEOMETRY)


def test_admission_refuses_what_the_strategy_cannot_serve(spec_llm, plain_llm):
    llm = spec_llm("near", 1, acceptance_method="typical_acceptance_sampler")
    ps = SHORT[:2]
    path_exact = SamplingParams(temperature=0.8, seed=1, max_tokens=8, spec_exactness="path-exact")
    with pytest.raises(ValueError, match="spec_exactness"):
        run(llm, ps, [greedy(8), path_exact])
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="spec_exactness"):
        llm.engine.add_request("refused", ps[0], path_exact)
    with pytest.raises(ValueError, match="spec_strategy"):
        run(llm, ps, SamplingParams(temperature=0, max_tokens=8, spec_strategy="nope"))
    assert not llm.engine.has_unfinished_requests()
    # what the certificate covers is admitted: a lossy demand at temperature 0, and a sampled
    # path-exact demand that opts out of speculation (plain decoding is path-exact)
    ok = [greedy(8, spec_exactness="lossy"),
          SamplingParams(temperature=0.8, seed=1, max_tokens=8, ignore_eos=True,
                         spec_exactness="path-exact", disable_spec_decode=True)]
    got = one_by_one(llm, ps[:1], ok)
    assert ids(got) == ids(one_by_one(plain_llm, ps[:1], ok))
    assert [o.certificate.strategy for o in got] == ["draft_model/typical_acceptance_sampler", "none"]


def test_spec_exactness_value_is_checked():
    with pytest.raises(ValueError, match="spec_exactness"):
        SamplingParams(spec_exactness="bitwise")


# "lossy" holds in every sampling mode, so the demand is covered wherever the strategy serves.
def test_lossy_demand_is_admitted_by_a_lossy_strategy(spec_llm):
    # typical acceptance is certified "lossy"; a sampled request it serves when it demands
    # nothing must also be served when it demands "lossy", the weakest class
    llm = spec_llm("near", 1, acceptance_method="typical_acceptance_sampler")
    ps = SHORT[:1]
    served = run(llm, ps, SamplingParams(temperature=0.8, seed=1, max_tokens=8))
    assert served[0].certificate.strategy == "draft_model/typical_acceptance_sampler"
    demanded = run(llm, ps, SamplingParams(temperature=0.8, seed=1, max_tokens=8, spec_exactness="lossy"))
    assert demanded[0].certificate.strategy == "draft_model/typical_acceptance_sampler"
    assert ids(demanded) == ids(served)
