"""The ``ckpt`` console script: what runs before the command line itself can be imported."""

from __future__ import annotations

import os
import signal
import sys


def _before_start(signum: int, frame: object) -> None:
    """Ctrl-C or SIGTERM while the CLI is still being imported (a tenth of a second, longer on a busy
    machine): nothing has been done, so the process ends at once with the one line and the exit code
    of an interruption (with --json, its document too), not a traceback of the import under way."""
    import json

    what, code = ("terminated", 143) if signum == signal.SIGTERM else ("interrupted", 130)
    message = f"{what} before it began; nothing was done"
    words = sys.argv[1:]

    def say(fd: int, text: str) -> None:
        try:
            os.write(fd, f"{text}\n".encode())
        except OSError:  # (its reader left, or it is closed: the exit code still says what happened)
            pass

    if "--json" in words[: words.index("--") if "--" in words else len(words)]:
        say(1, json.dumps({"error": message}, indent=2))
    say(2, message)
    os._exit(code)


def main() -> None:
    """Run ``ckpt`` (:func:`ckpt_store.cli.main.main`), which handles the signals itself once imported
    and until it is done."""
    handled = [s for s in (signal.SIGTERM, signal.SIGINT) if signal.getsignal(s) is not signal.SIG_IGN]
    before = {s: signal.signal(s, _before_start) for s in handled}
    try:
        from ckpt_store.cli.main import main as run
    finally:  # (main puts its own in place at once, and these back when it is done)
        for s, h in before.items():
            signal.signal(s, h)
    try:
        run()
    except SystemExit as e:
        # Done, its result printed: a signal while Python runs the exit handlers and joins threads (a
        # pool waiting on a request) ends it at once with the command's own status, not as interrupted.
        # (Python puts the default handlers back after that, for the last moments of its teardown.)
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        for s in handled:
            signal.signal(s, lambda signum, frame: os._exit(status))
        raise
