"""Shared models and engines for the speculative-decoding equality matrix.

Every engine here has the same geometry (max_num_seqs, max_model_len, row_tile), so engines with
the same model shapes and the same speculation settings reuse one another's compiled steps: the
draft folders "same", "near" and "other" share the tiny config, and differ only in weights.
"""

import dataclasses

import numpy as np
import pytest

from sfjax import LLM, toy
from sfjax import weights as W
from spec_util import GEOMETRY

# A draft larger than the target: deeper and wider, other head geometry, same vocabulary.
LARGER = toy.tiny_config(num_layers=3, hidden_size=96, num_heads=6, num_kv_heads=3,
                         intermediate_size=192)


@pytest.fixture(scope="session")
def drafts(tiny_folder, model_folder, tmp_path_factory):
    """Draft folders by name: "same" (the target itself), "near" (the target's weights plus 5%
    noise: partial acceptance), "other" (another seed: almost nothing accepted), "larger"."""
    cfg = toy.tiny_config()
    target = W.load_hf(tiny_folder, cfg)
    rng = np.random.default_rng(1234)

    def jitter(x):
        x = np.asarray(x)
        if x.ndim < 2:
            return x
        return (x + 0.05 * x.std() * rng.standard_normal(x.shape)).astype(x.dtype)

    near = dataclasses.replace(target, **{f.name: jitter(getattr(target, f.name))
                                          for f in dataclasses.fields(target)
                                          if getattr(target, f.name) is not None})
    near_path = toy.build_model_folder(str(tmp_path_factory.mktemp("near-draft")), cfg, weights=near)
    return {"same": tiny_folder, "near": near_path,
            "other": model_folder(toy.tiny_config(), seed=1, std=0.1),
            "larger": model_folder(LARGER, seed=2, std=0.1)}


@pytest.fixture(scope="session")
def eagle_head(tmp_path_factory):
    """An EAGLE-3 head folder for the tiny target, from a seed: random weights over a draft
    vocabulary of 256 of the 512 ids (mapped by d2t), fusing the input of layers 0, 1, 1. It
    accepts a few drafts, so rounds are ragged; exactness never depends on how many."""
    from sfjax.config import ModelConfig
    from sfjax.spec import eagle
    target = toy.tiny_config()
    layer = ModelConfig(vocab_size=target.vocab_size, hidden_size=target.hidden_size,
                        intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2,
                        head_dim=16, rope_theta=target.rope_theta, rms_norm_eps=1e-5,
                        max_position_embeddings=target.max_position_embeddings)
    cfg = eagle.HeadConfig(layer=layer, draft_vocab_size=256,
                           target_hidden_size=target.hidden_size, aux_layers=(0, 1, 1))
    path = str(tmp_path_factory.mktemp("eagle3-head"))
    eagle.save(path, cfg, eagle.init_random(cfg, seed=7, std=0.2))
    return path


@pytest.fixture(scope="session")
def plain_llm(tiny_folder):
    """The reference: plain decoding, no speculative_config."""
    return LLM(tiny_folder, **GEOMETRY)


@pytest.fixture(scope="session")
def spec_llm(tiny_folder, drafts):
    """``spec_llm(draft="near", k=3, method="draft_model", block_size=16, folder=None,
    compiler_options=None, **spec)``: one engine per distinct argument set for the whole
    session."""
    built = {}

    def make(draft="near", k=3, method="draft_model", block_size=16, folder=None,
             compiler_options=None, **spec):
        options = tuple(sorted((compiler_options or {}).items()))
        key = (draft, k, method, block_size, folder, options, tuple(sorted(spec.items())))
        if key not in built:
            config = {"method": method, "num_speculative_tokens": k, **spec}
            if method == "draft_model":
                config["model"] = drafts[draft]
            built[key] = LLM(folder or tiny_folder, block_size=block_size, speculative_config=config,
                             compiler_options=compiler_options, **GEOMETRY)
        return built[key]

    return make
