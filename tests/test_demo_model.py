"""The embedded default pair (sfjax/default/, made by scripts/train_demo.py): HF transformers loads
it and agrees with sfjax, it has learned Python, its draft agrees with its target, its n-gram
table drafts exactly, the CLI serves it with speculation, and the training script resumes from
its orbax checkpoints bit for bit."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import sys

import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

from sfjax import LLM, SamplingParams
from sfjax.cli import main as cli
from sfjax.config import ModelConfig
from sfjax.default_model import default_draft_path, default_model_path
from sfjax.spec import table as ngram_table
from test_hf_parity import (MIN_LOGIT_STD, MIN_MARGIN, PARITY_TOL, hf_greedy, hf_logits,
                            sfjax_logits, top2_margins, trajectory_logits)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "scripts"))
import code_prompts  # noqa: E402
import train_demo  # noqa: E402

FOLDERS = {"target": default_model_path(), "draft": default_draft_path()}
GREEDY_TOKENS = 24


@pytest.fixture(scope="module")
def held_out_prompts():
    """The openings of the first four functions in the files train_demo held out, as token ids."""
    root, files = train_demo.corpus_files(None)
    texts = train_demo.read_texts(root, files[::train_demo.HELD_OUT_EVERY])
    starts = [t[t.index("\ndef ") + 1:] for t in texts if "\ndef " in t][:4]
    tok = transformers.AutoTokenizer.from_pretrained(FOLDERS["target"])
    return [tok(s).input_ids[:48] for s in starts]


@pytest.fixture(scope="module")
def default_llm():
    return LLM(max_num_seqs=4)


@pytest.fixture(scope="module")
def hf_models():
    return {k: transformers.LlamaForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
            for k, p in FOLDERS.items()}


def test_the_pair_ships_in_bfloat16():
    cfgs = {k: ModelConfig.from_folder(p) for k, p in FOLDERS.items()}
    assert cfgs["draft"].vocab_size == cfgs["target"].vocab_size >= 4096
    assert cfgs["draft"].num_params() < cfgs["target"].num_params() / 2
    total = 0
    for role, path in FOLDERS.items():
        assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", "README.md"} <= set(os.listdir(path))
        with safe_open(os.path.join(path, "model.safetensors"), framework="numpy") as f:
            assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {"BF16"}
        total += os.path.getsize(os.path.join(path, "model.safetensors"))
        assert "scripts/train_demo.py" in (pathlib.Path(path) / "README.md").read_text()
    assert total < 16e6
    same = [(pathlib.Path(p) / "tokenizer.json").read_text() for p in FOLDERS.values()]
    assert same[0] == same[1]


@pytest.mark.parametrize("role", list(FOLDERS))
def test_logits_match_hf_on_held_out_code(role, hf_models, held_out_prompts):
    for ids in held_out_prompts:
        ref = hf_logits(hf_models[role], ids)
        got = sfjax_logits(FOLDERS[role], ids)
        assert ref.std(axis=-1).min() > MIN_LOGIT_STD
        diff = np.abs(got - ref).max()
        assert diff <= PARITY_TOL, f"{role}: max |sfjax - HF| = {diff:.3g}"


def test_greedy_tokens_match_hf(default_llm, hf_models, held_out_prompts):
    outs = default_llm.generate([{"prompt_token_ids": p} for p in held_out_prompts],
                        SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    for ids, out in zip(held_out_prompts, outs):
        gen = hf_greedy(hf_models["target"], ids, GREEDY_TOKENS)
        assert top2_margins(trajectory_logits(hf_models["target"], ids, gen)).min() > MIN_MARGIN
        assert out.outputs[0].token_ids == gen


def test_the_target_learned_python_and_the_draft_follows_it(held_out_prompts):
    """On held-out code: the target's loss is far below the vocabulary's entropy (8.3 nats) and
    the unigram plateau of training (6.5; measured here: 4.31), and the draft's greedy token
    equals the target's at most positions (the expected acceptance rate; measured: 0.70)."""
    ids = np.concatenate(held_out_prompts)
    target, draft = (sfjax_logits(FOLDERS[r], ids) for r in ("target", "draft"))
    logprobs = target - np.logaddexp.reduce(target, axis=-1, keepdims=True)
    assert -logprobs[np.arange(len(ids) - 1), ids[1:]].mean() < 5.0
    assert (target.argmax(-1) == draft.argmax(-1)).mean() > 0.5


def test_the_ngram_table_ships_and_drafts_where_lookup_cannot(default_llm, held_out_prompts):
    """The target's n-gram draft table loads with its vocabulary; prompt lookup with it emits
    plain decoding's tokens, greedy and sampled, and drafts (and gets accepted) in more rounds
    than without it."""
    path = os.path.join(FOLDERS["target"], ngram_table.TABLE_FILE)
    assert ngram_table.load(path, ModelConfig.from_folder(FOLDERS["target"]).vocab_size).keys.shape[0] > 10_000
    prompts = [{"prompt_token_ids": p} for p in held_out_prompts]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=40, ignore_eos=True)]
    want = [[o.outputs[0].token_ids for o in default_llm.generate(prompts, sp, use_tqdm=False)]
            for sp in params]
    counts = {}
    for name, extra in (("lookup", {}), ("table", {"prompt_lookup_table": path})):
        llm = LLM(max_num_seqs=4, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                      **extra})
        for sp, w in zip(params, want):
            assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == w
        counts[name] = llm.get_metrics()["spec_decode"]
    for field in ("num_drafts", "num_accepted_tokens"):
        assert counts["table"][field] > counts["lookup"][field], (field, counts)


def _ngram_equals_plain(default_llm, prompts, max_tokens: int, slots: int, k):
    """The embedded n-gram + table setting at ``k`` (an int or "auto") over ``slots`` slots
    decodes ``prompts`` greedily to plain decoding's tokens; returns its engine's metrics."""
    from sfjax.default_model import default_speculative_config

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm = LLM(max_num_seqs=slots, speculative_config={**default_speculative_config("ngram"),
                                                      "num_speculative_tokens": k})
    got = llm.generate(prompts, params, use_tqdm=False)
    want = default_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    return llm.get_metrics()


def test_adaptive_k_keeps_drafting_over_a_full_tile_of_rows(default_llm):
    """Adaptive k (n-gram + table, "auto") with 8 slots, over 4 benchmark code prompts and 4 of
    random ids (the bench's --mixed): plain decoding's tokens, and the rows keep drafting to the
    end. Before a round's fill counted in whether its drafts pay (``spec.config.round_drafts``),
    its third round's table k (2, 1, ..., 1: 17 rows, three tiles) did not pay, no row drafted
    again, and the batch ran 61 rounds with 43 drafting rows in all (127 and 42 at 128 tokens)."""
    from sfjax.benchmark import random_workload

    code = [default_llm.get_tokenizer().encode(p).ids for p in code_prompts.code_prompts(4)]
    noise = random_workload(4, len(code[0]), 128, default_llm.model_config.vocab_size, 0)
    prompts = [{"prompt_token_ids": p} for p in code + noise.prompt_ids]
    m = _ngram_equals_plain(default_llm, prompts, 64, 8, "auto")
    assert m["steps"] < 45 and m["spec_decode"]["num_drafts"] > 4 * m["steps"], m   # 35, 199


def test_prompt_lookup_drafts_on_around_a_short_period(default_llm):
    """N-gram + table at k = 7, batch 1, greedy, on the first 2 benchmark code prompts (whose
    output loops): plain decoding's tokens, in fewer rounds than before a match p < k tokens back
    drafted on around its period (``proposers.ngram``) and the table chained past its width
    (``table.lookup``): then 49 rounds (162 drafts), now 38 (234)."""
    tok = default_llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.encode(p).ids} for p in code_prompts.code_prompts(2)]
    m = _ngram_equals_plain(default_llm, prompts, 64, 1, 7)
    assert m["steps"] < 44 and m["spec_decode"]["num_draft_tokens"] > 200, m


def test_adaptive_k_weighs_copies_apart_from_the_tables_guesses(default_llm):
    """N-gram + table with adaptive k ("auto"), batch 1, greedy, on benchmark code prompts 2 and
    6, 128 tokens: plain decoding's tokens, in fewer rounds than when one acceptance estimate
    covered a row's copies (a match in its own tokens) and the table's guesses alike
    (``spec.config.kind_counts``): then 54 + 53 rounds, now 45 + 46, prefill included; the
    accepted copies are counted."""
    tok = default_llm.get_tokenizer()
    code = code_prompts.code_prompts(7)
    prompts = [{"prompt_token_ids": tok.encode(code[i]).ids} for i in (2, 6)]
    m = _ngram_equals_plain(default_llm, prompts, 128, 1, "auto")
    assert m["steps"] < 99, m                                                    # 91; then 107
    d = m["spec_decode"]
    assert 0 < d["num_accepted_copy_tokens"] < d["num_accepted_tokens"], d


def test_benchmark_prompts_end_with_a_def_line_of_held_out_files(tmp_path):
    """scripts/code_prompts.py: 240 characters each, ending with a function's ``def`` line, taken
    from files the pair never trained on."""
    root, files = train_demo.corpus_files(None)
    held = "".join(train_demo.read_texts(root, files[::train_demo.HELD_OUT_EVERY]))
    out = tmp_path / "p.jsonl"
    assert code_prompts.main(["--out", str(out), "--count", "8"]) == 0
    prompts = [json.loads(line)["prompt"] for line in out.read_text().splitlines()]
    assert len(prompts) == 8 and len(set(prompts)) == 8
    for p in prompts:
        last = p.rstrip("\n").rsplit("\n", 1)[-1]
        assert len(p) == 240 and p in held
        assert last.lstrip().startswith("def ") and last.endswith(":")
    assert code_prompts.code_prompts(2, start=7) == prompts[7:] + code_prompts.code_prompts(1, 8)


def test_cli_default_generates_python_with_speculation(default_llm, capsys):
    assert cli(["generate", "def fib(n):", "--max-tokens", "32"]) == 0
    out = capsys.readouterr().out
    assert "Generated text:" in out and "acceptance rate" in out
    text = out.split("Generated text: ", 1)[1].split("\n", 1)[0]
    plain = default_llm.generate("def fib(n):", SamplingParams(temperature=0, max_tokens=32),
                                 use_tqdm=False)[0].outputs[0].text
    assert text == repr(plain)                 # speculation is path-exact


def test_train_demo_smoke_resumes_bit_for_bit(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert train_demo.main(["--smoke", "--out", str(tmp_path / "a"), "--ckpt-dir", str(ckpt)]) == 0
    assert json.loads((ckpt / "run.json").read_text())["target_steps"] == train_demo.SMOKE.target_steps
    for role, steps in (("target", train_demo.SMOKE.target_steps),
                        ("draft", train_demo.SMOKE.draft_steps)):
        shutil.rmtree(ckpt / role / str(steps))          # as if killed after the last-but-one save
    assert train_demo.main(["--smoke", "--out", str(tmp_path / "b"), "--ckpt-dir", str(ckpt)]) == 0
    for role, name in (("target", "model.safetensors"), ("draft", "model.safetensors"),
                       ("target", ngram_table.TABLE_FILE)):
        a, b = ((tmp_path / d / role / name).read_bytes() for d in "ab")
        assert a == b
        hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "a" / role)
        assert hf.config.vocab_size == train_demo.SMOKE.vocab_size
    table = tmp_path / "a" / "target" / ngram_table.TABLE_FILE     # --table-only: the same bytes
    written = table.read_bytes()
    table.unlink()
    assert train_demo.main(["--smoke", "--out", str(tmp_path / "a"), "--ckpt-dir", str(ckpt),
                            "--table-only"]) == 0
    assert table.read_bytes() == written
