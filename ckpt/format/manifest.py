"""The checkpoint manifest: a frozen record of every file and tensor, as canonical JSON.

A checkpoint is a list of files as they were pushed. A ``safetensors`` file is
its header (stored as chunks, so it is restored byte for byte) followed by its
tensors' data in file order; a ``blob`` file (config.json, tokenizer files...)
is the concatenation of its chunks. Tensors name their chunks; every list under
a ``chunks`` key holds chunk ids (the rule storage/gc.py relies on).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckpt.format.entries import BundleEntry, FileEntry, TensorEntry, chunk_count, split_lengths
from ckpt.format.names import clashing_path
from ckpt.format.structure import STRUCTURE, check_structure
from ckpt.format.tagged_json import EXACT_TAGS, LATER_TAGS, decode, uses_tags
from ckpt.format.tensor_values import SPAN_SLACK, joins_pieces, views_ahead
from ckpt_store.storage.errors import InvalidNameError, StoreFormatError
from ckpt_store.storage.records import canonical_json, decode_record, finite_time, require

MANIFEST_FORMAT = "ckpt-manifest"
MANIFEST_VERSION = 1
# Version 2: as 1, but ``extra`` holds tagged JSON (ckpt/format/tagged_json.py): written only where a
# value needs a tag (a tuple in a pushed .pt, say), so that a reader that knows only version 1 refuses
# such a manifest instead of handing out ``{"__tuple__": ...}`` as the value.
EXTRA_TAGGED_VERSION = 2
# Version 3: as 2, where ``extra`` uses a tag that version 2 does not know (``LATER_TAGS``: ``__dtype__``, ``__set__``...),
# which a version-2 reader would hand out as a plain dict, or holds a pushed .pt's structure
# (``STRUCTURE``), which a version-2 reader would refuse as a damaged value: it refuses version 3 instead.
EXTRA_DTYPE_VERSION = 3
# Version 4: as 3, where the structure keeps the exact types ``torch.load(weights_only=True)`` gives back
# (``EXACT_TAGS``: an ``OrderedDict`` and its ``_metadata``, a ``torch.Size``, an ``nn.Parameter``), which a
# version-3 reader would hand out as plain dicts: it refuses version 4 instead.
EXACT_VERSION = 4
# Version 5: as 4, where the structure holds a view saved before the tensor it is a view of (``{"t": w.t(), "w": w}``:
# a ``__view__`` naming a tensor met later), which a version-4 reader would refuse as a damaged value: it refuses version 5.
VIEW_AHEAD_VERSION = 5
# Version 6: as 5, where the structure joins pieces of one storage that no tensor of it covers (``{"q": w[:4], "k": w[4:]}``:
# a span, the ``__view__`` of five items that heads them), which a version-5 reader would refuse as a damaged value:
# it refuses version 6.
SPAN_VERSION = 6
# Every version this ckpt reads (storage's chunk rule, ckpt_store.storage.chunk_lists.MANIFEST_VERSIONS, is the same list).
READ_VERSIONS = (MANIFEST_VERSION, EXTRA_TAGGED_VERSION, EXTRA_DTYPE_VERSION, EXACT_VERSION, VIEW_AHEAD_VERSION, SPAN_VERSION)


@dataclass(frozen=True)
class Manifest:
    """One checkpoint. Its id is the BLAKE3 of :meth:`to_json`."""

    source: str  # "safetensors" | "hf-dir" | "state-dict" | "tensors"
    chunk_size: int
    files: tuple[FileEntry, ...]
    tensors: tuple[TensorEntry, ...]
    created: float
    message: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)  # user metadata
    extra: dict[str, Any] = field(default_factory=dict)  # non-tensor state (JSON)
    lineage: dict[str, Any] = field(default_factory=lambda: {"parent": None, "base": None, "merge": None})
    bundles: tuple[BundleEntry, ...] = ()  # copies of its small chunks, for remote readers
    extra_tagged: bool = False  # ``extra`` is tagged JSON (version 2): :meth:`extra_values` decodes it
    # The version it was read with; None where it is made here (then it follows from its content, :meth:`_version`):
    # a version-2 manifest may hold a plain dict with a key that is a tag in version 3, and stays version 2.
    read_version: int | None = field(default=None, compare=False)

    def to_json(self) -> bytes:
        # "bundles" only where there are some: every manifest without keeps its bytes and id.
        return canonical_json(
            {
                **({"bundles": [b.to_obj() for b in self.bundles]} if self.bundles else {}),
                "format": MANIFEST_FORMAT,
                "version": self._version(),
                "source": self.source,
                "chunk_size": self.chunk_size,
                "files": [f.to_obj() for f in self.files],
                "tensors": [t.to_obj() for t in self.tensors],
                "created": self.created,
                "message": self.message,
                "metadata": self.metadata,
                "extra": self.extra,
                "lineage": self.lineage,
            }
        )

    @classmethod
    def from_json(cls, data: bytes, what: str = "manifest") -> Manifest:
        try:
            return cls._from_json(data, what)
        except InvalidNameError as e:
            # A name or id the record holds (a chunk id, a tensor name, a file path), not one a user typed:
            # the manifest is damaged, and the error names it (it named no manifest, and the web view
            # answered 400 "bad request", the client's mistake).
            raise StoreFormatError(f"{what}: {e.message}") from None

    @classmethod
    def _from_json(cls, data: bytes, what: str) -> Manifest:
        o = decode_record(data, MANIFEST_FORMAT, READ_VERSIONS, what)
        chunk_size = require(o, "chunk_size", int, what)
        if chunk_size <= 0:
            raise StoreFormatError(f"{what}: bad chunk_size")
        files = tuple(FileEntry.from_obj(f, what) for f in require(o, "files", list, what))
        clash = clashing_path(f.path for f in files)
        if clash is not None:  # (a pull could write only one of them, and verify, show or copy took it as sound)
            raise StoreFormatError(f"{what} lists {clash!r} twice, or as both a file and a directory")
        tensors = tuple(TensorEntry.from_obj(t, what) for t in require(o, "tensors", list, what))
        for t in tensors:
            if len(t.chunks) != chunk_count(t.nbytes, chunk_size):
                raise StoreFormatError(f"{what}: tensor {t.name} has the wrong number of chunks")
        for f in files:
            if len(f.chunks) != chunk_count(f.head_size if f.kind == "safetensors" else f.size, chunk_size):
                raise StoreFormatError(f"{what}: file {f.path} has the wrong number of chunks")
        raw_bundles = o.get("bundles", [])
        if not isinstance(raw_bundles, list):
            raise StoreFormatError(f"{what}: bundles must be a list")
        bundles = tuple(BundleEntry.from_obj(b, chunk_size, what) for b in raw_bundles)
        _check_files_hold_their_tensors(files, tensors, what)
        msg = o.get("message")
        m = cls(
            source=require(o, "source", str, what),
            chunk_size=chunk_size,
            files=files,
            tensors=tensors,
            created=finite_time(require(o, "created", (int, float), what), f"{what}: created"),
            message=msg if isinstance(msg, str) else None,
            metadata=_object(o, "metadata", what) or {},
            extra=_object(o, "extra", what) or {},
            lineage=_lineage(o, what),
            bundles=bundles,
            extra_tagged=o["version"] != MANIFEST_VERSION,
            read_version=o["version"],
        )
        m._lengths(what)  # one length per chunk id
        if m.extra_tagged:
            m.extra_values(what)  # checked here, like every other field
        if m._has_structure():
            _check_marks_of_its_version(m.extra[STRUCTURE], m._version(), what)
            names = Counter(t.name for t in m.tensors)
            tree = m.structure(names, what, torch_values=False)  # (reading a manifest never imports torch for it)
            check_structure(m.extra, tree, names, m._version() >= EXACT_VERSION, what)
        return m

    def _version(self) -> int:
        if self.read_version is not None:
            return self.read_version
        if not self.extra_tagged:
            return MANIFEST_VERSION
        structure = self.source == "state-dict" and STRUCTURE in self.extra
        if structure and uses_tags(self.extra[STRUCTURE], EXACT_TAGS):
            return _exact_version(self.extra[STRUCTURE])
        return EXTRA_DTYPE_VERSION if structure or uses_tags(self.extra, LATER_TAGS) else EXTRA_TAGGED_VERSION

    def _has_structure(self) -> bool:
        return self.source == "state-dict" and STRUCTURE in self.extra and self._version() >= EXTRA_DTYPE_VERSION

    def extra_values(self, what: str = "manifest") -> dict[str, Any]:
        """``extra`` as the values it stands for: tuples, infinite floats and bytes come back as such
        from a version-2 manifest (a pushed .pt); ``extra`` itself where it is plain JSON. A pushed
        .pt's structure is not one of them (:meth:`structure`)."""
        if not self.extra_tagged:
            return dict(self.extra)
        later, exact = self._version() >= EXTRA_DTYPE_VERSION, self._version() >= EXACT_VERSION
        return {k: decode(v, f"{what}: extra {k!r}", later=later, exact=exact) for k, v in self.extra.items()
                if not (k == STRUCTURE and self._has_structure())}

    def structure(self, tensors: Mapping[str, Any], what: str = "manifest", *, torch_values: bool = True) -> Any | None:
        """The object a pushed ``.pt`` file (or nested dict) held, as it was: its dicts, lists and
        tuples, int and str keys in their order, its values where they were, and each tensor taken
        from ``tensors`` by its stored name. None where the manifest records no structure (a flat
        state dict, a manifest older than version 3): the flat names are the structure then.
        Raises :class:`StoreFormatError` where it names a tensor that ``tensors`` lacks.
        ``torch_values=False``: torch.Size values as tuples and each Parameter as its tensor, without torch."""
        if not self._has_structure():
            return None

        def tensor(name: str) -> Any:
            if name not in tensors:
                raise StoreFormatError(f"{what}: its structure names tensor {name!r}, which it does not hold")
            return tensors[name]

        # (a span holds its pieces and gaps between them, at most SPAN_SLACK times their bytes: all its tensors' at most)
        return decode(self.extra[STRUCTURE], f"{what}: extra structure", tensor=tensor, exact=self._version() >= EXACT_VERSION,
                      torch_values=torch_values, span_bytes=SPAN_SLACK * sum(t.nbytes for t in self.tensors))

    @property
    def logical_bytes(self) -> int:
        """Bytes of every file as pushed."""
        return sum(f.size for f in self.files)

    def chunk_lengths(self) -> dict[str, int]:
        """Decoded length of every chunk this manifest names."""
        return self._lengths("manifest")

    def _lengths(self, what: str) -> dict[str, int]:
        out: dict[str, int] = {}

        def claim(cid: str, n: int) -> None:
            # An id is the hash of the chunk's bytes: a manifest that gives it two lengths is damaged
            # (one of the places naming it would be written or read with the other's length).
            if out.setdefault(cid, n) != n:
                raise StoreFormatError(f"{what} gives chunk {cid[:12]} two lengths ({out[cid]} and {n} bytes)")

        for f in self.files:
            for cid, n in zip(f.chunks, split_lengths(f.head_size if f.kind == "safetensors" else f.size, self.chunk_size), strict=True):
                claim(cid, n)
        for t in self.tensors:
            for cid, chain, n in zip(t.chunks, t.chains(), split_lengths(t.nbytes, self.chunk_size), strict=True):
                claim(cid, n)
                for base in chain:  # a base has the length of the chunk it serves
                    claim(base, n)
        bundled: dict[str, int] = {}
        for b in self.bundles:  # an accelerator only: a reader that finds a bundle lying reads its members
            bundled.update(zip(b.chunks, split_lengths(b.nbytes, self.chunk_size), strict=True))
        # (never over a tensor's or file's length: verify would call their intact chunk corrupt)
        out.update((cid, n) for cid, n in bundled.items() if cid not in out)
        return out


def _exact_version(tree: Any) -> int:
    """The version a structure with the exact types (``tree``, tagged JSON) is written as: 6 where it holds a span, 5
    where it holds a view saved before its base, else 4."""
    if joins_pieces(tree):
        return SPAN_VERSION
    return VIEW_AHEAD_VERSION if views_ahead(tree) else EXACT_VERSION


def _check_marks_of_its_version(tree: Any, version: int, what: str) -> None:
    """A structure read as ``version`` holds no mark of a later one: a span in a version-4 or 5 manifest, a view
    saved before its base in a version-4 one. No writer of that version made it, and a reader of that version
    refuses it as damaged; decoding it as the later mark would make a manifest mean what its version does not."""
    if version < EXACT_VERSION or (needs := _exact_version(tree)) <= version:
        return  # (before version 4 a ``__view__`` key is a plain dict's)
    mark = "a span (a __view__ of five items)" if needs == SPAN_VERSION else "a view saved before its base"
    raise StoreFormatError(f"{what}: its structure holds {mark}, which version {version} does not have: damaged")


def _object(o: dict[str, Any], key: str, what: str) -> dict[str, Any] | None:
    """``o[key]``: a JSON object, or None where it is absent or null."""
    val = o.get(key)
    if val is not None and not isinstance(val, dict):
        raise StoreFormatError(f"{what}: {key} must be an object, not {type(val).__name__}")
    return val


_HEX_ID = re.compile(r"[0-9a-f]{64}")
MERGE_FIELDS = ("method", "inputs", "base", "params", "input_refs", "base_ref", "remix")


def lineage_fields(lineage: Mapping[str, Any]) -> dict[str, Any]:
    """A manifest's ``lineage`` (as stored, or as ``show --json`` has it) with each field this format names
    present: ``parent`` and ``base`` (None where absent) and ``merge`` (None, or the merge record with each of
    :data:`MERGE_FIELDS`, None where absent; ``inputs`` a list, ``input_refs`` one name or None per input).
    Every one is optional (:func:`_lineage` checks the types of those present); readers take them from here,
    not each its own way. A new dict: the stored lineage is left as it is (the manifest's id hashes it).

    >>> lineage_fields({"merge": {"inputs": ["a" * 64]}})["merge"]["input_refs"]
    [None]
    """
    merge = lineage.get("merge")
    if isinstance(merge, Mapping):
        inputs = list(merge.get("inputs") or [])
        merge = {**{k: merge.get(k) for k in MERGE_FIELDS}, "inputs": inputs,
                 "input_refs": list(merge.get("input_refs") or [None] * len(inputs))}
    else:
        merge = None
    return {"parent": lineage.get("parent"), "base": lineage.get("base"), "merge": merge}


def _lineage(o: dict[str, Any], what: str) -> dict[str, Any]:
    """``o["lineage"]`` with the fields readers follow checked: ``parent``, ``base`` and a merge's
    ``inputs`` and ``base`` are checkpoint ids (or null), the merge record and its parts the JSON
    types docs/format.md gives them. Readers (``show``, the web view's lineage graph) use them as
    ids and lists; another type made them fail with a traceback."""
    lin = _object(o, "lineage", what)
    if lin is None:
        return {"parent": None, "base": None, "merge": None}

    def ids(rec: dict[str, Any], keys: tuple[str, ...], where: str) -> None:
        for key in keys:
            v = rec.get(key)
            if v is not None and not (isinstance(v, str) and _HEX_ID.fullmatch(v)):
                raise StoreFormatError(f"{what}: {where}{key} is not a checkpoint id")

    ids(lin, ("parent", "base"), "lineage ")
    merge = lin.get("merge")
    if merge is None:
        return lin
    if not isinstance(merge, dict):
        raise StoreFormatError(f"{what}: lineage merge must be an object")
    ids(merge, ("base",), "merge ")
    inputs = merge.get("inputs")
    if inputs is not None and not (isinstance(inputs, list) and all(isinstance(i, str) and _HEX_ID.fullmatch(i) for i in inputs)):
        raise StoreFormatError(f"{what}: merge inputs must be a list of checkpoint ids")
    for key, typ in (("method", str), ("params", dict), ("input_refs", list), ("base_ref", str), ("remix", dict)):
        if merge.get(key) is not None and not isinstance(merge[key], typ):
            raise StoreFormatError(f"{what}: merge {key} must be a {'string' if typ is str else typ.__name__}")
    refs = merge.get("input_refs")
    if refs is not None and (len(refs) != len(inputs or []) or not all(r is None or isinstance(r, str) for r in refs)):
        raise StoreFormatError(f"{what}: merge input_refs must be a list of names, one per input")
    remix = merge.get("remix") or {}
    for key, typ in (("scores", dict), ("chosen", list)):
        if remix.get(key) is not None and not isinstance(remix[key], typ):
            raise StoreFormatError(f"{what}: remix {key} must be a {typ.__name__}")
    return lin


def _check_files_hold_their_tensors(files: tuple[FileEntry, ...], tensors: tuple[TensorEntry, ...], what: str) -> None:
    """Every tensor lies in a safetensors file of the checkpoint, once by name, and each such file's
    size is its header and its tensors: a pull writes exactly the bytes it names, never zeros for
    bytes no entry holds, nor a file longer or shorter than it says."""
    held: dict[str, int] = {f.path: 0 for f in files if f.kind == "safetensors"}
    names: dict[str, set[str]] = {}
    for t in tensors:
        if t.file not in held:
            raise StoreFormatError(f"{what}: tensor {t.name} lies in {t.file!r}, not a safetensors file of this checkpoint")
        if t.name in names.setdefault(t.file, set()):
            raise StoreFormatError(f"{what}: tensor {t.name} is listed twice in {t.file}")
        names[t.file].add(t.name)
        held[t.file] += t.nbytes
    for f in files:
        if f.kind == "safetensors" and f.size != f.head_size + held[f.path]:
            raise StoreFormatError(f"{what}: file {f.path} is {f.size} bytes, but its header and tensors are "
                                   f"{f.head_size + held[f.path]}")
