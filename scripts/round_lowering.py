"""The engine's round for a Llama-2-7B-shaped bf16 model from abstract shapes (no weights are
made): lowered for GPU (Triton) or TPU (Mosaic) on any machine, or compiled on the device it
runs on. ``tests/test_accelerator_lowering.py`` checks what the lowering holds;
``scripts/device_check.py`` times the compile.

    python scripts/round_lowering.py [--platform cuda|tpu] [--layers 32] [--method ngram]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

from sfjax import rows, sampling
from sfjax import weights as W
from sfjax.cache import KVCache
from sfjax.config import ModelConfig
from sfjax.round import SpecBatch, round_step
from sfjax.run import RunConfig
from sfjax.sampling_params import SamplingParams
from sfjax.step import DeviceState, Progress, StepBatch

PLATFORMS = {
    "cuda": ("triton", AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")),
    "tpu": ("mosaic_tpu", AbstractDevice(device_kind="TPU v6 lite", num_cores=1, platform="tpu")),
}
SLOTS, K, MAX_LEN, BLOCK = 32, 4, 2048, 16


def llama_7b(num_layers: int = 32) -> ModelConfig:
    return ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                       num_layers=num_layers, num_heads=32, num_kv_heads=32, head_dim=128,
                       max_position_embeddings=4096, rms_norm_eps=1e-5, dtype="bfloat16")


def _abstract_weights(cfg):
    plain = W.Weights(**{k: jax.ShapeDtypeStruct(a.shape, cfg.jnp_dtype)
                         for k, a in W.describe(cfg).items()})
    return jax.eval_shape(rows.block_weights, plain)     # as the engine places them: blocked


def _abstract_cache(cfg, blocks=256):
    a = jax.ShapeDtypeStruct(KVCache.shape(cfg, blocks, BLOCK), cfg.jnp_dtype)
    return KVCache(k=a, v=a)


def _state(cfg, draft_cache=None) -> DeviceState:
    table = sampling.Sampling.placed(
        [SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=64)] * SLOTS,
        [(0, 1)] * SLOTS, [64] * SLOTS, eos_token_ids=(2,))
    tables = np.arange(SLOTS * MAX_LEN // BLOCK, dtype=np.int32).reshape(SLOTS, -1) % 256
    return DeviceState(cache=_abstract_cache(cfg),
                       history=jax.ShapeDtypeStruct((SLOTS, MAX_LEN), jnp.int32),
                       block_tables=tables, table=table, progress=Progress.start(np.full(SLOTS, 50, np.int32)),
                       draft_cache=draft_cache)


def _batch(k1: int) -> StepBatch:
    n = SLOTS * k1                       # one decode row, or k + 1 verify rows, per slot
    i32 = lambda x: np.asarray(x, np.int32)
    slot = np.repeat(np.arange(SLOTS), k1)
    draws = sampling.Draws(slot=i32(slot), seq_pos=i32(np.full(n, 99)), prompt_len=i32(np.full(n, 50)),
                           target=i32(np.full(n, -1)))
    return StepBatch(tokens=i32(np.ones(n)), positions=i32(np.full(n, 99)), slots=i32(slot),
                     logit_rows=i32(np.arange(n)), num_logit_rows=np.int32(n),
                     with_logprobs=np.bool_(False), draws=draws)


def _spec_batch() -> SpecBatch:
    i32 = lambda x: np.asarray(x, np.int32)
    s = np.arange(SLOTS)
    return SpecBatch(slots=i32(s), length=i32(np.full(SLOTS, 100)), prompt_len=i32(np.full(SLOTS, 50)),
                     k=i32(np.full(SLOTS, K)), verify_row=i32(s * (K + 1)),
                     verify_logit=i32(s * (K + 1)),
                     draft_tokens=i32(np.ones(2 * SLOTS)),
                     draft_positions=i32(np.tile([98, 99], SLOTS)), draft_slots=i32(np.repeat(s, 2)),
                     draft_last=i32(2 * s + 1))


def round_args(impl: str | None, num_layers: int = 32, method: str | None = None,
               matmul: str | None = "same"):
    """(the round's arguments, abstract where large; its ``RunConfig``) with every kernel impl
    ``impl``; ``method``: None (plain), "ngram", "draft_model" (a 2-layer draft, rejection
    sampling) or "typical" (n-gram, typical acceptance); k = 4."""
    cfg = llama_7b(num_layers)
    spec, draft, dw, dcache = None, None, None, None
    if method is not None:
        spec = {"method": method, "num_speculative_tokens": K}
        if method == "draft_model":
            draft = dataclasses.replace(cfg, num_layers=2)
            spec.update(model=draft, acceptance_method="rejection_sampler")
            dw, dcache = _abstract_weights(draft), _abstract_cache(draft)
        if method == "typical":
            spec.update(method="ngram", acceptance_method="typical_acceptance_sampler")
    run = RunConfig(cfg, MAX_LEN, speculative_config=spec, block_size=BLOCK, layer_loop="scan",
                    attention=impl, sampler=impl, matmul=impl if matmul == "same" else matmul)
    args = (_abstract_weights(cfg), dw, _state(cfg, dcache), _batch(1 if spec is None else K + 1),
            None if spec is None else _spec_batch())
    return args, run


def lower(platform: str, num_layers: int = 32, method: str | None = None,
          matmul: str | None = "same") -> tuple[str, float]:
    """The round's StableHLO for ``platform`` ("cuda", "tpu") and the CPU seconds this process
    spent tracing and lowering it (single-threaded Python: other processes don't change it);
    ``matmul=None``: the matmuls in row-tile loops (the CPU-shaped round)."""
    impl, device = PLATFORMS[platform]
    args, run = round_args(impl, num_layers, method, matmul)
    start = time.process_time()
    with use_abstract_mesh(AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)):
        text = round_step.trace(*args, run=run).lower(lowering_platforms=(platform,)).as_text()
    return text, time.process_time() - start


def compile_seconds(num_layers: int = 32, method: str | None = None) -> tuple[float, float]:
    """(lowering, compiling) seconds of the round on this machine's own backend, its kernels
    "auto"."""
    args, run = round_args("auto", num_layers, method, matmul="auto")
    start = time.perf_counter()
    lowered = round_step.trace(*args, run=run).lower()
    mid = time.perf_counter()
    lowered.compile()
    return mid - start, time.perf_counter() - mid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--platform", default="cuda", choices=list(PLATFORMS))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--method", choices=["ngram", "draft_model", "typical"])
    a = ap.parse_args()
    text, seconds = lower(a.platform, a.layers, a.method)
    ops = collections.Counter(re.findall(r"(?:stablehlo|func|sdy)\.[a-z_]+", text))
    print(f"lowered in {seconds:.1f} s of CPU: {sum(ops.values())} ops, "
          f"{ops['stablehlo.dot_general']} dot_general, {ops['stablehlo.while']} while, "
          f"{ops['stablehlo.if'] + ops['stablehlo.case']} conditionals, "
          f"{ops['stablehlo.custom_call']} custom calls")


if __name__ == "__main__":
    main()



