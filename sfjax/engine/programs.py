"""An engine's compiled programs, owned by the engine and freed with it.

``jax.jit`` keeps a function's executables in caches keyed by the traced Python function. The
step functions are module-level, so jitting them directly would keep every engine shape ever
built compiled for the life of the process (about 1,700 memory maps per small engine on XLA:CPU;
a notebook or a sweep building engine after engine dies at the kernel's 65,530). An engine
instead jits fresh closures of them (``Programs``): once nothing holds its ``Programs``, JAX's
caches, keyed weakly on those closures, release the executables.

Engines with the same static settings and array shapes share one ``Programs`` (the same
computation, so the same bits) through a small process-wide LRU of ``PROGRAM_CACHE_SIZE`` entries
(default 4; the environment variable ``SFJAX_PROGRAM_CACHE`` sets it, 0 keeps none): rebuilding
the same engine, as a test suite or an evaluation loop does, compiles once, and the memory held
is bounded by that many program sets plus the live engines'.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
from typing import Callable

import jax

from sfjax import step
from sfjax.engine import rounds
from sfjax.spec.round import spec_step

PROGRAM_CACHE_SIZE = int(os.environ.get("SFJAX_PROGRAM_CACHE", "4"))

_recent: collections.OrderedDict = collections.OrderedDict()


@dataclasses.dataclass(frozen=True)
class Programs:
    """The jitted steps of one engine shape; each DONATES the state (and draft cache) it takes."""
    model_step: Callable        # (weights, state, batch) -> (state, drawn)
    spec_step: Callable         # (weights, draft_weights, state, draft_cache, batch, spec) -> ...
    decode_rounds: Callable     # rounds.decode_rounds without its static arguments
    write_history: Callable     # (state, slot, row, n) -> state


def _jit(fn, donate: tuple[str, ...], **static) -> Callable:
    """A fresh jitted closure of ``fn`` (a jitted function's Python body) over ``static``."""
    return jax.jit(functools.partial(getattr(fn, "__wrapped__", fn), **static),
                   donate_argnames=donate)


def _shapes(tree) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((x.shape, str(x.dtype)) for x in leaves)


def _build(engine) -> Programs:
    c, spec = engine.config, engine.spec
    common = dict(row_tile=c.row_tile, sampler=c.sampler, attention=c.attention, mesh=engine.mesh)
    spec_static = {} if spec is None else dict(dcfg=spec.draft_cfg, rc=spec.round,
                                               draft_mesh=spec.mesh)
    return Programs(
        model_step=_jit(step.model_step, ("state",), cfg=engine.cfg, **common),
        spec_step=_jit(spec_step, ("state", "draft_cache"), cfg=engine.cfg, **common,
                       **spec_static) if spec is not None else None,
        decode_rounds=_jit(rounds.decode_rounds, ("state", "draft_cache"),
                           cfg=rounds.functional_config(engine),
                           max_rounds=c.num_scheduler_steps),
        write_history=_jit(step.write_history, ("state",)))


def _key(engine) -> tuple:
    """What the programs of ``engine`` are specialised on, and nothing more (so engines that
    differ only in host settings share them): the static arguments ``_build`` binds and the
    shapes and dtypes of the arrays they carry (the batch's shapes are keyed by jit itself)."""
    c, spec = engine.config, engine.spec
    arrays = (engine.weights, engine.state, spec.draft_weights if spec else None,
              spec.draft_cache if spec else None)
    statics = (engine.cfg, c.row_tile, c.sampler, c.attention, c.block_size, c.max_model_len,
               c.num_scheduler_steps, engine.mesh, engine._split,
               None if spec is None else (spec.draft_cfg, spec.round, spec.mesh, spec.config))
    return statics, _shapes(arrays)


def programs_for(engine) -> Programs:
    """The engine's programs: shared with a recent engine of the same key, else built."""
    key = _key(engine)
    found = _recent.pop(key, None) or _build(engine)
    if PROGRAM_CACHE_SIZE > 0:
        _recent[key] = found
        while len(_recent) > PROGRAM_CACHE_SIZE:
            _recent.popitem(last=False)
    return found


def clear() -> None:
    """Forgets the shared programs (live engines keep theirs)."""
    _recent.clear()
