"""Listing S3 (:class:`S3Listing`, a part of :class:`~ckpt_store.storage.backends.s3.S3Backend`):
pages of keys checked like any outside data, folders by common prefix, and existence asked in
batches at the cost of the fewest requests."""

from __future__ import annotations

import math
import posixpath
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckpt_store.storage.backends.base import Entry
from ckpt_store.storage.backends.s3_direct import LIST
from ckpt_store.storage.errors import StorageIOError

# A LIST page holds at most this many keys (S3's limit).
LIST_PAGE = 1000
# What one LIST request costs in HEADs: AWS prices a LIST 12.5x a HEAD, and a full page
# (~250 KB) takes longer to send. A listing is used only where it is cheaper by this measure.
LIST_COST = 10


class S3Listing:
    """The listings of :class:`~ckpt_store.storage.backends.s3.S3Backend`, which it is mixed into
    (through its client, bucket, prefix, retries and direct requests)."""

    page_keys = 0  # keys a LIST page may hold; 0: the server's maximum (1,000 on S3). Tests page with fewer.

    def _list_page(self, prefix: str, token: str | None, delimiter: str, start_after: str = "") -> dict[str, Any]:
        kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
        if start_after:
            kw["StartAfter"] = start_after
        if self.page_keys:
            kw["MaxKeys"] = self.page_keys
        if token:
            kw["ContinuationToken"] = token
        if delimiter:
            kw["Delimiter"] = delimiter

        def page() -> dict[str, Any]:
            direct = self._direct
            direct.teach(LIST, lambda: self.client.list_objects_v2(**{**kw, "MaxKeys": 1}))
            r, answer = direct.call(LIST, "", lambda: direct.list(prefix, token, delimiter, self.page_keys, start_after), (200,),
                                    lambda: self.client.list_objects_v2(**kw))
            return direct.page(r) if r is not None else answer  # type: ignore[no-any-return]

        where = prefix[len(self.prefix):] if self.prefix else prefix  # (errors name the store's URL and this below it)
        return self._call("list", where.strip("/"), page)

    def _pages(self, key_prefix: str, delimiter: str = "", start_after: str = "",
               prefixes: bool = False) -> Iterator[tuple[list[tuple[str, dict[str, Any] | None]], bool]]:
        """The listing of ``key_prefix`` page by page: each page's (path in the store, object) pairs,
        and whether more pages follow (the next is asked for only when the caller goes on). Keys from
        after ``start_after`` only, where given; ``prefixes``: each common prefix too (the path
        without its trailing delimiter), with None for its object.

        A listing is the server's word, checked like any outside data: a key that is not below
        ``key_prefix``, or whose path has an empty, ``.`` or ``..`` segment, is left out (a
        server that ignores the prefix would otherwise hand this store another store's objects);
        a continuation token given twice is an error (the listing would never end)."""
        token: str | None = None
        seen: set[str] = set()
        while True:
            page = self._list_page(key_prefix, token, delimiter, "" if token else start_after)
            found: list[tuple[str, dict[str, Any] | None]] = []
            listed = [(o.get("Key"), o) for o in page.get("Contents", [])]
            if prefixes:
                listed += [(p.get("Prefix"), None) for p in page.get("CommonPrefixes", []) if isinstance(p, dict)]
            for key, o in listed:
                if not isinstance(key, str) or not key.startswith(key_prefix):
                    continue
                rel = key[len(self.prefix) + 1 :] if self.prefix else key
                if o is None and rel.endswith(delimiter):
                    rel = rel[: -len(delimiter)]
                if rel and not rel.endswith("/") and not any(p in ("", ".", "..") for p in rel.split("/")):
                    found.append((rel, o))
            token = page.get("NextContinuationToken")
            more = bool(page.get("IsTruncated") and token)
            yield found, more
            if not more:
                return
            assert token is not None
            if token in seen:
                raise StorageIOError(f"list s3://{self.bucket}/{key_prefix} failed: the server gave the same "
                                     "continuation token twice (its listing would never end)")
            seen.add(token)

    def _list_keys(self, prefix: str, delimiter: str = "") -> Iterator[Entry]:
        """Objects whose path starts with directory ``prefix`` (one LIST request per 1000)."""
        key_prefix = self._key(prefix).rstrip("/") + "/" if (prefix or self.prefix) else ""
        for page, _ in self._pages(key_prefix, delimiter):
            for rel, o in page:
                yield self._entry(key_prefix, rel, o)

    def _entry(self, key_prefix: str, rel: str, o: dict[str, Any] | None) -> Entry:
        """The listed object ``o`` at path ``rel`` (its size and the server's time of its write)."""
        try:
            assert o is not None
            return Entry(rel, int(o.get("Size", 0)), float(o["LastModified"].timestamp()))
        except (AssertionError, KeyError, TypeError, ValueError, AttributeError, OverflowError):
            raise StorageIOError(f"list s3://{self.bucket}/{key_prefix} failed: the server listed "
                                 f"{rel!r} without a size and time") from None

    def list(self, prefix: str) -> Iterator[Entry]:
        yield from self._list_keys(prefix)

    def children(self, prefix: str, after: str = "") -> Iterator[tuple[list[tuple[str, bool]], bool]]:
        # One LIST page per 1000 names, from the first after ``after`` (StartAfter): a key below a name
        # rolls up into that name's common prefix (a "folder").
        key_prefix = self._key(prefix).rstrip("/") + "/" if (prefix or self.prefix) else ""
        cut = len(prefix.rstrip("/")) + 1 if prefix else 0
        for page, more in self._pages(key_prefix, "/", key_prefix + after if after else "", prefixes=True):
            names: dict[str, bool] = {}
            for rel, o in page:  # (a key below a name, from a server that ignores the delimiter, makes it a folder too)
                name, _, below = rel[cut:].partition("/")
                names[name] = names.get(name, True) and o is not None and not below
            yield sorted(names.items()), more

    def list_all(self, prefix: str, lookups: int) -> set[str] | None:
        """Every path below ``prefix``, if listing them costs less than ``lookups`` HEADs
        (at most ``lookups // LIST_COST`` pages of 1000); None as soon as it would cost more."""
        times = self.list_times(prefix, lookups)
        return None if times is None else set(times)

    def list_times(self, prefix: str, lookups: int) -> dict[str, float] | None:
        """:meth:`list_all` with the server's time of each object's write (as :meth:`mtime` gives it)."""
        max_pages = lookups // LIST_COST
        if max_pages < 1:
            return None
        key_prefix = self._key(prefix).rstrip("/") + "/" if (prefix or self.prefix) else ""
        found: dict[str, float] = {}
        for n, (page, more) in enumerate(self._pages(key_prefix)):
            found.update((rel, self._entry(key_prefix, rel, o).mtime) for rel, o in page)
            if more and n + 1 == max_pages:
                return None  # (before asking for the next page)
        return found

    def exists_many(self, paths: Iterable[str]) -> set[str]:
        """The subset of ``paths`` that exists, asking S3 as little as possible.

        If the directory holding all of them lists in fewer requests than one HEAD per
        path (priced by ``LIST_COST``), that listing answers. Otherwise paths are grouped
        by directory: listing a directory costs one request per 1000 keys in it, checking
        a path one HEAD; a directory is listed where that is cheaper, priced from the size
        of the most asked directory (listed first). Requests run ``concurrency`` at a time.
        """
        asked = list(dict.fromkeys(paths))
        if not asked:
            return set()
        listed = self.list_all(posixpath.commonpath([posixpath.dirname(p) for p in asked]), len(asked))
        if listed is not None:
            return listed & set(asked)
        by_dir: dict[str, list[str]] = defaultdict(list)
        for p in asked:
            by_dir[posixpath.dirname(p)].append(p)
        found: set[str] = set()
        ordered = sorted(by_dir, key=lambda d: -len(by_dir[d]))
        pages = 1
        first = ordered[0]
        if len(by_dir[first]) >= LIST_COST:
            names = {e.path for e in self._list_keys(first, delimiter="/")}
            found |= names & set(by_dir[first])
            pages = max(1, math.ceil(len(names) / LIST_PAGE))
            ordered = ordered[1:]
        to_list = [d for d in ordered if len(by_dir[d]) >= pages * LIST_COST]
        to_head = [p for d in ordered if len(by_dir[d]) < pages * LIST_COST for p in by_dir[d]]

        def list_dir(d: str) -> set[str]:
            return {e.path for e in self._list_keys(d, delimiter="/")} & set(by_dir[d])

        def head(p: str) -> set[str]:
            return {p} if self.exists(p) else set()

        jobs: list[Callable[[], set[str]]] = [lambda d=d: list_dir(d) for d in to_list]
        jobs += [lambda p=p: head(p) for p in to_head]
        if len(jobs) == 1:
            (only,) = jobs
            return found | only()
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(jobs) or 1), thread_name_prefix="ckpt-s3") as pool:
            for part in pool.map(lambda job: job(), jobs):
                found |= part
        return found
