"""HF transformers (torch, float32) as the oracle for sfjax's model, loader, engine and tokenizer.

Every model here is a folder written by ``sfjax.toy.build_model_folder``; HF loads the very same
files with ``LlamaForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``.

Measured on XLA:CPU / torch CPU (float32), for the record:
  teacher-forced logits, 200 tokens, 5 configs: max |sfjax - HF| 2.6e-6 .. 4.9e-6 (bound 1e-4);
  bfloat16 folder, 200 tokens, logit std 0.79: max |sfjax bf16 - HF bf16| 0.061 (0.077 std),
  max |sfjax bf16 - sfjax f32| 0.043 (0.055 std), max |HF bf16 - HF f32| 0.048 (bound 0.15 std);
  the f32 runs of those bf16 weights agree to 2.8e-6;
  greedy trajectories: smallest top1 - top2 margin 2.8e-3 (precondition > 1e-3); the 64-token
  trajectories hold 7 special tokens (0/1), so skip_special_tokens is exercised in the text.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from sfjax import LLM, SamplingParams, model, rows, toy, training
from sfjax import weights as W
from sfjax.cache import KVCache
from sfjax.config import ModelConfig, RopeScaling

from golden_runs import xla_defaults

PARITY_TOL = 1e-4          # float32 sfjax vs float32 HF, max abs over all logits
MIN_LOGIT_STD = 0.1        # every row's logits must spread at least this much (so the test can fail)
MIN_MARGIN = 1e-3          # top1 - top2 along a greedy trajectory: equality is meaningful above it
BF16_TOL = 0.15            # bf16 vs bf16 / f32, as a fraction of the logit std (measured ~0.07)
SEQ_LEN = 200              # well past the llama3 original_max_position_embeddings (64)

LLAMA3 = RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=64)
LINEAR = RopeScaling("linear", factor=4.0)

# All share tiny_config's shapes except where named, so one seed gives the same arrays in each.
CONFIGS = {
    "mha": toy.tiny_config(num_kv_heads=4),
    "gqa": toy.tiny_config(),                      # 4 heads / 2 kv heads
    "tied": toy.tiny_config(tie_word_embeddings=True),
    "llama3": toy.tiny_config(rope_scaling=LLAMA3),
    "linear": toy.tiny_config(rope_scaling=LINEAR),
}
PARITY_SEED, PARITY_STD = 1, 0.1

# The greedy model: std / seed picked so every top-1 along the trajectories is clear (see above).
GREEDY_SEED, GREEDY_STD = 1, 0.3
GREEDY_PROMPT_LENS = (3, 7, 12, 18, 24, 29, 35, 40)
GREEDY_NEW_TOKENS = 64
GREEDY_PROMPT_SEED = 200        # prompt i draws from seed 200 + i

TEXT_PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    if n < 2:",
    "Once upon a time there was",
    "naïve café ☕ 日本語 — unicode",
    "x",
]


# ---------------------------------------------------------------------------------------------
# helpers


# The logits held to HF's within a bound compile as users compile them, not with the suite's
# cheaper XLA:CPU settings (tests/conftest.py): the bound is on the numbers users get.
USER_COMPILE = xla_defaults() or None


@functools.partial(jax.jit, static_argnames=("cfg", "row_tile"), compiler_options=USER_COMPILE)
def _paged_logits(weights, cache, tokens, positions, slots, block_tables, *, cfg, row_tile):
    tiling = rows.Tiling(row_tile)
    hidden, cache = model.forward(weights, cache, tokens, positions, slots, block_tables, cfg,
                                  tiling)
    return model.logits(weights, hidden, cfg, tiling), cache


def sfjax_logits(folder: str, ids, dtype: str = "auto", chunks=(), block_size: int = 16,
                 row_tile: int = 8, page_seed: int = 0) -> np.ndarray:
    """Teacher-forced logits float32 [T, vocab] of one sequence through the paged forward.

    The sequence sits in slot 1 of a two-slot block table, on pages drawn in shuffled order from a
    pool twice the size it needs, and is prefilled in calls that end at each of ``chunks`` (later
    calls read the K/V earlier calls wrote). Padding rows (slot -1) fill each call to ``row_tile``.
    """
    cfg = ModelConfig.from_folder(folder, dtype)
    weights = W.load_hf(folder, cfg)
    ids = np.asarray(ids, np.int32)
    t = len(ids)
    nb = -(-t // block_size)
    pages = np.random.default_rng(page_seed).permutation(np.arange(1, 2 * nb + 1))[:nb]
    cache = KVCache.zeros(cfg, 2 * nb + 1, block_size)
    block_tables = np.zeros((2, nb), np.int32)
    block_tables[1] = pages
    out = []
    bounds = [0, *chunks, t]
    for start, end in zip(bounds[:-1], bounds[1:]):
        n = end - start
        rows = -(-n // row_tile) * row_tile
        tokens = np.zeros(rows, np.int32)
        positions = np.full(rows, -1, np.int32)
        slots = np.full(rows, -1, np.int32)
        tokens[:n], positions[:n], slots[:n] = ids[start:end], np.arange(start, end), 1
        lg, cache = _paged_logits(weights, cache, tokens, positions, slots, block_tables,
                                  cfg=cfg, row_tile=row_tile)
        out.append(np.asarray(lg)[:n])
    return np.concatenate(out)


def hf_logits(hf_model, ids) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.tensor([list(ids)])).logits[0].float().numpy()


def hf_greedy(hf_model, prompt: list[int], new_tokens: int) -> list[int]:
    """HF greedy continuation of one prompt, EOS disabled (it must run to ``new_tokens``)."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]),
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                do_sample=False, max_new_tokens=new_tokens, eos_token_id=None,
                                pad_token_id=0)
    gen = out[0, len(prompt):].tolist()
    assert len(gen) == new_tokens, f"HF stopped after {len(gen)} tokens"
    return gen


def top2_margins(logits: np.ndarray) -> np.ndarray:
    top = np.sort(logits, axis=-1)[:, -2:]
    return top[:, 1] - top[:, 0]


def trajectory_logits(hf_model, prompt: list[int], generated: list[int]) -> np.ndarray:
    """HF's logits at each step of a greedy trajectory: row i predicts generated[i]."""
    return hf_logits(hf_model, prompt + generated)[len(prompt) - 1:-1]


def random_ids(n: int, seed: int, vocab: int = 512) -> list[int]:
    return np.random.default_rng(seed).integers(2, vocab, n).tolist()


@pytest.fixture(scope="module")
def hf_model():
    """``hf_model(folder, dtype)``: ``LlamaForCausalLM.from_pretrained``, loaded once per module."""
    loaded = {}

    def load(folder: str, dtype=torch.float32):
        if (folder, dtype) not in loaded:
            m = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=dtype)
            loaded[folder, dtype] = m.eval()
        return loaded[folder, dtype]

    return load


@pytest.fixture(scope="module")
def parity_ids():
    return random_ids(SEQ_LEN, seed=0)


# ---------------------------------------------------------------------------------------------
# a. teacher-forced logits


@pytest.mark.parametrize("name", list(CONFIGS))
def test_teacher_forced_logits_match_hf(name, model_folder, hf_model, parity_ids):
    cfg = CONFIGS[name]
    folder = model_folder(cfg, seed=PARITY_SEED, std=PARITY_STD)
    hf = hf_model(folder)
    assert hf.config.num_key_value_heads == cfg.num_kv_heads
    assert hf.config.tie_word_embeddings == cfg.tie_word_embeddings
    if cfg.tie_word_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()

    ref = hf_logits(hf, parity_ids)
    got = sfjax_logits(folder, parity_ids)
    assert got.shape == ref.shape == (SEQ_LEN, cfg.vocab_size)
    assert got.dtype == np.float32
    assert ref.std(axis=-1).min() > MIN_LOGIT_STD
    diff = np.abs(got - ref).max()
    if diff > PARITY_TOL:   # seen once in a full run (5.8e-4, 2.5e-6 alone): say which side moved
        again_ref, again_got = hf_logits(hf, parity_ids), sfjax_logits(folder, parity_ids)
        r, c = np.unravel_index(np.abs(got - ref).argmax(), got.shape)
        pytest.fail(f"{name}: max |sfjax - HF| = {diff:.3g} at [{r}, {c}] (sfjax {got[r, c]}, "
                    f"HF {ref[r, c]}); again: HF repeats bitwise {np.array_equal(ref, again_ref)}, "
                    f"sfjax {np.array_equal(got, again_got)}, max diff "
                    f"{np.abs(again_got - again_ref).max():.3g}; torch threads "
                    f"{torch.get_num_threads()}, XLA_FLAGS {os.environ.get('XLA_FLAGS')!r}")


def test_chunked_prefill_on_small_pages_matches_hf(model_folder, hf_model, parity_ids):
    """The same sequence prefilled over five calls (77, 73, 1, 1, 48 rows) on 4-token pages:
    K/V written by earlier calls is read back through the block table."""
    folder = model_folder(CONFIGS["llama3"], seed=PARITY_SEED, std=PARITY_STD)
    ref = hf_logits(hf_model(folder), parity_ids)
    got = sfjax_logits(folder, parity_ids, chunks=(77, 150, 151, 152), block_size=4, page_seed=3)
    diff = np.abs(got - ref).max()
    assert diff <= PARITY_TOL, f"max |sfjax chunked - HF| = {diff:.3g}"
    # row invariance (model.py): chunking and page size do not reach a row's bits
    np.testing.assert_array_equal(got, sfjax_logits(folder, parity_ids))


@pytest.mark.parametrize("split", [False, True], ids=["scanned", "unrolled"])
def test_the_features_a_head_fuses_are_hfs_hidden_states(model_folder, hf_model, split):
    """``model.forward(features=...)`` (EAGLE-3's fused inputs, sfjax.spec.eagle): the residual
    stream entering each named layer is HF's ``hidden_states[i]``, in the order named; asking for
    them leaves the hidden states' bits as they were."""
    cfg = toy.tiny_config(num_layers=3)
    folder = model_folder(cfg, seed=PARITY_SEED, std=PARITY_STD)
    ids = random_ids(40, seed=4)
    with torch.no_grad():
        ref = hf_model(folder)(torch.tensor([ids]), output_hidden_states=True).hidden_states
    weights = W.load_hf(folder, cfg)
    weights = W.split_layers(weights) if split else weights
    n = len(ids)
    args = (weights, KVCache.zeros(cfg, 4, 16), np.asarray(ids, np.int32), np.arange(n, dtype=np.int32),
            np.ones(n, np.int32), np.array([[0, 0, 0], [1, 2, 3]], np.int32), cfg)
    run = jax.jit(model.forward, static_argnames=("cfg", "features"), compiler_options=USER_COMPILE)
    hidden, _, feats = run(*args, features=(2, 0, 1))
    assert feats.shape == (n, 3 * cfg.hidden_size)
    for j, i in enumerate((2, 0, 1)):
        np.testing.assert_allclose(np.asarray(feats[:, j * 64:(j + 1) * 64]), ref[i][0].numpy(),
                                   rtol=0, atol=1e-5)
    assert np.asarray(hidden).tobytes() == np.asarray(run(*args)[0]).tobytes()
    with pytest.raises(ValueError, match=r"features = \(0, 3\) is out of range: must be layers in \[0, 3\)"):
        model.forward(*args, features=(0, 3))


@pytest.mark.parametrize("name", ["llama3", "linear"])
def test_rope_scaling_matters_past_original_context(name, model_folder, hf_model, parity_ids):
    """The scaled and unscaled folders hold the same arrays (same seed and shapes): their logits
    must differ clearly past position 64, in sfjax and in HF, or the parity above proves nothing
    about the scaling."""
    scaled = model_folder(CONFIGS[name], seed=PARITY_SEED, std=PARITY_STD)
    plain = model_folder(CONFIGS["gqa"], seed=PARITY_SEED, std=PARITY_STD)
    for a, b in [(sfjax_logits(scaled, parity_ids), sfjax_logits(plain, parity_ids)),
                 (hf_logits(hf_model(scaled), parity_ids), hf_logits(hf_model(plain), parity_ids))]:
        assert np.abs(a[64:] - b[64:]).max() > 0.1


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_fields_config_json_leaves_out_mean_what_transformers_takes(model_type):
    """A field a config.json leaves out is transformers' default for that model type (a
    Mistral without sliding_window windows at 4096 there, and Qwen's KV heads default to 32),
    and so is a llama3 rope's original_max_position_embeddings (config.json's own field first,
    then the scaling's, then max_position_embeddings); a llama3 rope missing a factor is
    refused, as transformers refuses it (a KeyError). sfjax had read them otherwise."""
    full = dataclasses.replace(toy.tiny_config(num_heads=32, num_kv_heads=8, head_dim=2),
                               model_type=model_type).to_hf_config()
    for drop in ("num_key_value_heads", "max_position_embeddings", "sliding_window", "head_dim"):
        hf = {k: v for k, v in full.items() if k != drop}
        ours, theirs = ModelConfig.from_hf_config(hf), transformers.AutoConfig.for_model(**hf)
        assert ours.num_kv_heads == theirs.num_key_value_heads, drop
        assert ours.max_position_embeddings == theirs.max_position_embeddings, drop
        assert ours.head_dim == (getattr(theirs, "head_dim", None) or 64 // 32), drop
        assert ours.sliding_window == (theirs.sliding_window if model_type == "mistral" else None)
    if model_type != "llama":         # the rope rule reads no family's own field
        return
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    for extra in ({}, {"original_max_position_embeddings": 64}):
        for inner in ({}, {"original_max_position_embeddings": 256}):
            hf = lambda: copy.deepcopy({**full, "sliding_window": None, **extra,   # HF edits it
                                        "rope_scaling": {**rope, **inner}})
            ours = ModelConfig.from_hf_config(hf()).rope_scaling
            model = transformers.AutoModelForCausalLM.from_config(    # as a model reads it
                transformers.AutoConfig.for_model(**hf()))
            theirs = model.config.rope_parameters["original_max_position_embeddings"]
            assert ours.original_max_position_embeddings == theirs, (extra, inner)
    with pytest.raises(ValueError, match="rope_scaling.low_freq_factor is missing"):
        ModelConfig.from_hf_config({**full, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                            "high_freq_factor": 4.0}})


def test_a_tied_model_with_another_lm_head_is_refused(model_folder, tmp_path):
    """tie_word_embeddings with an lm_head.weight that is not the embedding: transformers 5
    serves that head untied, sfjax (as vLLM) the embedding, so the folder is refused naming
    both (it ran on the embedding with no word); a copy of the embedding is taken."""
    import shutil

    from safetensors.numpy import load_file, save_file
    folder = shutil.copytree(model_folder(toy.tiny_config(tie_word_embeddings=True)),
                             tmp_path / "m")
    tensors = load_file(str(folder / "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"]
    cfg = ModelConfig.from_folder(str(folder))
    for head, refused in ((embed.copy(), False), (embed[::-1].copy(), True)):
        save_file({**tensors, "lm_head.weight": head}, str(folder / "model.safetensors"))
        if refused:
            with pytest.raises(ValueError, match="ties the LM head to the embedding .* but "
                                                 "lm_head.weight differs"):
                W.load_hf(str(folder), cfg)
        else:
            assert W.load_hf(str(folder), cfg).lm_head is None


@pytest.mark.parametrize("name", ["gqa", "llama3", "linear"])
def test_config_json_as_transformers_writes_it_means_the_same_model(name, tmp_path):
    """transformers 5 writes ``rope_theta`` and the scaling inside ``rope_parameters`` (earlier
    versions at the top level, the form ``toy`` writes): a config.json as the installed
    transformers saves it, and one in transformers 5's form, mean the same ``ModelConfig``
    (an unread ``rope_parameters`` ran theta 10000, unscaled, with no error)."""
    cfg = dataclasses.replace(CONFIGS[name], rope_theta=5e5)
    legacy = cfg.to_hf_config()
    hf = transformers.LlamaConfig.from_dict(legacy).to_dict()
    assert ModelConfig.from_hf_config(hf) == cfg
    new = {k: v for k, v in legacy.items() if k not in ("rope_theta", "rope_scaling")}
    new["rope_parameters"] = {"rope_type": "default", **legacy.get("rope_scaling", {}),
                              "rope_theta": 5e5}
    assert ModelConfig.from_hf_config(new) == cfg
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
        ModelConfig.from_hf_config({**new, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})


@pytest.mark.parametrize("model_type,window", [("mistral", None), ("mistral", 40),
                                               ("qwen2", None), ("qwen3", None)])
def test_mistral_and_qwen_folders_run_as_hf_runs_them(model_type, window, model_folder,
                                                      parity_ids):
    """MistralForCausalLM is Llama's network with a sliding window of attention, Qwen2ForCausalLM
    Llama's with biases on q, k and v, Qwen3ForCausalLM Llama's with each query and key head
    RMS-normed (here with a head_dim other than hidden / heads, as Qwen3's). sfjax attends to
    every key, which is the window's attention exactly while a sequence holds at most
    ``sliding_window`` tokens: the window bounds max_model_len (its default; past it refused,
    naming the window). Within it the logits and greedy tokens are HF's, and speculation and
    batching keep a request's tokens."""
    cfg = dataclasses.replace(CONFIGS["gqa"], model_type=model_type, sliding_window=window,
                              head_dim=24 if model_type == "qwen3" else 16)
    jitter = {"norm_jitter": 0.3} if model_type == "qwen3" else {}   # head norms that matter
    folder = model_folder(cfg, seed=PARITY_SEED, std=PARITY_STD, **jitter)
    assert ModelConfig.from_folder(folder) == cfg
    written = cfg.to_hf_config()
    unsized = {k: v for k, v in written.items() if k != "head_dim"}     # HF's default head_dim
    assert ModelConfig.from_hf_config(unsized).head_dim == (128 if model_type == "qwen3" else 16)
    for bad, match in (({"sliding_window": 0, "model_type": "mistral",
                         "architectures": ["MistralForCausalLM"]},
                        r"config.json: sliding_window = 0 is out of range"),
                       ({"use_sliding_window": True, "model_type": "qwen2",
                         "architectures": ["Qwen2ForCausalLM"]}, "use_sliding_window"),
                       ({"use_sliding_window": True, "model_type": "qwen3",
                         "architectures": ["Qwen3ForCausalLM"]}, "use_sliding_window"),
                       ({"architectures": ["LlamaForCausalLM"]}, "unsupported architecture")):
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf_config({**written, **bad})
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(hf).__name__ == written["architectures"][0]
    if model_type == "qwen2":                          # the biases are there and matter
        assert hf.model.layers[0].self_attn.k_proj.bias.abs().min() > 0
    if model_type == "qwen3":                          # so are the head norms
        assert (hf.model.layers[0].self_attn.k_norm.weight - 1).abs().min() > 0
    n = window or SEQ_LEN
    want = hf_logits(hf, parity_ids[:n])
    diff = np.abs(sfjax_logits(folder, parity_ids[:n]) - want).max()
    assert diff <= PARITY_TOL, f"max |sfjax - HF {model_type}| = {diff:.3g}"
    dense = training.forward(W.load_hf(folder, cfg), jnp.asarray([parity_ids[:n]]), cfg)[0]
    diff = np.abs(np.asarray(dense) - want).max()            # the training scripts' model too
    assert diff <= PARITY_TOL, f"max |training.forward - HF {model_type}| = {diff:.3g}"
    if window is not None:
        # past the window HF's attention drops the oldest keys, so the limit is needed
        past = parity_ids[:n + 20]
        assert np.abs(sfjax_logits(folder, past) - hf_logits(hf, past))[n:].max() > 0.01
        with pytest.raises(ValueError, match=r"max_model_len \(41\) must be <= the model's "
                                             r"sliding_window \(40"):
            LLM(folder, max_model_len=41)
    if model_type == "mistral" and window is None:
        return
    # greedy to the end of the context, alone; then speculating among other requests
    folder = model_folder(cfg, seed=GREEDY_SEED, std=GREEDY_STD, **jitter)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    limit = window or 40
    prompt = random_ids(12, seed=GREEDY_PROMPT_SEED)
    gen = hf_greedy(hf, prompt, limit - len(prompt))
    assert top2_margins(trajectory_logits(hf, prompt, gen)).min() > MIN_MARGIN   # precondition
    greedy = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)    # to the end
    alone = LLM(folder, max_num_seqs=1, max_model_len=None if window else limit)
    assert alone.engine.config.max_model_len == limit
    out = alone.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == gen and out.finish_reason == "length"
    if model_type == "qwen3":         # the round runs these same forwards: qwen2's case covers it
        return
    batch = [{"prompt_token_ids": p} for p in
             (random_ids(5, seed=9), prompt, random_ids(6, seed=10) * 2)]
    spec = LLM(folder, max_num_seqs=4, max_model_len=None if window else limit, speculative_config={
        "method": "draft_model", "model": folder, "num_speculative_tokens": 3})   # all accepted
    outs = spec.generate(batch, SamplingParams(temperature=0, max_tokens=limit - len(prompt),
                                               ignore_eos=True), use_tqdm=False)
    assert outs[1].outputs[0].token_ids == gen
    assert spec.get_metrics()["spec_decode"]["num_accepted_tokens"] > 0


# ---------------------------------------------------------------------------------------------
# b, c. greedy generation and text


@pytest.fixture(scope="module")
def greedy_folder(model_folder):
    return model_folder(toy.tiny_config(), seed=GREEDY_SEED, std=GREEDY_STD)


@pytest.fixture(scope="module")
def greedy_llm(greedy_folder):
    return LLM(greedy_folder, max_num_seqs=8)


@pytest.fixture(scope="module")
def greedy_prompts():
    return [random_ids(n, seed=GREEDY_PROMPT_SEED + i) for i, n in enumerate(GREEDY_PROMPT_LENS)]


@pytest.fixture(scope="module")
def hf_greedy_runs(greedy_folder, hf_model, greedy_prompts):
    """Per prompt: (HF's greedy tokens, HF's logits along that trajectory)."""
    hf = hf_model(greedy_folder)
    runs = []
    for p in greedy_prompts:
        gen = hf_greedy(hf, p, GREEDY_NEW_TOKENS)
        runs.append((gen, trajectory_logits(hf, p, gen)))
    return runs


@pytest.fixture(scope="module")
def sfjax_greedy_outputs(greedy_llm, greedy_prompts):
    params = SamplingParams(temperature=0, max_tokens=GREEDY_NEW_TOKENS, ignore_eos=True)
    return greedy_llm.generate([{"prompt_token_ids": p} for p in greedy_prompts], params,
                               use_tqdm=False)


def test_greedy_precondition_top1_margins_are_clear(hf_greedy_runs):
    """Why token equality is a fair demand: at every step HF's top-1 leads its top-2 by more than
    float32 noise can close, and the trajectory is HF's own argmax (not a tie broken by chance)."""
    for gen, lg in hf_greedy_runs:
        assert lg.argmax(-1).tolist() == gen
        assert lg.std(axis=-1).min() > MIN_LOGIT_STD
        assert top2_margins(lg).min() > MIN_MARGIN
    # not a degenerate loop of one token
    assert all(len(set(gen)) > GREEDY_NEW_TOKENS // 2 for gen, _ in hf_greedy_runs)


def test_greedy_tokens_match_hf(sfjax_greedy_outputs, hf_greedy_runs, greedy_prompts):
    assert len(sfjax_greedy_outputs) == len(greedy_prompts)
    for i, (out, p, (gen, _)) in enumerate(zip(sfjax_greedy_outputs, greedy_prompts, hf_greedy_runs)):
        assert out.prompt_token_ids == p
        assert out.finished
        c = out.outputs[0]
        assert c.finish_reason == "length"
        assert c.token_ids == gen, f"prompt {i} (len {len(p)}): sfjax and HF greedy differ"


def test_output_text_matches_hf_decode(sfjax_greedy_outputs, greedy_folder):
    tok = transformers.AutoTokenizer.from_pretrained(greedy_folder)
    for out in sfjax_greedy_outputs:
        ids = out.outputs[0].token_ids
        assert out.outputs[0].text == tok.decode(ids, skip_special_tokens=True)


def test_string_prompts_encode_generate_and_decode_like_hf(greedy_llm, greedy_folder, hf_model):
    tok = transformers.AutoTokenizer.from_pretrained(greedy_folder)
    hf = hf_model(greedy_folder)
    n = 16
    outs = greedy_llm.generate(TEXT_PROMPTS, SamplingParams(temperature=0, max_tokens=n,
                                                            ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(TEXT_PROMPTS, outs):
        ids = tok(prompt).input_ids
        assert ids[0] == tok.bos_token_id == 0                 # the BOS is prepended
        assert out.prompt == prompt
        assert out.prompt_token_ids == ids
        gen = hf_greedy(hf, ids, n)
        assert top2_margins(trajectory_logits(hf, ids, gen)).min() > MIN_MARGIN  # precondition
        assert out.outputs[0].token_ids == gen
        assert out.outputs[0].text == tok.decode(gen, skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------
# d. bfloat16


def test_bfloat16_folder_matches_hf_bf16_and_own_float32(model_folder, hf_model, parity_ids):
    folder = model_folder(toy.tiny_config(dtype="bfloat16"), seed=PARITY_SEED, std=PARITY_STD)
    cfg = ModelConfig.from_folder(folder)
    assert cfg.dtype == "bfloat16"
    assert W.load_hf(folder, cfg).wq.dtype == jax.numpy.bfloat16

    sf16 = sfjax_logits(folder, parity_ids)                     # "auto": bfloat16
    sf32 = sfjax_logits(folder, parity_ids, dtype="float32")    # the same values, upcast
    hf16 = hf_logits(hf_model(folder, torch.bfloat16), parity_ids)
    hf32 = hf_logits(hf_model(folder, torch.float32), parity_ids)
    scale = hf32.std()
    assert hf32.std(axis=-1).min() > MIN_LOGIT_STD

    assert np.abs(sf32 - hf32).max() <= PARITY_TOL             # exact parity on bf16 weights
    assert np.abs(sf16 - hf16).max() <= BF16_TOL * scale
    assert np.abs(sf16 - sf32).max() <= BF16_TOL * scale
    assert np.abs(sf16 - sf32).max() > 0                        # it really ran in bfloat16
    assert (sf16.argmax(-1) == hf16.argmax(-1)).mean() >= 0.9

    # the engine serves the folder in bfloat16 too: its greedy first token is the argmax of the
    # same row of the paged forward above (the same bits, so no margin is needed)
    llm = LLM(folder, max_num_seqs=1, max_model_len=64)
    assert llm.model_config.dtype == "bfloat16"
    out = llm.generate({"prompt_token_ids": parity_ids[:40]},
                       SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == [int(sf16[39].argmax())]


# ---------------------------------------------------------------------------------------------
# e. sharded safetensors


def test_sharded_folder_loads_like_single_file(model_folder, tiny_folder, hf_model, parity_ids):
    cfg = toy.tiny_config()
    sharded = model_folder(cfg, seed=0, std=0.1, max_shard_bytes=64 * 1024)
    files = os.listdir(sharded)
    shards = [f for f in files if f.startswith("model-") and f.endswith(".safetensors")]
    assert "model.safetensors.index.json" in files and "model.safetensors" not in files
    assert len(shards) >= 3

    a, b = W.load_hf(tiny_folder, cfg), W.load_hf(sharded, cfg)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    single, split = sfjax_logits(tiny_folder, parity_ids), sfjax_logits(sharded, parity_ids)
    np.testing.assert_array_equal(single, split)

    hf_single, hf_split = hf_logits(hf_model(tiny_folder), parity_ids), hf_logits(hf_model(sharded), parity_ids)
    np.testing.assert_array_equal(hf_single, hf_split)
    assert np.abs(split - hf_split).max() <= PARITY_TOL


# ---------------------------------------------------------------------------------------------
# f. full-size shapes (random weights)


# llama-68m as a CPU user runs it (unrolled layers, the small tiles its certificate grants);
# llama-160m with the GPU and TPU engines' layer loop (``lax.scan`` over stacked layers), which no
# other test runs end to end, and no small tiles (its certificate's probe costs 6 s and, on the
# CPU box, grants none).
@pytest.mark.slow
@pytest.mark.parametrize("make_cfg, run", [
    (toy.llama_68m_config, {}),
    (toy.llama_160m_config, dict(layer_loop="scan", small_row_tiles=False))],
    ids=["llama-68m", "llama-160m-scan"])
def test_aphrodite_shaped_models_generate_like_hf(make_cfg, run, model_folder):
    cfg = make_cfg()
    folder = model_folder(cfg, seed=0)
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = [random_ids(n, seed=i, vocab=cfg.vocab_size) for i, n in enumerate((5, 23))]
    llm = LLM(folder, max_num_seqs=2, max_model_len=64, **run)
    assert llm.engine.run.unrolled == (not run)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for p, out in zip(prompts, outs):
        gen = hf_greedy(hf, p, 16)
        margins = top2_margins(trajectory_logits(hf, p, gen))
        assert margins.min() > MIN_MARGIN                   # precondition, every step
        assert out.outputs[0].token_ids[0] == gen[0]
        assert out.outputs[0].token_ids == gen
