"""Helpers for the speculative-decoding equality tests (prompts, parameter sets, comparisons)."""

import numpy as np

from sfjax import SamplingParams

# One geometry for every engine of the suite: engines whose model shapes and speculation settings
# match then share compiled steps. Without certified small tiles: a one-tile bucket compiles each
# certified tile as a branch of every tile loop (``rows.per_tile_sized``), about a quarter of
# this directory's compiling, and a small tile gives a row the whole tile's bits (its
# certificate, tests/test_model.py), so it cannot change what these tests compare. The golden runs
# (tests/golden_runs.py: draft model, EAGLE, n-gram), the prefix-cache, engine, EAGLE-round and
# rollback tests speculate with them.
MAX_NUM_SEQS = 64
MAX_MODEL_LEN = 128
GEOMETRY = dict(max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN, small_row_tiles=False)


# Prompts of at most 8 tokens: at batch 1 a round for k <= 6 has the prefill step's shapes, so each
# speculation setting compiles one step for all of them.
SHORT = [{"prompt_token_ids": [7, 300, 12, 45, 99]},
         {"prompt_token_ids": [3, 3, 17, 250, 9, 77, 3]},
         {"prompt_token_ids": [480, 2, 2, 2]}]

# The batch-8 family: these prompts and parameter sets are shared by several tests, so their
# steps compile once.
BATCH8_SEED = 8


def prompts(n, seed=0, lo=2, hi=40):
    """n token-id prompts of random length in [lo, hi)."""
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(2, 512, rng.integers(lo, hi)).tolist()} for _ in range(n)]


def repeated_prompts(n, seed=0, short=False):
    """Prompts made of a repeated segment (prompt lookup finds its n-grams); ``short``: at most
    8 tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        seg = rng.integers(2, 512, rng.integers(2, 4) if short else rng.integers(3, 7)).tolist()
        out.append({"prompt_token_ids": (seg * 3 + seg[:2])[:8] if short else seg * 3 + seg[:2]})
    return out


def one_by_one(llm, ps, params):
    """Generates each prompt alone (batch 1), for each of ``params``; outputs in order."""
    return [out for p in ps for sp in params for out in run(llm, [p], sp)]


def greedy(max_tokens=24, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=kw.pop("ignore_eos", True), **kw)


def sampled(n, max_tokens=24, seed=100, **kw):
    """n seeded SamplingParams cycling through temperatures {0.1, 1.0} and the processors."""
    ignore_eos = kw.pop("ignore_eos", True)
    kinds = [dict(temperature=1.0),
             dict(temperature=0.1),
             dict(temperature=1.0, top_p=0.8),
             dict(temperature=1.0, top_k=20),
             dict(temperature=0.1, min_p=0.05),
             dict(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3),
             dict(temperature=1.0, repetition_penalty=1.3, top_k=50, top_p=0.9),
             dict(temperature=0, repetition_penalty=1.2),      # greedy with a penalty
             dict(temperature=0.1, top_k=5, min_p=0.02, presence_penalty=-0.5)]
    return [SamplingParams(seed=seed + i, max_tokens=max_tokens, ignore_eos=ignore_eos,
                           **kinds[i % len(kinds)], **kw) for i in range(n)]


def ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def run(llm, ps, params):
    return llm.generate(ps, params, use_tqdm=False)


def spec_counters(llm):
    return dict(llm.get_metrics()["spec_decode"])


def delta(before, after):
    """The spec-decode counters accumulated between two snapshots."""
    d = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    a, b = after["accepted_per_pos"], before["accepted_per_pos"]
    d["accepted_per_pos"] = [x - (b[i] if i < len(b) else 0) for i, x in enumerate(a)]
    return d


def assert_same_outputs(got, ref):
    """Token ids, text, finish and stop reasons: what plain decoding gave."""
    assert ids(got) == ids(ref)
    for g, r in zip(got, ref):
        gc, rc = g.outputs[0], r.outputs[0]
        assert (gc.text, gc.finish_reason, gc.stop_reason) == (rc.text, rc.finish_reason, rc.stop_reason)
