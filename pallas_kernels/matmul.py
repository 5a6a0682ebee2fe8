"""A batch-invariant matmul: one Pallas launch over all of a call's rows, with a schedule fixed
by the weight's shape.

``x [M, K] @ w`` with ``w`` in ``sfjax.rows``' blocked layout ``[U, K, W]`` (U fixed column
blocks of W columns; the output is ``[M, U * W]``). The grid is (row blocks of ``block_m``,
column blocks, column tiles of ``block_n``); each program walks K in blocks of ``block_k`` in
ascending order, accumulating ``[block_m, block_k] x [block_k, block_n]`` products in float32.
``block_k`` and ``block_n`` follow from K and W alone (``schedule``), and ``block_m`` is fixed per
backend, so a row's output is computed by the same sequence of the same-shaped products whatever
M is, wherever the row sits, and whatever the other rows hold: its bits cannot depend on the
batch. No split of K depends on M (there is none). M is padded to whole row blocks; a row block
past ``num_rows`` (scalar-prefetched) is skipped and comes out zero.

``matmul_reference`` is the plain jnp product (float32 accumulation); ``matmul_kernel`` the
kernel, run in interpret mode by the CPU tests and cross-lowered for GPU (Triton, behind a
switch: deprecated from jax 0.11) and TPU (Mosaic).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

# row block per backend: Triton's dot wants >= 16 rows; a TPU f32 tile has 8 sublanes
BLOCK_M = {"triton": 16, "mosaic_tpu": 8, None: 8}
MAX_BLOCK_K = 512
MAX_BLOCK_N = 256
KERNELS = ("interpret", "triton", "mosaic_tpu")     # the impls that run the kernel


def _largest_power_of_two_dividing(n: int, most: int) -> int:
    b = 1
    while b * 2 <= most and n % (b * 2) == 0:
        b *= 2
    return b


def schedule(k: int, w: int) -> tuple[int, int]:
    """(block_k, block_n) for a weight of K rows and W columns per block: the largest powers of
    two up to ``MAX_BLOCK_K`` / ``MAX_BLOCK_N`` that divide them. A function of the weight's shape
    only."""
    return (_largest_power_of_two_dividing(k, MAX_BLOCK_K),
            _largest_power_of_two_dividing(w, MAX_BLOCK_N))


def matmul_reference(x, w, out_dtype=None):
    """x [M, K] @ w [U, K, W] -> [M, U * W] (``out_dtype``, default x's), float32 accumulation."""
    u, _, width = w.shape
    o = jnp.einsum("mk,ukw->muw", x, w, preferred_element_type=jnp.float32,
                   precision=lax.Precision.HIGHEST)
    return o.reshape(x.shape[0], u * width).astype(out_dtype or x.dtype)


def _kernel(n_ref, x_ref, w_ref, o_ref, *, block_k: int, steps: int):
    # x_ref [bm, K], w_ref [K, bn] (the column block squeezed), o_ref [bm, bn]
    bm = x_ref.shape[0]

    @pl.when(pl.program_id(0) * bm < n_ref[0])
    def _():
        def step(i, acc):
            at = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
            return acc + jnp.dot(x_ref[:, at], w_ref[at, :], preferred_element_type=jnp.float32)
        acc = lax.fori_loop(0, steps, step, jnp.zeros(o_ref.shape, jnp.float32))
        o_ref[...] = acc.astype(o_ref.dtype)

    @pl.when(pl.program_id(0) * bm >= n_ref[0])
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_m", "interpret", "backend"))
def matmul_kernel(x, w, num_rows=None, *, out_dtype=None, block_m: int | None = None,
                  interpret: bool = False, backend: str | None = None):
    """The kernel: same signature and result as ``matmul_reference`` (plus ``num_rows``, traced:
    rows at or past it may be skipped by whole row blocks and come out zero; default all).

    ``backend``: "triton" (GPU), "mosaic_tpu", or None (interpret mode). ``block_m``: the row
    block, by default ``BLOCK_M[backend]``; a row's bits are the same for every M at one
    ``block_m``, not across ``block_m``s.
    """
    m, k = x.shape
    u, k2, width = w.shape
    if k2 != k:
        raise ValueError(f"matmul: x has K = {k}, w has K = {k2}")
    block_m = block_m or BLOCK_M[backend]
    block_k, block_n = schedule(k, width)
    mp = -(-m // block_m) * block_m
    xp = jnp.pad(x, ((0, mp - m), (0, 0))) if mp != m else x
    n = jnp.full((1,), m if num_rows is None else num_rows, jnp.int32)
    tiles = width // block_n
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    kernel = functools.partial(_kernel, block_k=block_k, steps=k // block_k)
    grid, out_shape = (mp // block_m, u, tiles), jax.ShapeDtypeStruct((mp, u * width), out_dtype)
    x_at, w_at, o_at = (lambda i, c, j, *_: (i, 0)), (lambda i, c, j, *_: (c, 0, j)), (
        lambda i, c, j, *_: (i, c * tiles + j))
    specs = dict(in_specs=[pl.BlockSpec((block_m, k), x_at), pl.BlockSpec((None, k, block_n), w_at)],
                 out_specs=pl.BlockSpec((block_m, block_n), o_at))
    if backend == "mosaic_tpu":            # the row count scalar-prefetched into SMEM
        from jax.experimental.pallas import tpu as pltpu
        call = pl.pallas_call(
            kernel, out_shape=out_shape, name="sfjax_matmul",
            grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=grid, **specs),
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * 3))
    else:                                  # Triton, or the interpreter: the count as a plain ref
        params = None
        if backend == "triton":
            from jax.experimental.pallas import triton as pltriton
            params = pltriton.CompilerParams(num_warps=4, num_stages=3)
        specs["in_specs"].insert(0, pl.BlockSpec((1,), lambda *_: (0,)))
        call = pl.pallas_call(kernel, grid=grid, out_shape=out_shape, name="sfjax_matmul",
                              interpret=interpret, compiler_params=params, **specs)
    return call(n, xp, w)[:m]


def matmul(x, w, num_rows=None, *, out_dtype=None, impl: str = "auto"):
    """Dispatch: "auto" (the kernel on GPU via Triton and on TPU via Mosaic, the reference on
    CPU), "reference", "interpret" (the kernel in interpret mode), "triton", "mosaic_tpu"."""
    if impl == "auto":
        impl = {"gpu": "triton", "tpu": "mosaic_tpu"}.get(jax.default_backend(), "reference")
    if impl == "reference":
        return matmul_reference(x, w, out_dtype)
    if impl == "interpret":
        return matmul_kernel(x, w, num_rows, out_dtype=out_dtype, interpret=True)
    if impl not in ("triton", "mosaic_tpu"):
        raise ValueError(f"matmul impl must be auto, reference, interpret, triton or mosaic_tpu; "
                         f"got {impl!r}")
    return matmul_kernel(x, w, num_rows, out_dtype=out_dtype, backend=impl)
