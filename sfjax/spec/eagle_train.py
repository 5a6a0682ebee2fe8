"""Training an EAGLE-3 head for a target from the target's own features and distributions
(optax, a flax ``TrainState``), with EAGLE-3's training-time test: the head is also trained on
its own outputs, as it drafts.

A training row i of a sequence reads the target's features at position i (from the dense
forward of ``sfjax.training``, the layers' inputs ``model.forward(features=...)`` serves) and
the token at i + 1, and learns the target's
distribution over the token at i + 2 (soft labels: the target's log-probabilities there,
renormalised over the draft vocabulary). At depth s of the training-time test, row i's hidden
input is the head's own depth s - 1 output at row i - 1, and its attention sees what the round's
s-th draft step sees (``proposers.Eagle``): the depth-0 keys up to i - s and, for each depth
j in 1..s, the depth-j key at i - s + j. Depth 0 is plain teacher forcing.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState

from sfjax import training
from sfjax.config import ModelConfig
from sfjax.spec import eagle

# the head's fields that are not trained: the shared embedding and the vocabulary map
FROZEN = ("embed", "draft_to_target")


def target_features(target, cfg: ModelConfig, tokens, aux_layers):
    """The target's features at every position and its log-probabilities for the next token,
    held fixed: (features [B, T, 3 x d], log-probs float32 [B, T, vocab]). ``target``: its
    plain weights (``weights.load_hf``); the dense forward (``sfjax.training``)."""
    logits, feats = training.forward(target, tokens, cfg, tuple(aux_layers))
    return jax.lax.stop_gradient((feats, jax.nn.log_softmax(logits.astype(jnp.float32), -1)))


def _ttt(hw: eagle.HeadWeights, hc: eagle.HeadConfig, features, tokens, depth: int):
    """One sequence's head logits at each depth: float32 [depth, T, vocab] (row i predicts the
    token at i + 2; rows past T - 2, or below the depth, are not trained)."""
    c = hc.layer
    t = tokens.shape[0]
    positions = jnp.arange(t, dtype=jnp.int32)
    embeds = hw.embed[jnp.concatenate([tokens[1:], tokens[-1:]])]          # the token at i + 1
    hidden = eagle.fuse(hw, features)
    rep, scale = c.num_heads // c.num_kv_heads, c.head_dim ** -0.5
    i, j = positions[:, None], positions[None, :]
    down = lambda x, n: jnp.concatenate([jnp.zeros_like(x[:n]), x[:t - n]]) if n else x
    keys, values, out = [], [], []
    for s in range(depth):
        q, k, v = eagle.qkv(hw, hc, embeds, hidden, positions)
        k, v = jnp.repeat(k, rep, axis=1), jnp.repeat(v, rep, axis=1)
        keys.append(k)
        values.append(v)
        qf = q.astype(jnp.float32)
        base = jnp.einsum("qhd,khd->hqk", qf, keys[0].astype(jnp.float32)) * scale
        base = jnp.where(j <= i - s, base, -jnp.inf)                          # [H, T, T]
        # depth d's key at row i - s + d, for d in 1..s: the round's own drafts
        own_k = [down(keys[d], s - d).astype(jnp.float32) for d in range(1, s + 1)]
        own_v = [down(values[d], s - d).astype(jnp.float32) for d in range(1, s + 1)]
        diag = [jnp.einsum("qhd,qhd->hq", qf, kd)[..., None] * scale for kd in own_k]
        scores = jnp.concatenate([base, *diag], axis=-1)
        p = jax.nn.softmax(scores, axis=-1)
        attn = jnp.einsum("hqk,khd->qhd", p[..., :t], values[0].astype(jnp.float32))
        for d, vd in enumerate(own_v):
            attn = attn + p[..., t + d].T[..., None] * vd
        o = eagle.finish(hw, hc, hidden, attn.astype(hidden.dtype).reshape(t, -1))
        out.append(eagle.logits(hw, hc, o))
        hidden = down(o, 1)                       # row i's next hidden: row i - 1's output
    return jnp.stack(out)


def loss_fn(params, frozen, hc: eagle.HeadConfig, features, tokens, target_logp, depth: int,
            weights=None):
    """Mean over depths and trained rows of the cross-entropy of the head's draft distribution
    against the target's (renormalised over the draft vocabulary); also the head's greedy
    agreement with the target's argmax per depth. ``weights``: per-depth weights (default 1)."""
    hw = eagle.HeadWeights(**params, **frozen)
    lg = jax.vmap(lambda f, t: _ttt(hw, hc, f, t, depth))(features, tokens)   # [B, D, T, V]
    b, _, t, v = lg.shape
    ids = hw.draft_to_target
    label = target_logp[:, 1:][:, None]                                         # row i: t + 2
    label = jnp.concatenate([label, jnp.zeros_like(label[:, :, :1])], axis=2)   # [B, 1, T, V]
    lab = jax.nn.softmax(label[..., ids], axis=-1)
    logq = jax.nn.log_softmax(lg[..., ids], axis=-1)
    ce = -jnp.sum(lab * logq, axis=-1)                                          # [B, D, T]
    rows = jnp.arange(t)[None, :]
    mask = (rows >= jnp.arange(depth)[:, None]) & (rows <= t - 2)               # [D, T]
    per_depth = jnp.sum(ce * mask, axis=(0, 2)) / (b * jnp.sum(mask, axis=1))
    agree = jnp.argmax(lg[..., ids], -1) == jnp.argmax(label[..., ids], -1)
    acc = jnp.sum(agree * mask, axis=(0, 2)) / (b * jnp.sum(mask, axis=1))
    w = jnp.ones(depth) if weights is None else jnp.asarray(weights)
    return jnp.sum(w * per_depth) / jnp.sum(w), (per_depth, acc)


def split(hw: eagle.HeadWeights) -> tuple[dict, dict]:
    """(trained fields, frozen fields) of a head."""
    fields = {f.name: getattr(hw, f.name) for f in dataclasses.fields(hw)}
    return ({k: v for k, v in fields.items() if k not in FROZEN},
            {k: v for k, v in fields.items() if k in FROZEN})


def init_state(hw: eagle.HeadWeights, embed, learning_rate: float, steps: int,
               weight_decay: float = 0.0) -> tuple[TrainState, dict]:
    """(the training state of head ``hw``: AdamW with warmup and cosine decay over ``steps``,
    gradients clipped to norm 1; the frozen fields, the target's embedding among them)."""
    params, frozen = split(dataclasses.replace(hw, embed=jnp.asarray(embed)))
    warmup = min(max(steps // 20, 1), steps - 1)      # a 1-step run: none
    schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup, steps)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=weight_decay))
    return TrainState.create(apply_fn=None, params=params, tx=tx), frozen


@functools.partial(jax.jit, static_argnames=("hc", "cfg", "depth"), donate_argnames=("state",))
def train_step(state: TrainState, frozen, target, tokens, hc, cfg, depth: int):
    """One AdamW step on ``loss_fn`` over sequences ``tokens`` [B, T] of the target ``target``
    (plain weights, config ``cfg``); donates ``state``. Returns (state, metrics)."""
    features, logp = target_features(target, cfg, tokens, hc.aux_layers)
    grad = jax.grad(loss_fn, has_aux=True)
    g, metrics = grad(state.params, frozen, hc, features, tokens, logp, depth)
    return state.apply_gradients(grads=g), metrics


@functools.partial(jax.jit, static_argnames=("hc", "cfg", "depth"))
def evaluate(params, frozen, target, tokens, hc, cfg, depth: int):
    """(loss, (per-depth cross-entropy, per-depth greedy agreement)) without gradients."""
    features, logp = target_features(target, cfg, tokens, hc.aux_layers)
    return loss_fn(params, frozen, hc, features, tokens, logp, depth)


def head_of(state: TrainState, frozen) -> eagle.HeadWeights:
    """The head a training state holds, sharing the target's embedding (saved without it)."""
    return dataclasses.replace(eagle.HeadWeights(**state.params, **frozen), embed=None)


def train(target, cfg: ModelConfig, hc: eagle.HeadConfig, sequences, *, steps: int,
          batch: int = 8, depth: int = 3, learning_rate: float = 3e-3, seed: int = 0,
          log=None) -> eagle.HeadWeights:
    """A head for the target ``target`` (plain weights) trained ``steps`` AdamW steps on
    ``sequences`` (int32 [n, T]), batches drawn in a seeded order: deterministic in ``seed``.
    ``log(step, metrics)`` if given. (scripts/train_eagle.py adds checkpoints and the corpus.)"""
    seqs = np.asarray(sequences, np.int32)
    target = jax.tree.map(jnp.asarray, target)
    state, frozen = init_state(eagle.init_random(hc, seed=seed), target.embed, learning_rate, steps)
    rng = np.random.default_rng(seed)
    for step in range(steps):
        idx = rng.choice(len(seqs), batch, replace=len(seqs) < batch)
        state, metrics = train_step(state, frozen, target, jnp.asarray(seqs[idx]), hc, cfg, depth)
        if log is not None:
            log(step, metrics)
    return head_of(state, frozen)
