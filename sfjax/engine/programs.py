"""An engine's compiled programs, owned by the engine and freed with it.

``jax.jit`` keeps a function's executables in caches keyed by the traced Python function. The
step functions are module-level, so jitting them directly would keep every engine shape ever
built compiled for the life of the process (about 1,700 memory maps per small engine on XLA:CPU;
a notebook or a sweep building engine after engine dies at the kernel's 65,530). An engine
instead jits fresh closures of them (``Programs``): once nothing holds its ``Programs``, JAX's
caches, keyed weakly on those closures, release the executables.

Engines that agree on what a program is specialised on share it (the same computation, so the
same bits) through a small process-wide LRU of ``PROGRAM_CACHE_SIZE`` programs (default 16, about
four engines' worth; the environment variable ``SFJAX_PROGRAM_CACHE`` sets it, 0 keeps none)
trimmed, each time an engine is built, to at most ``EXECUTABLE_CACHE_SIZE`` compiled shapes
among them (default 24; ``SFJAX_EXECUTABLE_CACHE``; the new engine's own programs are kept
whatever they hold): rebuilding the same engine, as a test suite or an evaluation loop does,
compiles once, and the memory held is bounded by that many executables plus the live
engines'. Shapes, not programs, are what cost: an engine compiles one executable per shape bucket
it meets (``compile.Buckets.shape``), and on XLA:CPU each takes about three memory maps per kernel (about
900 for the tiny test model's round) of the kernel's 65,530 per process.
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
from sfjax.spec import eagle

PROGRAM_CACHE_SIZE = int(os.environ.get("SFJAX_PROGRAM_CACHE", "16"))
EXECUTABLE_CACHE_SIZE = int(os.environ.get("SFJAX_EXECUTABLE_CACHE", "24"))
# The widened sampling tables an engine keeps programs for beside its own: a request whose stop
# ids, logit_bias or allowed ids outgrow the table's lists widens them (``sampling.list_widths``),
# new shapes for every program; past this many the least recently used widening's programs are
# let go (compiled again if it comes back), so what a serving engine holds does not grow with
# the widths its clients ask for.
WIDE_PROGRAMS = int(os.environ.get("SFJAX_WIDE_PROGRAMS", "2"))

_recent: collections.OrderedDict = collections.OrderedDict()


@dataclasses.dataclass(frozen=True)
class Programs:
    """The jitted programs of one engine shape; each DONATES the state (and draft cache) it
    takes. ``round`` is the engine's one program (``rounds.call``, over ``round.round_step``):
    up to ``num_scheduler_steps`` rounds the device lays out (the first after the host's
    prefill rows), in one shape bucket; ``round_logprobs`` is the same, recording the rounds'
    tokens' logprobs."""
    round: Callable
    round_logprobs: Callable
    write_history: Callable     # (state, slot, row, n) -> state
    update_slots: Callable      # (state, slots, block rows, sampling rows) -> state
    update_blocks: Callable     # (block tables, slots, block rows) -> block tables
    forget: Callable | None     # eagle3: (state, slot) -> state (``forget``)
    max_rounds: int             # the rounds a call of ``round`` may run (its read-back's width)


def _jit(fn, donate: tuple[str, ...], options: tuple = (), **static) -> Callable:
    """A fresh jitted closure of ``fn`` (a jitted function's Python body) over ``static``,
    compiled with the XLA ``options`` (``EngineConfig.compiler_options``)."""
    return jax.jit(functools.partial(getattr(fn, "__wrapped__", fn), **static),
                   donate_argnames=donate, compiler_options=dict(options) or None)


def _shapes(tree) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((x.shape, str(x.dtype)) for x in leaves)


def _executables(program: Callable) -> int:
    """The shapes ``program`` holds compiled (1 where this JAX does not say)."""
    size = getattr(program, "_cache_size", None)
    return size() if size is not None else 1


def _shared(key: tuple, build: Callable[[], Callable]) -> Callable:
    """The program of ``key`` (what it is specialised on): a recent engine's, else built; kept
    as the newest."""
    found = _recent.pop(key, None) or build()
    if PROGRAM_CACHE_SIZE > 0:
        _recent[key] = found
    return found


def _trim(keep: int) -> None:
    """Lets the oldest kept programs go past ``PROGRAM_CACHE_SIZE`` programs or past
    ``EXECUTABLE_CACHE_SIZE`` executables among them, but not the newest ``keep`` (the engine
    just built's: trimming between its lookups would drop a program it is about to take)."""
    while len(_recent) > keep and (
            len(_recent) > PROGRAM_CACHE_SIZE
            or sum(map(_executables, _recent.values())) > EXECUTABLE_CACHE_SIZE):
        _recent.popitem(last=False)


class ByWidths:
    """An engine's programs by its sampling table's id-list widths: those of the widths it
    starts with (``programs_for``) always, and up to ``WIDE_PROGRAMS`` widened ones (its own,
    not shared), the least recently used let go. Holds no reference to the engine."""

    def __init__(self, engine, widths: tuple[int, int, int]):
        self.base = widths
        self._by = collections.OrderedDict([(widths, programs_for(engine))])

    def __call__(self, engine, widths: tuple[int, int, int]) -> Programs:
        """``engine``'s programs (the one this was built for) for a table of ``widths``."""
        found = self._by.pop(widths, None) or dataclasses.replace(   # the tables' own: the same
            programs_for(engine, share=False), update_blocks=self._by[self.base].update_blocks)
        self._by[widths] = found
        wide = [w for w in self._by if w != self.base]
        for w in wide[:max(0, len(wide) - WIDE_PROGRAMS)]:
            del self._by[w]
        return found

    def held(self) -> list[tuple[int, int, int]]:
        """The widths whose programs are held, least recently used first."""
        return list(self._by)


def programs_for(engine, share: bool = True) -> Programs:
    """The engine's programs, each shared (``share``) with recent engines that agree on what
    that program is specialised on, and nothing more (its ``RunConfig``, the rounds a call may
    run, the shapes and dtypes of the arrays it carries, and the XLA options it is compiled
    with; the batch's shapes are keyed by jit itself)."""
    get = _shared if share else (lambda key, build: build())
    run, spec = engine.run.of_device(), engine.spec
    target = _shapes((engine.weights, engine.state))
    draft = None if spec is None else _shapes(spec.draft_weights)
    steps, opts = engine.config.num_scheduler_steps, engine.config.compiler_options
    progs = dict(
        write_history=get(("write_history", _shapes(engine.state), opts),
                          lambda: _jit(step.write_history, ("state",), opts)),
        update_slots=get(("update_slots", _shapes(engine.state), opts),
                         lambda: _jit(step.update_slots, ("state",), opts)),
        update_blocks=get(("update_blocks", _shapes(engine.state.block_tables), opts),
                          lambda: _jit(step.update_blocks, ("block_tables",), opts)),
        forget=None, max_rounds=steps)
    if spec is not None and spec.head_cfg is not None:
        progs["forget"] = get(("forget", _shapes(engine.state), opts),
                              lambda: _jit(forget, ("state",), opts))
    for name, logprobs in (("round", False), ("round_logprobs", True)):
        progs[name] = get(
            ("round", run, steps, logprobs, target, draft, opts),
            lambda logprobs=logprobs: _jit(rounds.call, ("state",), opts, run=run,
                                           max_rounds=steps, with_logprobs=logprobs))
    if share:
        _trim(keep=sum(callable(p) for p in progs.values()))
    return Programs(**progs)


def forget(state: step.DeviceState, slot) -> step.DeviceState:
    """``state`` with an EAGLE head's kept features of ``slot`` dropped (``eagle.forget``)."""
    return dataclasses.replace(state, draft_cache=eagle.forget(state.draft_cache, slot))


def clear() -> None:
    """Forgets the shared programs (live engines keep theirs)."""
    _recent.clear()
