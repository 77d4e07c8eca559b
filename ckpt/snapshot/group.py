"""The gloo group that checkpoint collectives run on, and its rebuilding after a failure.

A collective that fails on a gloo group (a peer that did not answer within the timeout, a
connection closed) leaves that group unusable: gloo closes its connections ("Application
timeout caused pair closure"), and every later collective on it fails at once, on the rank
that timed out and on a peer that was stalled and resumed alike. So a group that failed is
never used again: before each save and restore the ranks agree, through the rendezvous store
of the default group (a few store operations, no collective), whether any of them saw it
fail since the last agreement; if one did, every rank creates a fresh group with the same
timeout and the save goes on with it.

Round ``k`` of the agreement (every rank counts its saves and restores alike):

* each rank adds ``1 + world * (failed + (world + 1) * asks)`` (``failed``: 0 or 1; ``asks``: 1 if
  it asks for the save to be persisted) to the round's counter, so that the counter says how
  many ranks arrived (modulo ``world``), saw a failure and asked;
* the rank whose addition completes the round (the counter becomes a multiple of ``world``)
  publishes the verdict ``go:N:P`` (N ranks saw a failure, P: whether any asked) with
  compare-and-set, and deletes the previous round's keys (every rank has left it);
* the others wait up to ``timeout_s`` for the verdict. One that waited in vain sets it to
  ``abandoned:P`` instead (P: whether any rank arrived so far asked; compare-and-set: exactly one
  verdict wins), and a rank arriving later reads that. Every rank of an abandoned round counts
  its group as failed, so the next round rebuilds it, and the save of that round does not happen
  (:class:`GroupUnavailable`).

Every rank that reads the verdict takes P from it, not from its own wish: whether the save that
did not happen raises or warns (ckpt/snapshot/saving.py) is then decided alike on every rank.
"""

from __future__ import annotations

import contextlib
import logging
from datetime import timedelta
from typing import Any

from ckpt.snapshot.run import SnapshotError
from ckpt.snapshot.tiers import COLLECTIVE_FAILURES, caught, describe

log = logging.getLogger(__name__)


class GroupUnavailable(SnapshotError):
    """The ranks could not agree on a working checkpoint group (a peer did not answer within
    ``timeout_s``, or the group could not be rebuilt): this save or restore did not happen.
    ``persist``: whether the ranks asked for the save to be persisted, as they agreed (the same
    on every rank that read the round's verdict; this rank's own wish where none could be read)."""

    retryable = True  # the next save agrees again, and rebuilds the group with the ranks that answer

    def __init__(self, message: str, *, hint: str | None = None, persist: bool = False) -> None:
        super().__init__(message, hint=hint)
        self.persist = persist


class CheckpointGroup:
    """The checkpoint collectives' own gloo group over the ranks of ``process_group``.

    :meth:`agree` before each save or restore (every rank alike); :meth:`failed` when a collective
    on :attr:`pg` fails. Every member calls the constructor in the same order (it creates a group)."""

    def __init__(self, process_group: Any, timeout_s: float) -> None:
        import torch.distributed as dist

        self.ranks = dist.get_process_group_ranks(process_group)
        self.world = len(self.ranks)
        self._whole_world = self.ranks == list(range(dist.get_world_size()))
        self.timeout = timedelta(seconds=timeout_s)
        self.pg = self._create()
        self.broken = False  # a collective on pg failed since the last agreement
        self.rebuilds = 0
        self._round = 0
        # Keys of the agreement, in the default group's store: named after the first group (the same
        # on every member, unique per manager), fixed across rebuilds.
        self._prefix = f"ckpt-group/{self.pg.group_name}"
        self._store: Any = None

    def _create(self) -> Any:
        import torch.distributed as dist

        # Over every rank, torch numbers groups in the order all ranks create them, so a replaced
        # one can be destroyed (its sockets and threads freed): no later group takes its name. A
        # subgroup's name is a hash of its ranks and of how many groups exist; destroying one would
        # give the next group the name of a live one, or one whose rendezvous keys are still in the
        # store, so a replaced subgroup is kept (closed, a few sockets per rebuild).
        return dist.new_group(self.ranks, backend="gloo", timeout=self.timeout,
                              use_local_synchronization=not self._whole_world)

    def _replace(self) -> None:
        """A fresh group in place of :attr:`pg` (every member alike); the old one destroyed where it can be."""
        import torch.distributed as dist

        old, self.pg = self.pg, self._create()
        if self._whole_world:
            try:
                dist.destroy_process_group(old)
            except Exception as e:  # noqa: BLE001 - a group that cannot be destroyed only costs its sockets
                log.warning("checkpoint group: the replaced group was not destroyed (%s)",
                            caught(log, "checkpoint group", e, COLLECTIVE_FAILURES))

    def failed(self, e: BaseException) -> None:
        """Note that a save or restore on :attr:`pg` raised ``e``. Not a failure of the group: ckpt's
        own error without a cause (a refusal the ranks agreed on through the group), or a DCP error
        that gathered the ranks' own failures (it came through the group's collectives). Anything
        else counts: a needless rebuild costs one group, a missed one every later save."""
        from torch.distributed.checkpoint.api import CheckpointException

        from ckpt.errors import CkptError

        if isinstance(e, CkptError):
            if e.__cause__ is None:
                return
            e = e.__cause__
        if isinstance(e, CheckpointException) and e.failures:
            return
        if not self.broken:  # (describe, not caught: every caller raises ``e`` on, a bug with its traceback)
            log.warning("checkpoint group: a collective failed (%s); the ranks rebuild the group at the next save",
                        describe(e))
        self.broken = True

    def agree(self, what: str, persist: bool = False) -> bool:
        """One round of the agreement; rebuild the group if any rank saw it fail. Returns whether
        any rank asked to ``persist`` the save. Raises :class:`GroupUnavailable` (``what``: the save
        or restore that does not happen; its ``persist`` as agreed) when a rank did not arrive within
        the timeout or the group could not be rebuilt."""
        if self.world == 1:
            return persist
        k, self._round = self._round, self._round + 1
        try:
            verdict = self._verdict(self._store_(), f"{self._prefix}/{k}", k, persist)
        except Exception as e:  # the rendezvous store itself failed
            self.broken = True
            raise GroupUnavailable(f"{what} not done: the ranks could not agree through the rendezvous store "
                                   f"({caught(log, 'checkpoint group', e, COLLECTIVE_FAILURES)})", persist=persist) from e
        kind, *counts = verdict.split(":")
        asked = counts[-1:] == ["1"]
        if kind == "abandoned":
            self.broken = True
            raise GroupUnavailable(
                f"{what} not done: not every rank of the checkpoint group arrived within "
                f"timeout_s={self.timeout.total_seconds():g} (a rank died, hangs, or is still failing an earlier save)",
                hint="the ranks try again at the next save; see the other ranks' logs", persist=asked)
        if counts[0] == "0":
            return asked
        try:
            self._replace()
        except Exception as e:  # a peer gone since it arrived: the next round tries again
            self.broken = True
            raise GroupUnavailable(f"{what} not done: the checkpoint group could not be rebuilt "
                                   f"({caught(log, 'checkpoint group', e, COLLECTIVE_FAILURES)})",
                                   hint="the ranks try again at the next save; see the other ranks' logs",
                                   persist=asked) from e
        self.broken = False
        self.rebuilds += 1
        log.warning("checkpoint group rebuilt (%s rank(s) saw it fail)", counts[0])
        return asked

    def final_step(self, step: int, preempted: bool) -> int | None:
        """The step at which every rank takes the final snapshot of a preempted run, once some rank
        has seen a preemption signal; else None. A rank that has (``preempted``) names ``step + 1``
        in the rendezvous store unless another named one first (compare-and-set: one name wins);
        the others look there at each ``maybe_save``. The next step, not this one: a rank whose
        signal came just after its own ``maybe_save(step)`` may be past it already, waiting for this
        one in the next step's collectives (DDP's gradient all-reduce)."""
        if self.world == 1:
            return step if preempted else None
        store, key = self._store_(), f"{self._prefix}/final"
        if preempted:
            return int(store.compare_set(key, "", str(step + 1)).decode())
        return int(store.get(key).decode()) if store.check([key]) else None

    def _verdict(self, store: Any, key: str, k: int, persist: bool) -> str:
        w = self.world
        n = store.add(f"{key}/n", 1 + w * (int(self.broken) + (w + 1) * int(persist)))
        if n % w == 0:  # the last to arrive: n = w + w * (failed + (w + 1) * asked), counted over the ranks
            asked, failed = divmod(n // w - 1, w + 1)
            verdict = store.compare_set(f"{key}/v", "", f"go:{failed}:{int(asked > 0)}").decode()
            if not verdict.startswith("abandoned") and k > 0:
                for old in (f"{self._prefix}/{k - 1}/n", f"{self._prefix}/{k - 1}/v"):
                    with contextlib.suppress(Exception):  # a store that cannot delete keeps a few bytes a round
                        store.delete_key(old)
            return verdict
        try:
            store.wait([f"{key}/v"], self.timeout)
        except Exception:  # noqa: BLE001 - the store's timeout: abandon the round, unless the verdict came meanwhile
            # Whether a rank that arrived so far asked: n = arrived + w * (failed + (w + 1) * asked), failed <= w
            # (arrived = w, if the last came meanwhile, counts as w + w * 0: see above).
            n = store.add(f"{key}/n", 0)
            asked = (n // w - (n % w == 0)) // (w + 1)
            return store.compare_set(f"{key}/v", "", f"abandoned:{int(asked > 0)}").decode()
        return store.get(f"{key}/v").decode()

    def _store_(self) -> Any:
        if self._store is None:
            from torch.distributed.distributed_c10d import _get_default_store

            self._store = _get_default_store()
        return self._store
