"""The store's root record, ``ckpt-store.json``: what format the store is in.

It is written once, by ``init``, and read first by every open. A store whose
version this code does not know is refused, never guessed at.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass

from ckpt_store.storage.backends.base import Backend
from ckpt_store.storage.errors import (
    StoreFormatError,
    StoreLocationError,
    StoreNotFoundError,
)
from ckpt_store.storage.records import MAX_RECORD_BYTES, decode_record, finite_time, require, sealed_json

CONFIG_PATH = "ckpt-store.json"
STORE_FORMAT = "ckpt-store"
STORE_VERSION = 2  # 2: sealed with a checksum (storage/records.py); 1 is still read


@dataclass(frozen=True)
class StoreConfig:
    store_id: str
    created: float
    version: int = STORE_VERSION

    def to_json(self) -> bytes:
        return sealed_json(
            {"format": STORE_FORMAT, "version": self.version, "store_id": self.store_id, "created": self.created}
        )

    @classmethod
    def from_json(cls, data: bytes) -> StoreConfig:
        obj = decode_record(data, STORE_FORMAT, (1, STORE_VERSION), f"store config {CONFIG_PATH}", sealed_since=2)
        return cls(
            store_id=require(obj, "store_id", str, CONFIG_PATH),
            created=finite_time(require(obj, "created", (int, float), CONFIG_PATH), f"{CONFIG_PATH}: created"),
            version=obj["version"],
        )


def read_config(backend: Backend) -> StoreConfig:
    """The config of the store at ``backend``; :class:`StoreNotFoundError` if there is none."""
    try:
        data = backend.read(CONFIG_PATH, MAX_RECORD_BYTES)
    except FileNotFoundError:
        raise StoreNotFoundError(backend.url) from None
    except IsADirectoryError:
        raise StoreFormatError(f"{backend.url}/{CONFIG_PATH} is a directory, not a store config") from None
    try:
        return StoreConfig.from_json(data)
    except StoreFormatError as e:
        if backend.local_path(".") is not None:
            raise
        # A remote endpoint that is no object store (a web page answering 200 to every request) lands here too.
        raise StoreFormatError(f"{backend.url}: {e.message}",
                               hint=e.hint or "check that the endpoint is the object store's (AWS_ENDPOINT_URL or "
                                              "--storage-option endpoint_url=...); if it is, restore "
                                              f"{CONFIG_PATH} from a backup") from None


def init_config(backend: Backend) -> tuple[StoreConfig, bool]:
    """Create the store config unless one exists. Returns (config, created)."""
    cfg = StoreConfig(store_id=uuid.uuid4().hex, created=time.time())
    if backend.create_exclusive(CONFIG_PATH, cfg.to_json()):
        return cfg, True
    return read_config(backend), False


def enclosing_store(path: str) -> str | None:
    """The root of the local store that ``path`` lies in (the store itself counts), else None.

    ``path`` need not exist: the walk starts at its nearest existing ancestor, with
    symbolic links resolved, so a link into a store is seen as the store.
    """
    here = os.path.realpath(os.path.abspath(os.path.expanduser(path)))
    while True:
        if os.path.isfile(os.path.join(here, CONFIG_PATH)):
            return here
        up = os.path.dirname(here)
        if up == here:
            return None
        here = up


def check_location(backend: Backend, *, create: bool) -> None:
    """Refuse a local store path that cannot hold a store, saying what the path is.

    A file is not a store directory; and a new store inside another one (say in its
    ``refs/``) would be read by the outer store as damage, so creating one there is refused,
    as is creating one in a folder that already holds anything else.
    """
    root = backend.local_path(".")
    if root is None:  # a remote store: its prefix must be new or empty, and below no other store's
        if create and not backend.exists(CONFIG_PATH):
            outer = backend.outer_store(CONFIG_PATH)
            if outer is not None:
                raise StoreLocationError(f"{backend.url} is inside the store at {outer}; a store cannot hold another",
                                         hint=f"choose a prefix outside {outer}")
            if backend.root_is_object():
                raise StoreLocationError(f"{backend.url} is an object (a file), not a place for a store",
                                         hint="give --store a prefix that names no object (the one it is in, say)")
            held = next((e.path for e in backend.list("") if not e.path.rsplit("/", 1)[-1].startswith(".tmp-")), None)
            if held is not None and not backend.exists(CONFIG_PATH):
                raise StoreLocationError(f"{backend.url} is not empty and holds no store (it holds {held!r}, say); "
                                         "a new store is created only where nothing is",
                                         hint="give a new prefix (below this one, say)")
        return
    root = os.path.normpath(root)
    if os.path.islink(root) and not os.path.exists(root):
        raise StoreLocationError(f"{root} is a symbolic link to {os.readlink(root)!r}, which does not exist",
                                 hint="create what it points to, or give --store another path")
    if os.path.exists(root) and not os.path.isdir(root):
        raise StoreLocationError(f"{root} is a file, not a store directory", hint="give --store a directory path")
    if create and not os.path.isfile(os.path.join(root, CONFIG_PATH)):
        outer = enclosing_store(os.path.dirname(root))
        if outer is not None:
            raise StoreLocationError(f"{root} is inside the store at {outer}; a store cannot hold another",
                                     hint=f"choose a path outside {outer}")
        # A new store goes to a new or empty folder: a folder of someone's work (a model, a
        # project) would have the store's folders written among its files (and gc run in it).
        # A ".tmp-" file is an interrupted write of the config, which creating it again finishes.
        try:
            held = sorted(n for n in os.listdir(root) if not n.startswith(".tmp-"))
        except OSError:  # not there yet (or unreadable: creating the config then fails, saying why)
            held = []
        # Checked again after the listing: a store another process made meanwhile (its config comes first) is one.
        if held and not os.path.isfile(os.path.join(root, CONFIG_PATH)):
            raise StoreLocationError(f"{root} is not empty and holds no store (it has {len(held)} entries, such as "
                                     f"{held[0]!r}); a new store is created only in a new or empty folder",
                                     hint="give a new folder (a subfolder of this one, say)")
