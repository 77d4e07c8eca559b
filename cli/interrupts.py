"""Ctrl-C and SIGTERM during a command: what the first and a second one do, and what the command then says."""

from __future__ import annotations

import os

signals_received: list[int] = []  # Ctrl-C and SIGTERM received, in order
# True of every command: a ref is written or removed whole, and a removal (`rm`, `gc`) done before
# the interruption stays done ("the store is unchanged" was wrong for an interrupted rm or gc).
AFTER_INTERRUPT = "nothing is half-written: what was done before it is complete, unreferenced objects left behind go with `ckpt gc`"
INTERRUPTED = f"interrupted; {AFTER_INTERRUPT}"


def on_signal(signum: int, frame: object) -> None:
    """Ctrl-C (SIGINT) or SIGTERM (``kill``, a job scheduler ending the job). The first unwinds
    (KeyboardInterrupt), so that a pull removes its temporary files (full-size, hidden) and puts
    back what ``--force`` had begun to replace; that waits for the requests in flight, which a
    server that stopped answering holds until their timeouts and retries (minutes). A second one
    while that goes on ends the process at once, once this process's temporaries are removed
    (:func:`~ckpt.store.destination.abandon`); while files are being renamed into place or back
    (moments) it is ignored."""
    signals_received.append(signum)
    if len(signals_received) == 1:
        raise KeyboardInterrupt
    from ckpt.store.destination import abandon

    if abandon():
        os.write(2, f"interrupted again: stopped at once, without waiting for requests in flight; {AFTER_INTERRUPT}\n".encode())
        os._exit(143 if terminated() else 130)


def terminated() -> bool:
    """Whether SIGTERM came (typer reports its unwinding, as Ctrl-C's, as exit code 130)."""
    import signal

    return signal.SIGTERM in signals_received
