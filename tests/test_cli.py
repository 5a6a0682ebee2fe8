"""The ``sfjax`` command: generate, bench (vLLM's labels, --compare-hf), help and errors."""

import json

import pytest

from sfjax.cli import main


def test_generate_json_with_speculation(tiny_folder, capsys):
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    assert main(["generate", "hello world", "def f(x):", "--model", tiny_folder, "--max-tokens", "6",
                 "--ignore-eos", "--speculative-config", spec, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    out = result["outputs"]
    assert [len(o["token_ids"]) for o in out] == [6, 6]
    assert all(o["spec_decode"] is not None for o in out)
    assert result["model"] == tiny_folder and result["speculation"].startswith("ngram (k = 3")
    t = result["timings"]
    assert t["output_tokens"] == 12 and t["generate_s"] > 0 and t["load_s"] > 0
    assert t["compile_s"] is None and t["generate_includes_compile"] is True
    spec = result["spec_decode"]
    assert spec["num_draft_tokens"] == sum(o["spec_decode"]["num_draft_tokens"] for o in out)
    assert 0 <= spec["acceptance_rate"] <= 1


def test_generate_names_the_model_and_method_and_keeps_quiet(tiny_folder):
    """A fresh process, as a user runs it: JAX's backend probing is not shown on a CPU machine."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    run = subprocess.run([sys.executable, "-m", "sfjax", "generate", "hi", "--model", tiny_folder,
                          "--max-tokens", "2"], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0] == f"model: {tiny_folder}; speculation: off"
    assert "Unable to initialize backend" not in run.stderr and "Traceback" not in run.stderr
    assert "KV cache:" in run.stderr                     # sfjax's own messages still are


def test_bench_prints_vllm_labels_and_compares_with_hf(tiny_folder, capsys):
    assert main(["bench", "--model", tiny_folder, "--num-prompts", "3", "--input-len", "8", "--repeats", "2",
                 "--output-len", "5", "--max-num-seqs", "2", "--compare-hf"]) == 0     # interleaved
    text = capsys.readouterr().out
    for label in ("Successful requests:", "Benchmark duration (s):", "Total token throughput (tok/s):",
                  "Output token throughput (tok/s):", "Mean TTFT (ms):", "Median TTFT (ms):",
                  "P99 TTFT (ms):", "Mean TPOT (ms):", "Median TPOT (ms):", "P99 TPOT (ms):",
                  "Mean ITL (ms):", "Median ITL (ms):", "P99 ITL (ms):", "HF plain (tok/s):",
                  "HF prompt_lookup (tok/s):", "sfjax / HF best:"):
        assert label in text
    assert "Successful requests:                    3" in text


def test_bench_json_reports_acceptance(tiny_folder, capsys):
    spec = json.dumps({"method": "draft_model", "model": tiny_folder, "num_speculative_tokens": 2})
    assert main(["bench", "--model", tiny_folder, "--num-prompts", "2", "--input-len", "8", "--repeats", "1",
                 "--output-len", "6", "--speculative-config", spec, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)["sfjax"]
    assert r["output_tokens"] == 12 and len(r["ttft"]) == 2
    assert r["spec"]["acceptance_rate"] == 1.0          # the draft is the target


@pytest.mark.parametrize("argv,message", [
    (["generate", "x", "--model", "/nonexistent"], "is not a folder"),
    (["generate", "x", "--speculative-config", "{bad json"], "--speculative-config is not valid JSON"),
    (["generate", "x", "--speculative-config", "notjson"], "--speculative-config is not valid JSON"),
    (["generate", "ab\udcff"], "prompt 0 = 'ab\\udcff' is not valid text"),      # a non-UTF-8 argv
    (["generate", "x", "--temperature", "nan"], "SamplingParams.temperature = nan is out of range"),
    (["generate", "x", "--temperature", "inf"], "SamplingParams.temperature = inf is out of range"),
    (["generate", "x", "--top-p", "0"], "SamplingParams.top_p = 0.0 is out of range"),
    (["generate", "x", "--max-tokens", "0"], "SamplingParams.max_tokens = 0 is out of range"),
    (["generate", "x", "--seed", "-1"], "SamplingParams.seed = -1 is out of range"),
    (["generate", "x", "--max-model-len", "0"], "EngineConfig.max_model_len = 0 is out of range"),
    (["generate", "x", "--block-size", "0"], "block_size"),
    (["generate", "x", "--num-kv-blocks", "1"], "EngineConfig.num_kv_blocks = 1 is out of range"),
    (["generate", "x", "--kv-cache-bytes", "0"], "EngineConfig.kv_cache_bytes = 0 is out of range"),
    (["generate", "x", "--max-num-seqs", "0"], "EngineConfig.max_num_seqs = 0 is out of range"),
    (["generate", "x", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2.5}'],
     "speculative_config.num_speculative_tokens = 2.5 has type float"),
    (["generate", "x", "--file", "/nonexistent/prompts.txt"], "--file /nonexistent/prompts.txt: No such file"),
    (["generate", "x", "--speculative-config", "[1]"], "must be a JSON object"),
    (["generate"], "no prompts"),
    (["generate", "x", "--compiler-options", "{bad"], "--compiler-options is not valid JSON"),
    (["generate", "x", "--compiler-options", "[1]"], "--compiler-options must be a JSON object"),
    (["generate", "x", "--compiler-options", '{"xla_no_such_option": 1}'],
     "EngineConfig.compiler_options = {'xla_no_such_option': 1}: XLA refused them"),
    (["generate", "x", "--cpu-threads", "0"], "cpu_threads: 0 is not an int in 1.."),
    (["bench", "--base-url", "http://127.0.0.1:1", "--request-rate", "0"],
     "--request-rate = 0.0 is out of range: must be a number > 0.0"),
    (["bench", "--base-url", "http://127.0.0.1:1", "--num-prompts", "0"], "--num-prompts = 0"),
    (["bench", "--base-url", "http://127.0.0.1:1", "--max-concurrency", "0"], "--max-concurrency = 0"),
    (["bench", "--base-url", "http://127.0.0.1:1", "--top-p", "0"], "SamplingParams.top_p = 0.0"),
    (["bench", "--base-url", "http://127.0.0.1:1", "--compare-hf"], "--compare-hf: not with --base-url"),
    (["bench", "--base-url", "http://127.0.0.1:1"], "--base-url http://127.0.0.1:1: ConnectError"),
    (["bench", "--base-url", "http://127.0.0.1:1", "--block-size", "32"], "--block-size: an "
     "engine flag; with --base-url the server's engine runs"),
])
def test_errors_are_one_line_and_exit_2(argv, message, capsys, tiny_folder):
    if "--model" not in argv and "--base-url" not in argv:
        argv = argv + ["--model", tiny_folder]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and err.startswith(f"sfjax {argv[0]}: error:")


def test_cpu_threads_off_linux_is_a_one_line_error(monkeypatch, capsys, tiny_folder):
    monkeypatch.delattr("os.sched_setaffinity", raising=False)
    assert main(["generate", "x", "--cpu-threads", "1", "--model", tiny_folder]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("sfjax generate: error: --cpu-threads 1: this platform can't set thread "
                   "affinity (Linux only)")


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0 and "--speculative-config" in capsys.readouterr().out


def test_generate_precompile_times_compilation_apart(tiny_folder, capsys):
    assert main(["generate", "hi", "--model", tiny_folder, "--max-tokens", "3", "--max-num-seqs", "1",
                 "--max-num-batched-tokens", "16", "--max-model-len", "32", "--precompile"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("load ") and "; compile " in last and "generate 3 tokens" in last


def test_convert_to_orbax_and_back(tiny_folder, tmp_path, capsys):
    import numpy as np
    import jax
    from sfjax import LLM, SamplingParams
    from sfjax import weights as W
    from sfjax.config import ModelConfig

    ckpt, back = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    assert main(["convert", tiny_folder, ckpt]) == 0
    assert main(["convert", ckpt, back]) == 0
    cfg = ModelConfig.from_folder(tiny_folder)
    for a, b in zip(jax.tree.leaves(W.load_hf(tiny_folder, cfg)), jax.tree.leaves(W.load_orbax(ckpt, cfg))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ids = [o.outputs[0].token_ids for o in LLM(back, max_model_len=64).generate(["def f(x):"], params, use_tqdm=False)]
    assert ids == [o.outputs[0].token_ids for o in
                   LLM(tiny_folder, max_model_len=64).generate(["def f(x):"], params, use_tqdm=False)]
    capsys.readouterr()
    assert main(["convert", tiny_folder, ckpt]) == 2                      # not empty
    assert "exists and is not empty" in capsys.readouterr().err


def test_convert_carries_a_slow_tokenizers_files(tiny_folder, tmp_path):
    """A folder whose tokenizer is a slow one's files (vocab.json + merges.txt, no
    tokenizer.json) converts to an export with them (it had none, and the empty tokenizer
    transformers then makes gave every prompt no tokens); a folder with no tokenizer at all is
    refused naming what it lacks."""
    import json
    import shutil

    from sfjax.tokenizer import encode, load_tokenizer

    slow = shutil.copytree(tiny_folder, tmp_path / "slow")
    model = json.loads((slow / "tokenizer.json").read_text())["model"]
    (slow / "vocab.json").write_text(json.dumps(model["vocab"]))
    (slow / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in model["merges"]))
    (slow / "tokenizer.json").unlink()
    config = json.loads((slow / "tokenizer_config.json").read_text())
    (slow / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    want = encode(load_tokenizer(str(slow)), "def fib(n): return n")
    assert len(want) > 3
    assert main(["convert", str(slow), str(tmp_path / "ckpt")]) == 0
    assert encode(load_tokenizer(str(tmp_path / "ckpt")), "def fib(n): return n") == want
    for name in ("vocab.json", "merges.txt"):
        (slow / name).unlink()
    with pytest.raises(ValueError, match=r"no tokenizer in .* \(tokenizer.json, or a slow tokenizer's"):
        load_tokenizer(str(slow))


def test_convert_round_trips_qwen_biases_and_head_norms_and_reads_checkpoints_without_them(
        model_folder, tmp_path):
    """A Qwen2 export keeps its q/k/v biases, a Qwen3 export its head norms; an export of a
    model without them, saved before Weights had the fields (no keys for them), still
    restores."""
    import dataclasses
    import json
    import os

    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from sfjax import toy
    from sfjax import weights as W
    from sfjax.config import ModelConfig

    def same(a, b):
        assert [f for f in W.layer_arrays(a)] == [f for f in W.layer_arrays(b)]
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    for kind in ("qwen2", "qwen3"):
        qwen = model_folder(dataclasses.replace(toy.tiny_config(), model_type=kind),
                            norm_jitter=0.3)
        assert main(["convert", qwen, str(tmp_path / kind)]) == 0
        cfg = ModelConfig.from_folder(str(tmp_path / kind))
        assert (cfg.qkv_bias, cfg.qk_norm) == (kind == "qwen2", kind == "qwen3")
        assert cfg == ModelConfig.from_folder(qwen)
        same(W.load_orbax(str(tmp_path / kind), cfg), W.load_hf(qwen, cfg))
    cfg = toy.tiny_config()
    w = W.init_random(cfg, seed=3)
    old = tmp_path / "old"
    os.makedirs(old)
    (old / "config.json").write_text(json.dumps(cfg.to_hf_config()))
    with ocp.StandardCheckpointer() as ckptr:           # the tree as exports before the biases
        ckptr.save(str(old / W.ORBAX_DIR), {f.name: getattr(w, f.name)
                                            for f in dataclasses.fields(w)
                                            if f.name not in W.BIAS_FIELDS + W.HEAD_NORM_FIELDS})
    same(W.load_orbax(str(old), cfg), w)


def test_a_save_replaces_the_last_saves_weights_and_a_damaged_export_is_named(tiny_folder,
                                                                              tmp_path, capsys):
    """save_hf into a folder an earlier save wrote leaves only its own layout (a stale index or
    single file beside it had sfjax and transformers read different weights), other files
    kept; an export whose orbax folder lost its metadata is one error naming it (a raw
    TypeError before)."""
    import dataclasses
    import os
    import shutil

    import numpy as np
    from safetensors.numpy import save_file
    from sfjax import toy
    from sfjax import weights as W

    cfg = toy.tiny_config()
    old, new = W.init_random(cfg, seed=1), W.init_random(cfg, seed=2)
    for first, second in ((60_000, None), (None, 60_000)):
        path = str(tmp_path / f"save-{first}")
        W.save_hf(path, cfg, old, max_shard_bytes=first)
        save_file({"other": np.zeros(2, np.int32)},                    # not the weights'
                  os.path.join(path, "ngram_table.safetensors"))
        W.save_hf(path, cfg, new, max_shard_bytes=second)
        files = sorted(os.listdir(path))
        assert ("model.safetensors" in files) == (second is None)
        assert ("model.safetensors.index.json" in files) == (second is not None)
        assert "ngram_table.safetensors" in files
        assert sum(f.startswith("model-") for f in files) == (0 if second is None else
                                                               len(files) - 3)
        np.testing.assert_array_equal(np.asarray(W.load_hf(path, cfg).embed),
                                      np.asarray(new.embed))
        with pytest.raises(Exception):                      # a save that fails keeps the last
            W.save_hf(path, cfg, dataclasses.replace(old, embed=None), max_shard_bytes=first)
        np.testing.assert_array_equal(np.asarray(W.load_hf(path, cfg).embed),
                                      np.asarray(new.embed))
    export = str(tmp_path / "export")
    assert main(["convert", tiny_folder, export]) == 0
    os.remove(os.path.join(export, W.ORBAX_DIR, "_METADATA"))
    capsys.readouterr()
    assert main(["convert", export, str(tmp_path / "again")]) == 2
    assert "incomplete or damaged" in capsys.readouterr().err
    shutil.rmtree(os.path.join(export, W.ORBAX_DIR))
    os.makedirs(os.path.join(export, W.ORBAX_DIR))                  # a copy cut short
    assert main(["convert", export, str(tmp_path / "again2")]) == 2
    assert "incomplete or damaged" in capsys.readouterr().err


def test_convert_carries_the_ngram_table(tiny_folder, tmp_path):
    import shutil
    from sfjax.config import ModelConfig
    from sfjax.spec import table as T

    src = tmp_path / "src"
    shutil.copytree(tiny_folder, src)
    vocab = ModelConfig.from_folder(tiny_folder).vocab_size
    T.save(T.build([[1, 2, 3, 1, 2, 4]], vocab, min_count=1), str(src / T.TABLE_FILE))
    assert main(["convert", str(src), str(tmp_path / "ckpt")]) == 0
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    for d in ("ckpt", "hf"):
        assert (tmp_path / d / T.TABLE_FILE).read_bytes() == (src / T.TABLE_FILE).read_bytes()


def test_orbax_checkpoint_of_another_config_is_refused(tiny_folder, tmp_path):
    from sfjax import toy
    from sfjax import weights as W

    ckpt = str(tmp_path / "ckpt")
    assert main(["convert", tiny_folder, ckpt]) == 0
    with pytest.raises(ValueError, match=r"weights\.\w+ has shape"):
        W.load_orbax(ckpt, toy.tiny_config(hidden_size=96, num_heads=6, num_kv_heads=3))


def test_serve_takes_only_the_flags_it_uses():
    """Sampling and output flags are each HTTP request's own: ``sfjax serve`` refuses them
    rather than ignoring them; the engine's seed and ``--precompile`` it takes."""
    from sfjax.cli import build_parser

    args = build_parser().parse_args(["serve", "--seed", "3", "--precompile"])
    assert args.seed == 3 and args.precompile
    for flag in (["--temperature", "0"], ["--top-p", "0.9"], ["--json"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *flag])


def _no_model(*args, **kwargs):
    raise AssertionError("the model loaded before the flags were checked")


@pytest.mark.parametrize("argv,message", [
    (["serve", "--port", "70000"], "--port = 70000 is out of range: must be an int in [0, 65535]"),
    (["serve", "--port", "-1"], "--port = -1 is out of range: must be an int in [0, 65535]"),
    (["serve", "--shutdown-timeout", "nan"], "--shutdown-timeout = nan is out of range: must be a finite number >= 0"),
    (["serve", "--shutdown-timeout", "inf"], "--shutdown-timeout = inf is out of range"),
    (["serve", "--shutdown-timeout", "-1"], "--shutdown-timeout = -1.0 is out of range"),
    (["serve", "--max-waiting", "-1"], "--max-waiting = -1 is out of range: must be an int >= 0"),
    (["bench", "--num-prompts", "-1"], "--num-prompts = -1 is out of range: must be an int >= 1"),
    (["bench", "--num-prompts", "0"], "--num-prompts = 0 is out of range: must be an int >= 1"),
    (["bench", "--input-len", "-5"], "--input-len = -5 is out of range: must be an int >= 1"),
    (["bench", "--input-len", "0"], "--input-len = 0 is out of range"),
    (["bench", "--output-len", "0"], "--output-len = 0 is out of range: must be an int >= 1"),
    (["bench", "--repeats", "0"], "--repeats = 0 is out of range: must be an int >= 1"),
    (["bench", "--request-rate", "-1"], "--request-rate = -1.0 is out of range: must be a number > 0.0"),
    (["bench", "--request-rate", "nan"], "--request-rate = nan is out of range"),
    (["bench", "--max-concurrency", "0"], "--max-concurrency = 0 is out of range"),
    (["bench", "--max-concurrency", "2"], "--max-concurrency: only with --base-url"),
    (["bench", "--request-rate", "5"], "--request-rate: only with --base-url"),
    (["bench", "--compare-offline"], "--compare-offline: only with --base-url"),
    (["bench", "--top-p", "0"], "SamplingParams.top_p = 0.0 is out of range"),
    (["bench", "--seed", "-1"], "SamplingParams.seed = -1 is out of range"),
    (["bench", "--base-url", "http://127.0.0.1:1", "--input-len", "-5"], "--input-len = -5 is out of range"),
    (["bench", "--base-url", "http://127.0.0.1:1", "--output-len", "0"], "--output-len = 0 is out of range"),
    (["bench", "--base-url", "http://127.0.0.1:1", "--repeats", "0"], "--repeats = 0 is out of range"),
])
def test_bad_flags_are_refused_before_the_model_loads(argv, message, monkeypatch, capsys):
    monkeypatch.setattr("sfjax.cli._llm", _no_model)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and err.startswith(f"sfjax {argv[0]}: error:")


@pytest.mark.parametrize("base_url", [[], ["--base-url", "http://127.0.0.1:1"]])
@pytest.mark.parametrize("name,content,message", [
    ("p.jsonl", '{"prompt": "a"}\n\n{"text": "b"}\n',
     "line 3: must be a JSON object with a \"prompt\""),
    ("p.jsonl", '{"prompt": "a"}\n{bad\n', "line 2: not valid JSON"),
    ("p.jsonl", '["a"]\n', "line 1: must be a JSON object with a \"prompt\""),
    ("p.jsonl", '{"prompt": 5}\n', "line 1: \"prompt\" = 5 has type int: must be a str"),
    ("p.jsonl", '{"prompt": "\\ud800"}\n', "line 1: \"prompt\" = '\\ud800' is not valid text"),
    ("p.txt", b"ok\n\xff\xfe\n", "line 2: not UTF-8 text"),
    ("p.txt", "\n  \n", "has no prompts"),
])
def test_bad_prompts_files_name_the_flag_the_file_and_the_line(name, content, message, base_url,
                                                               tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sfjax.cli._llm", _no_model)
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert main(["bench", "--prompts-file", str(path), *base_url]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("sfjax bench: error: ")
    assert f"--prompts-file {str(path)!r}" in err and message in err


def test_missing_prompts_file_names_the_flag(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sfjax.cli._llm", _no_model)
    path = str(tmp_path / "none.txt")
    assert main(["bench", "--prompts-file", path]) == 2
    assert f"--prompts-file {path!r}: No such file" in capsys.readouterr().err


def test_read_prompts_takes_the_first_num(tmp_path):
    from sfjax import benchmark as B

    (tmp_path / "p.txt").write_text("def f\n\nimport os\r\nclass A\n")
    assert B.read_prompts(str(tmp_path / "p.txt")) == ["def f", "import os", "class A"]
    assert B.read_prompts(str(tmp_path / "p.txt"), 2) == ["def f", "import os"]
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n{bad\n')
    assert B.read_prompts(str(tmp_path / "p.jsonl"), 2) == ["a", "b"]


def test_serve_takes_port_zero_and_a_zero_shutdown_timeout():
    """Port 0 asks the OS for a free port (as uvicorn does); 0 s of grace aborts at once."""
    from sfjax.cli import build_parser
    from sfjax.serve.cli import check_args

    args = build_parser().parse_args(["serve", "--port", "0", "--shutdown-timeout", "0",
                                      "--max-waiting", "0"])
    check_args(args)
    args = build_parser().parse_args(["serve", "--port", "65535"])
    check_args(args)
