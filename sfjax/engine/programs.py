"""An engine's compiled programs, owned by the engine and freed with it.

``jax.jit`` keeps a function's executables in caches keyed by the traced Python function. The
step functions are module-level, so jitting them directly would keep every engine shape ever
built compiled for the life of the process (about 1,700 memory maps per small engine on XLA:CPU;
a notebook or a sweep building engine after engine dies at the kernel's 65,530). An engine
instead jits fresh closures of them (``Programs``): once nothing holds its ``Programs``, JAX's
caches, keyed weakly on those closures, release the executables.

Engines that agree on what a program is specialised on share it (the same computation, so the
same bits) through a small process-wide LRU of ``PROGRAM_CACHE_SIZE`` programs (default 16, about
four engines' worth; the environment variable ``SFJAX_PROGRAM_CACHE`` sets it, 0 keeps none):
rebuilding the same engine, as a test suite or an evaluation loop does, compiles once, and the
memory held is bounded by that many programs plus the live engines'.
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

PROGRAM_CACHE_SIZE = int(os.environ.get("SFJAX_PROGRAM_CACHE", "16"))

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


def _shared(key: tuple, build: Callable[[], Callable]) -> Callable:
    """The program of ``key`` (what it is specialised on): a recent engine's, else built."""
    found = _recent.pop(key, None) or build()
    if PROGRAM_CACHE_SIZE > 0:
        _recent[key] = found
        while len(_recent) > PROGRAM_CACHE_SIZE:
            _recent.popitem(last=False)
    return found


def programs_for(engine) -> Programs:
    """The engine's programs, each shared with recent engines that agree on what that program
    is specialised on, and nothing more (its static arguments, and the shapes and dtypes of the
    arrays it carries; the batch's shapes are keyed by jit itself): a plain step is shared by
    plain and speculating engines of one model and cache, whatever their host settings."""
    c, spec = engine.config, engine.spec
    common = dict(cfg=engine.cfg, row_tile=c.row_tile, sampler=c.sampler, attention=c.attention,
                  mesh=engine.mesh)
    target = (tuple(common.values()), _shapes((engine.weights, engine.state)))
    progs = dict(
        model_step=_shared(("model_step",) + target,
                           lambda: _jit(step.model_step, ("state",), **common)),
        write_history=_shared(("write_history", _shapes(engine.state)),
                              lambda: _jit(step.write_history, ("state",))),
        spec_step=None)
    draft = None if spec is None else (spec.draft_cfg, spec.round, spec.mesh,
                                       _shapes((spec.draft_weights, spec.draft_cache)))
    if spec is not None:
        statics = dict(dcfg=spec.draft_cfg, rc=spec.round, draft_mesh=spec.mesh)
        progs["spec_step"] = _shared(("spec_step",) + target + draft, lambda: _jit(
            spec_step, ("state", "draft_cache"), **common, **statics))
    rounds_cfg = rounds.functional_config(engine)
    progs["decode_rounds"] = _shared(
        ("decode_rounds", rounds_cfg, c.num_scheduler_steps) + target + (draft,),
        lambda: _jit(rounds.decode_rounds, ("state", "draft_cache"), cfg=rounds_cfg,
                     max_rounds=c.num_scheduler_steps))
    return Programs(**progs)


def clear() -> None:
    """Forgets the shared programs (live engines keep theirs)."""
    _recent.clear()
