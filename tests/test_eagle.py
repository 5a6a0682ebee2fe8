"""EAGLE-3 heads (sfjax.spec.eagle): the published folder format, read without torch, gives the
draft logits of a torch implementation built from HF Llama's own pieces (RMSNorm, rotary
embedding) and the published tensor names, to 1e-5 at float32; heads that cannot draft for the
target are refused naming the field."""

import json
import os

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (LlamaRMSNorm, LlamaRotaryEmbedding,
                                                      apply_rotary_pos_emb)

import jax.numpy as jnp

from sfjax import toy
from sfjax.config import ModelConfig
from sfjax.spec import eagle

TARGET = toy.tiny_config()                   # vocab 512, d 64, 2 layers, GQA 4 / 2
DRAFT_VOCAB = 96


def _head_cfg(**kw) -> eagle.HeadConfig:
    layer = ModelConfig(vocab_size=TARGET.vocab_size, hidden_size=TARGET.hidden_size,
                        intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2,
                        head_dim=16, rope_theta=5000.0, rms_norm_eps=1e-5,
                        max_position_embeddings=TARGET.max_position_embeddings)
    return eagle.HeadConfig(layer=layer, draft_vocab_size=DRAFT_VOCAB,
                            target_hidden_size=TARGET.hidden_size, aux_layers=(0, 1, 1), **kw)


@pytest.fixture(scope="module")
def head_folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("eagle3"))
    cfg = _head_cfg()
    eagle.save(path, cfg, eagle.init_random(cfg, seed=5, std=0.15))
    return path


def _torch_head(path, embed, tokens, features, positions):
    """The head as the published format describes it, in torch, from the folder's tensors by
    their published names: (logits over the target vocabulary, pre-norm output)."""
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    t = {k: torch.from_numpy(np.array(v)) for k, v in load_file(os.path.join(path, "model.safetensors")).items()}
    cfg = LlamaConfig(**{k: v for k, v in hf.items() if k not in ("architectures", "eagle_config")})
    eps, heads, kv, hd = hf["rms_norm_eps"], hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]

    def norm(name, x):
        n = LlamaRMSNorm(x.shape[-1], eps=eps)
        n.weight.data = t[name].float()
        return n(x)

    lin = lambda name, x: x @ t[name].float().T
    n = tokens.shape[0]
    hidden = lin("fc.weight", torch.from_numpy(features))                       # [T, d]
    e = torch.from_numpy(embed)[torch.from_numpy(tokens).long()]
    x = torch.cat([norm("midlayer.input_layernorm.weight", e),
                   norm("midlayer.hidden_norm.weight", hidden)], dim=-1)
    q = lin("midlayer.self_attn.q_proj.weight", x).view(1, n, heads, hd).transpose(1, 2)
    k = lin("midlayer.self_attn.k_proj.weight", x).view(1, n, kv, hd).transpose(1, 2)
    v = lin("midlayer.self_attn.v_proj.weight", x).view(1, n, kv, hd).transpose(1, 2)
    cos, sin = LlamaRotaryEmbedding(cfg)(v, torch.from_numpy(positions).long()[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = k.repeat_interleave(heads // kv, dim=1), v.repeat_interleave(heads // kv, dim=1)
    s = q @ k.transpose(-1, -2) * hd ** -0.5
    s = s.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
    attn = (s.softmax(-1) @ v).transpose(1, 2).reshape(n, heads * hd)
    r = lin("midlayer.self_attn.o_proj.weight", attn) + hidden
    h = norm("midlayer.post_attention_layernorm.weight", r)
    prenorm = r + lin("midlayer.mlp.down_proj.weight", torch.nn.functional.silu(
        lin("midlayer.mlp.gate_proj.weight", h)) * lin("midlayer.mlp.up_proj.weight", h))
    draft = lin("lm_head.weight", norm("norm.weight", prenorm))
    full = torch.full((n, hf["vocab_size"]), float("-inf"))
    full[:, torch.arange(hf["draft_vocab_size"]) + t["d2t"]] = draft
    return full.numpy(), prenorm.numpy()


def test_the_heads_logits_equal_a_torch_head_from_the_published_names(head_folder):
    cfg, w = eagle.load(head_folder, TARGET)
    assert cfg == _head_cfg() and w.embed is None
    rng = np.random.default_rng(0)
    n = 11
    embed = rng.standard_normal((TARGET.vocab_size, TARGET.hidden_size)).astype(np.float32)
    tokens = rng.integers(0, TARGET.vocab_size, n).astype(np.int32)
    features = rng.standard_normal((n, 3 * TARGET.hidden_size)).astype(np.float32)
    positions = np.arange(5, 5 + n, dtype=np.int32)
    lg, out = eagle.forward_dense(w, cfg, jnp.asarray(embed)[tokens], eagle.fuse(w, features), positions)
    with torch.no_grad():
        want_lg, want_out = _torch_head(head_folder, embed, tokens, features, positions)
    lg, out = np.asarray(lg), np.asarray(out)
    draft = np.isfinite(want_lg)
    assert (np.isfinite(lg) == draft).all() and draft.sum(1).tolist() == [DRAFT_VOCAB] * n
    assert np.abs(want_lg[draft]).max() > 1.0                    # logits that mean something
    np.testing.assert_allclose(lg[draft], want_lg[draft], rtol=0, atol=1e-5)
    np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-5)


def test_layers_0_names_and_an_own_embedding_load_alike(head_folder, tmp_path):
    cfg, w = eagle.load(head_folder, TARGET)
    tensors = load_file(os.path.join(head_folder, "model.safetensors"))
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
    renamed["embed_tokens.weight"] = np.ones((TARGET.vocab_size, TARGET.hidden_size), np.float32)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    with open(os.path.join(head_folder, "config.json")) as f, open(tmp_path / "config.json", "w") as g:
        g.write(f.read())
    cfg2, w2 = eagle.load(str(tmp_path), TARGET)
    assert cfg2 == cfg and float(w2.embed.sum()) == TARGET.vocab_size * TARGET.hidden_size
    assert all((np.asarray(getattr(w, f)) == np.asarray(getattr(w2, f))).all()
               for f in ("fc", "wq", "w_down", "lm_head", "draft_to_target"))


def _edit(src, dst, config=None, drop=(), tensors=None):
    with open(os.path.join(src, "config.json")) as f:
        hf = json.load(f)
    hf.update(config or {})
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(hf, f)
    t = {k: v for k, v in load_file(os.path.join(src, "model.safetensors")).items() if k not in drop}
    t.update(tensors or {})
    save_file(t, os.path.join(dst, "model.safetensors"))
    return dst


@pytest.mark.parametrize("config, drop, tensors, match", [
    ({"architectures": ["LlamaForCausalLM"]}, (), None, "architectures"),
    ({"num_hidden_layers": 2}, (), None, "num_hidden_layers"),
    ({"vocab_size": 1000}, (), None, r"vocab_size = 1000 must be the target's \(512\)"),
    ({"draft_vocab_size": 600}, (), None, r"draft_vocab_size = 600 is out of range"),
    ({"target_hidden_size": 32}, (), None, r"target_hidden_size = 32 .* hidden_size \(64\)"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 5]}}, (), None,
     r"eagle_aux_hidden_state_layer_ids = \[0, 1, 5\] is out of range: must be 3 target layers in \[0, 2\)"),
    ({"eagle_config": {}}, (), None, r"eagle_aux_hidden_state_layer_ids = \(2, 1, -1\)"),
    ({}, ("d2t",), None, "the tensor 'd2t' is missing"),
    ({}, (), {"d2t": -np.arange(DRAFT_VOCAB)}, "two draft ids to one target id"),
    ({}, (), {"d2t": np.full(DRAFT_VOCAB, 500, np.int64)}, r"outside \[0, 512\)"),
    ({}, (), {"t2d": np.zeros(TARGET.vocab_size, bool)}, "t2d does not mark"),
    ({}, (), {"fc.weight": np.zeros((64, 64), np.float32)}, r"fc.weight has shape \(64, 64\)"),
    ({}, ("lm_head.weight",), None, "tensor 'lm_head.weight' is missing"),
    ({"hidden_size": 32, "head_dim": 8}, (), None, r"fc.weight has shape \(192, 64\); config.json implies \(192, 32\)"),
])
def test_heads_that_cannot_draft_for_the_target_are_refused(head_folder, tmp_path, config, drop,
                                                            tensors, match):
    bad = _edit(head_folder, str(tmp_path / "bad"), config, drop, tensors)
    with pytest.raises(ValueError, match=match):
        eagle.load(bad, TARGET)


def test_a_head_without_d2t_drafts_over_the_whole_vocabulary(head_folder, tmp_path):
    cfg = _head_cfg()
    full = eagle.HeadConfig(layer=cfg.layer, draft_vocab_size=TARGET.vocab_size,
                            target_hidden_size=TARGET.hidden_size, aux_layers=(0, 1, 1))
    path = str(tmp_path / "full")
    eagle.save(path, full, eagle.init_random(full, seed=1))
    _edit(path, path, drop=("d2t", "t2d"))
    _, w = eagle.load(path, TARGET)
    assert (np.asarray(w.draft_to_target) == np.arange(TARGET.vocab_size)).all()
