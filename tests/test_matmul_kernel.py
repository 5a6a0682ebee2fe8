"""The batch-invariant Pallas matmul (``pallas_kernels.matmul``): equal to the jnp product in
interpret mode, a row's bits the same at every position of calls of any M, padding row blocks
skipped, and lowerable for GPU (Triton) and TPU (Mosaic) on a CPU machine with no matmul left
to XLA."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

from engine_checks import RUNS_LONG
from pallas_kernels import matmul as MM

K, U, W = 64, 8, 24          # the tiny model's q projection: 64 -> 8 blocks of 24
ROWS = (1, 8, 16, 64, 128, 160, 512)


def _weights(rng, dtype, k=K, u=U, w=W):
    return jnp.asarray(rng.standard_normal((u, k, w)), jnp.float32).astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_equals_the_product(dtype):
    rng = np.random.default_rng(0)
    w = _weights(rng, dtype)
    for m in (1, 13, 160):
        x = jnp.asarray(rng.standard_normal((m, K)), jnp.float32).astype(dtype)
        ref = np.asarray(MM.matmul_reference(x, w, jnp.float32))
        got = np.asarray(MM.matmul_kernel(x, w, out_dtype=jnp.float32, interpret=True))
        assert got.shape == (m, U * W)
        # f32: to 1e-6 of the output's scale; bf16 inputs are exact in f32, so the same holds
        assert np.abs(got - ref).max() <= 1e-6 * np.abs(ref).max()
        rounded = np.asarray(MM.matmul_kernel(x, w, interpret=True)).astype(np.float32)
        np.testing.assert_allclose(rounded, ref, rtol=1e-2 if dtype == jnp.bfloat16 else 1e-6,
                                   atol=1e-2 * np.abs(ref).max() if dtype == jnp.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_rows_bits_do_not_depend_on_the_call(dtype):
    """A probe row at the first, a middle and the last position of calls with M in ROWS rows of
    other values: the same bytes every time (a plain ``x @ w`` on XLA:CPU is not so: M = 1 and
    M = 8 differ)."""
    rng = np.random.default_rng(1)
    w = _weights(rng, dtype)
    probe = jnp.asarray(rng.standard_normal(K), jnp.float32).astype(dtype)
    first = None
    for m in ROWS:
        for at in sorted({0, m // 2, m - 1}):
            x = jnp.asarray(rng.standard_normal((m, K)), jnp.float32).astype(dtype).at[at].set(probe)
            row = np.asarray(MM.matmul_kernel(x, w, interpret=True))[at]
            first = row if first is None else first
            assert row.tobytes() == first.tobytes(), (m, at)
    plain = [np.asarray(jnp.asarray(rng.standard_normal((m, K)), jnp.float32).at[0].set(
        probe.astype(jnp.float32)) @ w[0].astype(jnp.float32))[0] for m in (1, 8, 16, 64, 512)]
    assert any(p.tobytes() != plain[0].tobytes() for p in plain[1:]), \
        "XLA's own dot is batch-invariant here: this check shows nothing"


def test_row_blocks_past_num_rows_are_skipped():
    rng = np.random.default_rng(2)
    w = _weights(rng, jnp.float32)
    x = jnp.asarray(rng.standard_normal((40, K)), jnp.float32)
    whole = np.asarray(MM.matmul_kernel(x, w, interpret=True))
    part = np.asarray(MM.matmul_kernel(x, w, jnp.int32(9), interpret=True))
    assert part[:16].tobytes() == whole[:16].tobytes()      # the blocks holding rows 0..8
    assert (part[16:] == 0).all()


def test_the_schedule_follows_the_weight_shape_alone():
    assert MM.schedule(64, 24) == (64, 8)
    assert MM.schedule(4096, 512) == (512, 256)
    assert MM.schedule(11008, 1376) == (256, 32)        # Llama-2-7B's down and gate/up blocks
    # Mosaic: a multiple of 128 lanes, or the whole block's width
    assert MM.schedule(4096, 512, "mosaic_tpu") == (512, 512)
    assert MM.schedule(4096, 1376, "mosaic_tpu") == (512, 1376)
    # a whole-width block (Llama-2-7B's head, 4000 columns a block): shorter in K, to fit VMEM
    assert MM.schedule(4096, 4000, "mosaic_tpu") == (256, 4000)
    for k, w in [(4096, 512), (4096, 1376), (11008, 512), (4096, 4000)]:    # Llama-2-7B's blocks
        for size in (2, 4):
            assert MM.fits(k, w, "mosaic_tpu", size)
            assert MM.vmem_bytes(k, (w,), itemsize=size) <= MM.MOSAIC_VMEM_BYTES


def test_the_tpu_kernel_walks_k_on_the_grid():
    """Mosaic's launch (K on its last grid axis, a float32 accumulator in VMEM), run in Pallas'
    TPU interpret mode: fused weights with the norm prologue over three K blocks equal the
    product, give the generic kernel's bytes (the same sum in the same order), and skip the row
    blocks past num_rows."""
    rng = np.random.default_rng(5)
    k = 1536                                    # three K blocks of 512
    ws = tuple(_weights(rng, jnp.float32, k=k, u=2, w=w) for w in (256, 128))
    norm = jnp.asarray(rng.standard_normal(k), jnp.float32)
    assert MM.schedule(k, 256, "mosaic_tpu")[0] == 512
    for m, n in [(1, 1), (13, 13), (40, 9)]:
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        tpu = MM.matmul_kernel(x, ws, n, norm, eps=1e-5, backend="mosaic_tpu", interpret=True)
        generic = MM.matmul_kernel(x, ws, n, norm, eps=1e-5, interpret=True)
        ref = MM.matmul_reference(x, ws, None, (norm, 1e-5))
        live = -(-n // 8) * 8                   # rows of the row blocks holding rows 0..n-1
        for a, b, r in zip(tpu, generic, ref):
            a, b, r = np.asarray(a), np.asarray(b), np.asarray(r)
            # f32 rounding grows with sqrt(K): 1536 terms, 5x the tolerance of 64 (above)
            assert np.abs(a[:n] - r[:n]).max() <= 5e-6 * np.abs(r).max()
            assert a.tobytes() == b.tobytes()
            assert (a[live:] == 0).all()


FUSED = (24, 8, 8)           # the tiny model's q|k|v blocks (GQA: k and v narrower)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_weights_with_the_norm_prologue_equal_the_product(dtype):
    """q|k|v in one launch, x RMS-normed inside it: each output equals RMSNorm then its own
    product (f32 to 1e-6 of the output's scale; bf16: the norm rounds to bf16 in both, so the
    products see the same inputs and agree to 1e-6 before the final rounding)."""
    rng = np.random.default_rng(5)
    ws = tuple(_weights(rng, dtype, w=w) for w in FUSED)
    norm = (jnp.asarray(rng.uniform(0.5, 1.5, K), jnp.float32).astype(dtype), 1e-5)
    for m in (1, 13):
        x = jnp.asarray(rng.standard_normal((m, K)) * 3, jnp.float32).astype(dtype)
        refs = MM.matmul_reference(x, ws, jnp.float32, norm)
        got = MM.matmul_kernel(x, ws, None, norm[0], eps=norm[1], out_dtype=jnp.float32,
                               interpret=True)
        assert len(got) == 3
        for r, g, w in zip(refs, got, FUSED):
            r, g = np.asarray(r), np.asarray(g)
            assert g.shape == (m, U * w)
            tol = 1e-6 if dtype == jnp.float32 else 1e-2
            assert np.abs(g - r).max() <= tol * np.abs(r).max()
        assert np.asarray(MM.matmul(x, ws, norm=norm, impl="interpret")[1]).dtype == dtype


def test_fused_normed_rows_keep_their_bits_in_any_call():
    """The probe row of ``test_a_rows_bits_do_not_depend_on_the_call`` through q|k|v with the
    norm prologue (whose sum over K is per row as well)."""
    rng = np.random.default_rng(6)
    ws = tuple(_weights(rng, jnp.bfloat16, w=w) for w in FUSED)
    nw = jnp.asarray(rng.uniform(0.5, 1.5, K), jnp.float32).astype(jnp.bfloat16)
    probe = jnp.asarray(rng.standard_normal(K), jnp.float32).astype(jnp.bfloat16)
    f = jax.jit(lambda x: MM.matmul_kernel(x, ws, None, nw, eps=1e-5, interpret=True))
    first = None
    for m in (1, 8, 16, 160):
        for at in sorted({0, m - 1}):
            x = jnp.asarray(rng.standard_normal((m, K)), jnp.float32).astype(jnp.bfloat16).at[at].set(probe)
            row = b"".join(np.asarray(o)[at].tobytes() for o in f(x))
            first = row if first is None else first
            assert row == first, (m, at)


def test_dispatch_and_bad_input():
    rng = np.random.default_rng(3)
    w = _weights(rng, jnp.float32)
    x = jnp.asarray(rng.standard_normal((5, K)), jnp.float32)
    ref = np.asarray(MM.matmul(x, w, impl="reference"))
    np.testing.assert_allclose(np.asarray(MM.matmul(x, w, impl="interpret")), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(MM.matmul(x, w)), ref)      # CPU: the reference
    with pytest.raises(ValueError, match="matmul impl must be auto, reference, interpret"):
        MM.matmul(x, w, impl="cublas")
    with pytest.raises(ValueError, match="x has K = 32, w has K = 64"):
        MM.matmul_kernel(x[:, :32], w, interpret=True)


def _lower(backend, platform, device, dtype, m=32, k=4096, widths=(512, 512, 512)):
    """Llama-2-7B's q|k|v with the attention norm as the prologue."""
    # made outside the abstract mesh: eager ops fail there
    args = (jnp.zeros((m, k), dtype), tuple(jnp.zeros((8, k, w), dtype) for w in widths),
            jnp.int32(5), jnp.ones((k,), dtype))
    f = functools.partial(MM.matmul_kernel, eps=1e-5, backend=backend)
    with use_abstract_mesh(AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)):
        return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_cross_lowers_for_gpu_triton(dtype):
    device = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    text = _lower("triton", "cuda", device, dtype)
    assert "xla.gpu.triton" in text and "stablehlo.dot_general" not in text


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_cross_lowers_for_tpu_mosaic(dtype):
    device = AbstractDevice(device_kind="TPU v6 lite", num_cores=1, platform="tpu")
    text = _lower("mosaic_tpu", "tpu", device, dtype)
    assert "tpu_custom_call" in text and "stablehlo.dot_general" not in text


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_with_the_kernel_is_exact(tiny_folder, dtype, monkeypatch):
    """The engine with every matmul in the kernel (interpreted) on the tiny model: a request
    alone gets the tokens it gets in a batch of 32, and n-gram speculation gives plain
    decoding's tokens, greedy and seeded."""
    from sfjax import LLM, SamplingParams

    traced = []
    kernel = MM.matmul_kernel
    monkeypatch.setattr(MM, "matmul_kernel", lambda *a, **k: traced.append(a[1]) or kernel(*a, **k))

    rng = np.random.default_rng(4)
    prompts = []
    for _ in range(32):
        seg = rng.integers(2, 500, 3).tolist()
        prompts.append({"prompt_token_ids": seg * 2 + rng.integers(2, 500, 2).tolist()})
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=10, ignore_eos=True)
              for i in range(32)]
    # a few with the processors too, beside rows with none (the kernel path has no branches)
    for i in (3, 4):
        params[i] = SamplingParams(temperature=0.8 * (i % 2 == 0), seed=i, max_tokens=10,
                                   ignore_eos=True, presence_penalty=0.5, repetition_penalty=1.3,
                                   logit_bias={5: 2.0, 9: -3.0}, logprobs=2)
    # the sampler's row kernels too: every logit row of a call at once, as on an accelerator
    # the interpreted kernels are ops XLA:CPU generates code for: they run faster at -O2
    geometry = dict(dtype=dtype, matmul="interpret", sampler="interpret", max_num_seqs=32,
                    max_model_len=32, compiler_options=RUNS_LONG)
    ids = lambda outs: [o.outputs[0].token_ids for o in outs]
    plain = LLM(tiny_folder, **geometry)
    batch = ids(plain.generate(prompts, params, use_tqdm=False))
    assert traced, "the engine did not run the kernel"
    for i in (0, 1, 3, 4, 31):
        assert ids(plain.generate(prompts[i:i + 1], params[i:i + 1], use_tqdm=False)) == [batch[i]]
    spec = LLM(tiny_folder, **geometry, speculative_config={"method": "ngram",
                                                           "num_speculative_tokens": 3})
    assert ids(spec.generate(prompts, params, use_tqdm=False)) == batch
    assert spec.get_metrics()["spec_decode"]["num_accepted_tokens"] > 0


def test_auto_picks_the_kernel_on_accelerators_where_every_weight_fits(monkeypatch):
    """``matmul="auto"``: the row-tile loop on CPU; on GPU Triton when every weight's blocks
    reach Triton's 16 (Llama-2-7B), else the tile loop (the tiny test model's 8-column blocks);
    on TPU Mosaic."""
    from sfjax import rows, toy
    from sfjax.config import ModelConfig
    from sfjax.run import RunConfig

    big = ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=2,
                      num_heads=32, num_kv_heads=32, head_dim=128, max_position_embeddings=4096)
    tiny = toy.tiny_config()
    assert rows.kernel_for("auto", big) is None and RunConfig(big, 64).matmul is None   # CPU
    for backend, want in [("gpu", "triton"), ("tpu", "mosaic_tpu")]:
        monkeypatch.setattr(rows.jax, "default_backend", lambda b=backend: b)
        assert rows.kernel_for("auto", big) == want
        assert RunConfig(big, 64).matmul == want
        # Qwen2's biases are added after the product, not multiplied: (24 layers read as K)
        qwen = dataclasses.replace(big, model_type="qwen2", num_layers=24)
        assert rows.kernel_for("auto", qwen) == want
    monkeypatch.setattr(rows.jax, "default_backend", lambda: "gpu")
    assert rows.kernel_for("auto", tiny) is None and rows.kernel_for("auto", big, tiny) is None
    assert rows.kernel_for(None, big) is None and rows.kernel_for("interpret", tiny) == "interpret"
