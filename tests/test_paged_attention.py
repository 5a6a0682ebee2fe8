"""The pure-jnp paged reference equals dense causal attention, and is row-invariant."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.paged_attention import paged_attention_reference

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


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_paged_equals_dense_causal(block_size):
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
    out = paged_attention_reference(jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc), 0,
                                    jnp.asarray(tables), jnp.asarray(slots), jnp.asarray(positions),
                                    sm_scale=0.25)
    out = np.asarray(out)
    np.testing.assert_allclose(out[:len(out) - pad], np.concatenate(expect), atol=1e-6, rtol=1e-5)
    assert (out[len(out) - pad:] == 0).all(), "padding rows must be exact zeros"


def test_row_bits_do_not_depend_on_neighbours_or_count():
    """A query row gives the same bits alone, at any position of its tile, among any rows."""
    rng = np.random.default_rng(0)
    kc, vc, tables, _ = _scatter(rng, [90, 200, 17], 16, 64, 16)
    f = jax.jit(paged_attention_reference, static_argnames=("sm_scale",))
    q0 = rng.standard_normal((H, D)).astype(np.float32)
    alone = np.zeros((8, H, D), np.float32)
    alone[0] = q0
    sl = np.full(8, -1, np.int32)
    sl[0] = 0
    ps = np.full(8, -1, np.int32)
    ps[0] = 60
    ref = np.asarray(f(alone, kc, vc, 0, tables, sl, ps, sm_scale=0.25))[0]
    for n, where in [(8, 5), (16, 11), (32, 30)]:
        q = rng.standard_normal((n, H, D)).astype(np.float32)
        q[where] = q0
        sl = rng.integers(0, 3, n).astype(np.int32)
        ps = np.array([rng.integers(0, [90, 200, 17][s]) for s in sl], np.int32)
        sl[where], ps[where] = 0, 60
        out = np.asarray(f(q, kc, vc, 0, tables, sl, ps, sm_scale=0.25))
        assert (out[where] == ref).all(), (n, where)


def test_nan_in_unused_pages_never_reaches_output():
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
    out = np.asarray(paged_attention_reference(q, kc, vc, 0, tables, sl, ps, sm_scale=0.25))
    assert np.isfinite(out).all()
