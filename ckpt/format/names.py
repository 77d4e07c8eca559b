"""Names a checkpoint holds: tensor names and file paths as a reader may trust them (no control characters,
no path leaving its directory), and the one rule for picking tensors by name and for telling apart the
models of a pipeline that share names."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Sequence

MAX_NAME = 1024
# Unicode's control characters (Cc): C0, DEL and C1 (U+009B is a terminal's CSI, like ESC [).
_CTRL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def name_selected(name: str, include: Sequence[str] | None = None, exclude: Sequence[str] | None = None) -> bool:
    """Whether a tensor name passes ``--include``/``--exclude`` globs (case-sensitive
    ``fnmatch``; ``*`` crosses dots; no include means everything). The one rule for
    pull, load, diff and DCP consolidation.

    >>> name_selected("layer.0.weight", ["layer.*.weight"]), name_selected("head.bias", None, ["head.*"])
    (True, False)
    """
    if include and not any(fnmatch.fnmatchcase(name, p) for p in include):
        return False
    return not (exclude and any(fnmatch.fnmatchcase(name, p) for p in exclude))


def folder_names(tensors: Iterable[tuple[str, str]]) -> list[str]:
    """The name each tensor, given as (its name, its file), goes by when a checkpoint is read as one
    set of tensors (load, load_into, diff): its name; or, where files in several folders hold one
    name (a diffusers pipeline's unet/, text_encoder/, vae/, each a model), ``FOLDER/NAME`` for
    every tensor of a file in a subfolder, so that each model's tensors keep apart. Two files of one
    folder holding one name still give it twice: callers refuse that.

    >>> folder_names([("w", "unet/m.safetensors"), ("w", "vae/m.safetensors"), ("x", "vae/m.safetensors")])
    ['unet/w', 'vae/w', 'vae/x']
    >>> folder_names([("a", "unet/m.safetensors"), ("b", "vae/m.safetensors")])
    ['a', 'b']
    """
    pairs = list(tensors)
    folders: dict[str, set[str]] = {}
    for name, file in pairs:
        folders.setdefault(name, set()).add(file.rpartition("/")[0])
    split = any(len(f) > 1 for f in folders.values())
    return [f"{file.rpartition('/')[0]}/{name}" if split and "/" in file else name for name, file in pairs]


def check_tensor_name(name: str, what: str = "tensor name") -> str:
    """Reject names with control characters or absurd lengths (they end up in files and terminals)."""
    from ckpt.errors import InvalidNameError

    if not isinstance(name, str) or not name or len(name) > MAX_NAME or _CTRL.search(name):
        raise InvalidNameError(f"invalid {what} {name[:80]!r}" if isinstance(name, str) else f"invalid {what}")
    return name


def clashing_path(paths: Iterable[str]) -> str | None:
    """One of ``paths`` (relative, ``/``-separated) listed twice, or as a file and as a directory above another
    (``sub`` and ``sub/x.json``): no directory holds them all as files. None where each names one file.

    In the order of their segments, the paths below a path come right after it: one comparison per neighbour,
    and no memory beyond the segments (a set of every directory above every path took ~260 KB per path of 511
    segments: 10,000 of them in an 11 MB manifest, ~2.9 GB).

    >>> clashing_path(["sub/x.json", "sub.json"]), clashing_path(["sub", "sub/x.json"]), clashing_path(["a", "a"])
    (None, 'sub', 'a')
    """
    keyed = sorted(p.split("/") for p in paths)
    for a, b in zip(keyed, keyed[1:]):
        if b[:len(a)] == a:
            return "/".join(a)
    return None


def check_file_path(path: str) -> str:
    """A relative ``/``-separated path that stays inside its directory."""
    from ckpt.errors import InvalidNameError

    check_tensor_name(path, "file path")
    parts = path.split("/")
    if path.startswith("/") or "\\" in path or any(p in ("", ".", "..") for p in parts) or ":" in parts[0]:
        raise InvalidNameError(f"file path {path!r} would escape the checkpoint directory")
    return path
