"""Sharding: one rules table from logical axis names to a (``data``, ``model``) mesh.

Every weight and cache array names its axes (``weights.describe``, ``CACHE_AXES``); ``RULES`` maps
a name to a mesh axis. Tensor parallelism shards column blocks over ``model``; data parallelism
shards the slots over ``data``, with their KV pages and their rows of each step.

Slots over ``data`` (vLLM's data parallelism, inside one single-controller step): with dp data
shards and max_num_seqs S, slot s belongs to shard s // (S / dp). The cache's block axis is split
over ``data``: each shard holds num_kv_blocks / dp pages, its own page 0 its null block, and the
host allocates a slot's pages from its shard's allocator (``cache.ShardedAllocator``), so block
tables hold local page ids. A step's rows come laid out by shard: dp equal contiguous segments of
whole row tiles, segment d holding only rows of shard d's slots (and padding), so each shard
writes and reads only its own pages and no K/V crosses ``data``. The host lays out the engine's
steps (``engine.speculation.pack``); steps laid out on the device place their rows with
``slot_rows``. The history, block tables and sampling run replicated.

Exactness (DESIGN §1.2: a row's bits must not depend on how it was computed). A split contraction
followed by an all-reduce (Megatron's row-parallel o_proj and down_proj) changes the summation
order, and so the bits. Splitting only output columns is not enough either: XLA:CPU lowers an
[8, K] x [K, N] dot differently by N (measured: splitting N over 2..8 devices changed the last
bits of most shapes). So every matmul is computed in ``COL_BLOCKS`` fixed column blocks, as one
batched dot of [row_tile, K] x [K, N / COL_BLOCKS] products (``model.matmul``), and tensor
parallelism hands each device whole blocks: a device computes the same per-block products, with
the same shapes, as one device computing all blocks. No contraction is ever split across devices:
o_proj and down_proj are column-parallel too, on their output (``embed_out``) axis, after their
inputs are all-gathered. The cost per layer and row: all-gathers of the attention output (heads *
head_dim), the o_proj output (d), the MLP activation (ffn) and the down_proj output (d), about
(3d + ffn) * (tp - 1) / tp values received, against Megatron's two all-reduces of d (about
4d * (tp - 1) / tp); and one more collective per stage.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sfjax.config import ModelConfig
from sfjax.weights import describe

DATA, MODEL = "data", "model"
COL_BLOCKS = 8          # column blocks of every matmul; a tensor-parallel size must divide it

# logical axis -> mesh axis (None: replicated). Applied to the column-block axis of matrices,
# the vocabulary rows of the embedding, the KV heads of the cache and the rows of a step.
RULES = {
    "vocab": MODEL,       # embedding rows, LM head columns (replicated if the vocab doesn't divide)
    "q_heads": MODEL,     # wq columns (attention heads)
    "kv_heads": MODEL,    # wk / wv columns, cache heads (replicated where kv_heads < tp)
    "mlp": MODEL,         # gate / up columns
    "embed_out": MODEL,   # o_proj / down_proj output columns
    "embed": None,        # the hidden axis where it is contracted or normalized
    "layers": None,
    "cache_blocks": DATA,  # KV pages: each data shard holds its own slots' pages
    "block": None, "head_dim": None,
    "rows": DATA,         # the step's token rows (laid out by shard) and logit rows
}
CACHE_AXES = ("layers", "cache_blocks", "block", "kv_heads", "head_dim")


def make_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1, devices=None) -> Mesh:
    """A (data, model) mesh over the first tp * dp devices (all processes' devices, in order)."""
    tp, dp = tensor_parallel_size, data_parallel_size
    if tp < 1 or dp < 1:
        raise ValueError(f"tensor_parallel_size ({tp}) and data_parallel_size ({dp}) must be >= 1")
    devices = jax.devices() if devices is None else list(devices)
    if tp * dp > len(devices):
        raise ValueError(f"tensor_parallel_size {tp} x data_parallel_size {dp} = {tp * dp} devices, "
                         f"but only {len(devices)} are available")
    return Mesh(np.asarray(devices[:tp * dp], dtype=object).reshape(dp, tp), (DATA, MODEL))


def as_mesh(mesh: Mesh) -> Mesh:
    """A caller's mesh with Auto axes (``jax.make_mesh`` makes Explicit ones since jax 0.9; the
    steps place arrays by ``NamedSharding`` and run the model under ``shard_map``, GSPMD-style).
    The same devices and axis names, so the same compiled steps as ``make_mesh``'s."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh: a jax.sharding.Mesh is needed; got {type(mesh).__name__}")
    if DATA not in mesh.shape or MODEL not in mesh.shape:
        raise ValueError(f"mesh axes must include {DATA!r} and {MODEL!r}; got {tuple(mesh.shape)}")
    if any(mesh.shape[a] > 1 for a in mesh.axis_names if a not in (DATA, MODEL)):
        raise ValueError(f"mesh: axes other than {DATA!r} and {MODEL!r} must have size 1; "
                         f"got {dict(mesh.shape)}")
    devices = mesh.devices.reshape(mesh.shape[DATA], mesh.shape[MODEL]) \
        if mesh.axis_names.index(DATA) < mesh.axis_names.index(MODEL) \
        else mesh.devices.reshape(mesh.shape[MODEL], mesh.shape[DATA]).T
    return Mesh(devices, (DATA, MODEL))


def shard_map(fn, mesh: Mesh, in_specs, out_specs):
    """``jax.shard_map`` as the model uses it (jax 0.10.2 and 0.11.2 spell it the same): no
    varying-manual-axes check, since the bodies gather across shards by hand."""
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def tp_of(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape[MODEL]


def dp_of(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape[DATA]


def validate(cfg: ModelConfig, mesh: Mesh, what: str = "model") -> None:
    """Raises ValueError naming the first dimension the mesh's tensor-parallel size can't split."""
    if DATA not in mesh.shape or MODEL not in mesh.shape:
        raise ValueError(f"mesh axes must include {DATA!r} and {MODEL!r}; got {tuple(mesh.shape)}")
    tp = tp_of(mesh)
    if COL_BLOCKS % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide {COL_BLOCKS} (the column blocks)")
    dims = {"num_attention_heads": cfg.num_heads, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size}
    for name, n in dims.items():
        if n % tp:
            raise ValueError(f"tensor_parallel_size {tp} does not divide the {what}'s {name} ({n})")
    kv = cfg.num_kv_heads
    if kv % tp and tp % kv:
        raise ValueError(f"tensor_parallel_size {tp} and the {what}'s num_key_value_heads ({kv}): "
                         "one must divide the other")


def _mesh_axis(name: str | None, cfg: ModelConfig, mesh: Mesh | None):
    axis = RULES.get(name) if mesh is not None else None
    if axis == MODEL:
        tp = tp_of(mesh)
        if name == "kv_heads" and cfg.num_kv_heads % tp or name == "vocab" and cfg.vocab_size % tp:
            return None                                    # replicated
    return axis


def spec(axes: tuple[str | None, ...], cfg: ModelConfig, mesh: Mesh | None) -> P:
    return P(*(_mesh_axis(a, cfg, mesh) for a in axes))


def kv_shards(cfg: ModelConfig, mesh: Mesh | None) -> int:
    """How many ways the KV heads are split over ``model`` (1 where they are replicated)."""
    return tp_of(mesh) if _mesh_axis("kv_heads", cfg, mesh) == MODEL else 1


def kv_replicated(cfg: ModelConfig, mesh: Mesh | None) -> bool:
    return mesh is not None and _mesh_axis("kv_heads", cfg, mesh) is None and tp_of(mesh) > 1


def vocab_sharded(cfg: ModelConfig, mesh: Mesh | None) -> bool:
    return _mesh_axis("vocab", cfg, mesh) == MODEL


def _untied(cfg: ModelConfig) -> ModelConfig:
    """The config with its own LM head: placed weights carry a tied head as ``embed.T``
    (``model.block_weights``), sharded as an untied one."""
    return dataclasses.replace(cfg, tie_word_embeddings=False) if cfg.tie_word_embeddings else cfg


def weight_axes(cfg: ModelConfig, name: str, blocked: bool, stacked: bool = True):
    """Logical axes of one field as sharded: ``weights.describe``'s, with a matrix's contracted
    axis unnamed (never sharded); blocked matrices are [.., U, K, W] with the column axis's name
    on the block axis. Without the layer axis if not ``stacked``."""
    axes = describe(_untied(cfg))[name].axes
    if name != "embed" and len(axes) - (axes[0] == "layers") == 2:
        axes = (*axes[:-2], axes[-1], None, None) if blocked else (*axes[:-2], None, axes[-1])
    return axes if stacked or axes[0] != "layers" else axes[1:]


def weight_specs(weights, cfg: ModelConfig, mesh: Mesh | None):
    """PartitionSpecs for ``weights`` (stacked or split by layer, plain or blocked), same tree."""
    info = describe(_untied(cfg))

    def one(name, x, stacked=True):
        if isinstance(x, (tuple, list)):
            return tuple(one(name, a, stacked=False) for a in x)
        plain = len(info[name].shape) - (0 if stacked else 1)
        return spec(weight_axes(cfg, name, x.ndim > plain, stacked), cfg, mesh)

    return dataclasses.replace(weights, **{
        f.name: one(f.name, getattr(weights, f.name)) for f in dataclasses.fields(weights)
        if getattr(weights, f.name) is not None})


def put(tree, specs, mesh: Mesh):
    """Places host or device arrays on ``mesh`` by ``specs``; each process supplies only the shards
    on its own devices (from the same full host value)."""
    def one(x, s):
        sh = NamedSharding(mesh, s)
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return jax.jit(lambda a: a, out_shardings=sh)(x)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sh, lambda idx: host[idx])
    return jax.tree.map(one, tree, specs, is_leaf=lambda x: isinstance(x, P))


def zeros(shape, dtype, spec_: P, mesh: Mesh | None):
    """A zero array created in place with its sharding (no host copy)."""
    if mesh is None:
        return jnp.zeros(shape, dtype)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=NamedSharding(mesh, spec_))()


def cache_spec(cfg: ModelConfig, mesh: Mesh | None) -> P:
    return spec(CACHE_AXES, cfg, mesh)


def draft_mesh(mesh: Mesh, tp: int) -> Mesh:
    """The target's devices, in the same order, for a draft with tensor-parallel size ``tp``
    (dividing the target's): axes (data, replica, model); the draft is replicated over replica."""
    t = tp_of(mesh)
    if tp < 1 or t % tp:
        raise ValueError(f"speculative_config.draft_tensor_parallel_size ({tp}) must divide the "
                         f"target's tensor_parallel_size ({t})")
    if tp == t:
        return mesh
    return Mesh(mesh.devices.reshape(dp_of(mesh), t // tp, tp), (DATA, "replica", MODEL))


def pad_to(n: int, mesh: Mesh | None, row_tile: int) -> int:
    """Rows padded so every data shard gets whole tiles."""
    m = row_tile * dp_of(mesh)
    return -(-n // m) * m


def validate_slots(max_num_seqs: int, mesh: Mesh | None) -> None:
    dp = dp_of(mesh)
    if max_num_seqs % dp:
        raise ValueError(f"max_num_seqs ({max_num_seqs}) must be divisible by data_parallel_size "
                         f"({dp}): each data shard serves max_num_seqs / data_parallel_size slots")


def slot_rows(slots, live, num_slots: int, mesh: Mesh | None, rows_per_slot: int, row_tile: int):
    """Rows on the device for entries of ``rows_per_slot`` consecutive rows each (entry e is slot
    ``slots[e]``, int32 [E], where ``live``), laid out by data shard: shard d's segment holds its
    live entries packed in entry order. Returns (first row of each entry int32 [E], rows in all).

    Off a mesh or at dp 1, entry e starts at row e * rows_per_slot, live or not. Over dp shards a
    segment is num_slots / dp entries rounded up to whole tiles, and an entry that is not live
    starts at the row count (out of range: scatters with mode="drop" skip it)."""
    e, dp = slots.shape[0], dp_of(mesh)
    tiles = lambda n: -(-n // row_tile) * row_tile
    if dp == 1:
        return jnp.arange(e, dtype=jnp.int32) * rows_per_slot, tiles(e * rows_per_slot)
    per = num_slots // dp
    seg = tiles(per * rows_per_slot)
    shard = jnp.where(live, slots // per, dp)
    mine = (shard[:, None] == jnp.arange(dp)[None, :]).astype(jnp.int32)        # [E, dp]
    before = jnp.cumsum(mine, axis=0) - mine           # live entries of each shard before e
    rank = jnp.take_along_axis(before, jnp.minimum(shard, dp - 1)[:, None], axis=1)[:, 0]
    first = jnp.where(live, shard * seg + rank * rows_per_slot, dp * seg)
    return first.astype(jnp.int32), dp * seg


def blocks_of(n: int) -> int:
    return math.gcd(n, COL_BLOCKS)
