"""Adaptive k (``"num_speculative_tokens": "auto"`` or ``adaptive_k``): each request's k follows
its own acceptance, tokens stay plain decoding's for every proposer, the engine's host and the
device pick the same k (one step per call or several), and no k compiles anything new."""

import jax
import numpy as np
import pytest

from sfjax import LLM
from sfjax.benchmark import compiles
from sfjax.spec.config import ADAPTIVE_MAX, SpeculativeConfig, adaptive_k
from spec_util import (BATCH8_SEED, GEOMETRY, assert_same_outputs, delta, greedy, prompts,
                       repeated_prompts, run, sampled, spec_counters)


def _per_round(d):
    return d["num_draft_tokens"] / max(d["num_drafts"], 1)


def test_the_k_table_weighs_acceptance_against_cost():
    cheap = SpeculativeConfig("ngram", ADAPTIVE_MAX, adaptive_k=True)
    dear = SpeculativeConfig("ngram", ADAPTIVE_MAX, adaptive_k=True, draft_cost=1.0)
    from sfjax import toy
    t = cheap.k_table(toy.tiny_config())
    assert t[0] == 1 and t[-1] == ADAPTIVE_MAX
    assert (np.diff(t) >= 0).all()                                   # more acceptance, more k
    assert (dear.k_table(toy.tiny_config()) == 1).all()              # a draft as dear as a step
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": "auto"}) \
        == SpeculativeConfig("ngram", ADAPTIVE_MAX, adaptive_k=True)
    assert SpeculativeConfig("ngram", 8).k_table(toy.tiny_config()) is None
    # integer steps: numpy on the host and jax.numpy on the device read the same entry
    drafted, accepted = np.array([0, 7, 100, 1000]), np.array([0, 3, 99, 10])
    assert (adaptive_k(t, drafted, accepted) == np.asarray(adaptive_k(t, drafted, accepted, jax.numpy))).all()
    with pytest.raises(ValueError, match="draft_cost"):
        SpeculativeConfig("ngram", 8, adaptive_k=True, draft_cost=-1.0)


@pytest.mark.parametrize("draft", ["same", "other"])
def test_k_follows_each_requests_acceptance_and_tokens_equal_plain(spec_llm, plain_llm, draft):
    llm = spec_llm(draft, "auto", draft_cost=0.1)
    ps = prompts(8, seed=BATCH8_SEED)
    before = spec_counters(llm)
    for params in (greedy(), sampled(8, seed=BATCH8_SEED)):
        assert_same_outputs(run(llm, ps, params), run(plain_llm, ps, params))
    d = delta(before, spec_counters(llm))
    if draft == "same":                    # everything accepted: k climbs, round by round
        assert d["num_accepted_tokens"] == d["num_draft_tokens"] and _per_round(d) > 3
        assert len(d["accepted_per_pos"]) >= 6
    else:                                  # almost nothing accepted: one draft a round
        assert _per_round(d) < 1.2


def test_ngram_and_eagle3_with_adaptive_k_equal_plain(spec_llm, plain_llm, eagle_head):
    ps = repeated_prompts(8, seed=3)
    for method, extra in (("ngram", {"prompt_lookup_max": 3}), ("eagle3", {"model": eagle_head})):
        llm = spec_llm(None, "auto", method, **extra)
        before = spec_counters(llm)
        for params in (greedy(), sampled(8, seed=3)):
            assert_same_outputs(run(llm, ps, params), run(plain_llm, ps, params))
        assert delta(before, spec_counters(llm))["num_drafts"] > 0


def test_host_and_device_pick_the_same_k_and_nothing_recompiles(tiny_folder, drafts, monkeypatch):
    """One step per call (the host picks k) and eight (the device does): the same drafts and
    acceptances request by request. Then a workload whose acceptance, so its k, differs runs on
    the programs already compiled (each bucket compiled at its first ask, ``COMPILE_AFTER`` 0:
    this is about k)."""
    import sfjax.engine.compile as buckets

    monkeypatch.setattr(buckets, "COMPILE_AFTER", 0)
    spec = {"method": "draft_model", "model": drafts["near"], "num_speculative_tokens": "auto",
            "draft_cost": 0.1}
    ps = prompts(8, seed=BATCH8_SEED)
    counters = {}
    for steps in (1, 8):
        # no prefix cache: the second workload's prompts would hit it, a path (write_history)
        # the first did not take; what must not compile here is a new k
        llm = LLM(tiny_folder, speculative_config=spec, num_scheduler_steps=steps,
                  enable_prefix_caching=False, **GEOMETRY)
        outs = run(llm, ps, greedy())
        counters[steps] = [o.metrics.spec_decode for o in outs]
    assert counters[1] == counters[8]
    with compiles() as seen:
        before = spec_counters(llm)
        run(llm, ps, sampled(8, seed=BATCH8_SEED))
        d = delta(before, spec_counters(llm))
    assert not seen
    assert _per_round(d) != pytest.approx(
        sum(c["num_draft_tokens"] for c in counters[8]) / sum(c["num_drafts"] for c in counters[8]))
