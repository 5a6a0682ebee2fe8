"""Training EAGLE-3 heads (sfjax.spec.eagle_train, scripts/train_eagle.py): the training-time test
computes at each depth what the round computes when it drafts that deep; training lowers the
loss and is deterministic from its seed; the script resumes from its orbax checkpoints bit for
bit; the head shipped beside the demo target drafts for it."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sfjax import LLM, SamplingParams, toy
from sfjax import weights as W
from sfjax.config import ModelConfig
from sfjax.default_model import default_eagle_path, default_model_path
from sfjax.spec import eagle, eagle_train
from sfjax.training import forward

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "scripts"))
import train_eagle  # noqa: E402
from test_eagle_round import head_config  # noqa: E402

TARGET = toy.tiny_config()


@pytest.fixture(scope="module")
def target(tiny_folder):
    return jax.tree.map(jnp.asarray, W.load_hf(tiny_folder, TARGET))


def test_each_depth_is_what_the_round_computes_drafting_that_deep(target):
    """Depth 0 is the dense head on the real features; depth 1 at row i is the dense head over
    rows 0 .. i-1 on real features and row i fed row i-1's own output, as the round's second
    draft is."""
    hc = head_config()
    hw = eagle.init_random(hc, seed=2, std=0.15)
    hw = dataclasses.replace(hw, embed=target.embed)
    tokens = jnp.asarray(np.random.default_rng(0).integers(2, 512, 12), jnp.int32)
    _, feats = forward(target, tokens[None], TARGET, hc.aux_layers)
    feats = feats[0]
    got = eagle_train._ttt(hw, hc, feats, tokens, depth=2)
    embeds = target.embed[jnp.concatenate([tokens[1:], tokens[-1:]])]
    hidden = eagle.fuse(hw, feats)
    lg0, out0 = eagle.forward_dense(hw, hc, embeds, hidden, jnp.arange(12))
    draft = np.isfinite(np.asarray(lg0))
    np.testing.assert_allclose(np.asarray(got[0])[draft], np.asarray(lg0)[draft], atol=1e-5)
    for i in (1, 5, 10):
        h = jnp.concatenate([hidden[:i], out0[i - 1:i]])
        lg1, _ = eagle.forward_dense(hw, hc, embeds[:i + 1], h, jnp.arange(i + 1))
        np.testing.assert_allclose(np.asarray(got[1][i])[draft[i]],
                                   np.asarray(lg1[-1])[draft[i]], atol=1e-5)


def test_training_lowers_the_loss_and_repeats_from_its_seed(target):
    hc = head_config(vocab=512)
    seqs = np.random.default_rng(1).integers(2, 512, (16, 24)).astype(np.int32)
    losses = []
    a = eagle_train.train(target, TARGET, hc, seqs, steps=30, batch=4, depth=2, seed=3,
                          learning_rate=1e-2, log=lambda step, m: losses.append(float(m[0][0])))
    b = eagle_train.train(target, TARGET, hc, seqs, steps=30, batch=4, depth=2, seed=3,
                          learning_rate=1e-2)
    assert a.embed is None                                 # saved without the target's embedding
    assert all((np.asarray(getattr(a, f)) == np.asarray(getattr(b, f))).all()
               for f in ("fc", "wq", "w_down", "lm_head"))
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.05


def test_train_eagle_smoke_resumes_bit_for_bit(tmp_path):
    ckpt = tmp_path / "ckpt"
    args = lambda out: ["--smoke", "--out", str(tmp_path / out), "--ckpt-dir", str(ckpt)]
    assert train_eagle.main(args("a")) == 0
    assert json.loads((ckpt / "run.json").read_text())["steps"] == train_eagle.SMOKE.steps
    shutil.rmtree(ckpt / "head" / str(train_eagle.SMOKE.steps))   # killed after the last-but-one save
    assert train_eagle.main(args("b")) == 0
    assert ((tmp_path / "a" / "model.safetensors").read_bytes()
            == (tmp_path / "b" / "model.safetensors").read_bytes())
    cfg, _ = eagle.load(str(tmp_path / "a"), ModelConfig.from_folder(default_model_path()))
    assert cfg.draft_vocab_size == train_eagle.SMOKE.draft_vocab
    # the run.json a resume must match names the target's weights, not only its path
    run = json.loads((ckpt / "run.json").read_text())
    (ckpt / "run.json").write_text(json.dumps({**run, "target_weights": "another"}, sort_keys=True))
    with pytest.raises(SystemExit, match="holds checkpoints of a different run"):
        train_eagle.main(args("c"))
    (ckpt / "run.json").write_text(json.dumps(run, sort_keys=True))
    last = ckpt / "head" / str(train_eagle.SMOKE.steps)
    for f in last.rglob("_METADATA"):         # a damaged checkpoint: one line naming it
        f.unlink()
    with pytest.raises(SystemExit, match=rf"--ckpt-dir {ckpt}: step {train_eagle.SMOKE.steps} "
                                         r"under .* cannot be restored"):
        train_eagle.main(args("c"))
    with pytest.raises(SystemExit):           # argparse's error: 2
        train_eagle.main([*args("c"), "--steps", "0"])


def test_the_shipped_head_drafts_for_the_demo_target():
    """sfjax/default/eagle3 (scripts/train_eagle.py): it loads as the published format, and with
    it the demo target emits plain decoding's tokens, greedy and sampled, accepting drafts."""
    path = default_eagle_path()
    assert "scripts/train_eagle.py" in (pathlib.Path(path) / "README.md").read_text()
    plain = LLM(max_num_seqs=4, max_model_len=256)
    llm = LLM(max_num_seqs=4, max_model_len=256,
              speculative_config={"method": "eagle3", "model": path, "num_speculative_tokens": 3})
    prompts = ["def fibonacci(n):\n", "class Stack:\n    def push(self, item):\n",
               "import os\n\ndef list_files(path):\n"]
    for sp in (SamplingParams(temperature=0, max_tokens=48),
               SamplingParams(temperature=0.8, seed=1, max_tokens=48)):
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == want
    m = llm.get_metrics()["spec_decode"]
    assert m["acceptance_rate"] > 0.1, m
