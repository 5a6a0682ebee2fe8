"""The paged KV cache: a device pytree (the host's allocator of its pages: ``engine.allocator``).

Pages are ``[layers, num_blocks, block_size, kv_heads, head_dim]``. Block 0 is the null block: it
is never handed out, padding rows write there, and unused block-table entries point at it. Pages
are zeroed at creation because a masked score still multiplies V (0 * NaN is NaN).

Over dp data shards the block axis is split (``sharding.RULES``): shard d holds pages
[d * B / dp, (d + 1) * B / dp) of the B, addressed by local ids 0 .. B / dp - 1, its local page 0
its own null block; ``engine.allocator.ShardedAllocator`` hands them out per shard.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sfjax import sharding
from sfjax.config import ModelConfig

NULL_BLOCK = 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: jax.Array  # [layers, num_blocks, block_size, kv_heads, head_dim]
    v: jax.Array

    @staticmethod
    def shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)

    @classmethod
    def zeros(cls, cfg: ModelConfig, num_blocks: int, block_size: int, dtype=None,
              mesh=None) -> "KVCache":
        """Zeroed pages; on a ``mesh`` sharded by ``sharding.CACHE_AXES`` (KV heads over model,
        pages over data)."""
        dp = sharding.dp_of(mesh)
        if num_blocks % dp:
            raise ValueError(f"num_kv_blocks ({num_blocks}) must be divisible by "
                             f"data_parallel_size ({dp}): each data shard holds its own pages")
        shape = cls.shape(cfg, num_blocks, block_size)
        dtype = dtype or cfg.jnp_dtype
        spec = sharding.cache_spec(cfg, mesh)
        return cls(k=sharding.zeros(shape, dtype, spec, mesh), v=sharding.zeros(shape, dtype, spec, mesh))

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype=None, mesh=None) -> int:
        """A block's K and V bytes (on one device of ``mesh``: its share of the KV heads)."""
        itemsize = jnp.dtype(dtype or cfg.jnp_dtype).itemsize
        heads = cfg.num_kv_heads // sharding.kv_shards(cfg, mesh)
        return 2 * cfg.num_layers * block_size * heads * cfg.head_dim * itemsize
