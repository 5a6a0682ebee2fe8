"""The golden runs: one description of a fixed set of runs and how each is executed, shared by
``scripts/record_golden.py`` (which records them, on a pristine tree, into
``tests/golden/engine_runs.json``) and ``tests/test_golden.py`` (which asserts the engine still
gives exactly those tokens, finish reasons and speculation counters).

Everything is built from seeds (``build_models``): a tiny target (``toy.tiny_config()``'s shape,
seed 0, std 0.1, its second layer scaled down) and a one-layer draft (the target's first layer
plus seeded noise, so drafts are accepted often but not always); prompts from ``numpy`` seeds,
made of repeated segments so prompt lookup finds drafts. Every sampled request carries a
``seed``. The recording holds digests of both models; the test checks them first.

The dp 2 x tp 2 run needs fake CPU devices, so it runs in one subprocess
(``python tests/golden_runs.py --multidevice OUT``, XLA_FLAGS set by ``start_multidevice``).

A draft_model proposer with presence / frequency / repetition penalties is not among these runs
(recorded before the fix of the draft's penalty history inside a round); ``tests/test_rounds.py``
checks it: every draft of a model drafting for itself accepted, one step or eight rounds a call,
after slot reuse.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN_PATH = os.path.join(HERE, "golden", "engine_runs.json")
FORMAT = 1
MULTIDEVICE_FLAGS = "--xla_force_host_platform_device_count=8"
# XLA:CPU settings the suite compiles with (tests/conftest.py says why), dropped for the
# fake-device runs: name -> (the suite's XLA_FLAGS value, XLA's default as a compile option)
SUITE_FLAGS = {"xla_backend_optimization_level": ("0", 3),
               "xla_cpu_use_fusion_emitters": ("false", True)}


def xla_defaults() -> dict:
    """``jax.jit`` compiler options that undo the suite's settings in this process's XLA_FLAGS,
    so a program compiles as users compile it."""
    flags = os.environ.get("XLA_FLAGS", "")
    return {name: default for name, (_, default) in SUITE_FLAGS.items() if f"--{name}=" in flags}

MAX_LEN = 48
SECOND_LAYER = 0.2                          # the target's second layer, scaled (build_models)
DRAFT_NOISE = dict(seed=1, scale=0.1)       # the draft: the target's first layer + scale * noise


# ---------------------------------------------------------------------------------------------
# the run table

def _prompts(seed, n, *, shared=0, segment=4, repeats=2, tail=(1, 4)):
    return dict(seed=seed, n=n, shared=shared, segment=segment, repeats=repeats, tail=list(tail))


def make_prompts(seed, n, shared, segment, repeats, tail):
    """n prompts: a shared prefix of ``shared`` tokens, a random segment repeated, a random tail."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(2, 500, shared).tolist()
    out = []
    for _ in range(n):
        seg = rng.integers(2, 500, segment).tolist()
        out.append(prefix + seg * repeats + rng.integers(2, 500, rng.integers(*tail)).tolist())
    return out


# greedy and seeded T = 0.8, with the filters and the penalties (plain and ngram only); five
# requests over four slots
PENALTIES = [
    dict(temperature=0, max_tokens=20, ignore_eos=True),
    dict(temperature=0.8, seed=11, top_k=40, top_p=0.9, min_p=0.05, presence_penalty=0.5,
         frequency_penalty=0.3, repetition_penalty=1.2, max_tokens=20),
    dict(temperature=0, repetition_penalty=1.3, presence_penalty=0.2, max_tokens=16),
    dict(temperature=0.8, seed=12, frequency_penalty=0.5, repetition_penalty=1.1, max_tokens=24,
         min_tokens=2, stop_token_ids=[30, 125]),
    # peaked, so its own tokens repeat and prompt lookup drafts for a sampled row too; the fifth
    # request waits for a slot
    dict(temperature=0.8, seed=13, top_k=3, presence_penalty=0.1, max_tokens=20, ignore_eos=True),
]
# the same without penalties (for draft_model proposers)
NO_PENALTIES = [
    dict(temperature=0, max_tokens=20, ignore_eos=True),
    dict(temperature=0.8, seed=21, top_k=40, top_p=0.9, min_p=0.05, max_tokens=20),
    dict(temperature=0.8, seed=22, max_tokens=24, stop_token_ids=[30, 78]),
    dict(temperature=0, max_tokens=12),
]
# short, so the plain engine's small cache holds them all (no preemption)
SHORT = [dict(p, max_tokens=min(p["max_tokens"], 14)) for p in PENALTIES]
# six long requests over four slots sharing a first block: preemption and prefix cache hits
PREEMPT = [dict(temperature=0, max_tokens=26, ignore_eos=True),
           dict(temperature=0.8, seed=31, top_p=0.9, repetition_penalty=1.2, max_tokens=26,
                ignore_eos=True),
           dict(temperature=0.8, seed=32, presence_penalty=0.4, frequency_penalty=0.2,
                min_p=0.05, max_tokens=26, ignore_eos=True)] * 2

_NGRAM = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
_DRAFT = dict(method="draft_model", model="@draft", num_speculative_tokens=3)
_EAGLE = dict(method="eagle3", model="@eagle", num_speculative_tokens=3)

# block_size 8 and 1 + 16 blocks: 4 short requests fit, 6 long ones (5 blocks each) preempt;
# prompts prefill in chunks of 8 tokens (one step shape)
PLAIN = dict(max_num_seqs=4, max_model_len=MAX_LEN, block_size=8, num_kv_blocks=17,
             max_num_batched_tokens=8, num_scheduler_steps=1)
SPEC = dict(max_num_seqs=4, max_model_len=MAX_LEN)


def _run(name, kind, engine, prompts, params, multidevice=False, preempts=False):
    """``preempts``: the run must preempt (the test checks it still does)."""
    return dict(name=name, kind=kind, engine=engine, prompts=prompts, params=params,
                multidevice=multidevice, preempts=preempts)


RUNS = [
    # plain decoding, one round per call (the plain rounds: functional_generate_plain), a cache
    # small enough to preempt (prefix caching on)
    _run("plain_steps1_greedy_seeded_penalties", "llm", PLAIN, _prompts(0, 5, tail=(1, 2)), SHORT),
    _run("plain_steps1_prefix_cache_preemption", "llm", PLAIN, _prompts(1, 6, shared=8), PREEMPT,
         preempts=True),
    # n-gram prompt lookup: exact, 8 rounds a call
    _run("ngram_exact_steps8", "llm", dict(SPEC, speculative_config=_NGRAM), _prompts(2, 5), PENALTIES),
    # a draft model: exact, 8 rounds a call (rejection sampling: dp2_tp2_draft_rejection)
    _run("draft_exact_steps8", "llm", dict(SPEC, speculative_config=_DRAFT), _prompts(5, 4), NO_PENALTIES),
    # an EAGLE-3 head: exact, 8 rounds a call; rejection sampling with adaptive k, one round a
    # call (its drafts' bits decide its tokens; drafts priced free, so that this head, which
    # accepts little, still drafts)
    _run("eagle_exact_steps8", "llm", dict(SPEC, speculative_config=_EAGLE), _prompts(13, 5),
         PENALTIES),
    _run("eagle_rejection_auto_steps1", "llm", dict(
        SPEC, num_scheduler_steps=1, speculative_config=dict(
            _EAGLE, num_speculative_tokens="auto", acceptance_method="rejection_sampler",
            draft_cost=0.0)),
         _prompts(14, 5), PENALTIES),
    # sfjax.functional: generate (plain); prefill + decode rounds (ngram, typical acceptance: the
    # engine's rounds run these same functional rounds)
    _run("functional_generate_plain", "functional", dict(max_model_len=MAX_LEN, bucket=16),
         _prompts(8, 5), PENALTIES),
    _run("functional_prefill_decode_ngram_typical", "functional", dict(
        max_model_len=MAX_LEN, bucket=16, rounds_per_call=3,
        speculative_config=dict(_NGRAM, acceptance_method="typical_acceptance_sampler")),
         _prompts(9, 5), PENALTIES),
    # fake CPU devices (one subprocess): two data shards x two tensor shards, a draft model (k 2)
    # with rejection sampling, 8 rounds a call
    _run("dp2_tp2_draft_rejection", "llm", dict(SPEC, data_parallel_size=2, tensor_parallel_size=2,
                                                speculative_config=dict(_DRAFT, num_speculative_tokens=2,
                                                                        acceptance_method="rejection_sampler")),
         _prompts(11, 4), NO_PENALTIES, multidevice=True),
]

RUNS_BY_NAME = {r["name"]: r for r in RUNS}
assert len(RUNS_BY_NAME) == len(RUNS)


def definition(run: dict) -> dict:
    """What a record repeats of its run (the table's entry, with the prompts' token ids)."""
    return dict(name=run["name"], kind=run["kind"], engine=run["engine"], prompt_spec=run["prompts"],
                prompt_token_ids=make_prompts(**run["prompts"]), params=run["params"],
                multidevice=run["multidevice"], preempts=run["preempts"])


# ---------------------------------------------------------------------------------------------
# the models

def weights_digest(folder: str) -> str:
    """sha256 over the folder's tensors (names, dtypes, shapes, bytes) and its config.json."""
    from safetensors.numpy import load_file
    h = hashlib.sha256()
    with open(os.path.join(folder, "config.json"), "rb") as f:
        h.update(f.read())
    for fname in sorted(os.listdir(folder)):
        if fname.endswith(".safetensors"):
            tensors = load_file(os.path.join(folder, fname))
            for name in sorted(tensors):
                a = np.ascontiguousarray(tensors[name])
                h.update(f"{name}:{a.dtype}:{a.shape};".encode())
                h.update(a.tobytes())
    return h.hexdigest()


def build_models(root: str) -> dict:
    """The tiny target, draft and EAGLE-3 head as HF folders under ``root``, deterministic
    from their seeds.

    The target is ``toy.tiny_config()`` from seed 0 (std 0.1) with its second layer's output
    projections scaled by ``SECOND_LAYER``, so that the draft, the target's first layer (with
    its embeddings, final norm and head) plus seeded noise, agrees with it often but not always.
    """
    from sfjax import toy, weights as W

    cfg = toy.tiny_config()
    w = W.init_random(cfg, 0, std=0.1)
    scale = np.ones((cfg.num_layers, 1, 1), np.float32)
    scale[1:] = SECOND_LAYER
    w = dataclasses.replace(w, wo=w.wo * scale, w_down=w.w_down * scale)
    target = toy.build_model_folder(os.path.join(root, "target"), cfg, weights=w)
    noise = W.init_random(cfg, DRAFT_NOISE["seed"], std=0.1)
    dcfg = dataclasses.replace(cfg, num_layers=1)
    fields = {}
    for f in dataclasses.fields(w):
        a, n = getattr(w, f.name), getattr(noise, f.name)
        if a is not None:
            if f.name in W.LAYER_FIELDS:
                a, n = a[:1], n[:1]
            a = a if f.name.endswith("norm") else a + DRAFT_NOISE["scale"] * n
        fields[f.name] = a
    draft = toy.build_model_folder(os.path.join(root, "draft"), dcfg, weights=W.Weights(**fields))
    return dict(target=target, draft=draft, eagle=_eagle_head(os.path.join(root, "eagle"), cfg))


def _eagle_head(path: str, target) -> str:
    """An EAGLE-3 head for the target from seed 7 (std 0.2): a draft vocabulary of 256 of its
    512 ids, fusing the input of layers 0, 1, 1. It accepts a few drafts, so rounds are ragged."""
    from sfjax.config import ModelConfig
    from sfjax.spec import eagle

    layer = ModelConfig(vocab_size=target.vocab_size, hidden_size=target.hidden_size,
                        intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2,
                        head_dim=16, rope_theta=target.rope_theta, rms_norm_eps=1e-5,
                        max_position_embeddings=target.max_position_embeddings)
    cfg = eagle.HeadConfig(layer=layer, draft_vocab_size=256, target_hidden_size=target.hidden_size,
                           aux_layers=(0, 1, 1))
    eagle.save(path, cfg, eagle.init_random(cfg, seed=7, std=0.2))
    return path


# ---------------------------------------------------------------------------------------------
# executing a run

class Context:
    """The models, and the engines and compiled functional programs, shared between runs."""

    def __init__(self, root: str | None = None):
        self.root = root or tempfile.mkdtemp(prefix="sfjax-golden-")
        self.models = build_models(self.root)
        self.digests = {k: weights_digest(v) for k, v in self.models.items()}
        self._engines: dict = {}
        self._functional: dict = {}

    def _resolve(self, spec: dict | None) -> dict | None:
        if spec is None:
            return None
        return {k: self.models[v[1:]] if isinstance(v, str) and v.startswith("@") else v
                for k, v in spec.items()}

    def llm(self, engine: dict):
        from sfjax import LLM
        key = json.dumps(engine, sort_keys=True)
        if key not in self._engines:
            kw = dict(engine)
            kw["speculative_config"] = self._resolve(kw.get("speculative_config"))
            self._engines[key] = LLM(self.models["target"], **kw)
        return self._engines[key]


def _spec_counts(m: dict | None):
    if m is None:
        return None
    return [m["num_drafts"], m["num_draft_tokens"], m["num_accepted_tokens"]]


def _run_llm(ctx: Context, run: dict) -> dict:
    from sfjax import SamplingParams
    llm = ctx.llm(run["engine"])
    before = llm.get_metrics()["num_preemptions"]
    prompts = [{"prompt_token_ids": p} for p in make_prompts(**run["prompts"])]
    outs = llm.generate(prompts, [SamplingParams(**p) for p in run["params"]], use_tqdm=False)
    requests = [dict(token_ids=list(o.outputs[0].token_ids), finish_reason=o.outputs[0].finish_reason,
                     spec=_spec_counts(o.metrics.spec_decode)) for o in outs]
    return dict(requests=requests, num_preemptions=llm.get_metrics()["num_preemptions"] - before)


def _run_functional(ctx: Context, run: dict) -> dict:
    import jax
    from sfjax import SamplingParams, functional as F, weights as W
    from sfjax.config import ModelConfig

    e = run["engine"]
    spec = ctx._resolve(e.get("speculative_config"))
    key = json.dumps(e, sort_keys=True)
    if key not in ctx._functional:
        cfg = ModelConfig.from_folder(ctx.models["target"])
        weights = W.load_hf(ctx.models["target"], cfg)
        draft = None
        if spec is not None and spec["method"] == "draft_model":
            dcfg = ModelConfig.from_folder(spec["model"])
            draft = W.load_hf(spec["model"], dcfg)
        fcfg = F.Config(cfg, e["max_model_len"], speculative_config=spec)
        width = e["max_model_len"] - e["bucket"]
        if "rounds_per_call" in e:
            prefill = jax.jit(lambda w, dw, ids, lens, s: F.prefill(w, ids, lens, s, fcfg, dw))
            decode = jax.jit(lambda w, dw, st, n: F.decode(w, st, fcfg, n, dw))
            outputs = jax.jit(lambda st: F.outputs(st, width))

            def program(w, dw, ids, lens, s, n=e["rounds_per_call"]):
                st = prefill(w, dw, ids, lens, s)
                while not bool(jax.device_get(st.done).all()):
                    st = decode(w, dw, st, n)
                return outputs(st)
        else:
            program = jax.jit(lambda w, dw, ids, lens, s: F.generate(w, ids, lens, s, fcfg, dw, width=width))
        ctx._functional[key] = (cfg, weights, draft, program)
    cfg, weights, draft, program = ctx._functional[key]
    ids, lens = F.pad_prompts(make_prompts(**run["prompts"]), length=e["bucket"])
    sampling = F.Sampling.from_params([SamplingParams(**p) for p in run["params"]],
                                      eos_token_ids=cfg.eos_token_ids)
    out = jax.device_get(program(weights, draft, ids, lens, sampling))
    requests = []
    for i in range(ids.shape[0]):
        n = int(out.num_tokens[i])
        requests.append(dict(
            token_ids=out.token_ids[i, :n].tolist(), finished=bool(out.finished[i]),
            spec=None if spec is None else [int(out.num_drafts[i]), int(out.num_draft_tokens[i]),
                                            int(out.num_accepted_tokens[i])]))
    return dict(requests=requests)


def execute(ctx: Context, run: dict) -> dict:
    """Runs one table entry; returns its record: the definition and what the engine gave."""
    result = (_run_functional if run["kind"] == "functional" else _run_llm)(ctx, run)
    return dict(definition(run), **result)


def differences(want: dict, got: dict) -> list[str]:
    """What differs between a recorded run and a fresh one, each line naming run and request."""
    name = want["name"]
    keys = ("kind", "engine", "prompt_spec", "prompt_token_ids", "params", "multidevice", "preempts")
    changed = [k for k in keys if want.get(k) != got.get(k)]
    if changed:
        return [f"{name}: the run table's {', '.join(changed)} differ from the recording (a changed "
                f"table needs a new recording: scripts/record_golden.py on a pristine tree)"]
    out = []
    if len(want["requests"]) != len(got["requests"]):
        return [f"{name}: {len(got['requests'])} requests, recorded {len(want['requests'])}"]
    for i, (w, g) in enumerate(zip(want["requests"], got["requests"])):
        where = f"{name} request {i} ({json.dumps(want['params'][i], sort_keys=True)})"
        if w["token_ids"] != g["token_ids"]:
            t, u = w["token_ids"], g["token_ids"]
            p = next((j for j, (a, b) in enumerate(zip(t, u)) if a != b), min(len(t), len(u)))
            out.append(f"{where}: token ids differ from output position {p}: got {u[p:p + 8]}... "
                       f"({len(u)} tokens), recorded {t[p:p + 8]}... ({len(t)} tokens)")
        for k in ("finish_reason", "finished"):
            if w.get(k) != g.get(k):
                out.append(f"{where}: {k} {g.get(k)!r}, recorded {w.get(k)!r}")
        if w["spec"] != g["spec"]:
            out.append(f"{where}: spec counters [drafts, draft tokens, accepted] {g['spec']}, "
                       f"recorded {w['spec']}")
    return out


# ---------------------------------------------------------------------------------------------
# the fake-device runs, in one subprocess

def multidevice_runs() -> list[dict]:
    return [r for r in RUNS if r["multidevice"]]


def start_multidevice(out_path: str) -> subprocess.Popen:
    """Starts the subprocess that executes the fake-device runs into ``out_path`` (JSON), at
    XLA's defaults: the suite's compile settings (tests/conftest.py, ``SUITE_FLAGS``) dropped, so
    the recorded tokens are checked as users compile them too."""
    inherited = [f for f in os.environ.get("XLA_FLAGS", "").split()
                 if f.split("=")[0].removeprefix("--") not in SUITE_FLAGS]
    env = dict(os.environ, XLA_FLAGS=" ".join([*inherited, MULTIDEVICE_FLAGS]))
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--multidevice", out_path],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish_multidevice(proc: subprocess.Popen, out_path: str, timeout: float = 600) -> dict:
    """Waits for the subprocess; returns {"digests": ..., "records": {name: record}}."""
    log, _ = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"the multidevice golden runs failed (rc {proc.returncode}):\n{log[-6000:]}")
    with open(out_path) as f:
        return json.load(f)


def _multidevice_main(out_path: str) -> None:
    import jax
    assert jax.device_count() == 8, f"{jax.device_count()} devices: XLA_FLAGS={MULTIDEVICE_FLAGS} needed"
    ctx = Context(os.path.join(os.path.dirname(os.path.abspath(out_path)), "multidevice-models"))
    records = {r["name"]: execute(ctx, r) for r in multidevice_runs()}
    import sfjax
    with open(out_path, "w") as f:
        json.dump(dict(digests=ctx.digests, records=records, sfjax=os.path.abspath(sfjax.__file__)), f)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--multidevice":
        sys.path.insert(0, HERE)
        _multidevice_main(sys.argv[2])
    else:
        sys.exit("usage: python tests/golden_runs.py --multidevice OUT.json")
