"""The EAGLE-3 head in the round (sfjax.spec.proposers.Eagle): its paged path computes what the
dense head computes over the same sequence (K/V written at every position from the features
there and the next token, whatever the rounds were; drafts equal the dense head's greedy
continuation), and generation with it equals plain decoding in sfjax.functional."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sfjax import functional as F, model, sampling, toy
from sfjax import weights as W
from sfjax.cache import KVCache
from sfjax.config import ModelConfig
from sfjax.round import Context, SpecBatch
from sfjax.sampling_params import SamplingParams
from sfjax.spec import eagle

TARGET = toy.tiny_config()
K = 4
BLOCK = 16
MAX_LEN = 64


def head_config(vocab=96) -> eagle.HeadConfig:
    layer = ModelConfig(vocab_size=TARGET.vocab_size, hidden_size=TARGET.hidden_size,
                        intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2,
                        head_dim=16, rope_theta=5000.0, rms_norm_eps=1e-5,
                        max_position_embeddings=TARGET.max_position_embeddings)
    return eagle.HeadConfig(layer=layer, draft_vocab_size=vocab,
                            target_hidden_size=TARGET.hidden_size, aux_layers=(0, 1, 1))


@pytest.fixture(scope="module")
def pair(tiny_folder):
    hc = head_config()
    run = F.Config(model=TARGET, max_model_len=MAX_LEN, block_size=BLOCK,
                   speculative_config={"method": "eagle3", "model": hc, "num_speculative_tokens": K})
    weights = F.place_weights(W.load_hf(tiny_folder, TARGET), run)
    hw = eagle.init_random(hc, seed=5, std=0.15)
    return run, weights, hw, eagle.place(hw, weights.embed)


def _dense_features(weights, tokens):
    """The target's features over one sequence, from a fresh cache."""
    n = len(tokens)
    cache = KVCache.zeros(TARGET, 1 + MAX_LEN // BLOCK, BLOCK)
    tables = jnp.arange(1, 1 + MAX_LEN // BLOCK, dtype=jnp.int32)[None]
    rows = -(-n // 8) * 8
    pad = lambda x, fill: jnp.asarray(np.concatenate([x, np.full(rows - n, fill)]), jnp.int32)
    forward = jax.jit(lambda w, *rows: model.forward(w, cache, *rows, tables, TARGET,
                                                      features=(0, 1, 1))[2])    # one compile
    return forward(weights, pad(np.asarray(tokens), 0), pad(np.arange(n), -1),
                   pad(np.zeros(n), -1))[:n]


def _dense_drafts(hw, weights, tokens, k):
    """The dense head's greedy continuation: rows 0..L-2 on the real features and tokens
    1..L-1, then k drafts, each fed back with the head's own output."""
    feats = _dense_features(weights, tokens)
    embed = jnp.asarray(weights.embed)
    hidden = eagle.fuse(hw, feats[:-1])
    toks = list(tokens[1:])
    drafts = []
    for _ in range(k):
        n = len(toks)
        lg, out = eagle.forward_dense(hw, head_config(), embed[jnp.asarray(toks)], hidden,
                                      jnp.arange(n, dtype=jnp.int32))
        d = int(jnp.argmax(lg[-1]))
        drafts.append(d)
        toks.append(d)
        hidden = jnp.concatenate([hidden, out[-1:]])
    return drafts, hidden


def test_the_paged_head_drafts_what_the_dense_head_drafts(pair):
    run, weights, hw, placed = pair
    rng = np.random.default_rng(3)
    tokens = rng.integers(2, TARGET.vocab_size, 13).tolist()       # prompt 12 + the drawn token
    p = len(tokens) - 1
    ctx = Context(batch=None, spec=None, sampling=None, history=None,
                  block_tables=jnp.arange(1, 1 + MAX_LEN // BLOCK, dtype=jnp.int32)[None],
                  k_max=K, compares_distributions=False, run=run)
    proposer = run.round.proposer
    # jitted, as a round runs them (eagerly, each of their operations compiles on its own)
    follow = jax.jit(lambda *a: proposer.follow(ctx, *a))
    # the prompt's rows, as a prefill round feeds them (two chunks: the second reads the
    # features the first kept, and its last row is followed by the drawn token)
    hs = eagle.HeadState.zeros(run.head, 1 + MAX_LEN // BLOCK, BLOCK, 1)
    feats = _dense_features(weights, tokens[:p])
    for lo, hi in ((0, 5), (5, p)):
        n = hi - lo
        pad = lambda x, fill: jnp.asarray(np.concatenate([x, np.full(8 - n, fill)]), jnp.int32)
        drawn = np.full(n, -1)
        drawn[-1] = tokens[p] if hi == p else -1
        hs = follow(placed, hs, pad(np.asarray(tokens[lo:hi]), 0),
                             pad(np.arange(lo, hi), -1), pad(np.zeros(n), -1),
                             jnp.concatenate([feats[lo:hi], jnp.zeros((8 - n, feats.shape[1]))]),
                             None, pad(drawn, -1))
    assert int(hs.feature_pos[0]) == p - 1
    assert int(hs.out_pos[0]) == p - 1 and int(hs.out_token[0]) == tokens[p]
    # a round's drafts: greedy, from the kept features and the drawn token
    table = sampling.Sampling.from_params(SamplingParams(temperature=0, max_tokens=20,
                                                         ignore_eos=True), eos_token_ids=[])
    k1 = K + 1
    draws = sampling.Draws(slot=jnp.zeros(8, jnp.int32).at[k1:].set(-1),
                           seq_pos=jnp.asarray(p + np.arange(8), jnp.int32),
                           prompt_len=jnp.full(8, p, jnp.int32), target=jnp.full(8, -1, jnp.int32))
    history = jnp.zeros((1, MAX_LEN), jnp.int32).at[0, :p + 1].set(jnp.asarray(tokens))
    z = jnp.zeros(1, jnp.int32)
    spec = SpecBatch(slots=z, length=z + p + 1, prompt_len=z + p, k=z + K, verify_row=z,
                     draft_tokens=jnp.zeros(8, jnp.int32), draft_positions=jnp.full(8, -1, jnp.int32),
                     draft_slots=jnp.full(8, -1, jnp.int32), draft_last=z, verify_logit=z)
    ctx = dataclasses.replace(ctx, spec=spec, sampling=sampling.rows(table, draws), history=history)
    drafts, k, logq, hs = jax.jit(lambda *a: proposer.propose(ctx, *a))(placed, hs)
    want, hidden = _dense_drafts(hw, weights, tokens, K)
    assert int(k[0]) == K and logq is None
    assert np.asarray(drafts[0]).tolist() == want
    # the head's K/V at every position: what the dense head computes there (the last K - 1
    # rows from its own outputs, as the drafts were made)
    toks = jnp.asarray(tokens[1:] + want[:-1])
    n = len(toks)
    _, k_dense, v_dense = eagle.qkv(hw, head_config(), jnp.asarray(weights.embed)[toks], hidden[:n],
                                    jnp.arange(n, dtype=jnp.int32))
    pos = np.arange(n)
    got_k = hs.cache.k[0, 1 + pos // BLOCK, pos % BLOCK]
    got_v = hs.cache.v[0, 1 + pos // BLOCK, pos % BLOCK]
    np.testing.assert_allclose(np.asarray(got_k), np.asarray(k_dense), rtol=0, atol=2e-5)
    np.testing.assert_allclose(np.asarray(got_v), np.asarray(v_dense), rtol=0, atol=2e-5)


def _generate(pair, spec, params, prompts, rounds=None):
    run, weights, hw, _ = pair
    cfg = run if spec else F.Config(model=TARGET, max_model_len=MAX_LEN, block_size=BLOCK)
    ids, lens = F.pad_prompts(prompts, batch=len(prompts))
    table = sampling.Sampling.from_params(params, eos_token_ids=[], batch=len(prompts))
    dw = hw if spec else None
    if rounds is None:
        return jax.jit(lambda w, dw: F.generate(w, ids, lens, table, cfg, dw, width=24))(weights, dw)
    st = F.prefill(weights, ids, lens, table, cfg, dw)
    return F.decode(weights, st, cfg, rounds, dw)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_functional_generation_with_a_head_equals_plain(pair, temperature):
    prompts = [[7, 300, 12, 45, 99], [3, 3, 17, 250, 9, 77, 3], [480, 2, 2, 2]]
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=24, ignore_eos=True,
                            presence_penalty=0.8, repetition_penalty=1.3)
    got, ref = (_generate(pair, spec, params, prompts) for spec in (True, False))
    assert np.asarray(got.token_ids).tolist() == np.asarray(ref.token_ids).tolist()
    assert (np.asarray(got.num_draft_tokens) > 0).all()
    assert (np.asarray(ref.num_draft_tokens) == 0).all()


def test_the_heads_cache_holds_the_dense_heads_keys_whatever_the_rounds(pair):
    """After prefill and rounds with rejections, the head's K/V at every position q < L - 2 is
    the dense head's over the final sequence, from the target's features at q and token q + 1:
    rejected drafts left nothing behind."""
    run, weights, hw, _ = pair
    prompts = [[7, 300, 12, 45, 99]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    st = _generate(pair, True, params, prompts, rounds=6)
    length = int(st.progress.length[0])
    tokens = np.asarray(st.history[0, :length]).tolist()
    assert int(st.progress.spec_rounds[0]) == 6 and length > 11
    feats = _dense_features(weights, tokens[:-1])                 # positions 0 .. L-2
    n = length - 2                                                # rows 0 .. L-3
    toks = jnp.asarray(tokens[1:n + 1])
    _, k_dense, v_dense = eagle.qkv(hw, head_config(), jnp.asarray(weights.embed)[toks],
                                    eagle.fuse(hw, feats[:n]), jnp.arange(n, dtype=jnp.int32))
    table = np.asarray(st.block_tables[0])
    pos = np.arange(n)
    hs = st.draft_cache
    got = hs.cache.k[0, table[pos // BLOCK], pos % BLOCK]
    np.testing.assert_allclose(np.asarray(got), np.asarray(k_dense), rtol=0, atol=2e-5)
    got = hs.cache.v[0, table[pos // BLOCK], pos % BLOCK]
    np.testing.assert_allclose(np.asarray(got), np.asarray(v_dense), rtol=0, atol=2e-5)
    assert int(hs.feature_pos[0]) == length - 2
