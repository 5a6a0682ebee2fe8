"""Sharded engines give the single-device tokens, token for token (greedy and seeded sampling,
with and without speculation), and really shard their weights and KV cache."""

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from sfjax import LLM, SamplingParams, sharding, toy
from conftest import GEOMETRY

MESHES = [(2, 1), (4, 1), (8, 1), (2, 2), (4, 2)]


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


@pytest.mark.parametrize("tp, dp, draft_tp", [(2, 2, None), (4, 1, 1)])
def test_speculation_sharded_equals_one_device(engines, reference, tp, dp, draft_tp):
    llm = engines(tp, dp, spec=True, draft_tp=draft_tp)
    assert _ids(llm) == reference
    assert llm.get_metrics()["spec_decode"]["num_draft_tokens"] > 0


@pytest.mark.parametrize("tp, dp", [(4, 2), (8, 1)])
def test_weights_and_cache_are_sharded(engines, tp, dp):
    llm = engines(tp, dp)
    _ids(llm)                                                      # after steps too
    eng = llm.engine
    assert dict(eng.mesh.shape) == {"data": dp, "model": tp}
    wq, wo = eng.weights.wq[0], eng.weights.wo[0]                  # blocked [U, K, W] per layer
    assert wq.sharding.spec == P("model", None, None) and wo.sharding.spec == P("model", None, None)
    assert wq.addressable_shards[0].data.shape == (wq.shape[0] // tp, *wq.shape[1:])
    assert eng.weights.embed.sharding.spec == P("model", None)
    assert len(wq.sharding.device_set) == tp * dp
    k = eng.state.cache.k                                          # 4 KV heads: replicated at tp 8
    heads = {s.data.shape[3] for s in k.addressable_shards}
    assert heads == ({4} if tp == 8 else {4 // tp}) and len(k.sharding.device_set) == tp * dp


def test_a_draft_with_a_smaller_tensor_parallel_size(engines):
    spec = engines(4, 1, spec=True, draft_tp=1).engine.spec
    assert dict(spec.mesh.shape) == {"data": 1, "replica": 4, "model": 1}
    wq = spec.draft_weights.wq[0]                                  # whole on every device
    assert all(s.data.shape == wq.shape for s in wq.addressable_shards)


@pytest.mark.parametrize("kw, match", [
    (dict(tensor_parallel_size=3), "tensor_parallel_size 3 must divide 8"),
    (dict(tensor_parallel_size=4, data_parallel_size=4), "16 devices, but only 8"),
])
def test_bad_meshes(folder, kw, match):
    with pytest.raises(ValueError, match=match):
        LLM(folder, **kw, **GEOMETRY)


def test_a_tp_that_does_not_divide_the_heads(model_folder):
    six = model_folder(toy.tiny_config(num_heads=6, num_kv_heads=2, head_dim=16), seed=0)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 4 does not divide the model's "
                                         r"num_attention_heads \(6\)"):
        LLM(six, tensor_parallel_size=4, **GEOMETRY)
    with pytest.raises(ValueError, match="draft_tensor_parallel_size"):
        sharding.draft_mesh(sharding.make_mesh(4), 3)
