"""The accelerator round, lowered from abstract shapes of a Llama-2-7B-shaped bf16 model for GPU
(Triton) and TPU (Mosaic) on this CPU machine: every weight matmul, the attention, the sampler
and the softmax reductions are Pallas kernels (no ``dot_general`` left to XLA), no ``lax.cond``
is left, every loop has a constant trip count (XLA:GPU copies a loop's predicate to the host
each iteration otherwise), the program does not grow with the layer count (the layers are one
scan), and it lowers in seconds (the CPU-shaped round, with its row-tile loops, took minutes to
compile on an H200). Plain rounds and speculative ones (k = 4: n-gram; a draft model under
rejection sampling, whose distributions are row kernels too; n-gram under typical acceptance,
whose entropy is one)."""

import pathlib
import re
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "scripts"))
from round_lowering import PLATFORMS, lower  # noqa: E402

def ops(text: str) -> list[str]:
    return re.findall(r"(?:stablehlo|func|chlo|sdy|mhlo)\.[a-z_]+", text)


def loop_bounds(text: str) -> list[str]:
    """Each ``stablehlo.while``'s condition region, as text."""
    return [m.group(1) for m in re.finditer(r"stablehlo\.while.*?cond \{(.*?)\} do \{", text, re.S)]


def constant_trip_count(cond: str) -> bool:
    """A ``lax.fori_loop`` / ``lax.scan`` condition: the counter compared with a constant that
    is defined in the condition itself (through any sharding annotation)."""
    m = re.search(r"stablehlo\.compare\s+LT,\s*(%[\w#]+),\s*(%[\w#]+)", cond)
    if not m:
        return False
    bound = m.group(2)
    for _ in range(4):
        d = re.search(re.escape(bound) + r" = ([\w.]+) (%[\w#]+)?", cond)
        if d is None:
            return False
        if d.group(1) == "stablehlo.constant":
            return True
        if d.group(1) != "sdy.sharding_constraint":
            return False
        bound = d.group(2)
    return False


@pytest.fixture(scope="module", params=list(PLATFORMS))
def plain(request):
    return request.param, lower(request.param, 32), lower(request.param, 2)


def _check(text: str):
    assert "stablehlo.dot_general" not in text, "a matmul was left to XLA"
    # no branch either: XLA:GPU reads a conditional's predicate on the host, so a step with one
    # is not one command buffer (the sampler's skips of unused work are for the CPU path)
    assert not re.findall(r"stablehlo\.(?:if|case)\b", text), "a lax.cond in the step"
    conds = loop_bounds(text)
    assert text.count("stablehlo.while") == len(conds)
    bad = [c for c in conds if not constant_trip_count(c)]
    assert not bad, f"{len(bad)} loop(s) with a runtime trip count:\n" + bad[0][:600]


def test_the_plain_round_is_kernels_and_fixed_loops(plain):
    platform, (text, seconds), _ = plain
    _check(text)
    kernel = "xla.gpu.triton" if platform == "cuda" else "tpu_custom_call"
    assert text.count(kernel) >= 6        # q|k|v, o, gate|up, down, head, attention, sampler
    assert seconds < 10, f"lowering took {seconds:.1f} s of CPU"


def test_the_program_does_not_grow_with_the_layers(plain):
    _, (deep, _), (shallow, _) = plain
    assert len(ops(deep)) == len(ops(shallow))


@pytest.mark.parametrize("platform", list(PLATFORMS))
@pytest.mark.parametrize("method", ["ngram", "draft_model", "typical"])
def test_the_speculative_round_is_kernels_and_fixed_loops(platform, method):
    text, seconds = lower(platform, 32, method)
    _check(text)
    assert seconds < 10, f"lowering took {seconds:.1f} s of CPU"


def test_the_cpu_round_is_what_the_checks_catch():
    """The checks see what they look for: the CPU-shaped round (matmuls in row-tile loops with
    a runtime trip count) fails both."""
    text, _ = lower("cuda", 2, matmul=None)
    assert "stablehlo.dot_general" in text
    assert not all(constant_trip_count(c) for c in loop_bounds(text))
