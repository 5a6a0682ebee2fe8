"""The slot state the device keeps between calls, and the host's record of what it holds.

Each slot's block table row, its request's sampling settings and its progress (``step.Progress``:
length, newest token, counters, whether the device lays out its rows) live in
``step.DeviceState`` from call to call. The scheduler edits the host's block tables in place;
before each device call ``SlotSync.sync`` sends the rows of the slots whose pages, request or
progress changed since the last (one small donated program, ``step.update_slots``, over a bucket
of at least 8 slots, ``rows_for``; ``step.update_blocks``, over the block tables alone, when only
pages changed, as when a decoding request grows into a new block), and nothing when none did.
The device advances the progress of the slots it runs rounds for, and the host's record follows
from what it reads back (``advanced``): while every request decodes on the device, calls send
nothing but their scalars. A freed slot's block row follows the host's (cleared) like any
other; its sampling row stays until the next request takes the slot: nothing reads a free
slot's settings (a row of a free slot is padding).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np

from jax.sharding import PartitionSpec as P

from sfjax import sampling, sharding
from sfjax.rows import bucket
from sfjax.step import PROGRESS_FIELDS, Progress

# the columns of the host's progress rows (``SlotSync.progress``)
(PROMPT_LEN, LENGTH, LAST, LIVE, DRAFTED, ACCEPTED, SPEC_ROUNDS, REJECTED, DRAFTS, COPY_ACCEPTED,
 COPY_REJECTED) = range(len(PROGRESS_FIELDS))


def rows_for(changed: int, num_slots: int) -> int:
    """Rows of an update sending ``changed`` slots: a ``rows.bucket`` of 8 * 2**j, at most the
    slots (``buckets``: every such size)."""
    return min(bucket(changed, min(8, num_slots)), num_slots)


def buckets(num_slots: int) -> list[int]:
    return sorted({rows_for(c, num_slots) for c in range(1, num_slots + 1)})


class SlotSync:
    """The host side of the device's slot state: what was last sent, per slot."""

    def __init__(self, block_tables: np.ndarray, table: Callable, widths: Callable, mesh=None):
        """``block_tables``: the scheduler's, edited in place. ``table(reqs, rows, num_rows,
        widths)`` builds sampling rows (``BatchBuilder.table``); ``widths(reqs)`` the id-list
        widths a table holding ``reqs`` needs."""
        self.block_tables, self._table, self._widths_of = block_tables, table, widths
        self.mesh = mesh
        self._sent = np.zeros_like(block_tables)              # the device's block tables
        self._held: list = [None] * block_tables.shape[0]     # whose settings each slot holds
        self.widths = widths([])                              # the device table's list widths
        # the device's progress, a row per slot: int32 [slots, 8], Progress's fields in order
        self.progress = np.zeros((block_tables.shape[0], len(PROGRESS_FIELDS)), np.int32)

    def padding(self, u: int) -> tuple[np.ndarray, np.ndarray, sampling.Sampling, Progress]:
        """An update of ``u`` padding rows (it changes nothing; ``precompile`` runs it)."""
        n = self.block_tables.shape[0]
        return (np.full(u, n, np.int32), np.zeros((u, self.block_tables.shape[1]), np.int32),
                self._table([], [], u, self.widths),
                Progress.of_rows(np.zeros((u, len(PROGRESS_FIELDS)), np.int32)))

    def initial(self) -> tuple[jax.Array, sampling.Sampling, Progress]:
        """The device's block tables, sampling table and progress before any request: zeros,
        inert."""
        n = self.block_tables.shape[0]
        return self._place((self._sent, self._table([], [], n, self.widths),
                            Progress.of_rows(self.progress)))

    def _place(self, tree):
        """``tree`` on the device, or whole on every device of the mesh (each process placing
        its own devices' copies, as ``sharding.put`` does)."""
        if self.mesh is None:
            return jax.device_put(tree)
        return sharding.put(tree, jax.tree.map(lambda _: P(), tree), self.mesh)

    def sync(self, state, running, programs_of: Callable, progress: np.ndarray | None = None):
        """``state`` with the slots of ``running`` (requests holding slots) current, and with
        ``progress`` (every slot's row, as ``self.progress``) if given, else the progress as it
        is; ``programs_of(widths)``: the engine's programs for a table of those id-list widths
        (``programs.ByWidths``). A change of the widths (a request needing longer lists arrived,
        or the last that did left) sends the whole table."""
        n = len(self._held)
        now: list = [None] * n
        for req in running:
            now[req.slot] = req
        changed = np.array([a is not b for a, b in zip(now, self._held)])
        widths = (self._widths_of([r for r in now if r is not None]) if changed.any()
                  else self.widths)
        if widths != self.widths:
            live = [s for s in range(n) if now[s] is not None]
            table = self._table([now[s] for s in live], live, n, widths)
            state = dataclasses.replace(state, table=self._place(table))
            self._held, self.widths = now, widths
            changed[:] = False
        paged = (self.block_tables != self._sent).any(axis=1)
        sent_progress = self.progress
        if progress is not None:       # the record follows only once the update is sent
            changed |= (progress != self.progress).any(axis=1)
            sent_progress = progress.copy()
        dirty = np.flatnonzero(changed | paged)
        if dirty.size == 0:
            self.progress = sent_progress
            return state
        u = rows_for(dirty.size, n)
        slots = np.full(u, n, np.int32)
        slots[:dirty.size] = dirty
        blocks = np.zeros((u, self.block_tables.shape[1]), np.int32)
        blocks[:dirty.size] = self.block_tables[dirty]
        programs = programs_of(self.widths)
        if not changed.any():          # pages alone
            state = dataclasses.replace(
                state, block_tables=programs.update_blocks(state.block_tables, slots, blocks))
        else:
            held = [(i, now[s]) for i, s in enumerate(dirty) if now[s] is not None]
            rows = self._table([r for _, r in held], [i for i, _ in held], u, self.widths)
            sent = np.zeros((u, self.progress.shape[1]), np.int32)
            sent[:dirty.size] = sent_progress[dirty]
            state = programs.update_slots(state, slots, blocks, rows, Progress.of_rows(sent))
        self.progress = sent_progress
        self._sent[dirty] = self.block_tables[dirty]
        for s in dirty:
            self._held[s] = now[s]
        return state

    def forget(self) -> None:
        """Forgets what the device holds (after a call that was not read back): the next
        ``sync`` sends every slot's row, from the requests as the host has them."""
        self._held = [None] * len(self._held)
        self.progress[:] = -1

    def advanced(self, slots: np.ndarray, lengths: np.ndarray, live: np.ndarray,
                 tokens: np.ndarray, drafted, accepted, copies) -> None:
        """Records what a call of device rounds left in the progress of ``slots`` (int [D]): their
        new ``lengths`` [D], whether each is still ``live`` [D] (a row the rounds ended is not),
        their newest tokens (``tokens`` [slots, W]: each slot's tokens from its old length on),
        per round run [rounds, D] the drafts proposed and the accepted drafts emitted, and the
        copies' counts after them (``copies`` [D, 2])."""
        row = self.progress
        grew = lengths - row[slots, LENGTH]
        row[slots, LAST] = np.where(grew > 0, tokens[slots, np.maximum(grew - 1, 0)],
                                    row[slots, LAST])
        row[slots, LENGTH] = lengths
        row[slots, LIVE] = live
        if drafted.any():
            row[slots, DRAFTED] += drafted.sum(axis=0)
            row[slots, ACCEPTED] += accepted.sum(axis=0)
            row[slots, SPEC_ROUNDS] += (drafted > 0).sum(axis=0)
            row[slots, REJECTED] += ((drafted > 0) & (accepted < drafted)).sum(axis=0)
            row[slots, COPY_ACCEPTED], row[slots, COPY_REJECTED] = copies.T
