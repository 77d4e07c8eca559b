"""``ckpt``: push, pull and inspect checkpoints in a content-addressed store.

The wiring: each command is registered here, in the order ``ckpt --help`` lists them; the
console entry point turns errors and signals into one line and an exit code."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import typer

from ckpt_store.cli import diff_merge, housekeeping, inspection, transfers
from ckpt_store.cli.app import app, emit_document, state
from ckpt_store.cli.interrupts import AFTER_INTERRUPT, INTERRUPTED, on_signal, signals_received, terminated
from ckpt_store.cli.render import PIPE_GONE, GuardedStdout, err, out, safe


def _register(command: Callable[..., None], name: str | None = None, **settings: Any) -> None:
    """Add ``command`` to ``ckpt``, as ``@app.command(name, **settings)`` over its definition would."""
    decorate = app.command(name, **settings)
    decorate(command)


app.add_typer(housekeeping.cache_app, name="cache")
app.add_typer(housekeeping.tiers_app, name="tiers")
_register(transfers.init)
_register(transfers.push)
_register(transfers.pull)
_register(inspection.ls, "ls")
_register(inspection.log)
_register(inspection.show)
_register(inspection.du)
_register(inspection.verify)
_register(housekeeping.rm)
_register(transfers.copy)
_register(housekeeping.gc)
_register(diff_merge.diff)
_register(diff_merge.merge, epilog=diff_merge.merge_epilog())
_register(diff_merge.remix)
_register(inspection.serve)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: ckpt errors become one line on stderr and exit code 1."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return _main(argv)
    signals_received.clear()
    # (a SIGINT the parent ignores, a job started in the background, stays ignored)
    handled = [s for s in (signal.SIGTERM, signal.SIGINT) if signal.getsignal(s) is not signal.SIG_IGN]
    before = {s: signal.signal(s, on_signal) for s in handled}
    try:
        _main(argv)
    finally:  # (an in-process caller, a test, gets its own handlers back)
        for s, h in before.items():
            signal.signal(s, h)


def _main(argv: list[str] | None) -> None:
    from ckpt.errors import CkptError

    state["json"] = state["json_written"] = out.reader_left = False
    words = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
    state["argv"] = words  # this command's line, for open_store (None for an app invoked otherwise: CliRunner)
    stdout, sys.stdout = sys.stdout, GuardedStdout(sys.stdout)  # (click prints --help there while it parses)
    try:
        # Without standalone mode click returns the code of a typer.Exit instead of exiting.
        code = app(args=argv, standalone_mode=False)
    except CkptError as e:
        err.print(f"error: {safe(str(e))}")
        _json_error(str(e))
        sys.exit(1)
    except typer.Exit as e:
        sys.exit(_status(e.exit_code))
    except typer.Abort:  # click's word for Ctrl-C (and SIGTERM, unwound the same way)
        _end_interrupted("aborted")
    except BrokenPipeError:  # a write that escaped the guards ended the command: its reader left, no traceback
        out.on_broken_pipe()
        sys.exit(PIPE_GONE)
    except KeyboardInterrupt:
        _end_interrupted(INTERRUPTED)
    except typer.TyperException as e:  # usage errors: bad option, missing argument...
        show = getattr(e, "show", None)
        if show is None:
            raise
        import io

        buf = io.StringIO()  # click echoes the offending argument as typed: escape it like any user text
        show(file=buf)
        sys.stderr.write("".join(safe(line) + "\n" for line in buf.getvalue().splitlines()))
        if "--json" in words[: words.index("--") if "--" in words else len(words)]:
            # Refused before --json was read (an unknown option, a bad value ahead of it, a bad
            # --storage-option): the script that asked for JSON still gets its document.
            state["json"] = True
        _json_error(e.format_message())
        sys.exit(getattr(e, "exit_code", 2))
    finally:
        state["argv"] = None
        sys.stdout = stdout
    if terminated() or code == 130:  # typer returns Ctrl-C inside a command (or SIGTERM, unwound alike) as code 130, silently
        _end_interrupted(INTERRUPTED)
    sys.exit(_status(code if isinstance(code, int) else 0))


def _status(code: int) -> int:
    """The exit status of a command that ended with ``code``: 141 where it succeeded but the reader of
    its output left (`ckpt ls | head -1`), as a shell pipeline expects; a failure keeps its own status
    (`ckpt verify | head -1` on a damaged store: 1), so that a script learns that it failed."""
    return PIPE_GONE if code == 0 and out.reader_left else code


def _json_error(message: str) -> None:
    """With --json, an error is a document too, as the web view's /api/ answers one: {"error": MESSAGE}
    on stdout (exact text), unless the command printed its document already (`ls` naming damage)."""
    if state.get("json") and not state.get("json_written"):
        emit_document({"error": message})


def _end_interrupted(message: str) -> None:
    """Exit after Ctrl-C (130) or SIGTERM (143), saying which (with --json, as its document too)."""
    if terminated():
        message, code = f"terminated; {AFTER_INTERRUPT}", 143
    else:
        code = 130
    err.print(message)
    _json_error(message)
    sys.exit(code)


if __name__ == "__main__":
    main()
