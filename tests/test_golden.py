"""Same bits: the engine gives exactly the token ids, finish reasons and per-request speculation
counters recorded in ``tests/golden/engine_runs.json`` (by ``scripts/record_golden.py``, on a
pristine commit) for the fixed runs of ``tests/golden_runs.py``: plain, n-gram and draft-model
speculation, the three acceptance methods, greedy and seeded T = 0.8 with filters and
penalties, one and eight rounds per call, prefix caching under preemption, dp 2 and tp 2 on fake
CPU devices (one subprocess, started first so it runs alongside), and sfjax.functional."""

import json
import os

import pytest

import golden_runs as G

SINGLE = [r["name"] for r in G.RUNS if not r["multidevice"]]
MULTI = [r["name"] for r in G.RUNS if r["multidevice"]]


@pytest.fixture(scope="module")
def golden():
    with open(G.GOLDEN_PATH) as f:
        data = json.load(f)
    assert data["format"] == G.FORMAT
    return data


@pytest.fixture(scope="module")
def recorded(golden):
    return {r["name"]: r for r in golden["runs"]}


@pytest.fixture(scope="module", autouse=True)
def multidevice(request, tmp_path_factory):
    """The fake-device runs' subprocess, started before the first test of the module (when any
    of them is selected); calling the fixture's value waits for it."""
    if not any(item.name.startswith("test_fake_device_run") for item in request.session.items):
        yield None
        return
    out = str(tmp_path_factory.mktemp("golden-multidevice") / "runs.json")
    proc = G.start_multidevice(out)
    result = {}

    def wait():
        if not result:
            result.update(G.finish_multidevice(proc, out))
        return result

    yield wait
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    return G.Context(str(tmp_path_factory.mktemp("golden-models")))


def _check(recorded, got):
    want = recorded.get(got["name"])
    assert want is not None, f"{got['name']}: not in {G.GOLDEN_PATH}; record it"
    diffs = G.differences(want, got)
    assert not diffs, "the engine's output differs from the recording:\n" + "\n".join(diffs)
    if want["preempts"]:
        assert got["num_preemptions"] > 0, f"{got['name']}: no request was preempted"


def test_the_recording_covers_the_run_table(recorded):
    assert list(recorded) == [r["name"] for r in G.RUNS]


def test_the_models_are_the_recorded_ones(ctx, golden):
    assert ctx.digests == golden["models"], "the seeded toy models changed; the recording is void"


@pytest.mark.parametrize("name", SINGLE)
def test_run(ctx, recorded, name):
    _check(recorded, G.execute(ctx, G.RUNS_BY_NAME[name]))


@pytest.mark.parametrize("name", MULTI)
def test_fake_device_run(multidevice, golden, recorded, name):
    md = multidevice()
    assert md["digests"] == golden["models"], "the subprocess built other models"
    import sfjax
    assert md["sfjax"] == os.path.abspath(sfjax.__file__), "the subprocess imported another sfjax"
    _check(recorded, md["records"][name])
