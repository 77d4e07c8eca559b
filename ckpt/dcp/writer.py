"""Saving through ``torch.distributed.checkpoint`` into a ckpt store: :class:`Writer` (overview and
example: :mod:`ckpt.dcp.checkpoint`)."""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ckpt.dcp.format import DCP_SOURCE, UnsupportedStateError, encode_metadata, encode_value, shard_name
from ckpt.errors import CkptError, InvalidSourceError, TensorMismatchError
from ckpt.format.dtypes import byte_view, from_torch, itemsize
from ckpt.format.entries import BundleEntry, FileEntry, TensorEntry
from ckpt.format.manifest import Manifest
from ckpt.format.names import check_tensor_name
from ckpt.format.safetensors_header import check_not_reserved
from ckpt.settings import Settings
from ckpt.store.base import pair_tensors
from ckpt.store.push import PushResult, bundle_small, chains_of, small_chunks
from ckpt.store.sources import MemBytes
from ckpt.transfer.pipeline import BUNDLE_SHARE, PutResult, PutTask, Recorded, put_chunks, put_tasks
from ckpt_store.storage.commit import commit
from ckpt_store.storage.objects import check_manifest_size
from ckpt_store.storage.records import canonical_json
from ckpt_store.storage.refs import validate_ref_name

if TYPE_CHECKING:
    from ckpt.store.store import Store

FILE = "model.safetensors"  # the consolidated file a distributed checkpoint pulls to
BATCH_BYTES = 256 * 1024 * 1024  # tensor bytes a rank resolves (copies off the device) at once


class StoreHolder:
    """Opens the store lazily and forgets it when pickled (DCP's process-based async save)."""

    def __init__(self, store: str | os.PathLike[str] | Store, storage_options: dict[str, Any] | None, settings: Settings | None) -> None:
        from ckpt.store.store import Store

        self._store: Store | None = store if isinstance(store, Store) else None
        self.url = store.url if isinstance(store, Store) else os.fspath(store)
        self.storage_options = storage_options
        self.settings = settings

    def store(self, create: bool) -> Store:
        from ckpt.store.store import Store

        if self._store is None:
            connect = Store.init if create else Store.open
            self._store = connect(self.url, storage_options=self.storage_options, settings=self.settings)
        return self._store

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_store": None}


@dataclasses.dataclass(frozen=True)
class _LocalPlan:
    name: str | None  # the ref this rank saves to
    saved: dict[tuple[str, tuple[int, ...]], Any]  # (fqn, offsets) -> [size, dtype, shard sizes] of each tensor item


@dataclasses.dataclass(frozen=True)
class _RankPlan:
    base: str | None  # manifest whose same-named shards new chunks are delta-encoded against


@dataclasses.dataclass(frozen=True)
class _Written:
    entry: TensorEntry
    written: int  # stored bytes of chunks this rank wrote
    new_chunks: int
    bundles: tuple[BundleEntry, ...] = ()  # this rank's bundle (on its first tensor's result): in written and new_chunks too


class _Small:
    """Copies of the small chunks a rank saved, across its batches, for a bundle (push.bundle_small):
    at most ``room`` bytes of them (a quarter of what the rank saves, as push bundles no more, and
    what a reader takes, readable_bundles); past that none (a state of small tensors only is not
    stored twice, nor held twice in memory)."""

    def __init__(self, room: int) -> None:
        self.picked: dict[str, PutTask] = {}
        self.total = 0  # bytes saved
        self.room = room

    def add(self, settings: Settings, tasks: list[PutTask], results: list[PutResult]) -> None:
        self.total += sum(t.length for t in tasks)
        for cid, task in small_chunks(settings, tasks, results).items():
            if cid in self.picked or self.room < 0:
                continue
            if task.length > self.room:
                self.picked, self.room = {}, -1
                return
            data = bytes(task.read())  # (a copy: the batch's tensors are let go)
            self.picked[cid] = PutTask(lambda _at, _n, d=data: d, 0, len(data))
            self.room -= len(data)


@dataclasses.dataclass(frozen=True)
class _Value:
    value: Any  # tagged JSON (ckpt.dcp.format.encode_value)


class Writer(StorageWriter):
    """A DCP ``StorageWriter`` that saves into a ckpt store as ref ``name``.

    ``store`` is a URL (each rank opens it) or an open :class:`~ckpt.Store`.
    ``name`` may instead come from ``dcp.save(..., checkpoint_id=NAME)``. New chunks
    are delta-encoded against ``base`` (a ref), else ``name``'s current version
    (``delta=False``: never). ``aliases`` are refs moved along (like ``RUN/latest``),
    ``extra`` JSON recorded in the manifest. After a save, :attr:`last` (on the
    coordinator) is the :class:`~ckpt.store.push.PushResult`, and every rank's returned
    ``Metadata.storage_meta.checkpoint_id`` is the new checkpoint id.
    """

    def __init__(self, store: str | os.PathLike[str] | Store, name: str | None = None, *, message: str | None = None,
                 metadata: dict[str, Any] | None = None, base: str | None = None, delta: bool = True,
                 aliases: Sequence[str] = (), extra: dict[str, Any] | None = None,
                 storage_options: dict[str, Any] | None = None, settings: Settings | None = None) -> None:
        super().__init__()
        self._holder = StoreHolder(store, storage_options, settings)
        self.name = validate_ref_name(name) if name is not None else None
        self.message, self.base, self.delta = message, base, delta
        self.aliases = tuple(validate_ref_name(a) for a in aliases)
        # JSON, and within what the manifest may hold, or an error now, not after the data is written
        check_manifest_size(len(canonical_json([metadata or {}, extra or {}, message])),
                            "the JSON of the checkpoint's metadata, extra and message")
        if extra and "dcp" in extra:
            raise ValueError("extra['dcp'] is reserved for DCP's metadata")
        self.metadata, self.extra = dict(metadata or {}), dict(extra or {})
        self.is_coordinator, self.rank = True, 0
        self.save_id = uuid.uuid4().hex
        self._lineage: dict[str, Any] = {"parent": None, "base": None, "merge": None}
        self.last: PushResult | None = None

    # -- DCP protocol -------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.name = validate_ref_name(os.fspath(checkpoint_id))
        self.save_id = uuid.uuid4().hex
        self.last = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise CkptError("ckpt.dcp.Writer needs use_collectives=True: the coordinator writes one manifest for all ranks")
        if self.name is None:
            raise CkptError("no ref name to save to", hint="pass Writer(store, NAME) or dcp.save(..., checkpoint_id=NAME)")
        self.is_coordinator, self.rank = is_coordinator, int(kwargs.get("rank") or 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        import torch

        for i in plan.items:  # what cannot be stored is refused before anything is written
            td = i.tensor_data
            check_tensor_name(i.index.fqn, "state dict key")  # (checked again, with the rest of the layout, in finish)
            if td is not None:
                check_tensor_name(shard_name(i.index.fqn, tuple(td.chunk.offsets), tuple(td.chunk.sizes), tuple(td.size)))
                check_not_reserved(i.index.fqn)  # as build_header refuses it in finish: the pulled file would not parse
            if td is not None and td.properties.layout != torch.strided:  # (a sparse one failed in .contiguous())
                raise UnsupportedStateError(f"{i.index.fqn}: tensors of layout {td.properties.layout} are not supported (strided only)",
                                            hint="save t.to_dense() instead")
            if td is not None:  # (one failed in write_data, after the batches before it were written)
                try:
                    from_torch(td.properties.dtype)
                except InvalidSourceError:
                    raise UnsupportedStateError(f"{i.index.fqn}: tensors of dtype {td.properties.dtype} are not supported "
                                                "(ckpt stores the dtypes safetensors names)",
                                                hint="convert it (a quantized tensor: t.dequantize() or t.int_repr()), "
                                                "or save its bytes, t.view(torch.uint8)") from None
        # What this rank saves under each name, for the coordinator to compare (prepare_global_plan).
        saved = {(i.index.fqn, tuple(i.index.offset or ())): (list(td.size), str(td.properties.dtype).removeprefix("torch."),
                                                              list(td.chunk.sizes))
                 for i in plan.items if (td := i.tensor_data) is not None}
        return dataclasses.replace(plan, storage_data=_LocalPlan(self.name, saved))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # DCP saves one rank's copy of a tensor that several ranks save (one that is not a DTensor is
        # assumed replicated) and drops the others unseen: ranks that disagree on its size or dtype
        # would leave a checkpoint holding one rank's tensor, silently. Refused here, on every rank.
        first: dict[tuple[str, tuple[int, ...]], tuple[int, Any]] = {}
        names: dict[str, str] = {}  # manifest entry -> the key it stores
        local = [(rank, p.storage_data) for rank, p in enumerate(plans) if isinstance(p.storage_data, _LocalPlan)]
        other = next(((rank, lp.name) for rank, lp in local if lp.name != self.name), None)
        if other is not None:  # the coordinator's name would be committed over the others' shards: a torn checkpoint
            raise CkptError(f"the ranks save to different refs: rank {self.rank} to {self.name!r}, rank {other[0]} to {other[1]!r}",
                            hint="give every rank's Writer (or dcp.save's checkpoint_id) the same name: with a step in it, "
                            "the same step on every rank")
        for rank, lp in local:
            for key, desc in lp.saved.items():
                name = shard_name(key[0], key[1], tuple(desc[2]), tuple(desc[0]))
                if names.setdefault(name, key[0]) != key[0]:  # a key named like another's shard: one entry for two
                    raise UnsupportedStateError(f"state dict keys {names[name]!r} and {key[0]!r} would both be stored as {name!r}",
                                                hint="rename the key that is written like a shard (NAME[a:b,...])")
                r0, d0 = first.setdefault(key, (rank, desc))
                if d0 != desc:
                    raise TensorMismatchError(f"{key[0]}: rank {r0} saves a {d0[1]} tensor of size {d0[0]}, rank {rank} a {desc[1]} "
                                    f"tensor of size {desc[0]}" + (f" (shards {d0[2]} and {desc[2]})" if d0[:2] == desc[:2] else ""),
                                    hint="a tensor that is not a DTensor/ShardedTensor must be identical on every rank; "
                                    "give per-rank tensors per-rank names")
        store = self._holder.store(create=True)
        current = store.refs_db.current(self.name)  # type: ignore[arg-type]
        parent = current.target if current is not None else None
        base = store.resolve(self.base) if self.base else (parent if self.delta else None)
        self._lineage = {"parent": parent, "base": base, "merge": None}
        return [dataclasses.replace(p, storage_data=_RankPlan(base)) for p in plans]

    def _base_manifest(self, store: Store, base: str) -> Manifest | None:
        """The manifest of the delta base the coordinator chose (``base``, an id), from this rank's ``store``: a
        base missing or damaged there refuses the save (as a push refuses one)."""
        return store.manifest(base)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if getattr(planner, "_enable_plan_caching", False):
            # A cached plan is the first save's, with the storage data this writer gave it then: every
            # later save would be delta-encoded against that save's parent, or not at all, and the
            # checks of what the ranks save (prepare_global_plan) would not run again.
            raise CkptError("ckpt.dcp.Writer does not support a planner with enable_plan_caching=True",
                            hint="use DefaultSavePlanner() without plan caching: ckpt plans each save against the ref's newest version")
        for item in plan.items:  # before any batch is written: a tensor with no data fails only as it is copied
            if item.type != WriteItemType.BYTE_IO and planner.resolve_data(item).is_meta:
                raise UnsupportedStateError(f"{item.index.fqn}: a tensor on the meta device has no data to save",
                                            hint="materialize the model first (to_empty() and its initialization, or a load)")
        from ckpt.snapshot.local_lock import keeping_off

        store = self._holder.store(create=True)
        # Not into a local tier a manager holds (of another process, or through another store): it collects the
        # tier without grace (its own saves pass). A manager that takes the tier before finish: finish is refused.
        with keeping_off(store):
            results = self._write_data(store, plan, planner)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_data(self, store: Store, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        """This rank's chunks of ``plan`` written into ``store``; their results."""
        info = plan.storage_data if isinstance(plan.storage_data, _RankPlan) else _RankPlan(None)
        base_m = self._base_manifest(store, info.base) if info.base else None
        paired = pair_tensors(base_m if base_m is not None and base_m.chunk_size == store.settings.chunk_size else None)
        recorded = Recorded.of(store.objects, info.base, base_m)
        # A remote store's readers fetch the small chunks in a request or two (as a push's: docs/format.md, bundles).
        saved = sum(i.tensor_storage_size() or 0 for i in plan.items if i.type != WriteItemType.BYTE_IO)
        small = _Small(min(store.settings.inflight_mb << 20, saved // BUNDLE_SHARE)) if store.objects.backend.streams else None
        results = [WriteResult(index=i.index, size_in_bytes=0, storage_data=_Value(_lookup_value(planner, i)))
                   for i in plan.items if i.type == WriteItemType.BYTE_IO]
        batch: list[Any] = []
        size = 0
        for item in (i for i in plan.items if i.type != WriteItemType.BYTE_IO):
            batch.append(item)
            size += item.tensor_storage_size() or 0
            if size >= BATCH_BYTES:
                results += self._write_tensors(store, batch, planner, paired, recorded, small)
                batch, size = [], 0
        results += self._write_tensors(store, batch, planner, paired, recorded, small)
        first = next((i for i, r in enumerate(results) if isinstance(r.storage_data, _Written)), None)
        if small is not None and first is not None:
            bundles, _, stored = bundle_small(store, small.picked, small.total)
            if bundles:
                w = results[first].storage_data
                results[first] = dataclasses.replace(results[first], storage_data=dataclasses.replace(
                    w, written=w.written + sum(r.stored for r in stored), new_chunks=w.new_chunks + sum(1 for r in stored if r.stored),
                    bundles=bundles))
        store.backend.flush()  # this rank's chunk names are durable before the coordinator commits
        return results

    def _write_tensors(self, store: Store, items: list[Any], planner: SavePlanner, paired: dict[Any, TensorEntry],
                       recorded: Recorded | None, small: _Small | None) -> list[WriteResult]:
        cs = store.settings.chunk_size
        tasks: list[PutTask] = []
        shards = []
        for item in items:
            td = item.tensor_data
            t = planner.resolve_data(item).detach()
            if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
                # only the projection the plan names is saved; a lazy conjugate or negative view as its
                # values (its bytes are the unconjugated ones, and view() refuses it)
                t = t.cpu().resolve_conj().resolve_neg().contiguous()
            fqn, offsets, sizes = item.index.fqn, tuple(td.chunk.offsets), tuple(td.chunk.sizes)
            name, dtype = shard_name(fqn, offsets, sizes, tuple(td.size)), from_torch(t.dtype)
            view = byte_view(t)
            match = paired.get((name, dtype, len(view)))
            start = len(tasks)
            tasks += put_tasks(MemBytes(view, t).read, 0, len(view), cs, itemsize(dtype) or 1, match.chunks if match else (),
                               match.chains() if match else ())
            shards.append((item, name, dtype, tuple(t.shape), len(view), start, len(tasks)))
        res = put_chunks(store.objects, tasks, store.settings, recorded=recorded)
        if small is not None:
            small.add(store.settings, tasks, res)
        out = []
        for item, name, dtype, shape, nbytes, a, b in shards:
            rs = res[a:b]
            entry = TensorEntry(name, dtype, shape, nbytes, tuple(r.id for r in rs), FILE, codecs=tuple(r.codec for r in rs),
                                delta_bases=chains_of(r.bases for r in rs))
            out.append(WriteResult(index=item.index, size_in_bytes=nbytes,
                                   storage_data=_Written(entry, sum(r.stored for r in rs), sum(1 for r in rs if r.stored))))
        return out

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: write the manifest, then move the ref (every rank's chunks are in)."""
        from ckpt.snapshot.local_lock import keeping_off

        store = self._holder.store(create=True)
        with keeping_off(store):  # (not into a local tier a manager holds, as write_data)
            self._finish(store, metadata, results)

    def _finish(self, store: Store, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        entries: dict[tuple[str, tuple[int, ...]], str] = {}
        shards: dict[str, TensorEntry] = {}
        values: dict[str, Any] = {}
        written = new = 0
        bundles: list[BundleEntry] = []
        for wr in (w for ws in results for w in ws):
            sd = wr.storage_data
            if isinstance(sd, _Value):
                values[wr.index.fqn] = sd.value
                continue
            e = sd.entry
            if e.name in shards and shards[e.name].chunks != e.chunks:
                raise CkptError(f"two ranks saved different data for {e.name}",
                                hint="a tensor that is not a DTensor/ShardedTensor must be identical on every rank")
            shards[e.name] = e
            entries[(wr.index.fqn, tuple(wr.index.offset or ()))] = e.name
            written += sd.written
            new += sd.new_chunks
            bundles += sd.bundles
        dcp_md = encode_metadata(metadata, entries, values)
        head, head_res = self._header(store, dcp_md)
        file = FileEntry(FILE, "safetensors", len(head) + sum(_nbytes(it) for it in dcp_md["items"].values()),
                         tuple(r.id for r in head_res), len(head), {"format": "pt"}, chains_of(r.bases for r in head_res))
        manifest = Manifest(source=DCP_SOURCE, chunk_size=store.settings.chunk_size, files=(file,),
                            tensors=tuple(sorted(shards.values(), key=lambda e: e.name)), created=time.time(),
                            message=self.message, metadata=self.metadata, extra={**self.extra, "dcp": dcp_md},
                            lineage=self._lineage, bundles=tuple(bundles))
        mid = self._publish(store, manifest)
        metadata.storage_meta = StorageMeta(checkpoint_id=mid, save_id=self.save_id)
        chunks = sum(len(e.chunks) for e in shards.values()) + len(head_res) + sum(len(b.chunks) for b in bundles)
        new += sum(1 for r in head_res if r.stored)
        self.last = PushResult(mid, chunks, new, manifest.logical_bytes, written + sum(r.stored for r in head_res), manifest)

    def _publish(self, store: Store, manifest: Manifest) -> str:
        """Write the manifest (its chunks are all in: checked), then the ref and aliases."""
        mid, _ = commit(store.objects, store.refs_db, manifest.to_json(), self.name)
        for alias in self.aliases:
            store.refs_db.set(alias, mid, alias=True)
        return mid

    @staticmethod
    def _header(store: Store, dcp_md: dict[str, Any]) -> tuple[bytes, list[Any]]:
        """The consolidated file's safetensors header, stored as chunks like any pushed header."""
        from ckpt.format.safetensors_header import build_header

        specs = [(fqn, it["dtype"], tuple(it["size"]), _nbytes(it)) for fqn, it in dcp_md["items"].items() if it["kind"] == "tensor"]
        head, _ = build_header(specs, {"format": "pt"})
        return head, put_chunks(store.objects, put_tasks(MemBytes(memoryview(head)).read, 0, len(head), store.settings.chunk_size, 1), store.settings)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.name, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str | None:
        return self.name

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            validate_ref_name(os.fspath(checkpoint_id))
        except CkptError:
            return False
        return True


def _nbytes(item: dict[str, Any]) -> int:
    if item["kind"] != "tensor":
        return 0
    n = itemsize(item["dtype"]) or 1
    for d in item["size"]:
        n *= d
    return n


def _lookup_value(planner: SavePlanner, item: Any) -> Any:
    """A non-tensor item as tagged JSON, read from the planner's state dict (never from DCP's pickle)."""
    lookup = getattr(planner, "lookup_object", None)
    if lookup is None:
        raise UnsupportedStateError(f"{item.index.fqn}: this planner cannot hand over non-tensor values unpickled",
                                    hint="use DefaultSavePlanner (or one with lookup_object), or save tensors only")
    return encode_value(lookup(item.index), item.index.fqn)
