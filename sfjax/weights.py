"""The weights pytree, described once; random init, HF safetensors loading and saving derive from it.

Layers are stacked on a leading axis so the model can run them with ``lax.scan`` (off the CPU;
on CPU they are split by layer and unrolled, ``model.unrolled``). Matrices are
stored ``[in, out]`` (HF ``nn.Linear`` keeps ``[out, in]``; loading transposes).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from safetensors import safe_open
from safetensors.numpy import save_file

from sfjax.config import ModelConfig, read_json


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights:
    embed: jax.Array        # [vocab, d]
    attn_norm: jax.Array    # [L, d]
    wq: jax.Array           # [L, d, heads * head_dim]
    wk: jax.Array           # [L, d, kv_heads * head_dim]
    wv: jax.Array           # [L, d, kv_heads * head_dim]
    wo: jax.Array           # [L, heads * head_dim, d]
    mlp_norm: jax.Array     # [L, d]
    w_gate: jax.Array       # [L, d, ffn]
    w_up: jax.Array         # [L, d, ffn]
    w_down: jax.Array       # [L, ffn, d]
    final_norm: jax.Array   # [d]
    lm_head: jax.Array | None  # [d, vocab]; None when tied to embed
    q_bias: jax.Array | None = None  # [L, heads * head_dim]; None without (``ModelConfig.qkv_bias``)
    k_bias: jax.Array | None = None  # [L, kv_heads * head_dim]
    v_bias: jax.Array | None = None  # [L, kv_heads * head_dim]
    q_norm: jax.Array | None = None  # [L, head_dim]; None without (``ModelConfig.qk_norm``)
    k_norm: jax.Array | None = None  # [L, head_dim]


class ArrayInfo(NamedTuple):
    shape: tuple[int, ...]
    axes: tuple[str, ...]          # logical axis names, mapped to a mesh by one rules table
    hf_name: str                   # per-layer names carry "{i}"
    transpose: bool                # HF stores it [out, in]
    init: str                      # "normal" | "ones"


def describe(cfg: ModelConfig) -> dict[str, ArrayInfo]:
    """Every weight array once: shape, logical axes, HF name, layout, initializer."""
    d, f, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    p = "model.layers.{i}."
    out = {
        "embed": ArrayInfo((V, d), ("vocab", "embed"), "model.embed_tokens.weight", False, "normal"),
        "attn_norm": ArrayInfo((L, d), ("layers", "embed"), p + "input_layernorm.weight", False, "ones"),
        "wq": ArrayInfo((L, d, q), ("layers", "embed", "q_heads"), p + "self_attn.q_proj.weight", True, "normal"),
        "wk": ArrayInfo((L, d, kv), ("layers", "embed", "kv_heads"), p + "self_attn.k_proj.weight", True, "normal"),
        "wv": ArrayInfo((L, d, kv), ("layers", "embed", "kv_heads"), p + "self_attn.v_proj.weight", True, "normal"),
        "wo": ArrayInfo((L, q, d), ("layers", "q_heads", "embed_out"), p + "self_attn.o_proj.weight", True, "normal"),
        "mlp_norm": ArrayInfo((L, d), ("layers", "embed"), p + "post_attention_layernorm.weight", False, "ones"),
        "w_gate": ArrayInfo((L, d, f), ("layers", "embed", "mlp"), p + "mlp.gate_proj.weight", True, "normal"),
        "w_up": ArrayInfo((L, d, f), ("layers", "embed", "mlp"), p + "mlp.up_proj.weight", True, "normal"),
        "w_down": ArrayInfo((L, f, d), ("layers", "mlp", "embed_out"), p + "mlp.down_proj.weight", True, "normal"),
        "final_norm": ArrayInfo((d,), ("embed",), "model.norm.weight", False, "ones"),
    }
    if not cfg.tie_word_embeddings:
        out["lm_head"] = ArrayInfo((d, V), ("embed", "vocab"), "lm_head.weight", True, "normal")
    if cfg.qkv_bias:
        for name, n, axis in (("q", q, "q_heads"), ("k", kv, "kv_heads"), ("v", kv, "kv_heads")):
            out[f"{name}_bias"] = ArrayInfo((L, n), ("layers", axis),
                                            p + f"self_attn.{name}_proj.bias", False, "normal")
    if cfg.qk_norm:
        for name in ("q_norm", "k_norm"):
            out[name] = ArrayInfo((L, cfg.head_dim), ("layers", "head_dim"),
                                  p + f"self_attn.{name}.weight", False, "ones")
    return out


def abstract(cfg: ModelConfig, mesh=None) -> Weights:
    """The weights as ``jax.ShapeDtypeStruct``s (restore targets, ``jit(...).lower``). With a
    (data, model) ``mesh`` each carries its ``NamedSharding`` from the rules table
    (``sharding.weight_specs``), so a restore into it reads only the shards of this process's
    devices."""
    info = describe(cfg)
    tree = Weights(**{k: jax.ShapeDtypeStruct(a.shape, cfg.jnp_dtype) for k, a in info.items()},
                   **({"lm_head": None} if cfg.tie_word_embeddings else {}))
    if mesh is None:
        return tree
    from sfjax import sharding          # sharding reads describe(): imported here, not above

    sharding.validate(cfg, mesh)
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
        tree, sharding.weight_specs(tree, cfg, mesh))


def init_random(cfg: ModelConfig, seed: int = 0, std: float = 0.02,
                norm_jitter: float = 0.0) -> Weights:
    """Random weights (normal(std) matrices, norms ones + jitter), deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for name, a in describe(cfg).items():
        if a.init == "ones":
            x = 1.0 + norm_jitter * rng.standard_normal(a.shape)
        else:
            x = std * rng.standard_normal(a.shape)
        arrays[name] = jnp.asarray(x.astype(np.float32), cfg.jnp_dtype)
    if cfg.tie_word_embeddings:
        arrays["lm_head"] = None
    return Weights(**arrays)


def multiplied(name: str) -> bool:
    """Whether ``Weights.<name>`` is a matrix rows are multiplied by (not the embedding table,
    a norm or a bias)."""
    return name != "embed" and not name.endswith(("norm", "bias"))


LAYER_FIELDS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
BIAS_FIELDS = ("q_bias", "k_bias", "v_bias")     # per layer too, where the model has them
HEAD_NORM_FIELDS = ("q_norm", "k_norm")          # the same
PER_LAYER = LAYER_FIELDS + BIAS_FIELDS + HEAD_NORM_FIELDS


def layer_arrays(weights: Weights) -> dict:
    """The per-layer fields ``weights`` holds (``PER_LAYER``: the biases and head norms where
    the model has them)."""
    return {f: getattr(weights, f) for f in PER_LAYER if getattr(weights, f) is not None}


def split_layers(weights: Weights) -> Weights:
    """The same weights with each stacked [L, ...] field as a tuple of L separate arrays (the
    model then unrolls its layer loop instead of scanning; see model.forward)."""
    if isinstance(weights.wq, (tuple, list)):
        return weights
    # indexed, not iterated: an array sharded over several processes' devices can't be iterated
    split = {f: tuple(x[i] for i in range(x.shape[0])) for f, x in layer_arrays(weights).items()}
    return dataclasses.replace(weights, **split)


def check(weights: Weights, cfg: ModelConfig) -> None:
    """Raises ValueError naming the first array whose shape or dtype does not fit ``cfg``
    (stacked weights, or weights from ``split_layers``)."""
    info = describe(cfg)
    if cfg.tie_word_embeddings != (weights.lm_head is None):
        raise ValueError(f"weights.lm_head: expected {'None (tied)' if cfg.tie_word_embeddings else 'an array'}")
    for name in BIAS_FIELDS + HEAD_NORM_FIELDS:
        if (getattr(weights, name) is None) == (name in info):
            raise ValueError(f"weights.{name}: expected "
                             f"{'an array' if name in info else 'None (the model has none)'}")
    for name, a in info.items():
        x = getattr(weights, name)
        parts = [(name, x, a.shape)]
        if isinstance(x, (tuple, list)):        # split_layers: one array per layer
            if len(x) != a.shape[0]:
                raise ValueError(f"weights.{name}: {len(x)} layers, config needs {a.shape[0]}")
            parts = [(f"{name}[{i}]", v, a.shape[1:]) for i, v in enumerate(x)]
        for label, v, shape in parts:
            if tuple(v.shape) != shape:
                raise ValueError(f"weights.{label}: shape {tuple(v.shape)}, config needs {shape}")
            if v.dtype != cfg.jnp_dtype:
                raise ValueError(f"weights.{label}: dtype {v.dtype}, config needs {cfg.dtype}")


# ---------------------------------------------------------------------------------------------
# HF folders


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"model folder: {index} has no weight_map")
        files = sorted({os.path.join(path, f) for f in weight_map.values()})
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model folder: no *.safetensors weights in {path}")
    for f in files:
        if not os.path.exists(f):
            raise ValueError(f"model folder: shard {f} listed in the index is missing")
    return files


FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def tensor_reader(path: str) -> Callable[[str], np.ndarray]:
    """``read(name)``: a tensor of the folder's safetensors as numpy (ValueError naming a
    missing one); ``read.names``: every tensor there."""
    where: dict[str, str] = {}
    for f in _safetensors_files(path):
        try:
            with safe_open(f, framework="numpy") as sf:
                where.update({k: f for k in sf.keys()})
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ValueError(f"model folder: cannot read {f}: {e}") from None

    def read(name: str) -> np.ndarray:
        if name not in where:
            raise ValueError(f"model folder: tensor {name!r} is missing from {path}")
        try:
            with safe_open(where[name], framework="numpy") as sf:
                x = sf.get_tensor(name)
        except Exception as e:       # a dtype numpy lacks (float8), a corrupt file
            raise ValueError(f"model folder: cannot read tensor {name!r} of {where[name]}: "
                             f"{type(e).__name__}: {e}") from None
        return x

    read.names = frozenset(where)          # every tensor the folder holds
    return read


def load_hf(path: str, cfg: ModelConfig) -> Weights:
    """Loads ``model.safetensors`` (or sharded safetensors with their index) without torch, as
    host (numpy) arrays in ``cfg``'s dtype: ``sharding.place_weights`` lays them out on the host
    and places them once."""
    reader = tensor_reader(path)

    def read(name: str) -> np.ndarray:
        x = reader(name)
        if str(x.dtype) not in FLOAT_DTYPES:
            raise ValueError(f"model folder: {name} is {x.dtype}: sfjax loads float weights "
                             f"({', '.join(FLOAT_DTYPES)}); quantized checkpoints are not "
                             f"supported")
        return x

    arrays = {}
    for name, a in describe(cfg).items():
        layered = "{i}" in a.hf_name
        want = a.shape[1:] if layered else a.shape
        want = want[::-1] if a.transpose else want            # as the file holds it
        parts = []
        names = [a.hf_name.format(i=i) for i in range(cfg.num_layers)] if layered else [a.hf_name]
        for hf_name in names:
            x = read(hf_name)
            if tuple(x.shape) != tuple(want):
                raise ValueError(f"model folder: {hf_name} has shape {tuple(x.shape)}, "
                                 f"config.json implies {tuple(want)}")
            parts.append(x.T if a.transpose else x)
        x = np.stack(parts) if layered else parts[0]
        arrays[name] = np.asarray(x).astype(cfg.jnp_dtype, copy=False)
    if cfg.tie_word_embeddings:
        _check_tied(reader, arrays["embed"])
        arrays["lm_head"] = None
    return Weights(**arrays)


def _check_tied(reader, embed: np.ndarray) -> None:
    """A tied model's folder may hold lm_head.weight only as the embedding's copy: transformers
    5 serves a different one untied, sfjax (and vLLM) the embedding; so it is refused."""
    if "lm_head.weight" not in reader.names:
        return
    head = reader("lm_head.weight")
    if head.shape != embed.shape or not np.array_equal(head.astype(embed.dtype), embed):
        raise ValueError("model folder: config.json ties the LM head to the embedding "
                         "(tie_word_embeddings), but lm_head.weight differs from "
                         "model.embed_tokens.weight: set tie_word_embeddings false to serve "
                         "that head")


def save_hf(path: str, cfg: ModelConfig, weights: Weights, max_shard_bytes: int | None = None) -> None:
    """Writes ``config.json`` and safetensors (sharded with an index past ``max_shard_bytes``),
    then removes the weights files of an earlier save there that this one did not write (a
    stale index or single file beside the new layout made sfjax and transformers read
    different weights)."""
    os.makedirs(path, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    for name, a in describe(cfg).items():
        x = np.asarray(jax.device_get(getattr(weights, name)))
        if "{i}" in a.hf_name:
            for i in range(cfg.num_layers):
                tensors[a.hf_name.format(i=i)] = np.ascontiguousarray(x[i].T if a.transpose else x[i])
        else:
            tensors[a.hf_name] = np.ascontiguousarray(x.T if a.transpose else x)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf_config(), f, indent=2)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for k, v in tensors.items():
        if max_shard_bytes is not None and shards[-1] and size + v.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += v.nbytes
    files = (["model.safetensors"] if max_shard_bytes is None else
             [f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors" for n in range(len(shards))])
    for fname, shard in zip(files, shards):
        save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
    if max_shard_bytes is not None:
        weight_map = {k: fname for fname, shard in zip(files, shards) for k in shard}
        files.append("model.safetensors.index.json")
        with open(os.path.join(path, files[-1]), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
    for old in os.listdir(path):
        if old not in files and re.fullmatch(
                r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json", old):
            os.remove(os.path.join(path, old))


# ---------------------------------------------------------------------------------------------
# orbax checkpoints

ORBAX_DIR = "orbax"     # the weights' checkpoint inside an exported folder


def save_orbax(path: str, cfg: ModelConfig, weights: Weights) -> None:
    """Writes ``config.json`` and the weights as an orbax checkpoint under ``path/orbax``."""
    import orbax.checkpoint as ocp

    check(weights, cfg)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf_config(), f, indent=2)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.abspath(os.path.join(path, ORBAX_DIR)), weights)


def load_orbax(path: str, cfg: ModelConfig, mesh=None) -> Weights:
    """Restores ``save_orbax``'s weights straight into arrays of ``abstract(cfg, mesh)``: with a
    mesh, sharded by the rules table as they are read (each process reads only its own devices'
    shards; every process must call it). A checkpoint of another config is refused naming the
    first array that does not fit."""
    import orbax.checkpoint as ocp

    ckpt = os.path.abspath(os.path.join(path, ORBAX_DIR))
    if not os.path.isdir(ckpt):
        raise ValueError(f"{path!r} holds no orbax checkpoint (no {ORBAX_DIR}/ folder)")
    with ocp.StandardCheckpointer() as ckptr:
        try:
            stored = ckptr.metadata(ckpt)
        except Exception as e:     # orbax raises its own and tensorstore's errors
            raise ValueError(f"orbax checkpoint {path!r} cannot be read ({e})") from None
        stored = getattr(stored, "item_metadata", stored)     # StepMetadata -> its tree
        stored = getattr(stored, "tree", stored)              # TreeMetadata -> {name: metadata}
        if not isinstance(stored, dict):
            raise ValueError(f"orbax checkpoint {path!r} is incomplete or damaged (no metadata in "
                             f"{ckpt}): export the model again")
        _check_stored(path, stored, cfg)
        # the checkpoint's own fields: one saved before Weights had biases has no key for them
        target = abstract(cfg, mesh)
        try:
            return Weights(**ckptr.restore(ckpt, {f.name: getattr(target, f.name)
                                                  for f in dataclasses.fields(target)
                                                  if f.name in stored}))
        except Exception as e:
            raise ValueError(f"orbax checkpoint {path!r} cannot be restored: {str(e)[:300]}"
                             ) from None


def _check_stored(path: str, stored: dict, cfg: ModelConfig) -> None:
    want = describe(cfg)
    for name in sorted(set(stored) - set(want)):
        if stored[name] is not None:
            why = "the config ties lm_head to embed" if name == "lm_head" else "the config has no such array"
            raise ValueError(f"orbax checkpoint {path!r}: holds weights.{name}, but {why} "
                             "(a checkpoint of another model?)")
    for name, a in want.items():
        got = stored.get(name)
        if got is None or tuple(got.shape) != a.shape:
            raise ValueError(f"orbax checkpoint {path!r}: weights.{name} has shape "
                             f"{None if got is None else tuple(got.shape)}, the config needs "
                             f"{a.shape} (a checkpoint of another model?)")


def load(path: str, cfg: ModelConfig, mesh=None) -> Weights:
    """A model folder's weights: its orbax checkpoint (``sfjax convert``'s export: ``orbax/``),
    restored sharded over ``mesh``; else its safetensors (host arrays, placed by the engine)."""
    if os.path.isdir(os.path.join(path, ORBAX_DIR)):
        return load_orbax(path, cfg, mesh)
    return load_hf(path, cfg)
