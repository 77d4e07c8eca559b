"""The preemption handling of a :class:`~ckpt.snapshot.manager.CheckpointManager`
(``handle_signals=True``): the SIGTERM/SIGUSR1 handlers, and when ``maybe_save`` takes the final snapshot
(in a group, at the step the ranks agreed on)."""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterable

from ckpt.snapshot.manager_state import ManagerState

log = logging.getLogger(__name__)


class Preemption(ManagerState):
    """``CheckpointManager``'s preemption methods (a mixin: the state they use is
    :class:`~ckpt.snapshot.manager_state.ManagerState`'s)."""

    def _final_snapshot_due(self, step: int) -> bool:
        """Whether ``maybe_save(step)`` takes the final snapshot of a preempted run: once a preemption
        signal came. In a group every rank takes it at the step the first rank to see a signal named
        (:meth:`~ckpt.snapshot.group.CheckpointGroup.final_step`; a store lookup per ``maybe_save`` until
        then, with ``handle_signals`` only): each rank's signal comes at its own moment, and a rank
        that saved step 7 alone would wait in the save for one already training step 8, which waits
        for it in the gradient all-reduce, until ``timeout_s``, the final snapshot lost."""
        if not self._distributed or not self._old_handlers:
            return self.preempted
        if self._final_step is None:
            self._final_step = self._group_path.checkpoint_group.final_step(step, self.preempted)
        if self._final_step is None:
            return False
        self.preempted = True
        return step >= self._final_step

    def _install_signals(self, sigs: Iterable[int] = (signal.SIGTERM, signal.SIGUSR1)) -> None:
        def handler(signum: int, frame: object) -> None:
            log.warning("signal %d: finishing the in-flight snapshot; the next maybe_save takes a final one", signum)
            self.preempted = True
            f = self._inflight
            if f is not None:
                f.exception()  # waits; the error, if any, is raised by the final save

        for s in sigs:
            self._old_handlers[s] = signal.signal(s, handler)

    def _restore_signals(self) -> None:
        for s, h in self._old_handlers.items():
            signal.signal(s, h)
        self._old_handlers = {}
