"""Sharding: one rules table from logical axis names to a (``data``, ``model``) mesh.

Every weight and cache array names its axes (``weights.describe``, ``CACHE_AXES``); ``RULES`` maps
a name to a mesh axis. Tensor parallelism shards column blocks over ``model``; data parallelism
shards the slots over ``data``, with their KV pages and their rows of each step.

Slots over ``data`` (vLLM's data parallelism, inside one single-controller step): with dp data
shards and max_num_seqs S, slot s belongs to shard s // (S / dp). The cache's block axis is split
over ``data``: each shard holds num_kv_blocks / dp pages, its own page 0 its null block, and the
host allocates a slot's pages from its shard's allocator (``engine.allocator.ShardedAllocator``), so block
tables hold local page ids. A step's rows come laid out by shard: dp equal contiguous segments of
whole row tiles, segment d holding only rows of shard d's slots (and padding), so each shard
writes and reads only its own pages and no K/V crosses ``data``. The engine's host lays out its
prefill chunks so (``engine.batch.pack``); the device places the decoding slots' rows after them
with ``slot_rows``. The history, block tables and sampling run replicated.

Exactness (docs/design.md §1.2: a row's bits must not depend on how it was computed). A split contraction
followed by an all-reduce (Megatron's row-parallel o_proj and down_proj) changes the summation
order, and so the bits. Splitting only output columns is not enough either: XLA:CPU lowers an
[8, K] x [K, N] dot differently by N (measured: splitting N over 2..8 devices changed the last
bits of most shapes). So every matmul is computed in ``COL_BLOCKS`` fixed column blocks, as one
batched dot of [row_tile, K] x [K, N / COL_BLOCKS] products (``rows.matmul``), and tensor
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

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax import lax

from sfjax import rows
from sfjax.config import ModelConfig
from sfjax.rows import COL_BLOCKS
from sfjax.weights import describe, split_layers

DATA, MODEL = "data", "model"

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
    (``rows.block_weights``), sharded as an untied one."""
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


def slot_rows(slots, live, num_slots: int, mesh: Mesh | None, rows_per_slot: int, row_tile: int,
              counts=None, rows: int | None = None, after=None):
    """Rows on the device for entries of ``rows_per_slot`` consecutive rows each (entry e is slot
    ``slots[e]``, int32 [E], where ``live``), laid out by data shard: shard d's segment holds its
    live entries packed in entry order. Returns (first row of each entry int32 [E], rows in all).

    Off a mesh or at dp 1, entry e starts at row e * rows_per_slot, live or not. Over dp shards a
    segment is num_slots / dp entries rounded up to whole tiles, and an entry that is not live
    starts at the row count (out of range: scatters with mode="drop" skip it). ``counts`` (int32
    [E], each at most ``rows_per_slot``): the rows each entry takes instead, packed one after
    another within its segment, so the padding is all at the segment's end (where the tile loops
    skip it); an entry that is not live starts at the row count then, on one shard too.
    ``rows``: the rows in all instead (dp segments of rows / dp), a bucket whose segments hold
    every shard's live entries' rows (rows past it are dropped by the scatters). ``after`` (int32
    [dp]): rows at the head of each segment that are taken already (the engine's host rows of
    the round); the entries follow them."""
    e, dp = slots.shape[0], dp_of(mesh)
    tiles = lambda n: -(-n // row_tile) * row_tile
    if dp == 1 and counts is None:
        first = jnp.arange(e, dtype=jnp.int32) * rows_per_slot
        return (first if after is None else first + after[0]), rows or tiles(e * rows_per_slot)
    per = num_slots // dp
    seg = (rows // dp if rows else tiles(per * rows_per_slot) if dp > 1
           else tiles(e * rows_per_slot))
    shard = jnp.where(live, slots // per, dp) if dp > 1 else jnp.where(live, 0, 1)
    size = rows_per_slot if counts is None else jnp.where(live, counts, 0)
    mine = (shard[:, None] == jnp.arange(dp)[None, :]).astype(jnp.int32) * jnp.reshape(size, (-1, 1))
    before = jnp.cumsum(mine, axis=0) - mine           # rows of each shard's entries before e
    rank = jnp.take_along_axis(before, jnp.minimum(shard, dp - 1)[:, None], axis=1)[:, 0]
    if after is not None:
        rank = rank + after[jnp.minimum(shard, dp - 1)]
    first = jnp.where(live, shard * seg + rank, dp * seg)
    return first.astype(jnp.int32), dp * seg


def place_weights(weights, cfg: ModelConfig, mesh: Mesh | None = None, split: bool = False):
    """The weights as steps use them: blocked (``rows.block_weights``), split by layer if
    ``split`` (``model.forward``'s unrolled layer loop), and sharded over ``mesh`` by the rules
    table (each process placing only its own devices' shards)."""
    weights = rows.block_weights(weights)
    if split:
        weights = split_layers(weights)
    if mesh is None:       # host arrays (``weights.load_hf``'s) laid out there, then placed once
        return jax.tree.map(lambda x: jax.device_put(x) if isinstance(x, np.ndarray) else x,
                            weights)
    return put(weights, weight_specs(weights, cfg, mesh), mesh)


def pad_rows(mesh: Mesh | None, row_tile: int, *xs):
    """A call's (tokens, positions, slots) padded (as padding rows, -1) to whole tiles per data
    shard. Over dp > 1 data shards they must come laid out by shard already: dp equal segments
    of whole tiles."""
    n, dp = xs[0].shape[0], dp_of(mesh)
    if dp > 1 and n % (dp * row_tile):
        raise ValueError(f"{n} rows can't be laid out by data shard: over {dp} shards a step "
                         f"needs a multiple of {dp} x row_tile ({row_tile}) rows")
    m = pad_to(n, mesh, row_tile)
    return [jnp.pad(x, (0, m - n), constant_values=fill) for x, fill in zip(xs, (0, -1, -1))]


@dataclasses.dataclass(frozen=True)
class Split:
    """How one shard's part of a model call is split over the mesh (all 1 / False off a mesh);
    used inside ``shard_map``."""
    tp: int = 1
    dp: int = 1
    kv_replicated: bool = False
    vocab_sharded: bool = False

    @classmethod
    def of(cls, cfg: ModelConfig, mesh: Mesh | None) -> "Split":
        if mesh is None:
            return cls()
        return cls(tp_of(mesh), dp_of(mesh), kv_replicated(cfg, mesh), vocab_sharded(cfg, mesh))

    def columns(self, x, axis):
        """All model shards' columns of ``x`` (an all-gather; nothing on one device)."""
        return x if self.tp == 1 else lax.all_gather(x, MODEL, axis=axis, tiled=True)

    def own_slots(self, slots, num_slots: int):
        """``slots`` with rows of other data shards' slots made padding (-1). Rows come laid out
        by shard, so this changes nothing; a misplaced row can then not write another request's
        pages (its page ids are another shard's)."""
        if self.dp == 1:
            return slots
        mine = slots // (num_slots // self.dp) == lax.axis_index(DATA)
        return jnp.where(mine, slots, -1)

    def first_row(self, n: int):
        """The global index of this data shard's first row of an [n]-row shard of a call."""
        return lax.axis_index(DATA) * n if self.dp > 1 else 0

    def embed(self, table, tokens):
        """Embedding rows; with the vocabulary sharded, each shard looks up its own ids and the
        owner's row is selected from the gathered lookups (a selection: the table's bits)."""
        if not self.vocab_sharded:
            return table[tokens]
        v = table.shape[0]
        lo = lax.axis_index(MODEL) * v
        local = table[jnp.clip(tokens - lo, 0, v - 1)]
        every = lax.all_gather(local, MODEL)                              # [tp, N, d]
        return every[tokens // v, jnp.arange(tokens.shape[0])]

    def heads(self, run, q, num_heads: int):
        """``run(q)`` on this shard's query heads. With the KV cache replicated (kv_heads < tp)
        they are placed among zeros for all heads, so attention runs with one device's shapes."""
        if not self.kv_replicated:
            return run(q)
        h = q.shape[1]
        lo = lax.axis_index(MODEL) * h
        full = lax.dynamic_update_slice_in_dim(
            jnp.zeros((q.shape[0], num_heads, q.shape[2]), q.dtype), q, lo, 1)
        return lax.dynamic_slice_in_dim(run(full), lo, h, 1)
