"""``sfjax.cpu.limit_cpu_threads``: XLA:CPU's pool on fewer cores, started before the backends,
gives the tokens of the default pool; bad values and a late call are refused."""

import json
import os
import subprocess
import sys

import pytest

from sfjax import LLM, SamplingParams
from sfjax.cpu import limit_cpu_threads

PROMPTS = [{"prompt_token_ids": [7, 300, 12, 45, 99]}, {"prompt_token_ids": [5, 9, 11] * 3}]
PARAMS = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
          SamplingParams(temperature=0.8, seed=4, max_tokens=10, ignore_eos=True)]
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}

# A fresh process: limit the pool, decode (speculating: tiles of 2, 4 and 8 rows), report
# each thread's cores.
CHILD = """
import json, os, sys
from sfjax.cpu import limit_cpu_threads
limit_cpu_threads(1)
from sfjax import LLM, SamplingParams
sys.path.insert(0, {tests!r})
from test_cpu import PROMPTS, PARAMS, SPEC
ids = [o.outputs[0].token_ids for o in LLM({folder!r}, max_num_seqs=2, max_model_len=64,
       speculative_config=SPEC).generate(PROMPTS, PARAMS, use_tqdm=False)]
cores = {{t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}}
print(json.dumps({{"ids": ids, "cores": cores, "main": sorted(os.sched_getaffinity(0))}}))
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="thread affinity is Linux's")
def test_one_thread_pool_gives_the_default_pools_tokens(tiny_folder):
    here = os.path.dirname(os.path.abspath(__file__))
    run = subprocess.run([sys.executable, "-c", CHILD.format(tests=here, folder=tiny_folder)],
                         capture_output=True, text=True, cwd=os.path.dirname(here))
    assert run.returncode == 0, run.stderr[-3000:]
    child = json.loads(run.stdout.strip().splitlines()[-1])
    ids = [o.outputs[0].token_ids for o in LLM(tiny_folder, max_num_seqs=2, max_model_len=64,
                                               speculative_config=SPEC)
           .generate(PROMPTS, PARAMS, use_tqdm=False)]
    assert child["ids"] == ids
    everything = sorted(os.sched_getaffinity(0))
    assert child["main"] == everything                      # the caller keeps all its cores
    if len(everything) > 1:                                 # the threads JAX started: the last one
        assert [everything[-1]] in child["cores"].values()


@pytest.mark.parametrize("threads", [0, -1, 10**6, 1.0, "1", True])
def test_bad_thread_counts_are_refused(threads):
    with pytest.raises(ValueError, match=r"cpu_threads: .* is not an int in 1\.\.\d+"):
        limit_cpu_threads(threads)


def test_a_call_after_the_backends_started_is_refused():
    import jax
    jax.devices()
    with pytest.raises(RuntimeError, match="already started"):
        limit_cpu_threads(1)
