"""Sharded engines give the single-device tokens, token for token (greedy and seeded sampling,
with and without speculation); the sharded forward gives the single-device bits (the reference
attention and the Pallas kernel, interpreted, inside shard_map); the weights and KV cache really
are sharded (the cache's pages over data); bad meshes and checkpoints are refused naming the
mismatch."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from sfjax import LLM, SamplingParams, model, sharding, toy
from sfjax import functional as F
from sfjax.cache import KVCache
from sfjax.config import ModelConfig
from sfjax.weights import load_hf
from conftest import CFG, GEOMETRY

MESHES = [(2, 1), (4, 1), (8, 1), (2, 2), (4, 2)]       # (tp, dp)


def _requests():
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(2, 512, rng.integers(4, 8)).tolist()} for _ in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=8, ignore_eos=True)
              for i in range(4)]
    return prompts, params


def _ids(llm):
    return [o.outputs[0].token_ids for o in llm.generate(*_requests(), use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(engines):
    return _ids(engines())


@pytest.mark.parametrize("tp, dp", MESHES)
def test_sharded_equals_one_device(engines, reference, tp, dp):
    assert _ids(engines(tp, dp)) == reference


# KV heads sharded (tp 4) and replicated (tp 8), over one and two data shards, the draft sharded
# like the target or whole (draft tp 1); the tp 4 engines are built for other tests anyway.
# tp 4 over one shard with the draft sharded like the target is left out (12 s of the suite):
# each of its three properties is in at least two of these cases
@pytest.mark.parametrize("tp, dp, draft_tp", [(8, 1, None), (4, 2, None), (4, 1, 1), (4, 2, 1)])
def test_speculation_sharded_equals_one_device(engines, reference, tp, dp, draft_tp):
    llm = engines(tp, dp, spec=True, draft_tp=draft_tp)       # path-exact: plain decoding's tokens
    assert _ids(llm) == reference
    assert llm.get_metrics()["spec_decode"]["num_draft_tokens"] > 0


@pytest.fixture(scope="module")
def forward(folder):
    return _forwards(folder)


@pytest.fixture(scope="module")
def family_forward(model_folder):
    """``family_forward(model_type)``: ``_forwards`` of a folder of that family (Qwen3's with
    head_dim 24, not hidden / heads, and norms that are not ones)."""
    made = {}

    def get(model_type):
        if model_type not in made:
            cfg = dataclasses.replace(CFG, model_type=model_type,
                                      head_dim=24 if model_type == "qwen3" else CFG.head_dim)
            made[model_type] = _forwards(model_folder(cfg, seed=0, std=0.1, norm_jitter=0.3))
        return made[model_type]
    return get


def _forwards(folder):
    """``forward(mesh, attention)``: (hidden, K pages, V pages, logits) of one ragged prefill of two
    sequences (9 and 5 tokens), as host arrays. The rows are laid out by data shard for dp 2
    (slot 0's in rows 0-15, slot 1's in 16-31, the rest padding), and the pages are blocks 1, 2
    and 4, 5 of 6: over two data shards, local pages 1, 2 of each (the null blocks, which padding
    rows write, are left out: shard 1 has its own)."""
    cfg = ModelConfig.from_folder(folder)
    weights = load_hf(folder, cfg)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(2, 512, 32), jnp.int32)
    pad = lambda n: np.full(n, -1)
    positions = jnp.asarray(np.r_[np.arange(9), pad(7), np.arange(5), pad(11)], jnp.int32)
    slots = jnp.asarray(np.r_[np.zeros(9), pad(7), np.ones(5), pad(11)], jnp.int32)
    tables = {1: jnp.asarray([[1, 2], [4, 5]], jnp.int32),           # by dp: global, local ids
              2: jnp.asarray([[1, 2], [1, 2]], jnp.int32)}

    def run(w, cache, tables, *, mesh, attention):
        h, cache = model.forward(w, cache, tokens, positions, slots, tables, cfg, attention=attention,
                                 mesh=mesh)
        return h, cache.k, cache.v, model.logits(w, h, cfg, mesh=mesh)

    run = jax.jit(run, static_argnames=("mesh", "attention"))

    def one(mesh=None, attention="reference"):
        h, k, v, lg = run(sharding.place_weights(weights, cfg, mesh, split=True),
                          KVCache.zeros(cfg, 6, 8, mesh=mesh), tables[sharding.dp_of(mesh)],
                          mesh=mesh, attention=attention)
        pages = [1, 2, 4, 5]
        return [np.asarray(h), np.asarray(k)[:, pages], np.asarray(v)[:, pages], np.asarray(lg)]

    return one


@pytest.mark.parametrize("tp, dp", MESHES)
def test_sharded_forward_is_bit_equal(forward, tp, dp):
    for a, b in zip(forward(), forward(sharding.make_mesh(tp, dp))):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
@pytest.mark.parametrize("tp, dp", [(4, 2), (8, 1)])         # KV heads sharded / replicated
def test_qwen_biases_and_head_norms_keep_the_single_device_bits(family_forward, model_type,
                                                                tp, dp):
    """Qwen2's biases are sharded with their heads' columns; Qwen3's head norms replicated."""
    forward = family_forward(model_type)
    for a, b in zip(forward(), forward(sharding.make_mesh(tp, dp))):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("tp, dp", [(4, 2), (8, 1)])         # KV heads sharded / replicated
def test_the_pallas_kernel_inside_shard_map_is_bit_equal(forward, tp, dp):
    for a, b in zip(forward(attention="interpret"),
                    forward(sharding.make_mesh(tp, dp), attention="interpret")):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("tp, dp", MESHES)
def test_weights_and_cache_are_sharded(engines, tp, dp):
    llm = engines(tp, dp)
    _ids(llm)                                                      # after steps too
    eng = llm.engine
    assert dict(eng.mesh.shape) == {"data": dp, "model": tp}
    w = eng.weights
    kv_split = tp < 8                                              # 4 KV heads: replicated at tp 8
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):  # blocked [U, K, W] per layer
        x, split = getattr(w, name)[0], kv_split or name not in ("wk", "wv")
        assert x.sharding.spec == P("model" if split else None, None, None), name
        assert x.addressable_shards[0].data.shape == (x.shape[0] // (tp if split else 1), *x.shape[1:])
        assert len(x.sharding.device_set) == tp * dp
    assert w.embed.sharding.spec == P("model", None)
    assert w.embed.addressable_shards[0].data.shape == (w.embed.shape[0] // tp, w.embed.shape[1])
    k = eng.state.cache.k
    heads = {s.data.shape[3] for s in k.addressable_shards}
    assert heads == ({4 // tp} if kv_split else {4}) and len(k.sharding.device_set) == tp * dp
    _assert_pages_over_data(k, eng.mesh)


def _assert_pages_over_data(cache, mesh):
    """Each device holds num_blocks / dp pages: those of its own data shard."""
    dp = mesh.shape["data"]
    per = cache.shape[1] // dp
    assert cache.shape[1] % dp == 0
    shard_of = {dev: d for d in range(dp) for dev in mesh.devices[d].reshape(-1)}
    for s in cache.addressable_shards:
        d = shard_of[s.device]
        assert s.data.shape[1] == per
        assert s.index[1] == (slice(d * per, (d + 1) * per) if dp > 1 else slice(None))


@pytest.mark.parametrize("draft_tp", [None, 1])
def test_the_draft_cache_is_sharded_over_data_too(engines, draft_tp):
    eng = engines(4, 2, spec=True, draft_tp=draft_tp).engine
    dk = eng.state.draft_cache.k
    assert dk.shape[1] == eng.state.cache.k.shape[1] == eng.config.num_kv_blocks
    _assert_pages_over_data(dk, eng.spec.mesh)
    heads = {s.data.shape[3] for s in dk.addressable_shards}
    assert heads == ({1} if draft_tp is None else {4})            # 4 KV heads over model 4 or 1


def test_functional_generate_over_data_shards(folder, reference):
    """``sfjax.functional`` on a (2, 2) mesh: its own cache, pages over data, rows by shard."""
    cfg = F.Config(ModelConfig.from_folder(folder), GEOMETRY["max_model_len"],
                   block_size=GEOMETRY["block_size"], mesh=sharding.make_mesh(2, 2))
    prompts, params = _requests()
    ids, lens = F.pad_prompts([p["prompt_token_ids"] for p in prompts])
    sp = F.Sampling.from_params(params, eos_token_ids=cfg.model.eos_token_ids)
    run = jax.jit(lambda w, i, n, s: F.generate(w, i, n, s, cfg, width=8).token_ids)
    tokens = jax.device_get(run(load_hf(folder, cfg.model), ids, lens, sp))
    assert [t[t >= 0].tolist() for t in tokens] == reference


def test_a_draft_with_a_smaller_tensor_parallel_size(engines):
    spec = engines(4, 1, spec=True, draft_tp=1).engine.spec
    assert dict(spec.mesh.shape) == {"data": 1, "replica": 4, "model": 1}
    wq = spec.draft_weights.wq[0]                                  # whole on every device
    assert len(wq.sharding.device_set) == 4
    assert all(s.data.shape == wq.shape for s in wq.addressable_shards)
    sharded = engines(4, 1, spec=True).engine.spec.draft_weights.wq[0]
    assert sharded.addressable_shards[0].data.shape == (sharded.shape[0] // 4, *sharded.shape[1:])


def test_a_mesh_from_the_jax_program(folder, reference):
    mesh = jax.make_mesh((2, 2), ("data", "model"))                # Explicit axes since jax 0.9
    assert _ids(LLM(folder, mesh=mesh, **GEOMETRY)) == reference
    with pytest.raises(ValueError, match=r"tensor_parallel_size 4 and data_parallel_size 1 differ "
                                         r"from the mesh's model and data axes \(2, 2\)"):
        LLM(folder, mesh=mesh, tensor_parallel_size=4, **GEOMETRY)
    with pytest.raises(ValueError, match="mesh axes must include 'data' and 'model'"):
        LLM(folder, mesh=jax.make_mesh((2,), ("model",)), **GEOMETRY)


@pytest.mark.parametrize("kw, match", [
    (dict(tensor_parallel_size=3), "tensor_parallel_size 3 must divide 8"),
    (dict(tensor_parallel_size=4, data_parallel_size=4), "16 devices, but only 8"),
])
def test_bad_meshes(folder, kw, match):
    with pytest.raises(ValueError, match=match):
        LLM(folder, **kw, **GEOMETRY)


def test_a_draft_tensor_parallel_size_that_does_not_divide_the_targets(folder, draft_folder):
    spec = {"method": "draft_model", "model": draft_folder, "num_speculative_tokens": 2,
            "draft_tensor_parallel_size": 3}
    with pytest.raises(ValueError, match=r"draft_tensor_parallel_size \(3\) must divide the "
                                         r"target's tensor_parallel_size \(4\)"):
        LLM(folder, tensor_parallel_size=4, speculative_config=spec, **GEOMETRY)


def test_a_tp_that_does_not_divide_the_heads(model_folder, monkeypatch):
    import sfjax.llm                                    # refused before the weights load
    monkeypatch.setattr(sfjax.llm, "load", lambda *a, **k: pytest.fail("the weights loaded"))
    six = model_folder(toy.tiny_config(num_heads=6, num_kv_heads=2, head_dim=16), seed=0)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 4 does not divide the model's "
                                         r"num_attention_heads \(6\)"):
        LLM(six, tensor_parallel_size=4, **GEOMETRY)
    three = model_folder(toy.tiny_config(num_heads=6, num_kv_heads=3, head_dim=16), seed=0)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 and the model's "
                                         r"num_key_value_heads \(3\): one must divide the other"):
        LLM(three, tensor_parallel_size=2, **GEOMETRY)


def test_a_checkpoint_of_another_config(folder, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(config, intermediate_size=96)))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight has shape "
                                         r"\(128, 64\), config\.json implies \(96, 64\)"):
        LLM(str(other), tensor_parallel_size=2, **GEOMETRY)
