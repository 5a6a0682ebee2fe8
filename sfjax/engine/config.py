"""The engine's settings (``EngineConfig``), checked when built: each bad one a ValueError naming
the field and what it allows."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from sfjax import checks as C
from sfjax.run import check_settings

DEFAULT_KV_CACHE_BYTES = 1 << 30
MAX_NUM_SEQS = 16384      # slots (each holds a block-table row and a token history row)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None       # None: enough for max_num_seqs full sequences, capped
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES  # by this many bytes of pages per device
    max_model_len: int | None = None       # None: the model's (ModelConfig.context)
    max_num_seqs: int = 32
    max_num_batched_tokens: int | None = None  # None: max(512, max_num_seqs)
    row_tile: int = 8                      # rows per tile of every op; fixed => row-invariant bits
    sampler: str = "auto"                  # pallas_kernels.sampling.sample impl
    attention: str = "auto"                # pallas_kernels.paged_attention.paged_attention impl
    layer_loop: str = "auto"               # "scan" (stacked) | "unrolled" | "auto": unrolled on CPU
    matmul: str | None = "auto"            # RunConfig.matmul: "auto", None (row tiles) or a kernel
    enable_prefix_caching: bool = True     # share full KV blocks across requests by content hash
    num_scheduler_steps: int = 8           # decode rounds per host call when every request decodes
    # while every running request decodes and no waiting request has a free slot, send the next
    # call before reading this one back: the host's work overlaps the device's (Engine._follow)
    async_scheduling: bool = True
    # CPU, one device: a step whose valid rows fit a tile of 2 or 4 runs in that tile, where it is
    # certified to keep row_tile's bits (rows.certify_row_tiles)
    small_row_tiles: bool = True
    # XLA options for every program the engine compiles, as sorted (name, value) pairs
    # (``compiler_options``: e.g. xla_gpu_autotune_level, xla_backend_optimization_level)
    compiler_options: tuple[tuple[str, Any], ...] = ()
    seed: int = 0

    def __post_init__(self):
        f = lambda name: f"EngineConfig.{name}"
        check_settings("EngineConfig", block_size=self.block_size, row_tile=self.row_tile,
                       sampler=self.sampler, layer_loop=self.layer_loop,
                       attention=self.attention, matmul=self.matmul)
        C.integer(f("num_kv_blocks"), self.num_kv_blocks, 2, optional=True)
        C.integer(f("kv_cache_bytes"), self.kv_cache_bytes, 1)
        C.integer(f("max_model_len"), self.max_model_len, 2, optional=True)
        C.integer(f("max_num_seqs"), self.max_num_seqs, 1, MAX_NUM_SEQS)
        if self.max_num_batched_tokens is None:
            object.__setattr__(self, "max_num_batched_tokens", max(512, self.max_num_seqs))
        C.integer(f("max_num_batched_tokens"), self.max_num_batched_tokens, self.max_num_seqs,
                  allowed=f"an int >= max_num_seqs ({self.max_num_seqs})")
        C.boolean(f("enable_prefix_caching"), self.enable_prefix_caching)
        C.integer(f("num_scheduler_steps"), self.num_scheduler_steps, 1, 1024)
        C.boolean(f("small_row_tiles"), self.small_row_tiles)
        C.boolean(f("async_scheduling"), self.async_scheduling)
        object.__setattr__(self, "compiler_options",
                           compiler_options(f("compiler_options"), self.compiler_options))
        C.integer(f("seed"), self.seed, 0, 2**64 - 1, allowed="an int in [0, 2**64)")


def compiler_options(field: str, options) -> tuple[tuple[str, Any], ...]:
    """``options`` (a dict or (name, value) pairs of XLA compile options: DebugOptions fields
    such as ``xla_gpu_autotune_level`` or ``xla_backend_optimization_level``) as sorted pairs;
    each is tried on a trivial program of the default backend, so a name XLA does not know or a
    value of the wrong kind is a ValueError naming the field before anything runs. Options may
    change bits: on XLA:CPU, -O1 and up fuse a multiply and an add into one FMA where -O0 rounds
    twice, so some logits differ in their last bits (and a token may, where two candidates tie
    that closely). An engine's programs and its small-tile certificate all compile with its
    options."""
    if options is None:
        return ()
    pairs = options.items() if isinstance(options, dict) else options
    try:
        pairs = tuple(sorted((k, v) for k, v in pairs))
    except (TypeError, ValueError):
        raise C.InvalidType(f"{field} = {options!r}: must be a dict of XLA option names to "
                            f"values") from None
    for name, value in pairs:
        if not isinstance(name, str) or not isinstance(value, (bool, int, float, str)):
            raise C.InvalidType(f"{field}: {name!r}: {value!r} must map a str to a bool, int, "
                                f"float or str")
    if pairs and pairs not in _TRIED:
        try:
            jax.jit(lambda x: x + 1, compiler_options=dict(pairs)).lower(np.int32(0)).compile()
        except Exception as e:          # XLA's own message names the option
            raise ValueError(f"{field} = {dict(pairs)!r}: XLA refused them ({e})") from None
        _TRIED.add(pairs)
    return pairs


_TRIED: set = set()       # options a trivial program compiled with
