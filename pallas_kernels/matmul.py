"""A batch-invariant matmul: one Pallas launch over all of a call's rows, with a schedule fixed
by the weights' shapes; optionally several weights of one input at once (q|k|v, gate|up) and the
input's RMSNorm as its prologue.

``x [M, K] @ w`` with each ``w`` in ``sfjax.rows``' blocked layout ``[U, K, W]`` (U fixed column
blocks of W columns; the output is ``[M, U * W]``). The grid is (row blocks of ``block_m``,
column blocks, the weights' column tiles one after another); each program computes one
``[block_m, block_n]`` tile of one weight's output, walking K in blocks of ``block_k`` in
ascending order and accumulating ``[block_m, block_k] x [block_k, block_n]`` products in float32
(inside the program on GPU; on TPU over a last grid axis, so VMEM holds one weight block of
``[block_k, block_n]`` at a time, ``vmem_bytes``).
``block_k`` and ``block_n`` follow from K, W and the backend alone (``schedule``), and
``block_m`` is fixed per backend, so a row's output is computed by the same sequence of the
same-shaped products whatever M is, wherever the row sits, and whatever the other rows hold: its
bits cannot depend on the batch. No split of K depends on M (there is none). M is padded to
whole row blocks; a row block past ``num_rows`` (scalar-prefetched) is skipped and comes out
zero.

With ``norm`` (RMSNorm's weight [K] and epsilon) each program first sums the squares of its
rows' K blocks, in the same ascending order, and scales each K block by the row's reciprocal
RMS and the norm weight before its product: the norm, a reduction over K, is part of the
kernel, so it is row-local by construction (an XLA reduction picks its strategy by the shape of
the whole call).

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
TPU_LANES = 128
MOSAIC_WEIGHT_BLOCK_BYTES = 4 * 2**20   # one weight block in VMEM, counted at float32
KERNELS = ("interpret", "triton", "mosaic_tpu")     # the impls that run the kernel


def _largest_power_of_two_dividing(n: int, most: int) -> int:
    b = 1
    while b * 2 <= most and n % (b * 2) == 0:
        b *= 2
    return b


def schedule(k: int, w: int, backend: str | None = None) -> tuple[int, int]:
    """(block_k, block_n) for a weight of K rows and W columns per block: the largest powers of
    two up to ``MAX_BLOCK_K`` / ``MAX_BLOCK_N`` that divide them; on TPU (Mosaic wants the last
    block dimension a multiple of 128 lanes or the whole array's) ``block_n`` is the largest
    multiple of 128 up to 512 that divides W, or W itself, and ``block_k`` is halved until a
    float32 weight block fits ``MOSAIC_WEIGHT_BLOCK_BYTES``. A function of the weight's shape and
    the backend only."""
    block_k = _largest_power_of_two_dividing(k, MAX_BLOCK_K)
    if backend != "mosaic_tpu":
        return block_k, _largest_power_of_two_dividing(w, MAX_BLOCK_N)
    lanes = [b for b in range(TPU_LANES, 4 * TPU_LANES + 1, TPU_LANES) if w % b == 0]
    block_n = max(lanes) if lanes else w
    while block_k > 8 and block_k * block_n * 4 > MOSAIC_WEIGHT_BLOCK_BYTES:
        block_k //= 2            # a whole-width block (a 7B head's 4000 columns): shorter in K
    return block_k, block_n


# Mosaic's default scoped VMEM on TPU v5e (v6e: 32 MiB): the launch must hold its blocks in it
MOSAIC_VMEM_BYTES = 16 * 2**20


def vmem_bytes(k: int, widths, block_m: int = BLOCK_M["mosaic_tpu"], itemsize: int = 2) -> int:
    """The VMEM a Mosaic launch holds for x [M, K] and weights of blocks [K, W] for W in
    ``widths`` (elements of ``itemsize`` bytes): the row block of x, the norm weight, and per
    weight one [block_k, block_n] block, one output block (each double-buffered) and a float32
    accumulator (the K axis is walked on the grid)."""
    total = 2 * block_m * k * itemsize + 2 * k * 4
    for w in widths:
        block_k, block_n = schedule(k, w, "mosaic_tpu")
        total += 2 * block_k * block_n * itemsize + 2 * block_m * block_n * 4 + block_m * block_n * 4
    return total


def fits(k: int, w: int, backend: str, itemsize: int = 4) -> bool:
    """Whether a [K, W]-block weight (elements of ``itemsize`` bytes) has a schedule the backend
    can run: Triton's dot wants blocks of at least 16 (a tiny test model's 8-column blocks are
    below it); Mosaic's blocks must fit its VMEM (``vmem_bytes``)."""
    block_k, block_n = schedule(k, w, backend)
    if backend == "mosaic_tpu":
        return vmem_bytes(k, (w,), itemsize=itemsize) <= MOSAIC_VMEM_BYTES
    return backend != "triton" or min(block_k, block_n) >= 16


def rms_normed(x, weight, eps, scale=None):
    """RMSNorm as the model computes it: ``weight * (x * rsqrt(mean(x**2) + eps))`` with the
    product rounded to x's dtype first; ``scale`` (the reciprocal RMS, float32 [M, 1]) when it
    is known."""
    x32 = x.astype(jnp.float32)
    if scale is None:
        scale = lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * (x32 * scale).astype(x.dtype)


def matmul_reference(x, w, out_dtype=None, norm=None):
    """x [M, K] @ w [U, K, W] -> [M, U * W] (``out_dtype``, default x's), float32 accumulation;
    ``w`` a tuple: a tuple of products. ``norm``: (weight [K], eps), RMSNorm of x first."""
    if isinstance(w, (tuple, list)):
        return tuple(matmul_reference(x, a, out_dtype, norm) for a in w)
    if norm is not None:
        x = rms_normed(x, *norm).astype(x.dtype)
    u, _, width = w.shape
    o = jnp.einsum("mk,ukw->muw", x, w, preferred_element_type=jnp.float32,
                   precision=lax.Precision.HIGHEST)
    return o.reshape(x.shape[0], u * width).astype(out_dtype or x.dtype)


def _kernel(n_ref, x_ref, *refs, tiles, block_k: int, steps: int, eps, k_on_grid: bool):
    # x_ref [bm, K]; then (norm_ref [1, K]); the weights' refs (column block squeezed): [K, bn_i],
    # or with ``k_on_grid`` [block_k, bn_i] at K block program_id(3); the outputs' refs
    # [bm, bn_i]; with ``k_on_grid`` a float32 accumulator [bm, bn_i] per weight. Program
    # (i, c, j[, s]) computes weight t's tile j - start_t, for the t whose tiles hold j.
    norm_ref, refs = (refs[0], refs[1:]) if eps is not None else (None, refs)
    w_refs, o_refs = refs[:len(tiles)], refs[len(tiles):2 * len(tiles)]
    acc_refs = refs[2 * len(tiles):]
    bm = x_ref.shape[0]
    live = pl.program_id(0) * bm < n_ref[0]
    j = pl.program_id(2)
    at = lambda s: pl.ds(pl.multiple_of(s * block_k, block_k), block_k)

    def scale():
        def step(s, ss):
            xb = x_ref[:, at(s)].astype(jnp.float32)
            return ss + jnp.sum(xb * xb, axis=1, keepdims=True)
        ss = lax.fori_loop(0, steps, step, jnp.zeros((bm, 1), jnp.float32))
        return lax.rsqrt(ss / x_ref.shape[1] + eps)

    def term(s, w_block):
        """K block s's product: [bm, block_k] (normed) x [block_k, bn], in float32."""
        xb = x_ref[:, at(s)]
        if eps is not None:
            xb = rms_normed(xb, norm_ref[:, at(s)], eps, scale()).astype(xb.dtype)
        return jnp.dot(xb, w_block, preferred_element_type=jnp.float32)

    def product(w_ref, o_ref):
        step = lambda i, acc: acc + term(i, w_ref[at(i), :])
        acc = lax.fori_loop(0, steps, step, jnp.zeros(o_ref.shape, jnp.float32))
        o_ref[...] = acc.astype(o_ref.dtype)

    def product_step(w_ref, o_ref, acc_ref):
        # the same sum as ``product``'s (0 + term 0 + term 1 + ...), one K block a grid step;
        # the output block is written back once its index moves on, after the last K block
        s = pl.program_id(3)

        @pl.when(s == 0)
        def _():
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        acc_ref[...] = acc_ref[...] + term(s, w_ref[...])

        @pl.when(s == steps - 1)
        def _():
            o_ref[...] = acc_ref[...].astype(o_ref.dtype)

    start = 0
    for t, (w_ref, o_ref, n_tiles) in enumerate(zip(w_refs, o_refs, tiles)):
        mine = (j >= start) & (j < start + n_tiles)
        body = (functools.partial(product_step, w_ref, o_ref, acc_refs[t]) if k_on_grid
                else functools.partial(product, w_ref, o_ref))
        pl.when(mine & live)(body)

        @pl.when(mine & ~live)
        def _(o_ref=o_ref):
            o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
        start += n_tiles


def _pallas_call(kernel, grid, in_specs, out_specs, out_shape, backend, interpret, scratch=()):
    """The launch for ``backend``: Mosaic gets the row count scalar-prefetched into SMEM, walks
    the tile and K axes in order (a weight's output block is written back only when its index
    moves on, after the program that computes it) and holds the accumulators in VMEM
    (``scratch``); with ``interpret`` it runs in Pallas' TPU interpret mode. Triton and the
    interpreter get the row count as a plain ref."""
    if backend == "mosaic_tpu":
        from jax.experimental.pallas import tpu as pltpu
        return pl.pallas_call(
            kernel, out_shape=out_shape, name="sfjax_matmul",
            grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=grid,
                                                   in_specs=in_specs, out_specs=out_specs,
                                                   scratch_shapes=scratch),
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel",) + ("arbitrary",) * (len(grid) - 1)),
            interpret=pltpu.InterpretParams() if interpret else False)
    params = None
    if backend == "triton":
        from jax.experimental.pallas import triton as pltriton
        params = pltriton.CompilerParams(num_warps=4, num_stages=3)
    return pl.pallas_call(kernel, grid=grid, out_shape=out_shape, name="sfjax_matmul",
                          in_specs=[pl.BlockSpec((1,), lambda *_: (0,))] + in_specs,
                          out_specs=out_specs, interpret=interpret, compiler_params=params)


def _checked(x, w, norm_weight, eps) -> tuple:
    """``w`` as a tuple of weights, after checking they fit ``x`` and each other."""
    ws = tuple(w) if isinstance(w, (tuple, list)) else (w,)
    k = x.shape[1]
    for a in ws:
        if a.shape[1] != k:
            raise ValueError(f"matmul: x has K = {k}, w has K = {a.shape[1]}")
    if len({a.shape[0] for a in ws}) != 1:
        raise ValueError(f"matmul: the weights have other column block counts: {[a.shape for a in ws]}")
    if (norm_weight is None) != (eps is None):
        raise ValueError("matmul: a norm needs both norm_weight and eps")
    return ws


def _weight_specs(k: int, block_k: int, block_n, tiles, starts, k_on_grid: bool) -> list:
    """The weights' block specs over the grid (i, c, j[, s]). A weight's tile index is held at
    its first / last tile outside its own range of j: a block whose index doesn't change between
    grid steps is neither fetched nor written back again; its K block likewise (the first
    before its range, the last after it)."""
    steps = k // block_k
    tile = lambda j, t: jnp.clip(j - starts[t], 0, tiles[t] - 1)
    kblock = lambda j, s, t: jnp.where(j < starts[t], 0,
                                       jnp.where(j >= starts[t] + tiles[t], steps - 1, s))
    if k_on_grid:
        return [pl.BlockSpec((None, block_k, bn),
                             lambda i, c, j, s, *_, t=t: (c, kblock(j, s, t), tile(j, t)))
                for t, bn in enumerate(block_n)]
    return [pl.BlockSpec((None, k, bn), lambda i, c, j, *_, t=t: (c, 0, tile(j, t)))
            for t, bn in enumerate(block_n)]


@functools.partial(jax.jit, static_argnames=("out_dtype", "eps", "block_m", "interpret", "backend"))
def matmul_kernel(x, w, num_rows=None, norm_weight=None, *, eps: float | None = None,
                  out_dtype=None, block_m: int | None = None, interpret: bool = False,
                  backend: str | None = None):
    """The kernel: same signature and result as ``matmul_reference`` (``w`` one weight or a
    tuple; ``norm`` as ``norm_weight`` and ``eps``), plus ``num_rows`` (traced: rows at or past it
    may be skipped by whole row blocks and come out zero; default all).

    ``backend``: "triton" (GPU), "mosaic_tpu", or None (interpret mode); "mosaic_tpu" with
    ``interpret``: the TPU kernel in Pallas' TPU interpret mode (on any machine). ``block_m``: the row
    block, by default ``BLOCK_M[backend]``; a row's bits are the same for every M at one
    ``block_m``, not across ``block_m``s.
    """
    ws = _checked(x, w, norm_weight, eps)
    m, k = x.shape
    u = ws[0].shape[0]
    block_m = block_m or BLOCK_M[backend]
    block_k = schedule(k, ws[0].shape[2], backend)[0]
    block_n = [schedule(k, a.shape[2], backend)[1] for a in ws]
    tiles = tuple(a.shape[2] // b for a, b in zip(ws, block_n))
    starts = [sum(tiles[:i]) for i in range(len(ws))]
    mp = -(-m // block_m) * block_m
    xp = jnp.pad(x, ((0, mp - m), (0, 0))) if mp != m else x
    n = jnp.full((1,), m if num_rows is None else num_rows, jnp.int32)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    steps = k // block_k
    # Mosaic walks K on the grid (one [block_k, bn] weight block in VMEM at a time: a 7B head's
    # whole [K, bn] block is 32 MB); Triton and the interpreter loop over K inside a program
    k_on_grid = backend == "mosaic_tpu"
    kernel = functools.partial(_kernel, tiles=tiles, block_k=block_k, steps=steps, eps=eps,
                               k_on_grid=k_on_grid)
    grid = (mp // block_m, u, sum(tiles)) + ((steps,) if k_on_grid else ())
    tile = lambda j, t: jnp.clip(j - starts[t], 0, tiles[t] - 1)
    in_specs = [pl.BlockSpec((block_m, k), lambda i, c, j, *_: (i, 0))]
    args = [xp]
    if eps is not None:
        in_specs.append(pl.BlockSpec((1, k), lambda i, c, j, *_: (0, 0)))
        args.append(norm_weight.reshape(1, k))
    in_specs += _weight_specs(k, block_k, block_n, tiles, starts, k_on_grid)
    out_specs = [pl.BlockSpec((None, block_m, bn), lambda i, c, j, *_, t=t: (c, i, tile(j, t)))
                 for t, bn in enumerate(block_n)]
    out_shape = [jax.ShapeDtypeStruct((u, mp, a.shape[2]), out_dtype) for a in ws]
    scratch = ()
    if k_on_grid:
        from jax.experimental.pallas import tpu as pltpu
        scratch = [pltpu.VMEM((block_m, bn), jnp.float32) for bn in block_n]
    call = _pallas_call(kernel, grid, in_specs, out_specs, out_shape, backend, interpret, scratch)
    outs = call(n, *args, *ws)
    outs = tuple(jnp.moveaxis(o[:, :m], 0, 1).reshape(m, -1) for o in outs)   # [M, U * W]
    return outs if isinstance(w, (tuple, list)) else outs[0]


def matmul(x, w, num_rows=None, *, out_dtype=None, norm=None, impl: str = "auto"):
    """Dispatch: "auto" (the kernel on GPU via Triton and on TPU via Mosaic, the reference on
    CPU), "reference", "interpret" (the kernel in interpret mode), "triton", "mosaic_tpu".
    ``w``: one weight or a tuple (one launch); ``norm``: (weight [K], eps), x's RMSNorm first."""
    if impl == "auto":
        impl = {"gpu": "triton", "tpu": "mosaic_tpu"}.get(jax.default_backend(), "reference")
    if impl == "reference":
        return matmul_reference(x, w, out_dtype, norm)
    if impl not in KERNELS:
        raise ValueError(f"matmul impl must be auto, reference, interpret, triton or mosaic_tpu; "
                         f"got {impl!r}")
    norm_weight, eps = norm if norm is not None else (None, None)
    return matmul_kernel(x, w, num_rows, norm_weight, eps=eps, out_dtype=out_dtype,
                         interpret=impl == "interpret",
                         backend=None if impl == "interpret" else impl)
