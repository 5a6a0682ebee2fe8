"""The prompt-lookup executor's properties on a fake "copying" model, and rollback cleanliness
(the live KV pages after a speculative run equal a plain run's, bitwise) on a real one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sfjax import LLM, SamplingParams, model, toy
from sfjax.cache import KVCache

V = 24          # the fake model's vocabulary = its hidden size (a cfg no other test compiles)
N_BACK = 4      # its logits pick the token N_BACK positions back
EOS = 1


def _fake_forward(miss_every_third):
    def forward(weights, cache, tokens, positions, slots, block_tables, cfg, tiling=None, *,
                attention="auto", mesh=None, **_):
        """Stores each row's token in its K page (as a float) and 'predicts' position p + 1 as the
        token at p + 1 - N_BACK, read back through the block tables."""
        bs = cache.k.shape[2]
        page, off = model.cache_slots(block_tables, slots, positions, bs)
        old = cache.k[0, page, off, 0, 0]
        k = cache.k.at[0, page, off, 0, 0].set(jnp.where(positions >= 0, tokens.astype(jnp.float32), old))
        src = positions + 1 - N_BACK
        s_page = block_tables[jnp.maximum(slots, 0), jnp.maximum(src, 0) // bs]
        copied = jnp.where(src >= 0, k[0, s_page, jnp.maximum(src, 0) % bs, 0, 0].astype(jnp.int32), 2)
        if miss_every_third:
            # off the copy by a shifting amount, so the text never turns periodic
            copied = jnp.where((positions + 1) % 3 == 0, (copied + 1 + positions // 3) % V, copied)
        return 10.0 * jax.nn.one_hot(copied, cfg.hidden_size, dtype=jnp.float32), KVCache(k=k, v=cache.v)
    return forward


def _fake_logits(weights, hidden, cfg, tiling=None, num_rows=None, *, mesh=None, **_):
    return hidden.astype(jnp.float32)


@pytest.fixture(params=[False, True], ids=["copying", "misses-every-third"])
def fake(request, monkeypatch):
    monkeypatch.setattr(model, "forward", _fake_forward(request.param))
    monkeypatch.setattr(model, "logits", _fake_logits)
    return request.param


@pytest.fixture
def copy_folder(model_folder, fake):
    # a config per variant (and no other test's), so no compiled step of another model is reused
    cfg = toy.tiny_config(vocab_size=V, hidden_size=V, num_heads=2, num_kv_heads=1, head_dim=8,
                          intermediate_size=16, num_layers=1, rope_theta=1000.0 + fake)
    return model_folder(cfg, seed=0)


def _run(folder, prompts, params, spec=None, **kw):
    llm = LLM(folder, max_num_seqs=8, max_model_len=128, speculative_config=spec, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0] for o in outs], llm


PROMPTS = [{"prompt_token_ids": [5, 9, 13, 7] * 3}, {"prompt_token_ids": [3, 4, 6, 8, 10, 12, 14] * 2},
           {"prompt_token_ids": [20, 21, 22, 23]}]
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def test_greedy_drafts_are_taken_and_change_nothing(copy_folder, fake):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain, _ = _run(copy_folder, PROMPTS, params)
    spec, llm = _run(copy_folder, PROMPTS, params, NGRAM)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    m = llm.get_metrics()["spec_decode"]
    assert m["num_accepted_tokens"] > 0
    if not fake:    # a pure copy of a periodic text: every draft is right
        assert m["acceptance_rate"] > 0.9
    else:           # every third prediction is off the copy: drafts are rejected in part
        assert 0 < m["acceptance_rate"] < 0.9


def test_sampled_drafts_draw_what_plain_decoding_draws(copy_folder, fake):
    params = [SamplingParams(temperature=3.0, seed=10 + i, max_tokens=30, ignore_eos=True) for i in range(3)]
    plain, _ = _run(copy_folder, PROMPTS, params)
    spec, llm = _run(copy_folder, PROMPTS, params, NGRAM)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert llm.get_metrics()["spec_decode"]["num_accepted_tokens"] > 0


def test_eos_inside_a_draft_ends_the_sequence_there(copy_folder, fake):
    # the copy emits 9, 12, EOS, ...; the n-gram draft [9, 12, EOS, 7, 9] carries EOS inside it
    prompt = [{"prompt_token_ids": [9, 12, EOS, 7, 9, 12, EOS, 7]}]
    params = SamplingParams(temperature=0, max_tokens=30)
    plain, _ = _run(copy_folder, prompt, params)
    spec, llm = _run(copy_folder, prompt, params, NGRAM)
    assert plain[0].token_ids[-1] == EOS and plain[0].token_ids.count(EOS) == 1
    assert spec[0].token_ids == plain[0].token_ids
    assert spec[0].finish_reason == "stop"
    assert llm.engine.allocator.num_free == llm.engine.config.num_kv_blocks - 1


def _live_pages(llm):
    """Snapshots, at each request's finish, the K/V of its fed positions [0, num_tokens - 1)."""
    eng, got = llm.engine, {}
    release = eng._release

    def spy(req):
        n, bs = req.num_tokens - 1, eng.config.block_size
        pages = np.array([req.blocks[p // bs] for p in range(n)])
        offs = np.arange(n) % bs
        cache = eng.state.cache
        got[req.request_id] = (np.asarray(cache.k[:, pages, offs]), np.asarray(cache.v[:, pages, offs]))
        return release(req)

    eng._release = spy
    return got


@pytest.mark.parametrize("spec", [NGRAM, "draft"])
def test_partly_rejected_drafts_roll_back_cleanly_bitwise(model_folder, spec):
    target = model_folder(toy.tiny_config(), seed=0, std=0.1)
    if spec == "draft":
        # the target's matrices with perturbed norms: a draft that agrees often, not always
        draft = model_folder(toy.tiny_config(), seed=0, std=0.1, norm_jitter=0.3)
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 4}
    prompts = [{"prompt_token_ids": ([7, 8, 9, 10, 11] * 4)[:n]} for n in (20, 13, 9)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain_llm = LLM(target, max_num_seqs=4, max_model_len=128)
    plain_pages = _live_pages(plain_llm)
    plain = plain_llm.generate(prompts, params, use_tqdm=False)
    spec_llm = LLM(target, max_num_seqs=4, max_model_len=128, speculative_config=spec)
    spec_pages = _live_pages(spec_llm)
    got = spec_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    m = spec_llm.get_metrics()["spec_decode"]
    assert 0 < m["num_accepted_tokens"] < m["num_draft_tokens"], "drafts must be rejected in part"
    for a, b in zip(plain, got):
        pk, pv = plain_pages[a.request_id]
        sk, sv = spec_pages[b.request_id]
        assert pk.shape == sk.shape and (pk == sk).all() and (pv == sv).all()
