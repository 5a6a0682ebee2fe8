"""A round is compiled once per shape bucket: changing the batch's composition, per-row k, opt-outs
or sampling parameters does not recompile it."""

import numpy as np
import pytest

from sfjax import LLM, SamplingParams, toy
from sfjax.benchmark import compiles


def test_no_recompilation_when_composition_or_per_row_k_changes(model_folder, monkeypatch):
    import sfjax.engine.compile as buckets

    monkeypatch.setattr(buckets, "COMPILE_AFTER", 0)   # buckets at their first ask: this is about k
    target = model_folder(toy.tiny_config(), seed=0, std=0.1)
    # one round per call, so every call below is the engine's one program (its rounds with
    # logprobs are one shape whatever the composition: test_precompile_covers_every_step_of_a_run)
    llm = LLM(target, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=64,
              num_scheduler_steps=1,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    rng = np.random.default_rng(0)
    seg = rng.integers(2, 500, 6).tolist()
    prompts = [{"prompt_token_ids": seg * 3 + rng.integers(2, 500, 3).tolist()} for _ in range(4)]

    def run(params):
        llm.generate(prompts, params, use_tqdm=False)

    run(SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))       # warm up the buckets
    program = llm.engine.programs.round                      # the engine's own compiled program
    warm = program._cache_size()
    # other rows' k (max_tokens limits it near the end), opt-outs, sampling modes, stop tokens
    run([SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True) for i in range(4)])
    run([SamplingParams(temperature=1.0, seed=i, top_p=0.9, max_tokens=12, ignore_eos=True,
                        disable_spec_decode=i % 2 == 1) for i in range(4)])
    run([SamplingParams(temperature=0.7, seed=i, max_tokens=10, stop_token_ids=[3], min_tokens=2,
                        presence_penalty=0.5) for i in range(4)])
    assert program._cache_size() == warm
    assert llm.get_metrics()["spec_decode"]["num_drafts"] > 0


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_precompile_covers_every_step_of_a_run(model_folder, tmp_path, method):
    """After ``Engine.precompile``, a run of mixed prompt lengths, batch sizes, sampling modes and
    speculation compiles nothing more (with an EAGLE head, prefix-cache hits included)."""
    target = model_folder(toy.tiny_config(), seed=0, std=0.1)
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    if method == "eagle3":
        from sfjax.spec import eagle
        from test_eagle_round import head_config
        eagle.save(str(tmp_path), head_config(), eagle.init_random(head_config(), seed=1))
        spec = {"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 2}
    llm = LLM(target, max_num_seqs=2, max_model_len=64, max_num_batched_tokens=16, block_size=8,
              speculative_config=spec)
    assert llm.engine.precompile(progress=False) > 0
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": rng.integers(2, 500, n).tolist()} for n in (3, 30, 11)]
    params = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=1, max_tokens=5),
              SamplingParams(temperature=0, max_tokens=12, disable_spec_decode=True)]
    with compiles() as seen:                  # any program, the history write of a hit included
        llm.generate(prompts, params, use_tqdm=False)
        llm.generate(prompts[:2], params[:2], use_tqdm=False)      # both fit: several rounds per call
    assert llm.get_metrics()["prefix_cache"]["hit_tokens"] > 0      # the second run's prompts
    assert not seen, f"{len(seen)} compiles after precompile"
    assert llm.get_metrics()["host_steps"] < llm.get_metrics()["steps"]   # the rounds ran


def test_precompile_lists_each_bucket_once_and_none_that_no_call_can_fill(model_folder):
    """One slot of 64 positions at k = 4: a call holds at most 64 + 4 rows, so ``precompile``
    compiles no round past 128 rows (the default token budget of 512 listed buckets of up to
    1024 rows: three round programs no call could run, six with a draft model), and each bucket
    once (the decode and prefill spans meet at one)."""
    target = model_folder(toy.tiny_config(), seed=0, std=0.1)
    llm = LLM(target, max_num_seqs=1, max_model_len=64,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert llm.engine.config.max_num_batched_tokens == 512
    listed = llm.engine.shape_buckets()
    assert len(listed) == len(set(listed))
    assert max(n for kind, n, *_ in listed if kind == "round") == 128
