"""XLA:CPU's thread pool, which is sized when JAX starts its backends.

XLA:CPU runs an executable's thunks and splits its GEMMs over an intra-op thread pool sized, when
the backend starts, by the cores the starting thread may run on (there is no option for it). At
batch 1 on a small model every GEMM is a few microseconds, and handing work between the pool's
threads costs more than it saves: on the 2-core CI machine the demo model decodes about 1.17x
faster with a pool of one thread and the host (Python) thread free on the other core (BENCHMARKS.md, the
paragraph on ``--cpu-threads 1`` under "The demo pair at batch 1, T = 0"). Large batches want the whole pool.
"""

from __future__ import annotations

import os


def _backends_started() -> bool:
    from jax._src import xla_bridge
    probe = getattr(xla_bridge, "backends_are_initialized", None)
    return probe() if probe is not None else bool(getattr(xla_bridge, "_backends", {}))


def limit_cpu_threads(threads: int) -> None:
    """Starts JAX's backends with XLA:CPU's intra-op pool of ``threads`` threads, on the last
    ``threads`` of the cores this thread may run on; afterwards this thread (and the threads it
    starts later, torch's among them) may run on all of them again.

    Call it once, before anything touches a JAX device (``sfjax generate --cpu-threads``). It sets
    no bits: the certified row tiles and every exactness check run in the same process, and the
    pool's size changes no token (tests/test_cpu.py). Linux only (``os.sched_setaffinity``).

    Raises ValueError for a ``threads`` outside 1..cores, RuntimeError once the backends run.
    """
    if not hasattr(os, "sched_setaffinity"):
        raise RuntimeError("cpu_threads: this platform can't set thread affinity (Linux only)")
    cores = sorted(os.sched_getaffinity(0))
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= len(cores):
        raise ValueError(f"cpu_threads: {threads!r} is not an int in 1..{len(cores)} (the cores "
                         f"this process may run on)")
    if _backends_started():
        raise RuntimeError("cpu_threads: JAX's backends already started; limit the threads before "
                           "the first use of a JAX device")
    import jax

    os.sched_setaffinity(0, cores[-threads:])
    try:
        jax.devices()
    finally:
        os.sched_setaffinity(0, cores)
