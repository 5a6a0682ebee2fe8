"""Per-step sampling cost of sfjax at batch R=32 over a V=32000 vocabulary (float32 logits).

Run:
    python scripts/bench_sampling.py [--calls 50] [--interpret-calls 50]

Every path is its own jax.jit with all inputs passed as arguments (nothing constant-folds), warmed
up, then timed --calls times with block_until_ready; the median is reported, in ms per call and as
a ratio to plain jnp.argmax. ``draw`` runs as the engine runs it: row_tile=8, impl="auto", every
SamplingBatch field a runtime value. Also checks whether XLA keeps ``lax.top_k`` in the logprobs
path as its TopK call or lowers it to a full sort, with and without an optimization_barrier.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import sampling as K
from sfjax import sampling as S
from sfjax.sampling_params import MAX_LOGPROBS

R, V, L, TILE = 32, 32000, 512, 8


def busy_s():
    """(CPU seconds all processes have spent busy, this process's CPU seconds); Linux only."""
    try:
        with open("/proc/stat") as f:
            t = [int(x) for x in f.readline().split()[1:]]
        return (sum(t) - t[3] - t[4]) / os.sysconf("SC_CLK_TCK"), sum(os.times()[:2])
    except (OSError, ValueError, IndexError):
        return float("nan"), 0.0


def bench(fn, args, calls, warmup=3):
    fn = jax.jit(fn)
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(calls):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def batch(rng, temp, top_k=0, top_p=1.0, min_p=0.0, rep=1.0, pres=0.0, freq=0.0):
    f32 = lambda x: jnp.full((R,), x, jnp.float32)
    none = jnp.full((R, 1), -1, jnp.int32)
    return S.SamplingBatch(
        temperature=f32(temp), top_k=jnp.full((R,), top_k, jnp.int32), top_p=f32(top_p),
        min_p=f32(min_p), presence=f32(pres), frequency=f32(freq), repetition=f32(rep),
        key_data=jnp.asarray(rng.integers(0, 2**32, (R, 2), dtype=np.uint32)),
        position=jnp.full((R,), 7, jnp.int32), slot=jnp.arange(R, dtype=jnp.int32),
        seq_pos=jnp.full((R,), L - 1, jnp.int32),            # the whole 512-token history is known
        prompt_len=jnp.full((R,), L // 2, jnp.int32),         # half prompt, half output
        suppress=none, bias_ids=none, bias=jnp.zeros((R, 1), jnp.float32), allowed=none,
        target=jnp.full((R,), -1, jnp.int32))


def logprobs(barrier):
    """compute() of sfjax.sampling._logprobs (raw_logprobs in newer trees), without its cond;
    barrier: None, "after" top_k (on its results) or "before" (on its operand)."""
    def fn(raw, target):
        lp = raw - jax.nn.logsumexp(raw, axis=-1, keepdims=True)
        tok = jnp.take_along_axis(lp, target[:, None], axis=1)[:, 0]
        rank = 1 + jnp.sum(lp > tok[:, None], axis=1).astype(jnp.int32)
        top = lax.top_k(lax.optimization_barrier(lp) if barrier == "before" else lp, MAX_LOGPROBS)
        top_lp, top_ids = lax.optimization_barrier(top) if barrier == "after" else top
        return tok, rank, top_ids.astype(jnp.int32), top_lp
    return fn


def topk_lowering(fn, args):
    """How XLA compiled lax.top_k: "TopK call", "sort" (full sort of the row) or both."""
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    kinds = [k for k, pat in (("TopK call", 'custom_call_target="TopK"'), ("sort", " sort(")) if pat in hlo]
    return " + ".join(kinds) or "none found"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--interpret-calls", type=int, default=50)
    a = ap.parse_args()
    load0, busy0, wall0 = os.getloadavg(), busy_s(), time.perf_counter()
    backend = jax.default_backend()
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((R, V), np.float32) * 3)
    history = jnp.asarray(rng.integers(0, V, (R, L), dtype=np.int32))
    n, no, yes = jnp.int32(R), jnp.bool_(False), jnp.bool_(True)
    draw = lambda lg, b, h, n, lp: S.draw(lg, b, h, n, TILE, lp)
    filt = dict(temp=0.8, top_k=50, top_p=0.95, min_p=0.05)
    b4 = batch(rng, **filt)
    rows = []                                                # (label, ms, note)
    add = lambda label, ms, note="": rows.append((label, ms, note))
    c = a.calls
    add("1. jnp.argmax", bench(lambda x: jnp.argmax(x, axis=-1), (logits,), c))
    add("1. pallas_kernels.sampling.argmax", bench(K.argmax, (logits,), c))
    add("2. draw greedy (T=0)", bench(draw, (logits, batch(rng, 0.0), history, n, no), c))
    add("3. draw T=1.0", bench(draw, (logits, batch(rng, 1.0), history, n, no), c))
    add("4. draw T=0.8 k=50 p=0.95 min_p=0.05", bench(draw, (logits, b4, history, n, no), c))
    b5 = batch(rng, **filt, rep=1.1, pres=0.5, freq=0.5)
    add("5. case 4 + penalties (512-token history)", bench(draw, (logits, b5, history, n, no), c))
    add("6. draw T=1.0 + logprobs", bench(draw, (logits, batch(rng, 1.0), history, n, yes), c))
    kd, pos = b4.key_data, b4.position
    add("7. noise_bits [32, 32000]", bench(lambda k, p: S.noise_bits(k, p, V), (kd, pos), c))
    bits = jax.jit(lambda k, p: S.noise_bits(k, p, V))(kd, pos)
    add("7. gumbel_from_bits [32, 32000]", bench(K.gumbel_from_bits, (bits,), c))
    params = (b4.temperature, b4.top_k, b4.top_p, b4.min_p)
    add("8. sample_reference (case 4 params)", bench(K.sample_reference, (logits, bits, *params), c))
    interp = lambda *xs: K.sample_kernel(*xs, block_rows=TILE, interpret=True)
    add("8. sample_kernel interpret=True", bench(interp, (logits, bits, *params), a.interpret_calls),
        f"CPU emulation, {a.interpret_calls} calls; not a GPU/TPU kernel speed")
    same = bool(jnp.all(jax.jit(K.sample_reference)(logits, bits, *params) == jax.jit(interp)(logits, bits, *params)))
    native = {"gpu": "triton", "tpu": "mosaic_tpu"}.get(backend)
    if native:
        kern = lambda *xs: K.sample_kernel(*xs, block_rows=TILE, backend=native)
        add(f"8. sample_kernel backend={native}", bench(kern, (logits, bits, *params), c))
    target = jnp.asarray(rng.integers(0, V, R, dtype=np.int32))
    lowering = {}
    for barrier in (None, "after", "before"):
        fn = logprobs(barrier)
        lowering[barrier] = topk_lowering(fn, (logits, target))
        add(f"9. _logprobs copy, barrier {barrier or 'none'}", bench(fn, (logits, target), c),
            f"top_k compiled as: {lowering[barrier]}")
    add("9. lax.top_k(x, 20) alone", bench(lambda x: lax.top_k(x, MAX_LOGPROBS), (logits,), c),
        f"top_k compiled as: {topk_lowering(lambda x: lax.top_k(x, MAX_LOGPROBS), (logits,))}")
    draw_hlo = jax.jit(draw).lower(logits, b4, history, n, yes).compile().as_text()
    load1, busy1, wall = os.getloadavg(), busy_s(), time.perf_counter() - wall0
    others = (busy1[0] - busy0[0]) - (busy1[1] - busy0[1])     # CPU seconds used by other processes

    print(f"machine: {os.cpu_count()} cpus, jax {jax.__version__}, backend {backend} "
          f"({jax.devices()[0].device_kind}); load average {load0[0]:.2f} before, {load1[0]:.2f} after")
    print(f"R={R}, V={V}, float32 logits, row_tile={TILE}, median of {c} calls after 3 warm-up calls\n")
    base = rows[0][1]
    print(f"| {'path':<44} | {'ms/call':>8} | {'x argmax':>8} | note")
    print(f"|{'-' * 46}|{'-' * 10}|{'-' * 10}|-----")
    for label, ms, note in rows:
        print(f"| {label:<44} | {ms:8.3f} | {ms / base:8.2f} | {note}")
    print(f"\nsample_kernel(interpret=True) tokens == sample_reference tokens: {same}")
    print("top_k inside the compiled draw (with_logprobs traced): "
          + ("TopK call" if 'custom_call_target="TopK"' in draw_hlo else "")
          + (" sort" if " sort(" in draw_hlo else ""))
    print(f"other processes used {max(others, 0.0):.1f} CPU s during the {wall:.1f} s run")
    if load0[0] > 0.5 * (os.cpu_count() or 1) or others > 0.1 * wall:   # "after" load includes us
        print("WARNING: the machine was shared during the run; rerun when quiet")


if __name__ == "__main__":
    main()
