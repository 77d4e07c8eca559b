"""Stand-in for ``pip`` while tests/test_readme.py runs the README's blocks.

``pip install -e '.[EXTRA]'`` / ``pip install 'ckpt-store[EXTRA]'`` and ``pip install --no-deps PKG``
are checked, not run: the test environment already has (or lacks) them, and reinstalling
would rebuild it. Exit 0 when what the line names is importable, else 1 with one line.
"""

from __future__ import annotations

import importlib.util
import re
import sys

EXTRAS = {"s3": ["s3fs"], "lightning": ["pytorch_lightning"], "transformers": ["transformers", "accelerate"],
          "plot": ["matplotlib"], "test": ["pytest", "hypothesis"],
          "web": ["starlette", "jinja2", "uvicorn"]}


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "install":
        print(f"readme pip stand-in: only `pip install` is expected, got {argv}", file=sys.stderr)
        return 1
    modules = ["ckpt"]
    for arg in argv[1:]:
        m = re.search(r"\[([a-z0-9_,-]+)\]", arg)
        for extra in m.group(1).split(",") if m else []:
            modules += EXTRAS[extra]
        if not arg.startswith("-") and not m and arg not in (".",):
            modules.append(re.split(r"[=<>]", arg)[0].replace("-", "_"))
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        print(f"readme pip stand-in: not installed: {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
