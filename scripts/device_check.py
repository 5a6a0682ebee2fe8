"""Device check of the Pallas kernels (issues 6 and 20): correctness, bandwidth, end to end.

Run (one H200, under 8 minutes):
    python scripts/device_check.py [--out results.json]
    python scripts/device_check.py --smoke        # tiny shapes; on CPU the kernel is interpreted

Sections, each printed as it finishes (a failing section prints its error and the rest go on):
1. correct: the kernel against the jnp reference, float32 under
   jax.default_matmul_precision("highest") and bfloat16, on rows mixing decode, k+1 verify runs, a
   prefill chunk and padding (GQA 4 and 1, head_dim 128, 16-token pages); and row invariance: one
   query row alone, as the last of 5 verify rows, and inside a prefill chunk among other slots'
   rows must give the same bits.
2. copy: the device's copy ceiling, (read + written bytes) / time of ``x * 2`` over 4 GiB.
3. attention: decode (one query row per sequence) at batch 1/32/128 x context 1k/8k, plus a
   k+1 = 5 verify at batch 32 x 8k, Llama-2-7B's attention (32 heads, 32 KV heads, head_dim 128,
   bf16, 16-token pages at random places): the kernel and the jnp path, ms per call (median of
   --iters), and the K/V bytes read per second against the copy ceiling.
4. matmul: the batch-invariant Pallas matmul (``pallas_kernels.matmul``) on Llama-2-7B's weight
   shapes in bf16 (q/o 4096 x 4096, gate/up 4096 x 11008, down 11008 x 4096, head 4096 x 32000,
   in 8 column blocks): its largest error against XLA's product relative to the output's scale;
   whether a probe row's bytes are the same at the first and last position of calls with M in
   {1, 8, 16, 64, 128, 160, 512} (and whether XLA's own product keeps them); ms per call at M =
   1, 32 and 128 for both, and the weight bytes read per second against the copy ceiling.
5. compile: the Llama-2-7B plain round (32 decode rows, from abstract shapes:
   ``scripts/round_lowering.py``) lowered and compiled for the device, with default XLA flags
   and, in a fresh process, with GPU autotuning off.
6. bits: the 7B model's logits for a probe row (the engine's kernels, ``matmul="auto"``)
   compared bytewise: decoded alone, as the last of 128 rows of other slots, and as the first
   row of a k + 1 = 5 verify run; three separately compiled programs.
7. e2e: greedy decoding of a Llama-2-7B-shaped random bf16 model (13.5 GB of weights), plain at
   batch 1, 32 and 128 and with a draft model at batch 1 and 32, each against the weights + KV
   read roofline (batch x copy ceiling / (weight bytes + batch x KV bytes at the mean context)).
   The target's layers 3..32 write nothing to the residual stream (zero o_proj and down_proj:
   the same work, exact zeros), and the draft is its first two layers with the same embeddings
   and head, so every greedy draft is accepted: the round's best case. Speculative tokens must
   equal plain ones. Each (engine, batch) runs once to compile, then prefill (max_tokens=1) and
   the whole run are each the best of 2; decode tok/s = batch x (max_tokens - 1) / (whole -
   prefill). Plain runs again with async scheduling off (each call read back before the next is
   sent): its decode tok/s, and whether its tokens are the same.
8. hf: the peer, HF transformers' greedy ``generate`` (torch, sdpa attention) on the same
   Llama-2-7B shape in bf16 at batch 1, 32 and 128, the same prompt length and tokens, timed the
   same way (``scripts/hf_peer.py``, in a process of its own: it imports no JAX); with e2e's
   figures, sfjax plain's decode tok/s as a multiple of HF's at each batch. This process's JAX
   keeps ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (default here 0.55) of the GPU, the rest is torch's.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import json
import statistics
import subprocess
import sys
import time
import traceback

# JAX would take 75% of the GPU at start: leave the HF peer's process room for its 7B model
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.55")

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import matmul as MM
from pallas_kernels import paged_attention as P
from sfjax import SamplingParams, toy
from sfjax import benchmark as B
from sfjax import weights as W
from sfjax.config import ModelConfig
from sfjax.engine.engine import Engine, EngineConfig
from sfjax.spec.config import SpeculativeConfig

ON_CPU = jax.default_backend() == "cpu"
IMPL = "interpret" if ON_CPU else "auto"          # the kernel: interpreted on CPU


def kernel(*args, **kw):
    return P.paged_attention(*args, impl=IMPL, **kw)


def pages(rng_key, lengths, block_size, kvh, d, dtype, layers=1):
    """K/V pools with each sequence's pages at random places; returns (k, v, block_tables)."""
    per = [-(-n // block_size) for n in lengths]
    num = 1 + sum(per)
    shape = (layers, num, block_size, kvh, d)
    kk, kv = jax.random.split(rng_key)
    k = jax.random.normal(kk, shape, dtype)
    v = jax.random.normal(kv, shape, dtype)
    perm = 1 + np.random.default_rng(0).permutation(num - 1)
    tables = np.zeros((len(lengths), max(per)), np.int32)
    used = 0
    for s, p in enumerate(per):
        tables[s, :p] = perm[used:used + p]
        used += p
    return k, v, jnp.asarray(tables)


def rows(runs, n):
    """runs: (slot, first position, count); padded to n rows with slot/position -1."""
    slots, positions = [], []
    for s, p, c in runs:
        slots += [s] * c
        positions += list(range(p, p + c))
    pad = n - len(slots)
    return (jnp.asarray(slots + [-1] * pad, jnp.int32), jnp.asarray(positions + [-1] * pad, jnp.int32))


def timed(f, *args, iters):
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


# ---------------------------------------------------------------------------------------------


def check_correct(smoke: bool) -> dict:
    d = 16 if smoke else 128
    ctx = 90 if smoke else 1000
    out = {}
    for kvh, g in ((2, 4), (4, 1)) if smoke else ((8, 4), (32, 1)):
        h = kvh * g
        for dtype in (jnp.float32, jnp.bfloat16):
            k, v, tables = pages(jax.random.key(1), [ctx, ctx // 2, 40, ctx], 16, kvh, d, dtype)
            slots, positions = rows([(0, ctx - 1, 1), (1, ctx // 2 - 5, 5), (2, 3, 37), (3, ctx - 5, 5)], 64)
            q = jax.random.normal(jax.random.key(2), (64, h, d), dtype)
            args = (q, k, v, 0, tables, slots, positions)
            with jax.default_matmul_precision("highest"):
                ref = jax.jit(P.paged_attention_reference, static_argnames=("sm_scale",))(*args, sm_scale=d ** -0.5)
                got = jax.jit(kernel, static_argnames=("sm_scale",))(*args, sm_scale=d ** -0.5)
                err = float(jnp.max(jnp.abs(got - ref)))
                # row invariance: slot 0's row at position ctx - 1, three ways
                q0 = q[0]
                bits = []
                for runs, at in [([(0, ctx - 1, 1)], 0),
                                 ([(1, 10, 3), (0, ctx - 5, 5), (2, 20, 4)], 7),
                                 ([(2, 0, 9), (0, ctx - 30, 30), (3, 7, 2)], 38)]:
                    s, p = rows(runs, 64)
                    qq = q.at[at].set(q0)
                    o = jax.jit(kernel, static_argnames=("sm_scale",))(qq, k, v, 0, tables, s, p, sm_scale=d ** -0.5)
                    bits.append(np.asarray(o[at]))
            name = f"G{g}_{jnp.dtype(dtype).name}"
            tol = 1e-4 if dtype == jnp.float32 else 3e-2
            out[name] = dict(max_abs_err=err, tol=tol, ok=err <= tol,
                             row_invariant=all((b == bits[0]).all() for b in bits[1:]))
            print(f"correct {name}: max |kernel - reference| = {err:.3g} (tol {tol}); "
                  f"row invariant: {out[name]['row_invariant']}", flush=True)
    return out


def copy_ceiling(smoke: bool, iters: int) -> float:
    n = (1 << 20) if smoke else (1 << 31)                  # bf16 elements: 2 MiB or 4 GiB
    x = jnp.ones((n,), jnp.bfloat16)
    t = timed(jax.jit(lambda x: x * 2), x, iters=iters)
    gbs = 2 * n * 2 / t / 1e9
    print(f"copy: {gbs:.0f} GB/s (read + write of {2 * n / 2**20:.0f} MiB in {t * 1e3:.3f} ms)", flush=True)
    return gbs


def time_attention(smoke: bool, iters: int, ceiling: float) -> list[dict]:
    kvh, g, d, bs = (2, 1, 16, 16) if smoke else (32, 1, 128, 16)
    cases = ([(1, 128, 1), (4, 256, 1), (4, 256, 5)] if smoke else
             [(b, c, 1) for b in (1, 32, 128) for c in (1024, 8192)] + [(32, 8192, 5)])
    out = []
    f_ker = jax.jit(kernel, static_argnames=("sm_scale",))
    f_ref = jax.jit(P.paged_attention_reference, static_argnames=("sm_scale",))
    for b, ctx, qlen in cases:
        k, v, tables = pages(jax.random.key(b), [ctx] * b, bs, kvh, d, jnp.bfloat16)
        n = -(-b * qlen // 8) * 8
        slots, positions = rows([(s, ctx - qlen, qlen) for s in range(b)], n)
        q = jax.random.normal(jax.random.key(0), (n, kvh * g, d), jnp.bfloat16)
        args = (q, k, v, 0, tables, slots, positions)
        kv_bytes = 2 * b * ctx * kvh * d * 2
        row = dict(batch=b, context=ctx, q_len=qlen, kv_gb=kv_bytes / 1e9)
        for name, f in (("kernel", f_ker), ("jnp", f_ref)):
            t = timed(lambda *a: f(*a, sm_scale=d ** -0.5), *args, iters=iters)
            row[f"{name}_ms"] = t * 1e3
            row[f"{name}_gbs"] = kv_bytes / t / 1e9
            row[f"{name}_of_ceiling"] = row[f"{name}_gbs"] / ceiling
        out.append(row)
        print(f"attention B={b} ctx={ctx} q_len={qlen}: kernel {row['kernel_ms']:.3f} ms "
              f"({row['kernel_gbs']:.0f} GB/s, {100 * row['kernel_of_ceiling']:.0f}% of copy), jnp "
              f"{row['jnp_ms']:.3f} ms ({row['jnp_gbs']:.0f} GB/s)", flush=True)
        del k, v
    return out


# ---------------------------------------------------------------------------------------------


def random_weights(cfg: ModelConfig, seed: int) -> W.Weights:
    """Random weights made on the device (std 0.02; norms ones)."""
    info = W.describe(cfg)
    keys = jax.random.split(jax.random.key(seed), len(info))
    arrays = {name: (jnp.ones(a.shape, cfg.jnp_dtype) if a.init == "ones" else
                     0.02 * jax.random.normal(key, a.shape, cfg.jnp_dtype))
              for key, (name, a) in zip(keys, info.items())}
    return W.Weights(**arrays, **({"lm_head": None} if cfg.tie_word_embeddings else {}))


def llama_7b() -> ModelConfig:
    return ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                       num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128,
                       max_position_embeddings=4096, rms_norm_eps=1e-5, dtype="bfloat16")


def generate(engine: Engine, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
    """Greedy decoding of every prompt at once (one request each); (seconds, tokens per prompt)."""
    ids = [f"{time.perf_counter_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    t = time.perf_counter()
    tokens = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return time.perf_counter() - t, [tokens[rid] for rid in ids]


def compile_times(smoke: bool) -> dict:
    """The Llama-2-7B plain round (32 decode rows; abstract shapes, nothing allocated) lowered
    and compiled for this device with default XLA flags, then in a fresh process with GPU
    autotuning off (``--xla_gpu_autotune_level=0``)."""
    import subprocess
    import sys
    if smoke:
        return {"skipped": "smoke"}
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from round_lowering import compile_seconds
    out = {}
    lower_s, compile_s = compile_seconds(32)
    out["default"] = dict(lower_s=lower_s, compile_s=compile_s)
    print(f"compile: 7B plain round lowered in {lower_s:.1f} s, compiled in {compile_s:.1f} s", flush=True)
    code = ("import sys, json; sys.path.insert(0, %r); from round_lowering import compile_seconds; "
            "print(json.dumps(compile_seconds(32)))" % os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip())
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=400)
    if run.returncode == 0:
        lower_s, compile_s = json.loads(run.stdout.strip().splitlines()[-1])
        out["autotune_off"] = dict(lower_s=lower_s, compile_s=compile_s)
        print(f"compile: autotuning off: lowered in {lower_s:.1f} s, compiled in {compile_s:.1f} s", flush=True)
    else:
        out["autotune_off"] = {"error": run.stderr[-3000:]}
        print(f"compile: autotuning off FAILED:\n{run.stderr[-3000:]}", flush=True)
    return out


def row_bits(smoke: bool) -> dict:
    """The model's logits for a probe row, bytes compared: decoded alone (8-row bucket), as the
    last row of a 128-row batch of other slots' rows, and as the first row of a k + 1 = 5 verify
    run; each a separately compiled program (the engine's kernels: ``matmul="auto"``)."""
    cfg = toy.tiny_config(num_layers=4, dtype="bfloat16") if smoke else llama_7b()
    from sfjax import model, rows as R, sharding
    from sfjax.cache import KVCache
    w = sharding.place_weights(random_weights(cfg, 0), cfg)
    impl = R.kernel_for("auto", cfg) if not ON_CPU else "interpret"
    ctx, block = 200, 16
    pages_per = -(-(ctx + 8) // block)
    tables = jnp.arange(1, 1 + 130 * pages_per, dtype=jnp.int32).reshape(130, pages_per)
    cache = KVCache.zeros(cfg, 1 + 130 * pages_per, block)

    @functools.partial(jax.jit, static_argnums=(3,))
    def logits(tokens, positions, slots, n):
        tiling = R.Tiling(kernel=impl)
        h, _ = model.forward(w, cache, tokens, positions, slots, tables, cfg, tiling,
                             attention="auto" if not ON_CPU else "reference")
        return model.logits(w, h, cfg, tiling)

    rng = np.random.default_rng(0)
    probe_tok = 17
    cases = {}
    i32 = lambda x: jnp.asarray(x, jnp.int32)
    # alone: one decode row of slot 0 at position ctx (its earlier K/V: zeros, the same in all)
    tok, pos, sl = [probe_tok] + [0] * 7, [ctx] + [-1] * 7, [0] + [-1] * 7
    cases["alone"] = np.asarray(logits(i32(tok), i32(pos), i32(sl), 8)[0])
    tok = rng.integers(2, cfg.vocab_size, 128).tolist()
    tok[127] = probe_tok
    pos, sl = [ctx] * 128, list(range(1, 128)) + [0]
    cases["in_batch_128"] = np.asarray(logits(i32(tok), i32(pos), i32(sl), 128)[127])
    tok = [probe_tok] + rng.integers(2, cfg.vocab_size, 4).tolist() + [0] * 3
    pos, sl = [ctx + j for j in range(5)] + [-1] * 3, [0] * 5 + [-1] * 3
    cases["verify_row_0"] = np.asarray(logits(i32(tok), i32(pos), i32(sl), 8)[0])
    same = {name: cases[name].tobytes() == cases["alone"].tobytes() for name in cases}
    print(f"bits: matmul {impl}: probe row's logits identical alone / in batch 128 / first of a "
          f"verify run: {same}", flush=True)
    return dict(matmul=impl, same=same)


def e2e(smoke: bool, ceiling: float, max_tokens: int, k: int, repeats: int = 2,
        batches: tuple[int, ...] | None = None) -> dict:
    """Greedy decoding, plain at batch 1, 32 and 128 (``batches``) and with the all-accepting
    draft model at the first two; each against the weights + KV read roofline."""
    cfg = toy.tiny_config(num_layers=4, dtype="bfloat16") if smoke else llama_7b()
    w = random_weights(cfg, 0)
    dead = lambda x: x.at[2:].set(0)
    w = dataclasses.replace(w, wo=dead(w.wo), w_down=dead(w.w_down))
    dcfg = dataclasses.replace(cfg, num_layers=2)
    dw = dataclasses.replace(w, **{f: x[:2] for f, x in W.layer_arrays(w).items()})
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(w))
    prompt_len = 128 if not smoke else 16
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.jnp_dtype).itemsize
    tokenizer = toy.build_tokenizer(512)
    batches = batches or ((1, 32, 128) if not smoke else (1, 4))
    out = dict(weight_gb=weight_bytes / 1e9)
    print(f"e2e: {weight_bytes / 1e9:.2f} GB of weights", flush=True)
    tokens = {}
    for name, spec, draft, sizes in [
            ("plain", None, None, batches),
            ("draft_model", SpeculativeConfig(method="draft_model", model="(in memory)",
                                              num_speculative_tokens=k), (dcfg, dw), batches[:2])]:
        config = EngineConfig(max_num_seqs=max(sizes), max_model_len=max_tokens + prompt_len + k + 8,
                              max_num_batched_tokens=max(max(sizes), 512))
        engine = Engine(cfg, w, tokenizer, config, eos_token_ids=(), speculative=spec, draft=draft)
        out[name] = {"matmul": engine.run.matmul}
        for b in sizes:
            prompts = np.random.default_rng(b).integers(2, cfg.vocab_size, (b, prompt_len)).tolist()
            warm, _ = B.warm_up(engine, lambda e=engine: generate(e, prompts, max_tokens))
            prefill = min(generate(engine, prompts, 1)[0] for _ in range(repeats))
            total, toks = min(generate(engine, prompts, max_tokens) for _ in range(repeats))
            decode = b * (max_tokens - 1) / (total - prefill)
            context = prompt_len + max_tokens / 2
            roofline = b * ceiling * 1e9 / (weight_bytes + b * context * kv_per_token)
            row = dict(warmup_s=warm, prefill_s=prefill, total_s=total, decode_tok_s=decode,
                       roofline_tok_s=roofline, of_roofline=decode / roofline)
            if spec is not None:
                m = engine.get_metrics()["spec_decode"]
                row.update(acceptance_rate=m["acceptance_rate"],
                           mean_acceptance_length=m["mean_acceptance_length"])
            else:       # each call read back before the next is sent: what async scheduling saves
                on = engine.config
                engine.config = dataclasses.replace(on, async_scheduling=False)
                sync, sync_toks = min(generate(engine, prompts, max_tokens) for _ in range(repeats))
                engine.config = on
                row.update(sync_decode_tok_s=b * (max_tokens - 1) / (sync - prefill),
                           sync_equal=sync_toks == toks)
            tokens[name, b] = toks
            out[name][b] = row
            print(f"e2e {name} batch {b} ({engine.run.matmul}): decode {decode:.1f} tok/s "
                  f"({100 * decode / roofline:.0f}% of the {roofline:.0f} tok/s roofline), prefill "
                  f"{prefill * 1e3:.0f} ms, warm-up {warm:.1f} s"
                  + (f", acceptance {row['acceptance_rate']:.2f}" if spec else
                     f"; async scheduling off: {row['sync_decode_tok_s']:.1f} tok/s, tokens "
                     f"equal: {row['sync_equal']}"), flush=True)
        del engine
    out["spec_equals_plain"] = all(tokens["draft_model", b] == tokens["plain", b] for b in batches[:2])
    print(f"e2e: speculative tokens equal plain: {out['spec_equals_plain']}", flush=True)
    return out


def hf_peer(smoke: bool, max_tokens: int, plain: dict | None) -> dict:
    """``scripts/hf_peer.py`` in a child process, with e2e's plain figures beside it."""
    batches = "1,4" if smoke else "1,32,128"
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_peer.py"),
           "--batches", batches, "--prompt-len", "16" if smoke else "128",
           "--max-tokens", str(max_tokens)] + (["--smoke"] if smoke else [])
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if run.returncode:
        raise RuntimeError(f"hf_peer.py failed ({run.returncode}):\n{run.stderr[-4000:]}")
    out = json.loads(run.stdout.strip().splitlines()[-1])
    for b, row in out["batches"].items():
        ours = (plain or {}).get(int(b), {}).get("decode_tok_s")
        row["sfjax_plain_over_hf"] = ours / row["decode_tok_s"] if ours else None
        print(f"hf batch {b} ({out['device']}, torch {out['torch']}): decode "
              f"{row['decode_tok_s']:.1f} tok/s, prefill {row['prefill_s'] * 1e3:.0f} ms"
              + (f"; sfjax plain {row['sfjax_plain_over_hf']:.2f}x" if ours else ""), flush=True)
    return out


MATMUL_SHAPES = {"q/o": (4096, 4096), "gate/up": (4096, 11008), "down": (11008, 4096),
                 "head": (4096, 32000)}


def matmuls(smoke: bool, iters: int, ceiling: float) -> dict:
    shapes = {"small": (64, 192)} if smoke else MATMUL_SHAPES
    kernel = jax.jit(lambda x, w: MM.matmul(x, w, impl="interpret" if ON_CPU else "auto"))
    xla = jax.jit(lambda x, w: MM.matmul_reference(x, w))
    out = {}
    for name, (k, n) in shapes.items():
        key = jax.random.key(1)
        w = (jax.random.normal(key, (8, k, n // 8), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
        probe = jax.random.normal(jax.random.key(2), (k,), jnp.float32).astype(jnp.bfloat16)
        same, same_xla, first, first_xla = True, True, None, None
        for m in (1, 8, 16, 64, 128, 160, 512):
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16)
            for at in sorted({0, m - 1}):
                xm = x.at[at].set(probe)
                row, row_xla = (np.asarray(f(xm, w)[at]).tobytes() for f in (kernel, xla))
                first, first_xla = first or row, first_xla or row_xla
                same, same_xla = same and row == first, same_xla and row_xla == first_xla
        x = jax.random.normal(jax.random.key(3), (128, k), jnp.float32).astype(jnp.bfloat16)
        ref = np.asarray(MM.matmul_reference(x, w, jnp.float32))
        err = float(np.abs(np.asarray(kernel(x, w)).astype(np.float32) - ref).max() / np.abs(ref).max())
        times = {}
        for m in (1, 32, 128):
            xm = x[:m]
            t_k, t_x = timed(kernel, xm, w, iters=iters), timed(xla, xm, w, iters=iters)
            times[m] = dict(kernel_ms=1e3 * t_k, xla_ms=1e3 * t_x,
                            kernel_of_copy=w.nbytes / t_k / 1e9 / ceiling)
        out[name] = dict(rel_err=err, probe_row_same=same, xla_probe_row_same=same_xla, times=times)
        print(f"matmul {name} {k}x{n}: rel err {err:.2e}, probe row same {same} (XLA: {same_xla}), "
              + ", ".join(f"M={m}: {t['kernel_ms']:.3f} ms vs XLA {t['xla_ms']:.3f} ms "
                          f"({100 * t['kernel_of_copy']:.0f}% of copy)" for m, t in times.items()),
              flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (runs on CPU, interpreted)")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per attention case")
    ap.add_argument("--max-tokens", type=int, default=128, help="e2e: tokens generated")
    ap.add_argument("--k", type=int, default=4, help="e2e: drafts per round")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: "
                    "correct,attention,matmul,compile,bits,e2e,hf")
    ap.add_argument("--batches", default=None,
                    help="e2e's batch sizes, comma-separated (default 1,32,128; smoke 1,4)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    batches = tuple(map(int, args.batches.split(","))) if args.batches else None
    if args.smoke:
        args.iters, args.max_tokens = min(args.iters, 3), min(args.max_tokens, 8)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, kernel impl {IMPL}", flush=True)
    results = dict(jax=jax.__version__, device=jax.devices()[0].device_kind, smoke=args.smoke)
    start = time.perf_counter()
    sections = [("correct", lambda: check_correct(args.smoke)),
                ("copy_gbs", lambda: copy_ceiling(args.smoke, args.iters)),
                ("attention", lambda: time_attention(args.smoke, args.iters, results["copy_gbs"])),
                ("matmul", lambda: matmuls(args.smoke, args.iters, results["copy_gbs"])),
                ("compile", lambda: compile_times(args.smoke)),
                ("bits", lambda: row_bits(args.smoke)),
                ("e2e", lambda: e2e(args.smoke, results["copy_gbs"], args.max_tokens, args.k,
                                    batches=batches)),
                ("hf", lambda: hf_peer(args.smoke, args.max_tokens,
                                       results.get("e2e", {}).get("plain")))]
    for name, run in sections:
        if name in skip:
            continue
        t = time.perf_counter()
        try:
            results[name] = run()
        except Exception:                                   # one section's failure keeps the others
            results[name] = {"error": traceback.format_exc()}
            print(f"{name} FAILED:\n{results[name]['error']}", flush=True)
        print(f"[{name}: {time.perf_counter() - t:.1f} s]", flush=True)
    results["total_s"] = time.perf_counter() - start
    print(f"total {results['total_s']:.1f} s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
