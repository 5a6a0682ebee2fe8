"""EAGLE-3 draft heads: the published folder format, read and written without torch, and the
head's math.

An EAGLE-3 head drafts from the target's own features. The target's residual stream entering
three of its layers (low, middle, high: ``HeadConfig.aux_layers``) at position p, concatenated
(3 x the target's width) and fused to the head's width by ``fc``, is the head's hidden input at
p. With it the head reads the embedding of the token at p + 1 and runs one Llama decoder layer
whose q/k/v see both, 2 x d wide (the embedding through ``input_layernorm``, the hidden input
through ``hidden_norm``); the residual around its attention is the hidden input itself. Its
output, through ``norm`` and ``lm_head``, gives logits over a draft vocabulary of
``draft_vocab_size`` ids, each a target id (``d2t``: target = draft + d2t[draft]; other target
ids get -inf), for the token at p + 2; its pre-norm output is the hidden input at p + 1, so the
head drafts k tokens by feeding itself.

The folder is what the EAGLE authors, vLLM and SGLang publish: ``config.json`` with
``architectures: ["LlamaForCausalLMEagle3"]``, the layer's sizes, ``vocab_size`` (the target's),
``draft_vocab_size``, optionally ``target_hidden_size`` and ``eagle_config``'s
``eagle_aux_hidden_state_layer_ids``; safetensors with ``fc.weight``, ``midlayer.*`` (or
``layers.0.*``) in HF Llama names plus ``midlayer.hidden_norm.weight``, ``norm.weight``,
``lm_head.weight``, ``d2t`` and ``t2d``, and ``embed_tokens.weight`` only when the head does not
share the target's embedding.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from pallas_kernels.paged_attention import paged_attention
from sfjax import checks as C, model, rows
from sfjax.cache import KVCache
from sfjax.config import ModelConfig, read_json, rope_frequencies
from sfjax.rows import rms_norm
from sfjax.weights import tensor_reader

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The layers whose input EAGLE-3 fuses when the head names none (vLLM's and SGLang's
    default): low, middle, high; ``model.forward(features=...)`` returns them."""
    return (2, num_layers // 2, num_layers - 3)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class HeadConfig:
    """An EAGLE-3 head for one target. ``layer``: its decoder layer's sizes as a one-layer
    ``ModelConfig`` (vocab_size the target's); ``aux_layers``: the target layers whose input
    residual stream is fused; ``norm_before_residual``: the residual around attention is the
    normed hidden input (some checkpoints) instead of the raw one."""
    layer: ModelConfig
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, int, int]
    norm_before_residual: bool = False

    @classmethod
    def from_hf_config(cls, hf: dict, target: ModelConfig) -> "HeadConfig":
        """The head of ``config.json`` ``hf`` for ``target``; a ValueError naming the field when
        the head cannot draft for it."""
        archs = hf.get("architectures") or []
        if not set(archs) & set(ARCHITECTURES):
            raise ValueError(f"EAGLE-3 head config.json: architectures = {archs!r}: must name "
                             f"one of {', '.join(ARCHITECTURES)}")
        layers = hf.get("num_hidden_layers", 1)
        if layers != 1:
            raise ValueError(f"EAGLE-3 head config.json: num_hidden_layers = {layers!r} is out of "
                             f"range: sfjax runs one-layer heads (1)")
        plain = dict(hf, architectures=["LlamaForCausalLM"], model_type="llama")
        layer = ModelConfig.from_hf_config(plain, dtype=target.dtype)
        if layer.vocab_size != target.vocab_size:
            raise ValueError(f"EAGLE-3 head config.json: vocab_size = {layer.vocab_size} must be "
                             f"the target's ({target.vocab_size})")
        vd = hf.get("draft_vocab_size") or layer.vocab_size
        C.integer("EAGLE-3 head config.json: draft_vocab_size", vd, 1, target.vocab_size,
                  allowed=f"an int in [1, the target's vocab_size ({target.vocab_size})]")
        th = hf.get("target_hidden_size") or layer.hidden_size
        if th != target.hidden_size:
            raise ValueError(f"EAGLE-3 head config.json: target_hidden_size = {th} (the head's "
                             f"fc reads 3 x it) must be the target's hidden_size "
                             f"({target.hidden_size})")
        eagle = hf.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        ids = default_aux_layers(target.num_layers) if ids is None else ids
        name = "EAGLE-3 head config.json: eagle_config.eagle_aux_hidden_state_layer_ids"
        if (not isinstance(ids, (list, tuple)) or len(ids) != 3
                or not all(isinstance(i, int) and 0 <= i < target.num_layers for i in ids)):
            raise ValueError(f"{name} = {ids!r} is out of range: must be 3 target layers in "
                             f"[0, {target.num_layers}) (the residual stream entering each)")
        return cls(layer=dataclasses.replace(layer, max_position_embeddings=max(
            layer.max_position_embeddings, target.max_position_embeddings)),
            draft_vocab_size=int(vd), target_hidden_size=int(th), aux_layers=tuple(ids),
            norm_before_residual=bool(hf.get("norm_before_residual", False)))

    def num_params(self) -> int:
        """The head's parameters (its embedding is the target's): fc, the layer (q/k/v read
        2 x d), norms, the LM head over the draft vocabulary."""
        c = self.layer
        d, f = c.hidden_size, c.intermediate_size
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        return (3 * self.target_hidden_size * d + 2 * d * (q + 2 * kv) + q * d + 3 * d * f
                + 4 * d + d * self.draft_vocab_size)

    def to_hf_config(self) -> dict:
        out = self.layer.to_hf_config()
        out.update(architectures=[ARCHITECTURES[0]], num_hidden_layers=1,
                   draft_vocab_size=self.draft_vocab_size,
                   target_hidden_size=self.target_hidden_size,
                   norm_before_residual=self.norm_before_residual,
                   eagle_config={"eagle_aux_hidden_state_layer_ids": list(self.aux_layers),
                                 "use_aux_hidden_state": True})
        return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HeadWeights:
    """An EAGLE-3 head's arrays, matrices ``[in, out]`` (HF's ``[out, in]`` transposed)."""
    embed: jax.Array | None   # [vocab, d]; None: the head shares the target's
    fc: jax.Array             # [3 * target d, d]
    input_norm: jax.Array     # [d] the embedding's norm
    hidden_norm: jax.Array    # [d] the hidden input's norm
    wq: jax.Array             # [2d, heads * head_dim]
    wk: jax.Array             # [2d, kv_heads * head_dim]
    wv: jax.Array             # [2d, kv_heads * head_dim]
    wo: jax.Array             # [heads * head_dim, d]
    mlp_norm: jax.Array       # [d] post_attention_layernorm
    w_gate: jax.Array         # [d, ffn]
    w_up: jax.Array           # [d, ffn]
    w_down: jax.Array         # [ffn, d]
    norm: jax.Array           # [d]
    lm_head: jax.Array        # [d, draft vocab]
    draft_to_target: jax.Array  # int32 [draft vocab]: each draft id's target id


def _layout(cfg: HeadConfig) -> dict[str, tuple[str, tuple[int, ...], bool]]:
    """field -> (HF name, shape as sfjax keeps it, stored transposed)."""
    c = cfg.layer
    d, f, q, kv = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    m = "midlayer."
    return {
        "fc": ("fc.weight", (3 * cfg.target_hidden_size, d), True),
        "input_norm": (m + "input_layernorm.weight", (d,), False),
        "hidden_norm": (m + "hidden_norm.weight", (d,), False),
        "wq": (m + "self_attn.q_proj.weight", (2 * d, q), True),
        "wk": (m + "self_attn.k_proj.weight", (2 * d, kv), True),
        "wv": (m + "self_attn.v_proj.weight", (2 * d, kv), True),
        "wo": (m + "self_attn.o_proj.weight", (q, d), True),
        "mlp_norm": (m + "post_attention_layernorm.weight", (d,), False),
        "w_gate": (m + "mlp.gate_proj.weight", (d, f), True),
        "w_up": (m + "mlp.up_proj.weight", (d, f), True),
        "w_down": (m + "mlp.down_proj.weight", (f, d), True),
        "norm": ("norm.weight", (d,), False),
        "lm_head": ("lm_head.weight", (d, cfg.draft_vocab_size), True),
    }


def draft_to_target(d2t: np.ndarray | None, t2d: np.ndarray | None, cfg: HeadConfig) -> np.ndarray:
    """Each draft id's target id from the published ``d2t`` offsets (target = draft + d2t),
    checked against ``t2d`` (which target ids the draft vocabulary holds) when given."""
    vd, v = cfg.draft_vocab_size, cfg.layer.vocab_size
    if d2t is None:
        if vd != v:
            raise ValueError(f"EAGLE-3 head: the tensor 'd2t' is missing; a draft vocabulary of "
                             f"{vd} ids (draft_vocab_size) needs it to map to the target's {v}")
        return np.arange(v, dtype=np.int32)
    if d2t.shape != (vd,):
        raise ValueError(f"EAGLE-3 head: d2t has shape {d2t.shape}; draft_vocab_size implies ({vd},)")
    ids = np.arange(vd, dtype=np.int64) + d2t.astype(np.int64)
    if ids.min() < 0 or ids.max() >= v:
        raise ValueError(f"EAGLE-3 head: d2t maps draft ids outside [0, {v}) (the target's "
                         f"vocab_size)")
    if len(np.unique(ids)) != vd:
        raise ValueError("EAGLE-3 head: d2t maps two draft ids to one target id")
    if t2d is not None:
        t2d = np.asarray(t2d).astype(bool)
        if t2d.shape != (v,) or t2d.sum() != vd or not t2d[ids].all():
            raise ValueError("EAGLE-3 head: t2d does not mark exactly the target ids d2t maps to")
    return ids.astype(np.int32)


def load(path: str, target: ModelConfig) -> tuple[HeadConfig, HeadWeights]:
    """The head in folder ``path`` for ``target``, in the target's dtype; ValueError naming the
    field or tensor when it does not fit the target."""
    cfg = HeadConfig.from_hf_config(read_json(os.path.join(path, "config.json")), target)
    read = tensor_reader(path)
    names = set(read.names)
    prefix = "midlayer." if any(n.startswith("midlayer.") for n in names) else "layers.0."
    arrays = {}
    for field, (name, shape, transpose) in _layout(cfg).items():
        x = read(name.replace("midlayer.", prefix))
        x = x.T if transpose else x
        if x.shape != shape:
            raise ValueError(f"EAGLE-3 head: {name} has shape {x.shape}; config.json implies {shape}")
        arrays[field] = jnp.asarray(x, target.jnp_dtype)
    embed = None
    if "embed_tokens.weight" in names:
        embed = read("embed_tokens.weight")
        want = (target.vocab_size, cfg.layer.hidden_size)
        if embed.shape != want:
            raise ValueError(f"EAGLE-3 head: embed_tokens.weight has shape {embed.shape}; "
                             f"expected {want}")
        embed = jnp.asarray(embed, target.jnp_dtype)
    elif cfg.layer.hidden_size != target.hidden_size:
        raise ValueError(f"EAGLE-3 head: hidden_size = {cfg.layer.hidden_size} differs from the "
                         f"target's ({target.hidden_size}) and the head has no embed_tokens.weight")
    ids = draft_to_target(read("d2t") if "d2t" in names else None,
                          read("t2d") if "t2d" in names else None, cfg)
    return cfg, HeadWeights(embed=embed, draft_to_target=jnp.asarray(ids), **arrays)


def init_random(cfg: HeadConfig, seed: int = 0, std: float = 0.02,
                draft_ids: np.ndarray | None = None) -> HeadWeights:
    """Random head weights (normal(std) matrices, unit norms), deterministic in ``seed``; the
    draft vocabulary ``draft_ids`` (sorted target ids; default: a seeded choice)."""
    rng = np.random.default_rng(seed)
    arrays = {field: (np.ones(shape) if len(shape) == 1 else std * rng.standard_normal(shape))
              for field, (_, shape, _) in _layout(cfg).items()}
    if draft_ids is None:
        draft_ids = np.sort(rng.choice(cfg.layer.vocab_size, cfg.draft_vocab_size, replace=False))
    dtype = cfg.layer.jnp_dtype
    return HeadWeights(embed=None, draft_to_target=jnp.asarray(draft_ids, jnp.int32),
                       **{k: jnp.asarray(v.astype(np.float32), dtype) for k, v in arrays.items()})


def save(path: str, cfg: HeadConfig, w: HeadWeights) -> None:
    """Writes the head in the published format (``config.json``, ``model.safetensors``)."""
    os.makedirs(path, exist_ok=True)
    get = lambda x: np.asarray(jax.device_get(x))
    tensors = {name: np.ascontiguousarray(get(getattr(w, field)).T if transpose
                                          else get(getattr(w, field)))
               for field, (name, _, transpose) in _layout(cfg).items()}
    ids = get(w.draft_to_target).astype(np.int64)
    tensors["d2t"] = ids - np.arange(len(ids), dtype=np.int64)
    t2d = np.zeros(cfg.layer.vocab_size, bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    if w.embed is not None:
        tensors["embed_tokens.weight"] = np.ascontiguousarray(get(w.embed))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf_config(), f, indent=2)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


# -- the head's math -------------------------------------------------------------------------
# Each function is row-local; ``mm`` is the product: ``a @ w`` on plain weights (training, the
# dense reference), or ``rows.Rows.matmul`` on blocked ones inside a tile body (the round's
# paged path, ``paged``), where a row's bits do not depend on the call.


def _dense(a, w, out_dtype=None):
    if isinstance(w, tuple):
        return tuple(_dense(a, x, out_dtype) for x in w)
    return jnp.matmul(a, w, preferred_element_type=out_dtype)


def fuse(w: HeadWeights, features, mm=_dense):
    """The hidden input from the target's features: [T, 3 x target d] -> [T, d]."""
    return mm(features, w.fc)


def qkv(w: HeadWeights, cfg: HeadConfig, embeds, hidden, positions, mm=_dense):
    """The layer's queries, keys and values [T, heads, head_dim] (RoPE applied) from the input
    tokens' embeddings and the hidden inputs, both [T, d]."""
    c = cfg.layer
    x = jnp.concatenate([rms_norm(embeds, w.input_norm, c.rms_norm_eps),
                         rms_norm(hidden, w.hidden_norm, c.rms_norm_eps)], axis=-1)
    t, angles = x.shape[0], model.rope_angles(positions, rope_frequencies(c))
    zero = rows.opaque_zero(positions)
    q, k, v = (a.reshape(t, -1, c.head_dim) for a in mm(x, (w.wq, w.wk, w.wv)))
    return model.rope(q, angles, zero), model.rope(k, angles, zero), v


def finish(w: HeadWeights, cfg: HeadConfig, hidden, attn, mm=_dense):
    """The layer after attention (``attn`` [T, heads * head_dim]): the output projection, the
    residual around it, the MLP; returns the pre-norm output [T, d] (the next position's hidden
    input)."""
    eps = cfg.layer.rms_norm_eps
    residual = rms_norm(hidden, w.hidden_norm, eps) if cfg.norm_before_residual else hidden
    x = mm(attn, w.wo) + residual
    h = rms_norm(x, w.mlp_norm, eps)
    return x + mm(jax.nn.silu(mm(h, w.w_gate)) * mm(h, w.w_up), w.w_down)


def logits(w: HeadWeights, cfg: HeadConfig, prenorm, mm=_dense):
    """Logits over the target's vocabulary [T, vocab]: the draft vocabulary's at their target
    ids, -inf at the rest."""
    lg = mm(rms_norm(prenorm, w.norm, cfg.layer.rms_norm_eps), w.lm_head, jnp.float32)
    full = jnp.full((lg.shape[0], cfg.layer.vocab_size), -jnp.inf, jnp.float32)
    return full.at[:, w.draft_to_target].set(lg.astype(jnp.float32))


def forward_dense(w: HeadWeights, cfg: HeadConfig, embeds, hidden, positions):
    """The head over one sequence's T rows with causal attention among them (training, and the
    reference for the paged path): (logits [T, vocab], pre-norm outputs [T, d])."""
    c = cfg.layer
    q, k, v = qkv(w, cfg, embeds, hidden, positions)
    rep = c.num_heads // c.num_kv_heads
    k, v = jnp.repeat(k, rep, axis=1), jnp.repeat(v, rep, axis=1)
    s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k.astype(jnp.float32)) * c.head_dim ** -0.5
    causal = positions[None, :, None] >= positions[None, None, :]
    p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
    attn = jnp.einsum("hqk,khd->qhd", p, v.astype(jnp.float32)).astype(hidden.dtype)
    out = finish(w, cfg, hidden, attn.reshape(attn.shape[0], -1))
    return logits(w, cfg, out), out


# -- the head in the round ----------------------------------------------------------------------

_MATRICES = ("fc", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head")


def place(w: HeadWeights, embed) -> HeadWeights:
    """The head as the round runs it: its matrices in ``rows.matmul``'s column blocks, and the
    target's embedding ``embed`` when the head has none of its own; placed weights are kept."""
    block = lambda x: jnp.asarray(rows.block(x) if x.ndim == 2 else x)
    return dataclasses.replace(w, embed=jnp.asarray(w.embed if w.embed is not None else embed),
                               **{f: block(getattr(w, f)) for f in _MATRICES})


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HeadState:
    """What the head keeps between rounds (the round's draft cache for ``eagle3``): its K/V pages
    on the target's block tables; per slot the target's features at the newest position whose
    successor token was not yet fed (the head's next row reads them), with that position (-1:
    none); and per slot the head's row at its newest position q, which the round computes once
    the token at q + 1 is drawn: its pre-norm output (the first draft's logits, and the hidden
    input of the second), q (-1: none) and that token. A round drafts for a slot only when that
    row is at its length - 2 with its last token."""
    cache: KVCache
    feature: jax.Array       # [max_seqs, 3 x target d]
    feature_pos: jax.Array   # int32 [max_seqs]
    out: jax.Array           # [max_seqs, d]
    out_pos: jax.Array       # int32 [max_seqs]
    out_token: jax.Array     # int32 [max_seqs]

    @classmethod
    def zeros(cls, cfg: HeadConfig, num_blocks: int, block_size: int, max_seqs: int) -> "HeadState":
        dtype = cfg.layer.jnp_dtype
        return cls(cache=KVCache.zeros(cfg.layer, num_blocks, block_size),
                   feature=jnp.zeros((max_seqs, 3 * cfg.target_hidden_size), dtype),
                   feature_pos=jnp.full((max_seqs,), -1, jnp.int32),
                   out=jnp.zeros((max_seqs, cfg.layer.hidden_size), dtype),
                   out_pos=jnp.full((max_seqs,), -1, jnp.int32),
                   out_token=jnp.zeros((max_seqs,), jnp.int32))


@functools.partial(jax.jit, donate_argnames=("state",))
def forget(state: HeadState, slot) -> HeadState:
    """Drops ``slot``'s kept features and row (a request admitted there after a prefix-cache
    hit: the head's K/V before its first computed position is the cached block's own).
    DONATES ``state``."""
    return dataclasses.replace(state, feature_pos=state.feature_pos.at[slot].set(-1),
                               out_pos=state.out_pos.at[slot].set(-1))


def paged(w: HeadWeights, cfg: HeadConfig, cache: KVCache, tokens, inputs, positions, slots,
          block_tables, *, fused: bool, with_logits: bool, tiling: rows.Tiling, attention: str):
    """The head over a ragged batch of rows on its paged cache: row i reads the embedding of
    ``tokens[i]`` and its hidden input at ``positions[i]`` of slot ``slots[i]`` (padding: -1),
    writes its K/V there and attends to the slot's earlier ones. ``inputs``: the hidden inputs
    [N, d], or with ``fused`` the target's features [N, 3 x target d] (``fuse`` in the same
    tile body). Every op runs in ``rows`` tiles (or kernels), two tile loops in all, so a row's
    bits never depend on the call. Returns (pre-norm outputs [N, d], with ``with_logits`` the
    draft logits float32 [N, vocab] else None, cache)."""
    c = cfg.layer
    r = tiling.rows(positions >= 0)
    page, offset = model.cache_slots(block_tables, slots, positions, cache.k.shape[2])

    def first(e, x, p):
        h = fuse(w, x, r.matmul) if fused else x
        return (*qkv(w, cfg, e, h, p, r.matmul), h)

    q, k, v, hidden = r.apply(first, w.embed[tokens], inputs, positions)
    kc = cache.k.at[0, page, offset].set(k.astype(cache.k.dtype))
    vc = cache.v.at[0, page, offset].set(v.astype(cache.v.dtype))
    attn = paged_attention(q, kc, vc, 0, block_tables, slots, positions,
                           sm_scale=float(c.head_dim) ** -0.5, row_tile=tiling.tile,
                           impl=attention).astype(hidden.dtype)

    def last(h, a):
        out = finish(w, cfg, h, a.reshape(a.shape[0], -1), r.matmul)
        return (out, logits(w, cfg, out, r.matmul)) if with_logits else (out, None)

    out, lg = r.apply(last, hidden, attn)
    return out, lg, KVCache(k=kc, v=vc)


def paged_logits(w: HeadWeights, cfg: HeadConfig, prenorm, valid, *, tiling: rows.Tiling):
    """``logits`` of the pre-norm outputs ``prenorm`` [N, d] (``paged``'s), in ``rows`` tiles (or
    kernels) over the ``valid`` rows [N], so a row's bits never depend on the call."""
    r = tiling.rows(valid)
    return r.apply(lambda o: logits(w, cfg, o, r.matmul), prenorm)
