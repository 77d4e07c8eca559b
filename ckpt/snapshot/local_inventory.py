"""The local tiers this user has on this node: listed, and freed (`ckpt tiers`, `ckpt tiers rm`).

A manager's ``close()`` keeps its tier (a preempted job restarts from it), so every finished or abandoned run
leaves its snapshots in /dev/shm, host memory, until the machine restarts. Each tier folder's
``ckpt-local-tier.json`` says whose it is (``docs/format.md``, "The local tier"); a manager holds it with an
exclusive ``flock`` (local_lock.py), which a removal takes too. Nothing here follows a link, and nothing that
is not a tier (no readable marker: it may be a folder of the user's) is ever removed.

>>> import tempfile, torch, ckpt
>>> root = tempfile.mkdtemp()
>>> store = ckpt.Store.init(f"{root}/store")
>>> with ckpt.CheckpointManager(store, "run", every_n_steps=2, local=f"{root}/tiers/run", local_every_n_steps=1) as mgr:
...     for step in (1, 2, 3):
...         mgr.save(step, {"w": torch.full((4,), float(step))})
>>> [(t.run, t.steps, t.held, t.durable_step, t.unpersisted) for t in local_tiers([f"{root}/tiers"], store)]
[('run', [2, 3], False, 2, [3])]
>>> remove_tier(f"{root}/tiers/run", store, force=True).steps  # (step 3 is in the tier alone: force)
[2, 3]
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ckpt.errors import CkptError
from ckpt.snapshot.local_claim import TIER_MARKER, read_marker, readable
from ckpt.snapshot.local_lock import held, taken
from ckpt.snapshot.steps import run_steps, step_of
from ckpt.snapshot.tiers import describe

if TYPE_CHECKING:
    from ckpt.store.store import Store

RANK = re.compile(r"rank-[0-9]+\Z")  # a process group's rank's tier, below its key's folder (local_paths.py)


@dataclass(frozen=True)
class TierInfo:
    """One folder where local tiers live (:func:`local_tiers`): a tier, or what stands there instead.

    ``kind``: "tier" (a readable marker), "unmarked" (a folder without one: a manager killed before it wrote it,
    or someone's folder), "damaged" (a marker that cannot be read, or without its two fields), "link" (never
    followed) or "file". ``bytes``: what the folder occupies (``du``, links not followed). ``held``: whether a
    manager (or a write into it) holds it now; None where that cannot be told. ``durable_step``: the run's
    newest step in the durable store (None: none there, or not looked at); ``unpersisted``: the steps only the
    tier has: those whose checkpoint the durable store's ``RUN/step-N`` never named (a step of a timeline the run
    left has its number, not its id; one retention pruned there stays in the ref's history), but for those older
    than a step it did (superseded), unless the tier's ``RUN/latest`` names it (the head of a timeline the run
    began again, a crash before its persist). None: the durable store was not looked at (another store's, or none). ``others``: checkpoints
    the tier holds that are no snapshot of its run (a push into it while no manager held it): the tier alone
    has them. ``error``: why the steps or the durable store could not be read, or refs of it that are damaged."""

    path: str
    kind: str
    run: str | None = None
    store_id: str | None = None
    steps: list[int] = field(default_factory=list)
    bytes: int = 0
    held: bool | None = None
    durable_step: int | None = None
    unpersisted: list[int] | None = None
    error: str | None = None
    others: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` row: the fields, and ``persisted`` (nothing it holds is the tier's alone; None: not known)."""
        return {"path": self.path, "kind": self.kind, "run": self.run, "store_id": self.store_id, "steps": self.steps,
                "bytes": self.bytes, "held": self.held, "durable_step": self.durable_step,
                "unpersisted_steps": self.unpersisted, "other_refs": self.others,
                "persisted": None if self.unpersisted is None else not self.unpersisted and not self.others,
                "error": self.error}


def user_folder_name() -> str:
    """The name of this user's folder of default tiers below a root (``ckpt-local-UID``, local_paths.py)."""
    return f"ckpt-local-{os.getuid() if hasattr(os, 'getuid') else 0}"


def default_folders() -> list[str]:
    """This user's folders of default tiers that exist (links too: listed, never followed) under each root
    :func:`~ckpt.snapshot.local_paths.default_local_path` may have used: ``$CKPT_LOCAL_DIR``, /dev/shm and the temp
    directory (a run kept its tier under whichever was the root then)."""
    roots = [os.environ.get("CKPT_LOCAL_DIR") or "", "/dev/shm", tempfile.gettempdir()]
    found: list[str] = []
    for root in roots:
        if not root:
            continue
        path = os.path.join(os.path.abspath(os.path.expanduser(root)), user_folder_name())
        if os.path.lexists(path) and path not in found:
            found.append(path)
    return found


def local_tiers(folders: Iterable[str | os.PathLike[str]], durable: Store | None = None) -> list[TierInfo]:
    """Every tier folder in ``folders`` (:func:`default_folders`, or the parent of a ``local=PATH``): each entry
    that holds a marker, each ``rank-R`` of an entry that holds those (a process group's key folder), and
    whatever else stands there (:class:`TierInfo`'s ``kind``); a folder named like this user's folder of default
    tiers is looked into too. ``durable``: the store whose runs' tiers are checked against it (their newest
    durable step, their steps not persisted); other stores' tiers are listed without. Sorted by path."""
    found: list[TierInfo] = []
    newest: dict[str, tuple[dict[int, str], str | None]] = {}  # run -> its durable steps' ids, or why not known
    for folder in folders:
        top = os.path.abspath(os.path.expanduser(os.fspath(folder)))
        whole = not _is_dir(top) or os.path.lexists(os.path.join(top, TIER_MARKER))  # (a tier named itself)
        for path in [top] if whole else _entries(top):
            if _is_dir(path) and not os.path.lexists(os.path.join(path, TIER_MARKER)) and (
                    os.path.basename(path) == user_folder_name()):
                paths = _entries(path)
            else:
                paths = [path]
            for p in paths:
                found.extend(_look(t, durable, newest) for t in _ranks(p) or [p])
    return sorted({t.path: t for t in found}.values(), key=lambda t: t.path)


def remove_tier(path: str | os.PathLike[str], durable: Store | None, force: bool = False) -> TierInfo:
    """Free the local tier at ``path``: remove its folder (``shutil.rmtree``, which follows no link inside it),
    then its key's folder where that is left empty (a process group's ``rank-R``). What was removed.

    Raises :class:`~ckpt.snapshot.run.SnapshotError`, nothing removed, where ``path`` is a link (never followed),
    not a folder, or not a tier (no readable marker: it may be a folder of the user's); where a manager, or a
    write into it, holds it (its exclusive ``flock`` is taken without waiting and held while it is removed: a
    manager starting meanwhile waits, then takes a folder made anew); and, unless ``force``, where another user
    owns it, where it holds a snapshot ``durable`` lacks (:class:`TierInfo`'s ``unpersisted``) or a checkpoint
    that is no snapshot of its run (both would be lost), has damaged refs, or holds steps and ``durable`` is not
    its store (whether they are persisted cannot be told)."""
    from ckpt.snapshot.run import SnapshotError

    p = os.path.normpath(os.path.abspath(os.path.expanduser(os.fspath(path))))
    if os.path.islink(p):
        raise SnapshotError(f"{p} is a link, not a local tier: nothing removed, its target neither (a link is never followed)",
                            hint="name the tier's own folder (`ckpt tiers` lists them)")
    if not os.path.isdir(p):
        raise SnapshotError(f"{p} is not a local tier: {'not a folder' if os.path.lexists(p) else 'no such folder'}",
                            hint="`ckpt tiers` lists the local tiers")
    if not readable(read_marker(p)):
        raise _not_a_tier(p, read_marker(p))
    if not force and hasattr(os, "getuid") and os.stat(p).st_uid != os.getuid():
        raise SnapshotError(f"local tier {p} is another user's (uid {os.stat(p).st_uid}): nothing removed",
                            hint="its user frees it, or pass --force")
    with taken(p):
        # Under the lock: what it holds now, and no manager adds to it (held by none but this removal).
        info = replace(_look(p, durable, {}), held=False)
        if info.kind != "tier":
            raise _not_a_tier(p, read_marker(p))
        if not force and info.unpersisted is None and (info.steps or info.error is not None):
            if durable is not None and durable.config.store_id == info.store_id:
                why, hint = f"({info.error})", "pass --force to remove it anyway"
            else:
                which = "no store is given" if durable is None else f"the store given ({durable.url}) is another store"
                why, hint = f"(it is run {info.run!r} of the store with id {info.store_id:.12}, and {which})", \
                    "pass --store URL of that run's durable store, or --force to remove it anyway"
            raise SnapshotError(f"local tier {p}: whether the steps it holds ({_steps(info.steps) or '?'}) are persisted "
                                f"cannot be told {why}: nothing removed", hint=hint)
        if not force and info.unpersisted:
            after = "has none" if info.durable_step is None else f"has step {info.durable_step} at the newest"
            raise SnapshotError(f"local tier {p} holds step(s) {_steps(info.unpersisted)} of run {info.run!r} that are "
                                f"not persisted (the durable store {after}, none of them the same snapshot): they would "
                                "be lost; nothing removed",
                                hint="restore from them and save to the durable store first, or pass --force to "
                                     "remove them")
        if not force and info.others:
            raise SnapshotError(f"local tier {p} holds checkpoint(s) that are no snapshot of run {info.run!r}: "
                                f"{', '.join(info.others[:8])}{' ...' if len(info.others) > 8 else ''}; they would be "
                                "lost: nothing removed",
                                hint=f"copy them elsewhere first (ckpt --store {p} copy --to URL NAME), or pass --force")
        try:
            shutil.rmtree(p)
        except OSError as e:
            raise SnapshotError(f"local tier {p} could not be removed whole ({describe(e)})",
                                hint="remove what is left of it with rm -r") from e
    key = os.path.dirname(p)
    if RANK.match(os.path.basename(p)) and os.path.basename(os.path.dirname(key)) == user_folder_name():
        try:
            os.rmdir(key)  # a default key's folder, once its last rank's tier is gone (only if empty; not a user's)
        except OSError:
            pass
    return info


def _look(path: str, durable: Store | None, newest: dict[str, tuple[int | None, str | None]]) -> TierInfo:
    """What stands at ``path`` (:class:`TierInfo`); ``newest``: the runs' newest durable steps known so far."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return TierInfo(path, "unmarked", error=describe(e))
    if stat.S_ISLNK(st.st_mode):
        return TierInfo(path, "link")
    if not stat.S_ISDIR(st.st_mode):
        return TierInfo(path, "file", bytes=st.st_blocks * 512)
    size, busy = du(path), held(path)
    have = read_marker(path)
    if have is None:
        return TierInfo(path, "unmarked", bytes=size, held=busy)
    if not readable(have):
        return TierInfo(path, "damaged", bytes=size, held=busy)
    run, store_id = have["run"], have["store_id"]  # type: ignore[index]
    try:
        ids, latest, others, damaged = _tier_refs(path, run)
    except (CkptError, OSError) as e:
        return TierInfo(path, "tier", run, store_id, bytes=size, held=busy, error=describe(e))
    steps = sorted(ids)
    if damaged:  # (a snapshot that may be the tier's alone: `ckpt --store PATH ls` names them, as here)
        return TierInfo(path, "tier", run, store_id, steps, size, busy, others=others,
                        error=f"damaged ref(s) {', '.join(damaged[:8])}{' ...' if len(damaged) > 8 else ''}")
    if durable is None or durable.config.store_id != store_id:
        return TierInfo(path, "tier", run, store_id, steps, size, busy, others=others)
    if run not in newest:
        try:
            newest[run] = (run_steps(durable, run)[0], None)
        except CkptError as e:
            newest[run] = ({}, describe(e))
    kept, error = newest[run]
    try:
        same = {s for s in steps if ids[s] in _named(durable, f"{run}/step-{s}")}
    except CkptError as e:
        same, error = set(), error or describe(e)
    # Persisted: the durable store's RUN/step-N named that checkpoint, now or before retention pruned it (a number alone
    # may be another timeline's, or a copied store's run gone on apart); older than such a step: superseded there,
    # but not the tier's RUN/latest (the head of a timeline begun again below it, its persist cut short by a crash)
    top = max(same, default=None)
    unpersisted = None if error else [s for s in steps if s not in same and (top is None or s > top or ids[s] == latest)]
    return TierInfo(path, "tier", run, store_id, steps, size, busy, max(kept, default=None), unpersisted, error, others)


def _named(store: Store, name: str) -> set[str]:
    """Every checkpoint ref ``name`` of ``store`` has named (its history: a ref removed by retention keeps it)."""
    from ckpt.errors import RefNotFoundError

    try:
        return {e.target for e in store.refs_db.history(name) if e.target is not None}
    except RefNotFoundError:
        return set()


def _tier_refs(path: str, run: str) -> tuple[dict[int, str], str | None, list[str], list[str]]:
    """The tier at ``path``'s snapshots (step -> checkpoint id), what its ``RUN/latest`` names, its other live refs
    (not the run's steps nor ``RUN/latest``) and its damaged refs, read only (a manager may hold it: nothing is
    written, not even its metadata index, which a listing through the index would heal)."""
    from ckpt.store.store import Store
    from ckpt_store.storage.refs import validate_ref_name

    validate_ref_name(f"{run}/latest")  # (a marker naming no run that could have refs: its steps cannot be told)
    refs, damaged = Store.open(path).refs_db.scan()
    ids: dict[int, str] = {}
    others: list[str] = []
    for name, entry in refs.items():
        step = step_of(run, name)
        if step is not None and entry.target is not None:
            ids[step] = entry.target
        elif name != f"{run}/latest":
            others.append(name)
    latest = refs[f"{run}/latest"].target if f"{run}/latest" in refs else None
    return ids, latest, sorted(others), sorted(damaged)


def du(path: str) -> int:
    """Bytes the folder ``path`` occupies, as ``du`` counts them: blocks of everything in it, each file once
    (hard links), links not followed."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for top, dirs, files in os.walk(path, onerror=lambda e: None):
        for name in [".", *dirs, *files]:
            try:
                st = os.lstat(os.path.join(top, name))
            except OSError:
                continue  # (gone meanwhile: a manager pruning it)
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def _entries(folder: str) -> list[str]:
    try:
        return [os.path.join(folder, n) for n in sorted(os.listdir(folder))]
    except OSError:
        return []


def _ranks(path: str) -> list[str]:
    """The ``rank-R`` entries of ``path``, a process group's key folder (none where it is a tier itself, or a link)."""
    if not _is_dir(path) or os.path.lexists(os.path.join(path, TIER_MARKER)):
        return []
    return [p for p in _entries(path) if RANK.match(os.path.basename(p))]


def _is_dir(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path)


def _not_a_tier(path: str, have: object) -> CkptError:
    from ckpt.snapshot.run import SnapshotError

    if have is None and _ranks(path):
        return SnapshotError(f"{path} holds a process group's local tiers, one per rank: nothing removed",
                             hint=f"name them: {os.path.join(path, 'rank-*')}")
    if have is None:
        return SnapshotError(f"{path} is not a local tier: it holds no {TIER_MARKER} (it may be a folder of yours): "
                             "nothing removed", hint="`ckpt tiers` lists the local tiers; remove other folders yourself")
    return SnapshotError(f"{path}: its {TIER_MARKER} is damaged, so whose tier it is cannot be told: nothing removed",
                         hint="if it is a tier you no longer need, remove it yourself (rm -r)")


def _steps(steps: list[int]) -> str:
    shown = ", ".join(map(str, steps[:8]))
    return shown + (f" (+{len(steps) - 8} more)" if len(steps) > 8 else "")


__all__ = ["TierInfo", "default_folders", "du", "local_tiers", "remove_tier", "user_folder_name"]
