"""The Pallas paged-attention kernel: equal to the reference in interpret mode, NaN-proof,
row-invariant bit for bit, and lowerable for GPU (Triton) and TPU (Mosaic) on a CPU machine."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

from pallas_kernels import paged_attention as P

D, SCALE = 16, 0.25
BACKENDS = ["triton", "mosaic_tpu"]


@pytest.fixture(autouse=True)
def _full_precision_dots():
    """Full float32 dots in the kernel and the reference alike: on a GPU the default precision
    runs f32 dots in TF32 (the same code on CPU is unaffected), which the 1e-6 tolerance is not
    for."""
    with jax.default_matmul_precision("highest"):
        yield


def _cache(rng, lengths, block_size, kvh, dtype=np.float32, max_blocks=12):
    """Random K/V pages (2 layers; layer 1 is read), distinct pages per slot; unused pages hold
    other random values, so a wrong page shows."""
    num_blocks = 1 + len(lengths) * max_blocks
    shape = (2, num_blocks, block_size, kvh, D)
    kc, vc = (rng.standard_normal(shape).astype(dtype) for _ in range(2))
    perm = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((len(lengths), max_blocks), np.int32)
    for s, n in enumerate(lengths):
        nblk = -(-n // block_size)
        tables[s, :nblk] = perm[s * max_blocks:s * max_blocks + nblk]
    return kc, vc, tables


def _rows(rng, runs, h, n, dtype=np.float32):
    """runs: (slot, first position, count) in row order, None for one padding row; padded to n."""
    slots, positions = [], []
    for run in runs:
        s, p, c = run or (-1, -1, 1)
        slots += [s] * c
        positions += list(range(p, p + c)) if s >= 0 else [-1]
    pad = n - len(slots)
    q = rng.standard_normal((n, h, D)).astype(dtype)
    return q, np.array(slots + [-1] * pad, np.int32), np.array(positions + [-1] * pad, np.int32)


def _both(backend, q, kc, vc, tables, slots, positions, **kw):
    args = (q, kc, vc, 1, tables, slots, positions)
    ref = np.asarray(P.paged_attention_reference(*args, sm_scale=SCALE))
    out = np.asarray(P.paged_attention_kernel(*args, sm_scale=SCALE, backend=backend,
                                              interpret=kw.pop("interpret", True), **kw))
    return out, ref


# Each block size and each GQA ratio (1, 4, 8) once per backend; every call mixes decode rows,
# verify runs of q_len 1..5 (k = 4), a prefill chunk longer than a query block, padding rows in
# the middle and at the end, and lengths just below, at and past page boundaries.
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size, kvh, g", [(8, 2, 4), (16, 1, 8), (32, 2, 1)])
def test_kernel_equals_reference(backend, block_size, kvh, g):
    rng = np.random.default_rng(block_size)
    b = block_size
    lengths = [b - 1, b, b + 1, 2 * b + 3, 3 * b, 90, 5]
    kc, vc, tables = _cache(rng, lengths, b, kvh)
    runs = [(0, b - 2, 1), (1, b - 3, 3), None, (2, b - 4, 5), (3, 2 * b - 1, 4),
            (4, 3 * b - 2, 2), (5, 70, 11), None, None, (6, 0, 5)]
    q, slots, positions = _rows(rng, runs, kvh * g, 40)
    out, ref = _both(backend, q, kc, vc, tables, slots, positions)
    np.testing.assert_allclose(out, ref, atol=1e-6, rtol=1e-6)
    assert (out[slots < 0] == 0).all(), "padding rows must be exact zeros"


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_equals_reference_bf16(backend):
    # bf16 pages and queries are upcast exactly, so the f32 tolerance holds in the interpreter
    rng = np.random.default_rng(7)
    kc, vc, tables = _cache(rng, [20, 45, 9], 16, 2, jnp.bfloat16)
    q, slots, positions = _rows(rng, [(0, 16, 4), (1, 40, 5), None, (2, 8, 1)], 8, 16, jnp.bfloat16)
    out, ref = _both(backend, q, kc, vc, tables, slots, positions)
    np.testing.assert_allclose(out, ref, atol=1e-6, rtol=1e-6)


def test_dispatch():
    rng = np.random.default_rng(3)
    kc, vc, tables = _cache(rng, [30], 8, 2)
    q, slots, positions = _rows(rng, [(0, 25, 5)], 4, 8)
    args = (q, kc, vc, 1, tables, slots, positions)
    ref = np.asarray(P.paged_attention_reference(*args, sm_scale=SCALE))
    auto = np.asarray(P.paged_attention(*args, sm_scale=SCALE))
    if jax.default_backend() == "cpu":                     # "auto" is the reference there
        assert (auto == ref).all()
    else:                                                  # and the compiled kernel elsewhere
        np.testing.assert_allclose(auto, ref, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(P.paged_attention(*args, sm_scale=SCALE, impl="interpret")),
                               ref, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="attention impl"):
        P.paged_attention(*args, sm_scale=SCALE, impl="cuda")


def test_tpu_kernel_in_the_tpu_interpreter():
    """The TPU interpreter simulates the DMAs and semaphores (the plain interpreter runs a copy
    at once), so a wait on the wrong buffer or a missing start shows here; with 64-key splits
    the second slot's row reads two of them, each its own chain of DMAs."""
    rng = np.random.default_rng(4)
    kc, vc, tables = _cache(rng, [20, 70], 8, 2)
    q, slots, positions = _rows(rng, [(0, 15, 5), (1, 69, 1)], 4, 8)
    out, ref = _both("mosaic_tpu", q, kc, vc, tables, slots, positions,
                     interpret=pltpu.InterpretParams(), kv_split=64)
    np.testing.assert_allclose(out, ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_unused_pages_never_reaches_output(backend):
    rng = np.random.default_rng(5)
    kc, vc, tables = _cache(rng, [20, 40], 8, 2)
    used = set(tables.ravel()) - {0}
    for b in range(kc.shape[1]):
        if b not in used:
            kc[:, b] = vc[:, b] = np.nan
    # the unused tail of a partly filled page is poisoned too
    kc[:, tables[0, 2], 4:] = vc[:, tables[0, 2], 4:] = np.nan
    q, slots, positions = _rows(rng, [(0, 17, 3), (1, 0, 1), (1, 35, 5)], 4, 16)
    out, ref = _both(backend, q, kc, vc, tables, slots, positions)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, atol=1e-6, rtol=1e-6)


def _probe_row_bits(rng, kc, vc, tables, pos, **kw):
    """Slot 0's row at ``pos`` (the same query) decoded alone, as the last of 5 verify rows
    among other slots' rows, and inside a prefill chunk that spans two query blocks: its three
    outputs."""
    q0 = rng.standard_normal((8, D)).astype(np.float32)
    got = []
    for n, runs, at in [(1, [(0, pos, 1)], 0),
                        (24, [(1, 80, 3), None, (0, pos - 4, 5), (2, 30, 2)], 8),
                        (40, [(2, 10, 6), (0, pos - 13, 14), (1, 5, 3)], 19)]:
        q, slots, positions = _rows(rng, runs, 8, n)
        q[at] = q0
        assert (slots[at], positions[at]) == (0, pos)
        out = P.paged_attention_kernel(q, kc, vc, 1, tables, slots, positions, sm_scale=SCALE,
                                       interpret=True, **kw)
        got.append(np.asarray(out)[at])
    return got


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_bits_do_not_depend_on_q_len_or_the_batch(backend):
    """Slot 0's row at position 60 gives the same bits alone, in a verify run and inside a
    prefill chunk (``_probe_row_bits``)."""
    rng = np.random.default_rng(6)
    kc, vc, tables = _cache(rng, [61, 90, 33], 16, 2)
    got = _probe_row_bits(rng, kc, vc, tables, 60, backend=backend)
    assert all((x == got[0]).all() for x in got[1:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_split_over_the_keys_equals_reference_and_keeps_a_rows_bits(backend):
    """Flash-decoding with 64-key splits (one chunk each), so the rows here span 1 to 3 of
    them: equal to the reference, and slot 0's row at position 150 the same bits alone, in a
    verify run and inside a prefill chunk (its block then needing other split counts)."""
    rng = np.random.default_rng(8)
    kc, vc, tables = _cache(rng, [151, 190, 33], 16, 2)
    runs = [(0, 147, 4), (1, 185, 5), None, (2, 20, 13)]
    q, slots, positions = _rows(rng, runs, 8, 32)
    out, ref = _both(backend, q, kc, vc, tables, slots, positions, kv_split=64)
    np.testing.assert_allclose(out, ref, atol=1e-6, rtol=1e-6)
    got = _probe_row_bits(rng, kc, vc, tables, 150, backend=backend, kv_split=64)
    assert all((x == got[0]).all() for x in got[1:])


def _lowering_args(dtype):
    # bf16 with Llama-2-7B's G = 1 (8 rows a block, padded to Triton's 16); f32 with G = 4
    n, kvh, d = 16, 2, 128
    g = 1 if dtype == jnp.bfloat16 else 4
    cache = jnp.zeros((2, 33, 16, kvh, d), dtype)
    return (jnp.zeros((n, kvh * g, d), dtype), cache, cache, jnp.int32(1),
            jnp.zeros((4, 8), jnp.int32), jnp.zeros(n, jnp.int32), jnp.zeros(n, jnp.int32))


def _lower(backend, platform, device, dtype):
    args = _lowering_args(dtype)              # made outside the abstract mesh: eager ops fail there
    f = functools.partial(P.paged_attention_kernel, sm_scale=0.1, backend=backend)
    with use_abstract_mesh(AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)):
        return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_cross_lowers_for_gpu_triton(dtype):
    # jax >= 0.11 needs a GPU to lower for, or an abstract one
    device = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    assert "triton" in _lower("triton", "cuda", device, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_cross_lowers_for_tpu_mosaic(dtype):
    device = AbstractDevice(device_kind="TPU v6 lite", num_cores=1, platform="tpu")
    assert "tpu_custom_call" in _lower("mosaic_tpu", "tpu", device, dtype)


def test_engine_with_the_kernel_in_the_interpreter_equals_plain_reference(tiny_folder, model_folder):
    """The engine with attention="interpret" (the GPU kernel, interpreted) gives plain decoding's
    tokens with the reference attention, plain and speculating (a draft model of another seed,
    partly accepted; n-gram lookup), greedy and seeded sampled."""
    from sfjax import LLM, SamplingParams, toy

    geometry = dict(max_num_seqs=4, max_model_len=64, block_size=8)
    prompts = [{"prompt_token_ids": p} for p in ([7, 300, 12, 45, 99], [5, 9, 11] * 3 + [5],
                                                 [480, 2, 2, 2, 17, 3, 250, 9, 77, 3, 41])]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] + [
        SamplingParams(temperature=t, top_k=k, seed=s, max_tokens=12, ignore_eos=True)
        for t, k, s in [(1.0, 0, 1), (0.7, 20, 2)]]
    ids = lambda llm: [o.outputs[0].token_ids for o in llm.generate(prompts * 3, params * 3,
                                                                        use_tqdm=False)]
    ref = ids(LLM(tiny_folder, attention="reference", **geometry))
    assert ids(LLM(tiny_folder, attention="interpret", **geometry)) == ref
    draft = model_folder(toy.tiny_config(), seed=1, std=0.1)
    for spec in ({"method": "draft_model", "model": draft, "num_speculative_tokens": 3},
                 {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}):
        llm = LLM(tiny_folder, attention="interpret", speculative_config=spec, **geometry)
        assert ids(llm) == ref
        m = llm.get_metrics()["spec_decode"]
        assert m["num_drafts"] > 0
        if spec["method"] == "draft_model":
            assert 0 < m["num_accepted_tokens"] < m["num_draft_tokens"]
