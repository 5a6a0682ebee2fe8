"""Acceptance rules, exactly: rejection sampling by enumeration, typical acceptance's rule,
the exact rule's prefix, stop truncation, and the on-device n-gram proposer."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sampling import gumbel_from_bits
from sfjax import sampling as S
from sfjax.spec import accept, proposers

V = 4


def _dist(rng, peaked=1.0):
    x = rng.standard_normal(V) * peaked
    p = np.exp(x - x.max())
    return p / p.sum()


def _emit_prob(p, q, d):
    """P(accept d) and the residual distribution, from the implementation's own functions."""
    a = float(accept.accept_probability(jnp.log(p)[None], jnp.log(q)[None], jnp.array([d]))[0])
    r = np.exp(np.asarray(accept.residual_logits(jnp.log(p), jnp.log(q)), np.float64))
    return a, r / r.sum()


@pytest.mark.parametrize("seed", range(4))
def test_rejection_sampling_is_distribution_exact_by_enumeration(seed):
    """Two drafted positions over a 4-token vocabulary: every draft outcome x accept/reject, with
    the probabilities the implementation uses; the first two emitted tokens must be distributed as
    the target's p1(x) p2(y | x) to 1e-6."""
    rng = np.random.default_rng(seed)
    p1, q1 = _dist(rng), _dist(rng, 2.0)
    p2 = {x: _dist(rng) for x in range(V)}
    q2 = {x: _dist(rng, 0.5) for x in range(V)}
    joint = np.zeros((V, V))
    for d1 in range(V):
        a1, r1 = _emit_prob(p1, q1, d1)
        for x in range(V):                               # rejected at 1: x ~ residual, then p2(.|x)
            joint[x] += q1[d1] * (1 - a1) * r1[x] * p2[x]
        for d2 in range(V):                              # accepted d1, draft d2
            a2, r2 = _emit_prob(p2[d1], q2[d1], d2)
            joint[d1] += q1[d1] * a1 * q2[d1][d2] * (1 - a2) * r2
            joint[d1, d2] += q1[d1] * a1 * q2[d1][d2] * a2
    target = p1[:, None] * np.stack([p2[x] for x in range(V)])
    np.testing.assert_allclose(joint, target, atol=1e-6)
    assert abs(joint.sum() - 1) < 1e-9


def test_rejection_rule_follows_its_uniforms_and_residual():
    """accept.rejection on random rows equals the rule applied by hand with the same draws."""
    rng = np.random.default_rng(5)
    s, k = 64, 3
    logp = jax.nn.log_softmax(jnp.asarray(rng.standard_normal((s, k + 1, V)) * 2, jnp.float32))
    logq = jax.nn.log_softmax(jnp.asarray(rng.standard_normal((s, k, V)) * 2, jnp.float32))
    drafts = jnp.asarray(rng.integers(0, V, (s, k)), jnp.int32)
    u = jnp.asarray(rng.random((s, k)), jnp.float32)
    noise = gumbel_from_bits(jax.random.bits(jax.random.key(0), (s, k, V), jnp.uint32))
    bonus = jnp.asarray(rng.integers(0, V, (s, k + 1)), jnp.int32)
    ks = jnp.asarray(rng.integers(0, k + 1, s), jnp.int32)
    acc, out = map(np.asarray, accept.rejection(drafts, logp, logq, u, noise, bonus, ks))
    lp, lq, dr, un, nz, bn = map(np.asarray, (logp, logq, drafts, u, noise, bonus))
    for i in range(s):
        a = 0
        while a < ks[i] and un[i, a] < min(1.0, np.exp(lp[i, a, dr[i, a]] - lq[i, a, dr[i, a]])):
            a += 1
        assert acc[i] == a
        assert list(out[i, :a]) == list(dr[i, :a])
        if a < ks[i]:
            res = np.maximum(np.exp(lp[i, a]) - np.exp(lq[i, a]), 0)
            expect = np.argmax(np.where(res > 0, np.log(np.where(res > 0, res, 1)), -np.inf) + nz[i, a])
            assert out[i, a] == expect
        else:
            assert out[i, a] == bn[i, a]


def test_rejection_with_counter_keys_matches_the_target_by_monte_carlo():
    """One drafted position, uniforms and residual noise from the counter keys of 10^5 output
    positions: the emitted token's distribution is p (TV < 0.01; the bound of
    test_sampling.py gives P(TV >= 0.01) < 1e-6 for V <= 8)."""
    n = 100_000
    p = jnp.asarray([0.5, 0.2, 0.2, 0.1])
    q = jnp.asarray([0.1, 0.6, 0.2, 0.1])
    keys = jnp.tile(jnp.array([[0, 9]], jnp.uint32), (n, 1))
    pos = jnp.arange(n)
    d = S.noise_bits(keys, pos, V, S.ROLE_DRAFT)
    drafts = jnp.argmax(jnp.log(q)[None] + gumbel_from_bits(d), axis=1)[:, None]
    u = jax.vmap(lambda kd, t: jax.random.uniform(S.draw_keys(kd[None], t[None], S.ROLE_ACCEPT)[0]))(keys, pos)
    res = gumbel_from_bits(S.noise_bits(keys, pos, V, S.ROLE_RESIDUAL))[:, None]
    bonus = jnp.argmax(jnp.log(p)[None] + gumbel_from_bits(S.noise_bits(keys, pos + 1, V)), 1)
    _, out = accept.rejection(drafts, jnp.tile(jnp.log(p), (n, 2, 1)), jnp.tile(jnp.log(q), (n, 1, 1)),
                              u[:, None], res, jnp.stack([bonus, bonus], 1), jnp.ones(n, jnp.int32))
    counts = np.bincount(np.asarray(out[:, 0]), minlength=V) / n
    assert 0.5 * np.abs(counts - np.asarray(p)).sum() < 0.01


def test_typical_acceptance_rule():
    rng = np.random.default_rng(6)
    s, k, v = 32, 3, 6
    logp = jax.nn.log_softmax(jnp.asarray(rng.standard_normal((s, k + 1, v)) * 2, jnp.float32))
    drafts = jnp.asarray(rng.integers(0, v, (s, k)), jnp.int32)
    target = jnp.asarray(rng.integers(0, v, (s, k + 1)), jnp.int32)
    ks = jnp.full((s,), k, jnp.int32)
    greedy = jnp.asarray(rng.random(s) < 0.3)
    acc, out = map(np.asarray, accept.typical(drafts, target, logp, ks, greedy, 0.09, 0.3))
    p = np.exp(np.asarray(logp, np.float64))
    for i in range(s):
        a = 0
        while a < k:
            pa = p[i, a]
            best = int(np.argmax(pa))
            if greedy[i]:
                ok = drafts[i, a] == best
            else:
                ok = pa[drafts[i, a]] > min(0.09, 0.3 * np.exp((pa * np.log(pa)).sum()))
            if not ok:
                break
            a += 1
        assert acc[i] == a, i
        # accepted tokens are above the threshold; the replacement is the target's argmax
        assert list(out[i, :a]) == list(np.asarray(drafts)[i, :a])
        assert out[i, a] == (int(np.argmax(p[i, a])) if a < k else int(target[i, a]))


def test_exact_rule_and_per_row_k():
    drafts = jnp.array([[5, 6, 7], [5, 9, 7], [5, 6, 7], [1, 2, 3]])
    target = jnp.array([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [4, 2, 3, 0]])
    acc, out = accept.exact(drafts, target, jnp.array([3, 3, 1, 3]))
    assert acc.tolist() == [3, 1, 1, 0]
    assert (out == target).all()


def test_truncate_at_stops():
    tokens = jnp.array([[5, 1, 7, 8], [5, 1, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    accepted = jnp.array([3, 3, 3, 1])
    n = accept.truncate_at_stops(tokens, accepted, jnp.array([[1, -1]] * 4), jnp.array([0, 2, 0, 0]),
                                 jnp.array([9, 9, 2, 9]))
    # stop at index 1; stop not yet allowed (min_left 2); budget 2; accepted 1 => 2 tokens
    assert n.tolist() == [2, 4, 2, 2]


@pytest.mark.parametrize("n_min, n_max, vocab", [(1, 1, 5), (1, 3, 5), (2, 4, 5), (1, 17, 2),
                                                 (3, 64, 2), (1, 1000, 2)])
def test_ngram_proposer_matches_a_brute_force_lookup(n_min, n_max, vocab):
    """Beside small n_max, ones past the unrolled 16 and past the history's width (the loop's
    body is one; vocabulary 2 makes long matches common); lengths 0, 1, 2 and the whole width
    among them, rows read from other slots, and tokens past a row's length never read."""
    rng = np.random.default_rng(n_max)
    width, k, rows = 40, 4, 12
    hist = rng.integers(0, vocab, (rows, width)).astype(np.int32)
    length = np.concatenate([[0, 1, 2, width], rng.integers(3, width, rows - 4)]).astype(np.int32)
    slots = rng.permutation(rows).astype(np.int32)
    garbage = np.where(np.arange(width)[None, :] >= length[np.argsort(slots)][:, None], 99, hist)
    drafts, avail, copied = map(np.asarray, proposers.ngram(
        jnp.asarray(garbage), jnp.asarray(slots), jnp.asarray(length), k, n_min, n_max))
    for s in range(rows):
        h, L = list(garbage[slots[s], :length[s]]), length[s]
        start = -1
        for n in range(n_max, n_min - 1, -1):
            if n > L - 1:
                continue
            hits = [p for p in range(0, L - n) if h[p:p + n] == h[L - n:]]
            if hits:
                start = max(hits) + n
                break
        assert copied[s] == (start >= 0)
        if start < 0:
            assert avail[s] == 0
        else:       # the tokens after the match, then around its period (L - start) on to k
            assert avail[s] == k
            assert list(drafts[s]) == [h[start + j % (L - start)] for j in range(k)]


def test_ngram_enumerates_small_histories_exhaustively():
    """Every history of length 5 over 2 symbols: the proposal is the brute-force one."""
    seqs = np.array(list(itertools.product([0, 1], repeat=5)), np.int32)
    drafts, avail, copied = map(np.asarray, proposers.ngram(
        jnp.asarray(seqs), jnp.arange(len(seqs)), jnp.full(len(seqs), 5, jnp.int32), 2, 1, 2))
    for s, h in enumerate(seqs.tolist()):
        start = -1
        for n in (2, 1):
            hits = [p for p in range(0, 5 - n) if h[p:p + n] == h[5 - n:]]
            if hits:
                start = max(hits) + n
                break
        assert avail[s] == (0 if start < 0 else 2) and copied[s] == (start >= 0)
        if start >= 0:
            assert list(drafts[s]) == [h[start + j % (5 - start)] for j in range(2)]
