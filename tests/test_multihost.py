"""scripts/tpu_pod_generate.py as two JAX processes on this machine (4 fake CPU devices each,
joined by ``jax.distributed.initialize``, collectives over gloo) gives the single-process tokens,
from an HF folder and from an orbax export; only process 0 prints them."""

import json
import re
import os
import socket
import subprocess
import sys

import jax
import pytest

from sfjax import LLM, SamplingParams
from sfjax.cli import main as cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import jax", "class Cache:"]
FLAGS = ["--max-tokens", "8", "--ignore-eos", "--max-model-len", "64", "--max-num-seqs", "4",
         "--temperature", "1.0", "--top-p", "0.9", "--seed", "7", "--json"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(model: str, prompts: str, tp: int, dp: int) -> list[str]:
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"
    env = dict(os.environ, XLA_FLAGS=flags.strip(),
               JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "tpu_pod_generate.py"), "--model", model,
           "--prompts", prompts, "--tensor-parallel-size", str(tp), "--data-parallel-size", str(dp),
           "--coordinator-address", f"127.0.0.1:{_free_port()}", "--num-processes", "2", *FLAGS]
    procs = [subprocess.Popen([*cmd, "--process-id", str(i)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out[-3000:] + err[-6000:]
    # gloo writes "[Gloo] Rank i is connected ..." to stdout; ours is one JSON line
    return [[line for line in out.splitlines() if line.startswith("[{")] for out, _ in outs]


@pytest.fixture(scope="module")
def reference(tiny_folder):
    llm = LLM(tiny_folder, max_model_len=64, max_num_seqs=4)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the 2 processes run on fake CPU devices; "
                    "an in-process reference on a GPU or TPU would not give their bits")
@pytest.mark.parametrize("source, tp, dp", [("hf", 4, 2), ("orbax", 2, 4)])
def test_two_processes_equal_one(tiny_folder, reference, tmp_path, source, tp, dp):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    model = tiny_folder
    if source == "orbax":
        model = str(tmp_path / "export")
        assert cli(["convert", tiny_folder, model]) == 0
    printed = _two_processes(model, str(prompts), tp, dp)
    assert len(printed[0]) == 1 and printed[1] == []             # process 0 alone prints
    got = json.loads(printed[0][0])
    assert [o["prompt"] for o in got] == PROMPTS
    assert [o["token_ids"] for o in got] == reference


def test_pod_flags_are_refused_naming_the_flag(tiny_folder, tmp_path, capsys):
    """Refused before anything loads, each naming its flag (a raw ZeroDivisionError, dp 0 run
    as the default, a process id past the count run as one process, JSON errors naming neither
    the flag nor the line, before)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "tpu_pod_generate", os.path.join(ROOT, "scripts", "tpu_pod_generate.py"))
    pod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pod)
    text, jsonl = tmp_path / "p.txt", tmp_path / "p.jsonl"
    text.write_text("def f\n")
    jsonl.write_text('{"prompt": "a"}\n\nnot json\n')
    base = ["--model", tiny_folder, "--prompts", str(text), "--num-processes", "1"]
    for extra, message in (
            (["--tensor-parallel-size", "0"], "--tensor-parallel-size 0 must be >= 1"),
            (["--data-parallel-size", "0"], "--data-parallel-size 0 must be >= 1"),
            (["--process-id", "3"], r"--process-id \(or JAX_PROCESS_ID\) 3 must be in \[0, 1\)"),
            (["--speculative-config", "{bad"], "--speculative-config is not valid JSON"),
            (["--prompts", str(jsonl)], "--prompts '.*p.jsonl' line 3: not valid JSON")):
        assert pod.main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert re.search(message, err), err
