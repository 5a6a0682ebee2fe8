"""The paged KV cache (device pytree) and the host block allocator.

Pages are ``[layers, num_blocks, block_size, kv_heads, head_dim]``. Block 0 is the null block: it
is never handed out, padding rows write there, and unused block-table entries point at it. Pages
are zeroed at creation because a masked score still multiplies V (0 * NaN is NaN).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

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
    def zeros(cls, cfg: ModelConfig, num_blocks: int, block_size: int, dtype=None) -> "KVCache":
        shape = cls.shape(cfg, num_blocks, block_size)
        dtype = dtype or cfg.jnp_dtype
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype=None) -> int:
        itemsize = jnp.dtype(dtype or cfg.jnp_dtype).itemsize
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * itemsize


def validate_block_size(block_size: int) -> None:
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")


class BlockAllocator:
    """A free list of page ids (block 0 excluded); the host owns all scheduling of pages."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))   # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    def free_ids(self) -> set[int]:
        return set(self._free)
