"""Sampling: counter keys, distribution exactness, processors against vLLM's rules, the kernel."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import sampling as K
from sfjax import LLM, SamplingParams
from sfjax import sampling as S

# ------------------------------------------------------------------------------------------
# the Gumbel-max draw itself


def test_noise_is_jax_gumbel_of_the_counter_key():
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(7), 11), S.ROLE_TARGET)
    bits = S.noise_bits(jnp.array([[0, 7]], jnp.uint32), jnp.array([11]), 300)[0]
    assert (K.gumbel_from_bits(bits) == jax.random.gumbel(key, (300,), jnp.float32)).all()


def test_exact_distribution_by_enumerating_the_noise():
    """Each token's noise takes 2**23 equally likely values, independently, so the probability
    that token i wins (argmax: the first index on ties) is an exact sum over i's noise values of
    the product of the others' CDFs. It equals softmax(x) to 1e-6."""
    x = np.array([1.3, -0.4, 0.0, 2.1], np.float32)
    g = np.sort(np.asarray(K.gumbel_from_bits(jnp.arange(2**23, dtype=jnp.uint32) << 9)))
    sums = [np.float32(xi) + g for xi in x]             # sorted, as rounding is monotone
    n = float(len(g))
    win = []
    for i in range(len(x)):
        p = np.ones(len(g))
        for j in range(len(x)):
            if j != i:
                p *= np.searchsorted(sums[j], sums[i], side="left" if j < i else "right") / n
        win.append(p.mean())
    soft = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
    assert abs(sum(win) - 1) < 1e-9
    np.testing.assert_allclose(win, soft, atol=1e-6)


def _draws(logits, n=100_000, **params):
    """n draws from one row's logits with the counter keys of positions 0..n-1 of one request."""
    v = logits.shape[0]
    bits = S.noise_bits(jnp.tile(jnp.array([[0, 5]], jnp.uint32), (n, 1)), jnp.arange(n), v)
    full = lambda name, val, dt: jnp.full((n,), params.get(name, val), dt)
    return np.asarray(jax.jit(K.sample_reference)(
        jnp.tile(jnp.asarray(logits)[None], (n, 1)), bits, full("temperature", 1.0, jnp.float32),
        full("top_k", 0, jnp.int32), full("top_p", 1.0, jnp.float32), full("min_p", 0.0, jnp.float32)))


def _expected(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """vLLM's rules by brute force on sorted probabilities."""
    x = logits / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = p >= min_p * p.max()
    if top_k:
        kth = np.sort(np.where(keep, x, -np.inf))[::-1][top_k - 1]
        keep &= x >= kth
    q = np.where(keep, p, 0)
    q /= q.sum()
    if top_p < 1:
        above = np.array([q[q > q[i]].sum() for i in range(len(q))])
        keep &= above < top_p
    q = np.where(keep, p, 0)
    return q / q.sum()


# TV of the empirical distribution over V <= 8 outcomes at n = 10^5 draws: by the
# Bretagnolle-Huber-Carol inequality P(TV >= eps) <= 2^V exp(-2 n eps^2) = 256 e^-20 < 1e-6
# at eps = 0.01. The draws are fixed by the keys, so the test is deterministic.
@pytest.mark.parametrize("params", [
    dict(), dict(temperature=0.5), dict(temperature=2.0), dict(top_k=3), dict(top_p=0.7),
    dict(min_p=0.2), dict(top_k=5, top_p=0.8, temperature=0.7), dict(top_p=0.3, min_p=0.05),
])
def test_distribution_matches_processed_softmax(params):
    logits = np.array([0.5, 2.0, -1.0, 1.5, 0.0, 1.0, -0.5, 1.9], np.float32)
    expected = _expected(logits, **params)
    counts = np.bincount(_draws(logits, **params), minlength=8) / 100_000
    assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(expected)), "drew outside the set"
    assert 0.5 * np.abs(counts - expected).sum() < 0.01


def test_filters_never_leave_their_set_on_random_rows():
    rng = np.random.default_rng(0)
    r, v = 64, 40
    logits = (rng.standard_normal((r, v)) * 3).astype(np.float32)
    logits[:, :5] = logits[:, 5:10]                   # ties at the cutoffs
    bits = S.noise_bits(jnp.zeros((r, 2), jnp.uint32), jnp.arange(r), v)
    temp = rng.uniform(0.3, 2, r).astype(np.float32)
    top_k = rng.integers(0, 8, r).astype(np.int32)
    top_p = rng.uniform(0.05, 1, r).astype(np.float32)
    min_p = np.where(rng.random(r) < 0.5, rng.uniform(0, 0.5, r), 0).astype(np.float32)
    tokens = np.asarray(K.sample_reference(logits, bits, temp, top_k, top_p, min_p))
    for i in range(r):
        allowed = _expected(logits[i], temp[i], top_k[i], top_p[i], min_p[i]) > 0
        assert allowed[tokens[i]], i


def test_kernel_equals_reference_in_interpret_mode():
    rng = np.random.default_rng(1)
    r, v = 32, 300
    logits = (rng.standard_normal((r, v)) * 2).astype(np.float32)
    bits = S.noise_bits(jnp.zeros((r, 2), jnp.uint32), jnp.arange(r), v)
    args = (logits, bits, np.where(rng.random(r) < 0.2, 0, rng.uniform(0.2, 2, r)).astype(np.float32),
            rng.integers(0, 30, r).astype(np.int32), rng.uniform(0.1, 1, r).astype(np.float32),
            np.where(rng.random(r) < 0.5, 0.1, 0).astype(np.float32))
    ref = np.asarray(K.sample_reference(*args))
    assert (np.asarray(K.sample_kernel(*args, interpret=True)) == ref).all()
    assert (np.asarray(K.sample(*args, impl="interpret")) == ref).all()


def _np_log_softmax(x):
    """Row by row on the host, so every call gets the same input rows."""
    x = x.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    return (x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True))).astype(np.float32)


def test_the_row_kernels_equal_their_references_and_keep_a_rows_bits():
    """logsumexp, the processed log-probabilities and the entropy, in interpret mode: equal to
    the jnp references (f32, 1e-6), and a probe row's bytes the same in calls of any row count
    (their reductions run inside fixed-shape programs of ``BLOCK_ROWS`` rows)."""
    rng = np.random.default_rng(7)
    v = 300
    probe = (rng.standard_normal(v) * 3).astype(np.float32)
    params = lambda r: (np.full(r, 0.7, np.float32), np.full(r, 40, np.int32),
                        np.full(r, 0.9, np.float32), np.zeros(r, np.float32))
    funcs = {"logsumexp": lambda x, impl: K.logsumexp(x, impl=impl),
             "log_probs": lambda x, impl: K.log_probs(x, *params(x.shape[0]), impl=impl),
             "entropy": lambda x, impl: K.entropy(_np_log_softmax(x), impl=impl)}
    for name, f in funcs.items():
        first = None
        for r in (1, 8, 13, 160):
            x = (rng.standard_normal((r, v)) * 3).astype(np.float32)
            x[r - 1] = probe
            got, ref = np.asarray(f(x, "interpret")), np.asarray(f(x, "reference"))
            finite = np.isfinite(ref)
            assert (np.isfinite(got) == finite).all(), name
            assert np.abs(got[finite] - ref[finite]).max() <= 1e-6 * max(1.0, np.abs(ref[finite]).max()), name
            row = got[r - 1].tobytes()
            first = row if first is None else first
            assert row == first, (name, r)


def _lowering_args():
    r, v = 16, 1000
    return (jnp.zeros((r, v)), jnp.zeros((r, v), jnp.uint32), jnp.ones(r), jnp.zeros(r, jnp.int32),
            jnp.ones(r), jnp.zeros(r))


def _cross_lower(backend: str, platform: str, device) -> str:
    """The kernel lowered for another platform on an abstract device (jax 0.11 needs the device
    for a GPU lowering too)."""
    from jax.sharding import AbstractMesh, AxisType, use_abstract_mesh

    f = functools.partial(K.sample_kernel, backend=backend)
    args = _lowering_args()                   # made outside the abstract mesh: eager ops fail there
    with use_abstract_mesh(AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)):
        return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def test_kernel_cross_lowers_for_gpu_triton():
    from jax.sharding import AbstractDevice

    device = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    assert "triton" in _cross_lower("triton", "cuda", device)


def test_kernel_cross_lowers_for_tpu_mosaic():
    from jax.sharding import AbstractDevice

    device = AbstractDevice(device_kind="TPU v6 lite", num_cores=1, platform="tpu")
    assert "tpu_custom_call" in _cross_lower("mosaic_tpu", "tpu", device)


# ------------------------------------------------------------------------------------------
# processors against vLLM's rules


def test_penalties_bias_and_allowed_follow_vllm():
    rng = np.random.default_rng(2)
    r, v, length = 8, 24, 12
    logits = rng.standard_normal((r, v)).astype(np.float32)
    history = rng.integers(0, v, (4, length)).astype(np.int32)
    slot = rng.integers(0, 4, r).astype(np.int32)
    prompt_len = rng.integers(1, 6, r).astype(np.int32)
    seq_pos = (prompt_len + rng.integers(0, 5, r)).astype(np.int32)
    b = S.SamplingBatch(
        temperature=np.ones(r, np.float32), top_k=np.zeros(r, np.int32), top_p=np.ones(r, np.float32),
        min_p=np.zeros(r, np.float32), presence=rng.uniform(-2, 2, r).astype(np.float32),
        frequency=rng.uniform(-2, 2, r).astype(np.float32),
        repetition=rng.uniform(0.5, 2, r).astype(np.float32),
        key_data=np.zeros((r, 2), np.uint32), position=np.zeros(r, np.int32), slot=slot,
        seq_pos=seq_pos, prompt_len=prompt_len,
        suppress=np.array([[3, -1]] * r, np.int32),
        bias_ids=np.array([[5, 7]] * r, np.int32), bias=np.array([[1.5, -100.0]] * r, np.float32),
        allowed=np.array([[-1, -1, -1]] * 4 + [[1, 5, 9]] * 4, np.int32),
        target=np.full(r, -1, np.int32))
    got = np.asarray(S.process(jnp.asarray(logits), b, jnp.asarray(history)))
    for i in range(r):
        x = logits[i].astype(np.float64).copy()
        x[5] += 1.5
        x[7] -= 100.0
        if i >= 4:
            mask = np.full(v, -np.inf)
            mask[[1, 5, 9]] = 0
            x = x + mask
        x[3] = -np.inf
        seen = history[slot[i], :seq_pos[i] + 1]
        out = history[slot[i], prompt_len[i]:seq_pos[i] + 1]
        rp = b.repetition[i]
        for t in set(seen.tolist()):
            x[t] = x[t] / rp if x[t] > 0 else x[t] * rp
        counts = np.bincount(out, minlength=v)
        x = x - b.frequency[i] * counts - b.presence[i] * (counts > 0)
        np.testing.assert_allclose(got[i], x, rtol=1e-6, atol=1e-5)
    # the accelerator path applies every processor to every row, with no branch: the same bits
    same = np.asarray(S.process(jnp.asarray(logits), b, jnp.asarray(history), branch_free=True))
    assert same.tobytes() == got.tobytes()
    # rows that ask for none of them come out as they went in, bit for bit, beside rows that do
    off = dict(presence=np.zeros(r, np.float32), frequency=np.zeros(r, np.float32),
               repetition=np.ones(r, np.float32), suppress=np.full((r, 2), -1, np.int32),
               bias_ids=np.full((r, 2), -1, np.int32), allowed=np.full((r, 3), -1, np.int32))
    half = {k: np.where(np.arange(r).reshape(-1, *[1] * (v.ndim - 1)) < 4, v, getattr(b, k))
            for k, v in off.items()}
    for fields in (off, half):
        c = dataclasses.replace(b, **fields)
        plain = np.asarray(S.process(jnp.asarray(logits), c, jnp.asarray(history)))
        free = np.asarray(S.process(jnp.asarray(logits), c, jnp.asarray(history), branch_free=True))
        assert free.tobytes() == plain.tobytes()
        assert free[:4].tobytes() == logits[:4].tobytes()


# ------------------------------------------------------------------------------------------
# through the engine


@pytest.fixture(scope="module")
def llm(tiny_folder):
    return LLM(tiny_folder, max_num_seqs=32, max_model_len=128, seed=0)


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(2, 500, rng.integers(3, 30)).tolist()} for _ in range(n)]


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_seeded_request_is_the_same_alone_in_a_batch_and_across_engine_seeds(llm, tiny_folder):
    prompts = _prompts(32, seed=1)
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    alone = _ids(llm.generate(prompts[0], params, use_tqdm=False))[0]
    others = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    for slot in (0, 17, 31):
        batch = [others] * 32
        batch[slot] = params
        mixed = prompts[1:slot + 1] + [prompts[0]] + prompts[slot + 1:]
        assert _ids(llm.generate(mixed, batch, use_tqdm=False))[slot] == alone
    other_engine = LLM(tiny_folder, max_num_seqs=8, max_model_len=128, seed=99)
    assert _ids(other_engine.generate(prompts[0], params, use_tqdm=False))[0] == alone


def test_unseeded_requests_differ_across_engine_seeds(llm, tiny_folder):
    prompts = _prompts(4, seed=2)
    params = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    a = _ids(LLM(tiny_folder, max_num_seqs=4, max_model_len=128, seed=1).generate(prompts, params, use_tqdm=False))
    b = _ids(LLM(tiny_folder, max_num_seqs=4, max_model_len=128, seed=1).generate(prompts, params, use_tqdm=False))
    c = _ids(LLM(tiny_folder, max_num_seqs=4, max_model_len=128, seed=2).generate(prompts, params, use_tqdm=False))
    assert a == b
    assert all(x != y for x, y in zip(a, c))


def test_top_k_1_equals_greedy(llm):
    prompts = _prompts(6, seed=3)
    greedy = _ids(llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                               use_tqdm=False))
    top1 = _ids(llm.generate(prompts, SamplingParams(temperature=1.3, top_k=1, seed=5, max_tokens=16,
                                                     ignore_eos=True), use_tqdm=False))
    assert top1 == greedy


@pytest.mark.parametrize("top_p", [1e-30, 1e-38, 1e-45])
def test_the_smallest_top_p_keeps_the_top_token(llm, top_p):
    """top_p keeps at least the most likely token, as in vLLM, however small: a top_p that is
    subnormal (1e-38) or zero (1e-45) in float32 kept none, and every draw was token 0, even
    where allowed_token_ids or min_tokens ruled it out."""
    logits = np.random.default_rng(0).standard_normal((4, 40)).astype(np.float32)
    bits = S.noise_bits(jnp.zeros((4, 2), jnp.uint32), jnp.arange(4), 40)
    one = lambda x: np.full(4, x, np.float32)
    tokens = K.sample_reference(logits, bits, one(1.0), one(0).astype(np.int32), one(top_p), one(0))
    np.testing.assert_array_equal(tokens, logits.argmax(-1))
    prompts = _prompts(3, seed=4)
    run = lambda **kw: _ids(llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True,
                                                                 **kw), use_tqdm=False))
    assert run(temperature=1.3, top_p=top_p, seed=5) == run(temperature=0)
    allowed = dict(allowed_token_ids=[7, 8], min_tokens=6, stop_token_ids=[0])
    assert run(temperature=1.3, top_p=top_p, seed=5, **allowed) == run(temperature=0, **allowed)


def test_logits_past_float32s_range_draw_what_they_mean(llm):
    """A tiny temperature (logits / T past float32's largest) or repetition_penalty (a seen
    logit / it) made the softmax NaN, and with top-k, top-p or min-p every draw was token 0,
    even outside allowed_token_ids. A tiny T now draws the argmax, as greedy does, by kernel and
    reference alike; a tiny repetition_penalty keeps the seen logits' order; in range, the bits are
    as they were (``test_exact_distribution_by_enumerating_the_noise`` and the golden runs)."""
    logits = np.random.default_rng(2).standard_normal((8, 40)).astype(np.float32) * 40
    logits[:, 5] = -np.inf                                     # a masked token stays masked
    bits = S.noise_bits(jnp.zeros((8, 2), jnp.uint32), jnp.arange(8), 40)
    one = lambda x, dtype=np.float32: np.full(8, x, dtype)
    for top_k, top_p, min_p in ((0, 1.0, 0.0), (3, 1.0, 0.0), (0, 0.9, 0.0), (0, 1.0, 0.1)):
        args = (logits, bits, one(1e-37), one(top_k, np.int32), one(top_p), one(min_p))
        np.testing.assert_array_equal(K.sample_reference(*args), logits.argmax(-1))
        np.testing.assert_array_equal(K.sample(*args, impl="interpret"), logits.argmax(-1))
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    run = lambda **kw: llm.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True, seed=0,
                                                           **kw), use_tqdm=False)[0].outputs[0]
    allowed = dict(logit_bias={100: 100}, allowed_token_ids=[100, 200, 300])
    assert run(temperature=1e-37, top_k=3, **allowed).token_ids == [100] * 6
    assert run(temperature=1e-37, top_p=0.9).token_ids == run(temperature=0).token_ids
    # a seen logit / 1e-38 past float32's largest: held in range, the seen logits' order kept
    # (clipped, they tied, and the lowest id won whatever the logits or the seed)
    logits = np.zeros((1, 12), np.float32)
    logits[0, 3], logits[0, 9] = 2.0, 5.0
    one = lambda x, dtype=np.float32: np.full(1, x, dtype)
    b = S.SamplingBatch(
        temperature=one(1.0), top_k=one(0, np.int32), top_p=one(1.0), min_p=one(0.0),
        presence=one(0.0), frequency=one(0.0), repetition=one(1e-38),
        key_data=np.zeros((1, 2), np.uint32), position=one(0, np.int32), slot=one(0, np.int32),
        seq_pos=one(1, np.int32), prompt_len=one(2, np.int32), suppress=np.full((1, 1), -1, np.int32),
        bias_ids=np.full((1, 1), -1, np.int32), bias=np.zeros((1, 1), np.float32),
        allowed=np.full((1, 1), -1, np.int32), target=one(-1, np.int32))
    x = np.asarray(S.process(jnp.asarray(logits), b, jnp.asarray([[3, 9, 0, 0]], np.int32)))[0]
    assert np.isfinite(x).all() and x[9] > x[3] > 1e37 and x.argmax() == 9, x


def test_n_completions_per_prompt_as_vllm_samples_them(llm):
    """SamplingParams.n (vLLM's parallel sampling, in LLM.generate): one RequestOutput per
    prompt holding n completions, completion i the tokens of the same request alone seeded
    seed + i (greedy: n equal ones; unseeded: n draws of their own); the engine and the server
    take one sequence per request, and say so."""
    prompts = _prompts(2, seed=7)
    seeded = SamplingParams(n=3, temperature=0.9, seed=10, max_tokens=8, ignore_eos=True,
                            presence_penalty=0.5)
    outs = llm.generate(prompts, seeded, use_tqdm=False)
    assert len(outs) == 2 and [[c.index for c in o.outputs] for o in outs] == [[0, 1, 2]] * 2
    for p, o in zip(prompts, outs):
        alone = [llm.generate(p, SamplingParams(temperature=0.9, seed=10 + i, max_tokens=8,
                                                ignore_eos=True, presence_penalty=0.5),
                              use_tqdm=False)[0].outputs[0].token_ids for i in range(3)]
        assert [c.token_ids for c in o.outputs] == alone and len(set(map(tuple, alone))) > 1
        assert o.prompt_token_ids == p["prompt_token_ids"]
    greedy = llm.generate(prompts[0], SamplingParams(n=2, temperature=0, max_tokens=8),
                          use_tqdm=False)[0].outputs
    assert greedy[0].token_ids == greedy[1].token_ids
    free = llm.generate(prompts[0], SamplingParams(n=4, temperature=1.0, max_tokens=8,
                                                   ignore_eos=True), use_tqdm=False)[0].outputs
    assert len({tuple(c.token_ids) for c in free}) > 1
    with pytest.raises(ValueError, match="SamplingParams.n = 2: the engine runs one sequence"):
        llm.engine.add_request("n2", prompts[0], SamplingParams(n=2))


def test_stop_strings(llm):
    prompt = _prompts(1, seed=4)[0]
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop = base.text[len(base.text) // 2: len(base.text) // 2 + 2]
    assert stop
    cut = base.text.index(stop)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == base.text[:cut] and (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.token_ids == base.token_ids[:len(out.token_ids)]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stop,
                                              include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert out.text == base.text[:cut + len(stop)]
    # a stop string across each token boundary: every output's text, step by step, is the start
    # of the final one (the engine holds back what a stop string may still cut, as vLLM does;
    # a stream's text shrank where a call ended between a stop string's characters)
    pieces = [llm.get_tokenizer().decode(base.token_ids[:j]) for j in range(25)]
    stops = {f"b{j}": pieces[j][-1] + pieces[j + 1][len(pieces[j])] for j in range(1, 23)
             if len(pieces[j + 1]) > len(pieces[j]) > 0}
    texts = {rid: [] for rid in stops}
    for rid, st in stops.items():
        llm.engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=24,
                                                           ignore_eos=True, stop=[st]))
    while llm.engine.has_unfinished_requests():
        for o in llm.engine.step():
            texts[o.request_id].append(o.outputs[0].text)
    assert len(stops) > 10 and all(t[-1] == base.text[:base.text.index(stops[rid])]
                                   for rid, t in texts.items())
    assert all(b.startswith(a) for t in texts.values() for a, b in zip(t, t[1:])), texts
    # min_tokens: as in vLLM, a stop string counts where a token past min_tokens completes it
    decode = llm.get_tokenizer().decode
    k = next(n for n in range(1, 25) if stop in decode(base.token_ids[:n]))   # completes it
    for min_tokens, stopped in ((k - 1, True), (k, False)):
        for stops in ([stop], [stop, "\x01" * 12]):    # a longer one beside it widens no window
            out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                      stop=stops, min_tokens=min_tokens),
                               use_tqdm=False)[0].outputs[0]
            assert out.token_ids == base.token_ids[:len(out.token_ids)]
            assert (out.text == base.text[:cut]) == stopped
            assert (len(out.token_ids) > k) != stopped


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(min_p=1.5), "min_p"), (dict(logprobs=21), "logprobs"),
    (dict(prompt_logprobs=50), "prompt_logprobs"), (dict(presence_penalty=3), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(stop=["ok", ""]), "stop"), (dict(n=0), "n"), (dict(seed=-1), "seed"),
    (dict(stop_token_ids=np.array([[3, 4]])), "stop_token_ids"),
    (dict(temperature=1e39), "temperature"), (dict(repetition_penalty=1e300), "repetition_penalty"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} .*must be"):
        SamplingParams(**kwargs)


def test_token_id_lists_may_be_arrays():
    """A 1-D integer array is a list of ids, as vLLM takes it; its entries are checked alike."""
    p = SamplingParams(stop_token_ids=np.array([3, 4]), allowed_token_ids=np.arange(5, 8))
    assert p.stop_token_ids == [3, 4] and p.allowed_token_ids == [5, 6, 7]
    assert all(type(t) is int for t in p.stop_token_ids + p.allowed_token_ids)
    with pytest.raises(ValueError, match=r"stop_token_ids\[0\]"):
        SamplingParams(stop_token_ids=np.array([0.5]))


@pytest.mark.parametrize("kwargs, field", [
    (dict(stop_token_ids=[512]), "stop_token_ids"), (dict(logit_bias={600: 1.0}), "logit_bias"),
    (dict(allowed_token_ids=[3, 600]), "allowed_token_ids"),   # [3, -1]: refused at construction
])
def test_token_ids_outside_the_vocabulary_are_refused(llm, kwargs, field):
    with pytest.raises(ValueError, match=rf"{field} .*\[0, 512\)"):
        llm.generate(_prompts(1)[0], SamplingParams(**kwargs), use_tqdm=False)


def test_processors_reach_the_engine(llm):
    prompt = _prompts(1, seed=5)[0]
    out = llm.generate(prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True,
                                              allowed_token_ids=[10, 11, 12]), use_tqdm=False)[0].outputs[0]
    assert set(out.token_ids) <= {10, 11, 12}
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                              logit_bias={42: 100.0}), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [42] * 12
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                              logit_bias={42: 100.0}, presence_penalty=2.0,
                                              repetition_penalty=2.0), use_tqdm=False)[0].outputs[0]
    assert out.token_ids[0] == 42   # 42 is in neither prompt nor output before the first draw


def test_logprobs_match_hf_log_softmax(llm, tiny_folder):
    """logprobs and prompt_logprobs are of the raw logits: log_softmax of HF's, to 1e-4."""
    import torch
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32).eval()
    prompt = _prompts(1, seed=9)[0]
    out = llm.generate(prompt, SamplingParams(temperature=0.7, top_k=20, seed=4, max_tokens=10, ignore_eos=True,
                                              logprobs=5, prompt_logprobs=3), use_tqdm=False)[0]
    ids = prompt["prompt_token_ids"] + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1).numpy()
    p = len(prompt["prompt_token_ids"])
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == p
    for i, entry in enumerate(out.prompt_logprobs[1:], 1):
        assert ids[i] in entry and len(entry) >= 3
        for tok, lp in entry.items():
            assert abs(lp.logprob - ref[i - 1, tok]) < 1e-4
        top3 = np.argsort(-ref[i - 1])[:3]
        assert set(top3) <= set(entry)
    total = 0.0
    for j, entry in enumerate(out.outputs[0].logprobs):
        tok = out.outputs[0].token_ids[j]
        row = ref[p - 1 + j]
        assert abs(entry[tok].logprob - row[tok]) < 1e-4
        assert entry[tok].rank == 1 + int((row > row[tok]).sum())
        assert set(np.argsort(-row)[:5]) <= set(entry)
        total += entry[tok].logprob
    assert abs(out.outputs[0].cumulative_logprob - total) < 1e-6
