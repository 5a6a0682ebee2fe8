"""Small-tile certificates kept across processes, as XLA keeps GPU autotuning results.

``rows.certify_row_tiles`` probes, on the model itself, which smaller row tiles this backend
computes with ``row_tile``'s bits: a compile and two runs of the model (3.3 s of the 17 s that
``sfjax generate`` takes to start on the 2-core CPU box). The answer is a property of the compiled
code, so it is stored under a digest of everything that code follows: the probe's key (model
shape, dtypes, tiles, attention impl, backend), jax and jaxlib versions, the backend's platform
version and device kind, ``XLA_FLAGS``, the CPU (model name and feature flags), and the source
of every module of sfjax and pallas_kernels. Anything different is another entry, and the probe
runs again. Each stage's choice among the certified tiles (``rows.tune_stage_tiles``, timed) is
kept the same way, so a machine's engines run the same programs from one start to the next.

The file is ``$SFJAX_CACHE_DIR/row_tile_certificates.json`` (default ``~/.cache/sfjax``);
``SFJAX_CACHE_DIR=off`` (or empty) keeps nothing. An unreadable or damaged file is ignored, and
a write that fails leaves the certificate to this process.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile

import jax

FILE = "row_tile_certificates.json"


def _path() -> str | None:
    d = os.environ.get("SFJAX_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "sfjax"))
    return None if d.strip().lower() in ("", "0", "off", "none") else os.path.join(d, FILE)


@functools.cache
def _sources() -> str:
    """A digest of the .py files of sfjax and pallas_kernels."""
    import pallas_kernels
    h = hashlib.sha256()
    for pkg in (os.path.dirname(os.path.abspath(__file__)),
                os.path.dirname(os.path.abspath(pallas_kernels.__file__))):
        for root, dirs, files in sorted(os.walk(pkg)):
            dirs.sort()
            for name in sorted(f for f in files if f.endswith(".py")):
                with open(os.path.join(root, name), "rb") as f:
                    h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        import platform
        return platform.processor() + platform.machine()


def digest(key) -> str:
    """The entry of a probe's ``key`` on this machine, jax, XLA flags and sfjax source."""
    import jaxlib
    device = jax.devices()[0]
    parts = [repr(key), jax.__version__, jaxlib.__version__,
             str(getattr(device.client, "platform_version", "")), device.device_kind,
             os.environ.get("XLA_FLAGS", ""), _cpu(), _sources()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _as_tiles(got):
    return tuple(got) if isinstance(got, list) and all(isinstance(t, int) for t in got) else None


def recall(key, parse=_as_tiles):
    """The stored answer of ``key`` as ``parse`` reads it (default: a certificate's tiles), or
    None (nothing stored, or nothing ``parse`` reads)."""
    path = _path()
    got = None if path is None else _read(path).get(digest(key))
    return None if got is None else parse(got)


def remember(key, tiles) -> None:
    """Stores ``tiles`` (a certificate's tiles, or another JSON value) for ``key`` (merged into
    the file, replaced atomically)."""
    path = _path()
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = _read(path)
        data[digest(key)] = list(tiles)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".certificates-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:
        pass
