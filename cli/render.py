"""Output helpers for the CLI: escaping user text, JSON, tables and progress bars (sizes and times: units.py).

Everything a command prints that came from a user -- commit messages, metadata, ref,
tensor and file names, paths -- goes through :func:`safe` before it reaches the
terminal, and the consoles never interpret rich markup or emoji codes: a checkpoint
pushed by anyone with write access to a shared store cannot clear a reader's screen,
write their clipboard (OSC 52) or break the layout. ``--json`` output keeps the exact text.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

from rich.console import Console

from ckpt.progress import TerminalProgress

# A command started with its output closed (`ckpt ls >&-`) has no sys.stdout: what it prints goes
# nowhere, as a write to a closed descriptor would, instead of the command failing on import.
for _name in ("stdout", "stderr"):
    if getattr(sys, _name) is None:
        setattr(sys, _name, open(os.devnull, "w"))  # noqa: SIM115 - for the life of the process
# Output in an encoding that cannot hold every character of a name or message (PYTHONIOENCODING=ascii,
# a legacy locale, a Windows code page) gets \xe9-style escapes, as Python writes stderr, instead of
# failing with a UnicodeEncodeError traceback. (--json output is ASCII: JSON escapes the rest.)
if getattr(sys.stdout, "errors", None) == "strict" and hasattr(sys.stdout, "reconfigure"):
    sys.stdout.reconfigure(errors="backslashreplace")

# The exit status of a command whose output's reader left (`ckpt ls | head -1`): 128 + SIGPIPE, as a shell
# pipeline expects. Only a command that succeeded ends so: one that failed keeps its own status (cli/main.py).
PIPE_GONE = 141


def _to_devnull(stream: Any) -> None:
    """Point ``stream``'s descriptor at /dev/null: what is left to write there goes nowhere."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, stream.fileno())
        os.close(fd)
    except (OSError, ValueError):  # (a stream that is no file: a test's capture)
        pass


class _Console(Console):
    #: The reader of stdout left during this command (cli/main.py resets it for each command).
    reader_left = False

    def on_broken_pipe(self) -> None:
        """The reader of a pipe left (`ckpt ls | head -1`): what is left to print goes nowhere, and the
        command goes on to its own end. It ends with :data:`PIPE_GONE` if it succeeds (rich's exit was 1);
        one that fails after (the error it names, the damage it lists) keeps its own status, so that the
        script reading the status learns that it failed (cli/main.py, the one place that decides)."""
        self.quiet = True
        self.reader_left = True
        _to_devnull(sys.stdout)

    def _check_buffer(self) -> None:
        """Write what is buffered (rich's own step, which hands a broken pipe to :meth:`on_broken_pipe`);
        any other failure to write ends the command as :func:`output_failed` says."""
        try:
            super()._check_buffer()
        except OSError as e:
            output_failed(e)


class _ErrConsole(Console):
    def on_broken_pipe(self) -> None:
        """The reader of stderr left: what is left to say there goes nowhere, and the command goes on,
        its output and exit status its own (rich's handler pointed *stdout* at /dev/null and exited 1:
        a command's result lost over a warning nobody could read)."""
        self.quiet = True
        _to_devnull(sys.stderr)


def output_failed(e: OSError) -> None:
    """Standard output did not take what a command printed (a full disk behind `ckpt ls --json >
    ls.json`, an I/O error): one line on stderr and exit 1, never a traceback, so that a script knows
    its file is cut short. What is left to print goes nowhere (the exit's own flush included)."""
    out.quiet = True
    _to_devnull(sys.stdout)
    err.print(f"error: cannot write the output: {e.strerror or e}")
    raise SystemExit(1)


class GuardedStdout:
    """``sys.stdout`` while a command line is parsed and run: what click writes there itself (the help,
    printed while it parses, outside any command) fails as every other output does: a closed pipe
    ends a command that succeeds with 141 (:meth:`_Console.on_broken_pipe`), any other failure to write with one
    line and 1 (:func:`output_failed`), never a traceback or click's silent 1. Only stdout's own
    errors are turned so; the rest of the stream is the one it wraps."""
    # (a closed pipe: :meth:`_Console.on_broken_pipe`, after which the text went nowhere, as all that follows)

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return int(self._stream.write(text))
        except BrokenPipeError:
            out.on_broken_pipe()
        except OSError as e:
            output_failed(e)
        return len(text)  # (written to nowhere: its reader left)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            out.on_broken_pipe()
        except OSError as e:
            output_failed(e)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


# Wide when piped, so tables in logs and files do not wrap at 80 columns. markup and
# emoji off: "[red]" and ":smile:" in a message are text, never styling (or a crash on "[/b]").
out = _Console(highlight=False, markup=False, emoji=False, soft_wrap=True, width=None if sys.stdout.isatty() else 200)
err = _ErrConsole(stderr=True, highlight=False, markup=False, emoji=False, soft_wrap=True)

# What a terminal may act on rather than show: C0 controls, DEL, C1 controls (U+009B is
# CSI, like ESC [), and the Unicode line/paragraph separators and bidirectional
# overrides/isolates, which move or reorder the text around them ("Trojan Source"), and
# lone surrogates (bytes that were not UTF-8, e.g. a C1 byte typed as $'\x9b' in a shell).
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(m: re.Match[str]) -> str:
    c = m.group()
    if c in _NAMED:
        return _NAMED[c]
    if 0xDC80 <= ord(c) <= 0xDCFF:  # surrogateescape: the undecodable byte itself
        return f"\\x{ord(c) - 0xDC00:02x}"
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def safe(text: object) -> str:
    r"""``text`` as one inert line for a terminal: control characters shown as escapes.

    >>> print(safe("fix\x1b[2J \x9b1m\nnext [red]x é"))
    fix\x1b[2J \x9b1m\nnext [red]x é

    Printable text (markup-looking brackets and non-ASCII included) is left as it is;
    the consoles above print it literally. None becomes "".
    """
    if text is None:
        return ""
    s = text if isinstance(text, str) else str(text)
    return _UNSAFE.sub(_escape, s)


def as_text(value: Any) -> str:
    """A value inside text output: strings as they are (escaped), anything nested as
    compact JSON (never a Python repr), all of it through :func:`safe`."""
    if isinstance(value, str):
        return safe(value)
    return safe(json.dumps(value, sort_keys=True, ensure_ascii=False, default=str))


def ratio(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def emit_json(obj: Any) -> None:
    """``--json``: the result as it is (exact text; JSON escapes any control character), every
    string valid Unicode (:func:`~ckpt_store.cli.results.strict_json`)."""
    text = json.dumps(obj, indent=2, sort_keys=True)
    if "\\ud" in text:  # a surrogate: a lone one (strict_json's work), or half of an escaped pair
        from ckpt_store.cli.results import strict_json

        text = json.dumps(strict_json(obj), indent=2, sort_keys=True)
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        out.on_broken_pipe()
    except OSError as e:
        output_failed(e)


class RichProgress(TerminalProgress):
    """ckpt's terminal progress bar on the CLI's stderr console, descriptions made inert."""

    def __init__(self, enabled: bool | None = None) -> None:
        super().__init__(console=err, enabled=enabled)

    def start(self, description: str, total: int) -> None:
        super().start(safe(description), total)
