"""An orbax checkpoint restores straight into the rules table's shardings, bit-equal to the HF
folder loaded and placed; a checkpoint of another config is refused naming the mismatch."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from sfjax import sharding, toy
from sfjax import weights as W
from sfjax.config import ModelConfig
from conftest import CFG


@pytest.fixture(scope="module")
def export(folder, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("export"))
    cfg = ModelConfig.from_folder(folder)
    W.save_orbax(path, cfg, W.load_hf(folder, cfg))
    return path


@pytest.mark.parametrize("tp, dp", [(4, 2), (8, 1)])        # tp 8: the KV heads replicated
def test_restore_is_sharded_by_the_rules_and_equals_hf(folder, export, tp, dp):
    cfg = ModelConfig.from_folder(folder)
    mesh = sharding.make_mesh(tp, dp)
    restored = W.load_orbax(export, cfg, mesh)
    hf = W.load_hf(folder, cfg)
    specs = sharding.weight_specs(hf, cfg, mesh)
    placed = sharding.put(hf, specs, mesh)
    leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    for got, want, spec in zip(jax.tree.leaves(restored), jax.tree.leaves(placed), leaves):
        assert got.sharding == NamedSharding(mesh, spec) == want.sharding
        assert got.dtype == want.dtype
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()          # bit-equal
    wq = restored.wq                                                 # [L, d, heads * head_dim]
    assert {s.data.shape for s in wq.addressable_shards} == {(*wq.shape[:2], wq.shape[2] // tp)}


def test_a_checkpoint_of_another_config_is_refused(export):
    other = toy.tiny_config(num_heads=8, num_kv_heads=4, head_dim=8, intermediate_size=256)
    with pytest.raises(ValueError, match=r"weights\.w_gate has shape \(2, 64, 128\), the config "
                                         r"needs \(2, 64, 256\)"):
        W.load_orbax(export, other, sharding.make_mesh(4, 2))
    tied = toy.tiny_config(num_heads=8, num_kv_heads=4, head_dim=8, tie_word_embeddings=True)
    assert CFG.tie_word_embeddings is False
    with pytest.raises(ValueError, match="holds weights.lm_head, but the config ties"):
        W.load_orbax(export, tied, sharding.make_mesh(4, 2))
