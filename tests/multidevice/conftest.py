import jax
import pytest

from sfjax import LLM, toy

# 8 query heads over 4 KV heads: tp 2 and 4 shard the KV cache, tp 8 replicates it
CFG = toy.tiny_config(num_heads=8, num_kv_heads=4, head_dim=8)
# prompts prefill in chunks of 8 tokens, so each engine runs (and compiles) one step shape
GEOMETRY = dict(max_num_seqs=4, max_model_len=64, block_size=8, max_num_batched_tokens=8)


def pytest_configure(config):
    assert jax.device_count() == 8, "run through tests/test_sharding.py (XLA_FLAGS: 8 devices)"


@pytest.fixture(scope="session")
def folder(model_folder):
    return model_folder(CFG, seed=0, std=0.1)


@pytest.fixture(scope="session")
def draft_folder(model_folder):
    return model_folder(CFG, seed=3, std=0.1)


@pytest.fixture(scope="session")
def engines(folder, draft_folder):
    """``engines(tp, dp, spec=False, draft_tp=None)``: one LLM per argument set."""
    built = {}

    def make(tp=1, dp=1, spec=False, draft_tp=None):
        key = (tp, dp, spec, draft_tp)
        if key not in built:
            config = None
            if spec:
                config = {"method": "draft_model", "model": draft_folder, "num_speculative_tokens": 2,
                          "draft_tensor_parallel_size": draft_tp}
            built[key] = LLM(folder, tensor_parallel_size=tp, data_parallel_size=dp,
                             speculative_config=config, **GEOMETRY)
        return built[key]

    return make
