"""Shared fixtures: a per-run compilation cache, and small HF model folders built from a seed."""

import atexit
import os
import shutil
import tempfile

# The suite's programs run a few times each and compile hundreds of shapes, so compiling is most
# of its time (2,118 of the 3,356 worker-seconds of a full run compiled in the workers, 332 round
# programs at about 5 s each). Two XLA:CPU settings make a compile cheaper (SUITE_FLAGS):
# - LLVM at -O0: a third less time per compile. It changes bits: at -O1 and up LLVM fuses a
#   multiply and an add into one FMA, at -O0 it rounds twice (92% of the parity model's logits
#   differ, by at most 2e-6);
# - fusions emitted by XLA's elemental IR emitter, not its MLIR fusion emitters: about 40% less
#   time per round program, and the same logits bits on the parity model.
# Every exactness check compares programs compiled alike (an engine's programs and its small-tile
# certificate share its options), so the checks hold under both. The golden tokens, recorded at
# XLA's defaults, hold here, and the golden fake-device runs (tests/golden_runs.py) drop both
# settings; the logits checked against HF transformers compile with XLA's defaults
# (``golden_runs.xla_defaults``), the numbers users get. Set before JAX starts its backend;
# subprocesses inherit them; a setting already in XLA_FLAGS is kept, and one this jaxlib's XLA
# does not know is left out.
from golden_runs import SUITE_FLAGS  # noqa: E402


def _xla_accepts(flag: str) -> bool:
    """Whether this jaxlib's XLA knows ``flag``: XLA aborts a process at start-up on a flag it
    does not know, and flags come and go between releases, so a child process tries it once
    (the workers and the tests' subprocesses inherit the result through XLA_FLAGS)."""
    import subprocess
    import sys
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip(),
               JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                          capture_output=True, timeout=120).returncode == 0


for _name, (_value, _) in SUITE_FLAGS.items():
    if f"--{_name}" not in os.environ.get("XLA_FLAGS", "") and _xla_accepts(f"--{_name}={_value}"):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{_name}={_value}".strip()

import jax  # noqa: E402
import pytest

# Engines share compiled programs through a bounded LRU (sfjax.engine.programs, 16 programs
# holding at most 24 compiled shapes by default); a test module builds many engine shapes in
# turn, so the suite keeps more (the module-end clear below drops their executables anyway),
# under the kernel's 65,530 memory maps a process (XLA:CPU: about 900 per round executable of
# the tiny model). The memory test sets its own.
os.environ.setdefault("SFJAX_PROGRAM_CACHE", "64")
os.environ.setdefault("SFJAX_EXECUTABLE_CACHE", "40")


def _scratch(prefix: str) -> str:
    """A folder of this process's, removed when it exits."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


_CACHE_DIR = _scratch("sfjax-jit-cache-")
# Small-tile certificates (sfjax.certificate_cache) go to this run's own folder, not the user's
# ~/.cache: the run's first probe of a model shape is kept for its later processes (the workers,
# the CLI and multi-device subprocesses inherit the variable; the process that made it removes
# it), and no earlier run's answer is taken.
if "SFJAX_CACHE_DIR" not in os.environ:
    os.environ["SFJAX_CACHE_DIR"] = _scratch("sfjax-certificates-")
jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
# On XLA:CPU the persistent cache stays off: every compiled step is reused from jit's in-memory
# cache within the run anyway; serializing one of the round's executables segfaulted in a CI run
# (jaxlib 0.10.2, in put_executable_and_time), and XLA:CPU's AOT loader rejects entries on reload
# (jax-ml/jax#38445), so it only cost time. On a GPU or TPU it caches across the run as usual.
if jax.default_backend() == "cpu":
    jax.config.update("jax_enable_compilation_cache", False)

from sfjax import toy  # noqa: E402

# The files that take longest (``--durations``, summed per file) go first: pytest-xdist hands
# out whole files in collection order (``--no-loadscope-reorder``, pyproject.toml), and a long
# file handed out last keeps one worker busy while the other idles.
SLOW_FILES = ("test_serving.py", "test_golden.py", "test_server.py", "test_spec_e2e_draft.py",
              "test_spec_e2e_eagle.py", "test_spec_adaptive.py",
              "test_sharding.py", "test_reliability.py", "test_rounds.py", "test_hf_parity.py",
              "test_docs.py", "test_prefix_cache.py", "test_engine.py", "test_fuzz.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))      # stable


# tests/multidevice needs 8 fake devices: tests/test_sharding.py runs it in a subprocess
collect_ignore = [] if os.environ.get("SFJAX_MULTIDEVICE") else ["multidevice"]


@pytest.fixture(scope="session")
def model_folder(tmp_path_factory):
    """``model_folder(cfg, seed=0, **kw)`` builds (once per arguments) and returns an HF folder."""
    built = {}

    def make(cfg=None, seed=0, **kw):
        cfg = cfg or toy.tiny_config()
        key = (cfg, seed, tuple(sorted(kw.items())))
        if key not in built:
            path = str(tmp_path_factory.mktemp("model"))
            built[key] = toy.build_model_folder(path, cfg, seed=seed, **kw)
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_folder(model_folder):
    """The default tiny test model: vocab 512, 2 layers, GQA 4/2, float32."""
    return model_folder(toy.tiny_config(), seed=0, std=0.1)

@pytest.fixture(autouse=True, scope="module")
def _release_module_level_programs():
    """Drops, after each test module, what jax.jit caches for module-level functions: the
    kernels and sfjax.functional's rounds that tests call directly, at hundreds of shapes no
    user process meets (one worker of the suite otherwise reaches the kernel's 65,530 memory
    maps and XLA:CPU's compiler segfaults). Engines do not need it: each owns its programs and
    frees them when dropped (sfjax.engine.programs), which
    tests/test_reliability.py::test_sixty_engines_stay_bounded checks in a fresh process with
    no cache clear at all. Cleared only past ``_MAPS_BEFORE_CLEAR`` maps, so modules that build
    the same engine shapes reuse each other's programs."""
    yield
    if os.environ.get("SFJAX_TEST_CLEAR") == "always" or _num_maps() > _MAPS_BEFORE_CLEAR:
        jax.clear_caches()


_MAPS_BEFORE_CLEAR = 30_000


def _num_maps() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return _MAPS_BEFORE_CLEAR + 1
