"""The pure-jnp paged references (by row, and in row tiles) equal dense causal attention, and are
row-invariant."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.paged_attention import paged_attention

REFERENCES = ["reference", "reference_tiles"]

H, KVH, D = 4, 2, 16


def _dense(q, k, v, scale):
    """q [T, H, D] at positions P-T..P-1 over k, v [P, KVH, D]; numpy float64 causal softmax."""
    t, p = q.shape[0], k.shape[0]
    g = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = np.einsum("thd,shd->hts", q, k) * scale
    pos = np.arange(p - t, p)[:, None]
    s = np.where(np.arange(p)[None, :] <= pos, s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("hts,shd->thd", w, v)


def _scatter(rng, lengths, block_size, num_blocks, max_blocks):
    """Random distinct pages per sequence; returns k/v caches, block tables and dense copies."""
    perm = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((len(lengths), max_blocks), np.int32)
    kc = np.zeros((1, num_blocks, block_size, KVH, D), np.float32)
    vc = np.zeros_like(kc)
    dense, used = [], 0
    for s, n in enumerate(lengths):
        nblk = -(-n // block_size)
        tables[s, :nblk] = perm[used:used + nblk]
        used += nblk
        k = rng.standard_normal((n, KVH, D)).astype(np.float32)
        v = rng.standard_normal((n, KVH, D)).astype(np.float32)
        for i in range(n):
            kc[0, tables[s, i // block_size], i % block_size] = k[i]
            vc[0, tables[s, i // block_size], i % block_size] = v[i]
        dense.append((k, v))
    return kc, vc, tables, dense


@pytest.mark.parametrize("impl", REFERENCES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_paged_equals_dense_causal(block_size, impl):
    rng = np.random.default_rng(block_size)
    lengths = [1, 7, 33, 70, 130]
    q_lens = [1, 3, 5, 8, 4]
    kc, vc, tables, dense = _scatter(rng, lengths, block_size, 64, 20)
    rows_q, slots, positions, expect = [], [], [], []
    for s, (n, t) in enumerate(zip(lengths, q_lens)):
        t = min(t, n)
        q = rng.standard_normal((t, H, D)).astype(np.float32)
        rows_q.append(q)
        slots += [s] * t
        positions += list(range(n - t, n))
        expect.append(_dense(q.astype(np.float64), *map(np.float64, dense[s]), 0.25))
    pad = -len(slots) % 8
    q = np.concatenate(rows_q + [np.zeros((pad, H, D), np.float32)])
    slots = np.array(slots + [-1] * pad, np.int32)
    positions = np.array(positions + [-1] * pad, np.int32)
    out = paged_attention(jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc), 0, jnp.asarray(tables),
                          jnp.asarray(slots), jnp.asarray(positions), sm_scale=0.25, impl=impl)
    out = np.asarray(out)
    np.testing.assert_allclose(out[:len(out) - pad], np.concatenate(expect), atol=1e-6, rtol=1e-5)
    assert (out[len(out) - pad:] == 0).all(), "padding rows must be exact zeros"


@pytest.mark.parametrize("impl", REFERENCES)
def test_row_bits_do_not_depend_on_neighbours_or_count(impl):
    """A query row gives the same bits alone, at any position of its tile, among any rows."""
    rng = np.random.default_rng(0)
    kc, vc, tables, _ = _scatter(rng, [90, 200, 17], 16, 64, 16)
    f = jax.jit(paged_attention, static_argnames=("sm_scale", "impl"))
    q0 = rng.standard_normal((H, D)).astype(np.float32)
    alone = np.zeros((8, H, D), np.float32)
    alone[0] = q0
    sl = np.full(8, -1, np.int32)
    sl[0] = 0
    ps = np.full(8, -1, np.int32)
    ps[0] = 60
    ref = np.asarray(f(alone, kc, vc, 0, tables, sl, ps, sm_scale=0.25, impl=impl))[0]
    for n, where in [(8, 5), (16, 11), (32, 30)]:
        q = rng.standard_normal((n, H, D)).astype(np.float32)
        q[where] = q0
        sl = rng.integers(0, 3, n).astype(np.int32)
        ps = np.array([rng.integers(0, [90, 200, 17][s]) for s in sl], np.int32)
        sl[where], ps[where] = 0, 60
        out = np.asarray(f(q, kc, vc, 0, tables, sl, ps, sm_scale=0.25, impl=impl))
        assert (out[where] == ref).all(), (n, where)


@pytest.mark.parametrize("impl", REFERENCES)
def test_nan_in_unused_pages_never_reaches_output(impl):
    rng = np.random.default_rng(1)
    kc, vc, tables, _ = _scatter(rng, [20, 40], 8, 32, 8)
    used = set(tables.ravel()) - {0}
    for b in range(1, 32):
        if b not in used:
            kc[0, b] = np.nan
            vc[0, b] = np.nan
    # the unused tail of a partly filled page is poisoned too
    kc[0, tables[0, 2], 4:] = np.nan
    vc[0, tables[0, 2], 4:] = np.nan
    q = rng.standard_normal((8, H, D)).astype(np.float32)
    sl = np.array([0, 0, 1, 1, 1, -1, -1, -1], np.int32)
    ps = np.array([19, 10, 39, 0, 25, -1, -1, -1], np.int32)
    out = np.asarray(paged_attention(q, kc, vc, 0, tables, sl, ps, sm_scale=0.25, impl=impl))
    assert np.isfinite(out).all()


def test_the_engine_on_row_tiles_speculates_exactly(tiny_folder):
    """attention="reference_tiles" computes other bits than the row reference, and is exact on
    its own terms: n-gram speculation gives its plain decoding's tokens, greedy and seeded."""
    from sfjax import LLM, SamplingParams

    geometry = dict(max_num_seqs=4, max_model_len=64, block_size=8, attention="reference_tiles")
    prompts = [{"prompt_token_ids": p} for p in ([5, 9, 11] * 3 + [5],
                                                 [480, 2, 2, 2, 17, 3, 250, 9, 77, 3, 41])]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=4, max_tokens=12, ignore_eos=True)]
    ids = lambda llm: [o.outputs[0].token_ids for o in llm.generate(prompts * 2, params * 2,
                                                                        use_tqdm=False)]
    ref = ids(LLM(tiny_folder, **geometry))
    llm = LLM(tiny_folder, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                               "prompt_lookup_max": 2}, **geometry)
    assert ids(llm) == ref
    assert llm.get_metrics()["spec_decode"]["num_drafts"] > 0
