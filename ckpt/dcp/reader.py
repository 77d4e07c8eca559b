"""Loading through ``torch.distributed.checkpoint`` from a ckpt store, at any world size: :class:`Reader`
(overview and example: :mod:`ckpt.dcp.checkpoint`)."""

from __future__ import annotations

import dataclasses
import io
import os
import uuid
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ckpt.dcp.consolidate import Copy, run_copies, shard_entry
from ckpt.dcp.format import DCP_SOURCE, DcpLayout, Shard, TensorItem, decode_layout, to_metadata
from ckpt.dcp.writer import StoreHolder, Writer
from ckpt.errors import CkptError
from ckpt.format.manifest import Manifest
from ckpt.settings import Settings
from ckpt_store.storage.errors import StoreFormatError

if TYPE_CHECKING:
    from ckpt.snapshot.tiers import Tiers
    from ckpt.store.store import Store


def _gather_failures(err: BaseException | None, group: Any) -> list[tuple[int, CkptError]]:
    """Every rank's failure (``err``: this rank's, or None) as ``[(rank, error), ...]``, gathered over
    ``group`` where torch.distributed is initialized; [] otherwise."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
        return []
    # What crosses to the other ranks must unpickle there: ckpt's errors do (CkptError.__reduce__), others are described.
    sent = None if err is None else err if isinstance(err, CkptError) else CkptError(f"{type(err).__name__}: {err}")
    got: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(got, sent, group=group)
    return [(r, e) for r, e in enumerate(got) if e is not None]


class Reader(StorageReader):
    """A DCP ``StorageReader`` for checkpoint ``ref`` (a ref, ``NAME@N`` or id prefix) of a ckpt store.

    The ref is resolved once per load; if ranks resolve it to different checkpoints
    (a save moved it meanwhile) the load fails before reading, asking for an id.
    Any DCP resharding works: each rank reads only the chunks of the shard regions
    its own layout needs, verified as always.

    Given ``process_group`` (the group ``dcp.load`` runs on: ``dist.group.WORLD`` for every
    rank), the ranks agree, where the ref is named (here or as ``checkpoint_id``), whether
    each of them found it, in one small collective: if one did not (its view of the store
    lags, as a shared file system's listing can), every rank raises its error at once,
    before DCP starts. Without it each rank checks alone, so that a Reader made on some
    ranks only (``dcp.load(..., no_dist=True)`` on rank 0, a subgroup's load) never waits
    for ranks that do not load; a rank whose view lags then raises alone while the others
    wait in DCP for the group's timeout.

    What the ranks check before DCP starts (the ref, and the checkpoint's manifest: a distributed one,
    its layout sound) is raised as ckpt's own error (:class:`~ckpt.errors.CkptError`: a
    :class:`~ckpt.errors.RefNotFoundError`, a :class:`~ckpt.errors.StoreFormatError` naming the damaged
    manifest). What fails once DCP runs (a chunk missing or damaged while the data is read) reaches
    ``dcp.load``'s caller as torch's ``CheckpointException``, as any storage reader's error does: it
    gathers the ranks' errors, and ``e.failures`` maps each failed rank to ``(ckpt's error, its
    traceback)``: ``next(iter(e.failures.values()))[0]`` is the :class:`~ckpt.errors.CkptError`.
    (Wrapping ``dcp.load`` to unwrap it would fight torch's API, whose callers expect that exception.)
    """

    def __init__(self, store: str | os.PathLike[str] | Store, ref: str | None = None, *,
                 storage_options: dict[str, Any] | None = None, settings: Settings | None = None,
                 tiers: Tiers | None = None, process_group: Any = None) -> None:
        super().__init__()
        self._holder = StoreHolder(store, storage_options, settings)
        self.ref = ref
        self.process_group = process_group
        # snapshot tiers (ckpt/snapshot/tiers.py): ``ref`` is a manifest id, read with its chunks
        # from the nearest tier holding each; ``store`` is then not read
        self.tiers = tiers
        self._checked: tuple[str, Manifest, DcpLayout] | None = None  # the manifest _check_ref read, by its id
        self._check_ref()
        self.load_id = uuid.uuid4().hex
        self._manifest: tuple[str, Manifest] | None = None
        self._values: dict[str, Any] = {}
        self._shards: dict[tuple[str, tuple[int, ...]], tuple[TensorItem, Shard]] = {}  # (fqn, offsets) -> its shard
        self._storage: dict[Any, str | None] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.ref = os.fspath(checkpoint_id)
            self._check_ref()
        self.load_id = uuid.uuid4().hex
        self._manifest = None

    def _check_ref(self) -> None:
        """Raise :class:`~ckpt.errors.RefNotFoundError` (or StoreNotFoundError), or the error of a manifest that is
        no distributed checkpoint or is damaged (:meth:`_layout`), now, before DCP starts: from ``read_metadata``
        DCP would log it and raise its own AssertionError (CheckpointException across ranks) in its place. The ranks agree first: a rank that raised alone would leave the
        others waiting in DCP's first collective for the group's timeout (or, where it goes on to
        another collective, matched against the wrong one). Agreed over ``process_group`` where one
        is given (see the class docstring)."""
        if self.ref is None or self.tiers is not None:
            return
        try:
            store = self._holder.store(create=False)
            mid = store.resolve(self.ref)
            if self._checked is None or self._checked[0] != mid:  # (reset() to the same checkpoint reads nothing again)
                self._checked = (mid, *self._layout(store.manifest(mid), mid))
            err: BaseException | None = None
        except Exception as e:  # noqa: BLE001 - any failure, told to the other ranks before it is raised
            err = e
        # Only where the caller named the group: ranks that do not load must not be waited for.
        failed = _gather_failures(err, self.process_group) if self.process_group is not None else []
        if err is not None:
            raise err
        if failed:
            rank, e = failed[0]
            e.message = f"rank {rank}: {e.message}"
            e.args = (e.message,)
            e.hint = (f"this rank finds {self.ref!r}, rank(s) {', '.join(str(r) for r, _ in failed)} do not: their view of "
                      "the store lags (a shared file system's stale listing?) or names another store; retry once every "
                      "rank sees it")
            raise e

    def _layout(self, m: Manifest, mid: str) -> tuple[Manifest, DcpLayout]:
        """``m`` (manifest ``mid``) and its DCP layout; a :class:`CkptError` naming the manifest where it is no
        distributed checkpoint or its layout does not decode. Each shard is checked against its entry as it is
        read (``read_data``): a load of some keys is not refused for a damaged record of others, as a load or a
        pull with ``include=`` is not; DCP allocates from the caller's state, never from a layout's sizes."""
        if m.source != DCP_SOURCE:
            raise CkptError(f"{self.ref} is a {m.source!r} checkpoint, not a distributed one",
                            hint="load it with Store.load / load_into, or push it again through dcp.save")
        return m, decode_layout(m.extra, f"manifest {mid}")

    def read_metadata(self) -> Metadata:
        """DCP's metadata, rebuilt from the manifest's JSON (no pickle)."""
        if self.ref is None:
            raise CkptError("no checkpoint to load", hint="pass Reader(store, REF) or dcp.load(..., checkpoint_id=REF)")
        if self.tiers is not None:
            mid = self.ref
            m, layout = self._layout(self.tiers.get_manifest(mid), mid)
        else:
            mid = self._holder.store(create=False).resolve(self.ref)
            # (the manifest _check_ref read and checked, where the ref still names it: an id names its bytes)
            if self._checked is not None and self._checked[0] == mid:
                m, layout = self._checked[1:]
            else:
                m, layout = self._layout(self._holder.store(create=False).manifest(mid), mid)
        self._manifest, self._values = (mid, m), layout.values
        self._shards = {(t.fqn, s.offsets): (t, s) for t in layout.tensors.values() for s in t.shards}
        md = to_metadata(layout, mid)
        md.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._storage = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return dataclasses.replace(plan, storage_data=self._manifest[0] if self._manifest else None)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        ids = {p.storage_data for p in plans}
        if len(ids) > 1:
            raise CkptError(f"ranks resolved {self.ref} to different checkpoints ({', '.join(sorted(i[:12] for i in ids if i))}): "
                            "it moved during the load", hint="load by checkpoint id")
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        import torch

        assert self._manifest is not None, "read_metadata comes first"
        store = self.tiers.nearest if self.tiers is not None else self._holder.store(create=False)
        mid, m = self._manifest
        entries = {t.name: t for t in m.tensors}
        copies = []
        for req in plan.items:
            if req.type == LoadItemType.BYTE_IO:
                buf = io.BytesIO()
                torch.save(self._values[req.storage_index.fqn], buf)  # our JSON-decoded value, for the planner's torch.load
                buf.seek(0)
                planner.load_bytes(req, buf)
                continue
            found = self._shards.get((req.storage_index.fqn, tuple(req.storage_index.offset or ())))
            if found is None or self._storage.get(req.storage_index) != found[1].entry:
                raise StoreFormatError(f"manifest {mid}: no stored shard for {req.storage_index.fqn} at {list(req.storage_index.offset or ())}")
            copies.append(Copy(shard_entry(*found, entries, f"manifest {mid}"), tuple(req.storage_offsets), tuple(req.lengths), planner.resolve_tensor(req).detach(),
                               lambda t, r=req: planner.commit_tensor(r, t)))
        run_copies(store, m, copies, get=self.tiers.get if self.tiers is not None else None)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @property
    def checkpoint_id(self) -> str | None:
        return self.ref

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return Writer.validate_checkpoint_id(checkpoint_id)
