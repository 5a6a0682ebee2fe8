"""Records the golden runs (``tests/golden_runs.py``) into ``tests/golden/engine_runs.json``:
per run its settings, prompt ids and SamplingParams, and per request the output token ids, the
finish reason (``finished`` for sfjax.functional rows) and the speculation counters [drafts,
draft tokens, accepted tokens]. ``tests/test_golden.py`` asserts the engine gives exactly those.

Record on a pristine commit, with the sfjax of the tree this script lives in:

    git worktree add /tmp/golden-base HEAD
    cp scripts/record_golden.py /tmp/golden-base/scripts/ && cp tests/golden_runs.py /tmp/golden-base/tests/
    cd /tmp/golden-base && PYTHONPATH=$PWD python scripts/record_golden.py --out /path/to/engine_runs.json

It refuses to record when the sfjax it imports is not this tree's, or when this tree's sfjax/ or
pallas_kernels/ differ from its commit (``--allow-dirty`` overrides that).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import golden_runs as G  # noqa: E402


def _git(*args) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=G.GOLDEN_PATH)
    ap.add_argument("--allow-dirty", action="store_true",
                    help="record even if sfjax/ or pallas_kernels/ differ from the commit")
    args = ap.parse_args(argv)

    import jax
    import jaxlib
    import numpy as np
    import sfjax

    where = os.path.dirname(os.path.abspath(sfjax.__file__))
    if where != os.path.join(ROOT, "sfjax"):
        sys.exit(f"sfjax is imported from {where}, not from this tree ({ROOT}): set PYTHONPATH={ROOT}")
    dirty = _git("status", "--porcelain", "--", "sfjax", "pallas_kernels")
    if dirty and not args.allow_dirty:
        sys.exit(f"sfjax/ or pallas_kernels/ differ from the commit:\n{dirty}")

    start = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="sfjax-golden-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    md_out = os.path.join(tmp, "multidevice.json")
    proc = G.start_multidevice(md_out)                    # runs alongside the single-device runs
    ctx = G.Context(os.path.join(tmp, "models"))
    records = {}
    for run in G.RUNS:
        if not run["multidevice"]:
            records[run["name"]] = G.execute(ctx, run)
            print(f"{run['name']}: {time.monotonic() - start:.0f} s", flush=True)
    md = G.finish_multidevice(proc, md_out)
    if md["sfjax"] != os.path.abspath(sfjax.__file__):
        sys.exit(f"the multidevice subprocess imported {md['sfjax']}")
    if md["digests"] != ctx.digests:
        sys.exit(f"the subprocess built other models: {md['digests']} != {ctx.digests}")
    records.update(md["records"])
    for run in G.RUNS:
        if run["preempts"] and records[run["name"]]["num_preemptions"] == 0:
            sys.exit(f"{run['name']}: no preemption; the run table must make it preempt")

    header = dict(
        format=G.FORMAT,
        about="tests/golden_runs.py's runs on the commit below; tests/test_golden.py asserts the "
              "engine gives exactly these token ids, finish reasons and spec counters "
              "[num_drafts, num_draft_tokens, num_accepted_tokens] (num_preemptions: only > 0 is "
              "asserted, where the run says preempts)",
        commit=_git("rev-parse", "HEAD"), dirty=bool(dirty), jax=jax.__version__,
        jaxlib=jaxlib.__version__, numpy=np.__version__, backend=jax.default_backend(),
        models=ctx.digests)
    body = ",\n".join(json.dumps(records[r["name"]], separators=(",", ":")) for r in G.RUNS)
    text = json.dumps(header, separators=(",", ":"))[:-1] + ',"runs":[\n' + body + "\n]}\n"
    json.loads(text)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out}: {len(records)} runs, {len(text)} bytes, {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
