"""Corruption of every kind of stored object, in turn: detected, named, never repaired or returned.

For each kind — chunk, manifest, ref entry, store config — and each kind of damage —
a flipped bit (at several positions) and a truncation (to half, to nothing) — the
damaged store is checked three ways:

* ``verify`` reports it, naming the object and exactly the refs that depend on it;
* reading a dependent ref raises a ``CkptError`` naming the object (and the ref);
* nothing was silently repaired: the damaged file is as the test left it, and refs
  that do not depend on it still load bit for bit.

Then ``verify --repair-from`` puts damaged objects back from another store that holds
them, after which everything verifies and loads bit for bit again.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt_store.storage.errors import CkptError


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory):
    """A store with refs a, b (a fine-tune of a, so delta chunks against a's) and c (unrelated)."""
    root = tmp_path_factory.mktemp("pristine")
    url = str(root / "store")
    store = ckpt.Store.init(url)
    g = torch.Generator().manual_seed(7)
    a = {"emb": torch.randn(256, 512, generator=g), "w": torch.randn(512, 512, generator=g)}
    b = {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in a.items()}
    c = {"other": torch.randn(300, 300, generator=g).to(torch.bfloat16)}
    store.push(a, "a")
    store.push(b, "b", base="a")
    store.push(c, "c")
    return url, {"a": a, "b": b, "c": c}


def _copy(pristine, tmp_path: Path) -> tuple[ckpt.Store, str]:
    url, _ = pristine
    dst = str(tmp_path / "store")
    shutil.copytree(url, dst)
    return ckpt.Store.open(dst), dst


def _targets(store: ckpt.Store, kind: str) -> dict[str, tuple[str, set[str]]]:
    """Objects of ``kind`` to damage: label -> (path relative to the store, refs depending on it)."""
    ma, mb = store.manifest("a"), store.manifest("b")
    if kind == "chunk":
        shared = ma.tensors[0].chunks[0]  # a's chunk; b's first chunk is a delta against it
        assert any(shared in (bases or []) for t in mb.tensors for bases in t.delta_bases or []), "b should delta against a"
        return {"base chunk": (store.objects.path("chunks", shared), {"a", "b"}),
                "delta chunk": (store.objects.path("chunks", mb.tensors[0].chunks[0]), {"b"})}
    if kind == "manifest":
        return {"manifest": (store.objects.path("manifests", store.resolve("b")), {"b"})}
    if kind == "ref":
        (entry,) = [e for e in store.backend.list("refs/a") if e.path.endswith(".ref")]
        return {"ref entry": (entry.path, {"a"})}
    return {"config": ("ckpt-store.json", {"a", "b", "c"})}


def _damage(path: Path, how: str) -> bytes:
    data = bytearray(path.read_bytes())
    if how.startswith("flip@"):
        frac = float(how[5:])
        i = min(int(len(data) * frac), len(data) - 1)
        data[i] ^= 1 << (i % 8)
    elif how == "truncate-half":
        data = data[: len(data) // 2]
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    return bytes(data)


KINDS = ["chunk", "manifest", "ref", "config"]
DAMAGE = ["flip@0.0", "flip@0.3", "flip@0.6", "flip@0.99", "truncate-half", "truncate-empty"]


@pytest.mark.parametrize("how", DAMAGE)
@pytest.mark.parametrize("kind", KINDS)
def test_damage_is_detected_and_named(kind: str, how: str, pristine, tmp_path: Path) -> None:
    _, want = pristine
    store, url = _copy(pristine, tmp_path)
    for label, (rel, dependents) in _targets(store, kind).items():
        store, url = _copy(pristine, tmp_path / label.replace(" ", "-"))
        path = Path(url) / rel
        damaged = _damage(path, how)
        name = rel.rsplit("/", 1)[-1]

        if kind == "config":  # the store cannot be opened at all, and says why
            with pytest.raises(CkptError, match="ckpt-store.json"):
                ckpt.Store.open(url)
            assert path.read_bytes() == damaged
            continue

        store = ckpt.Store.open(url)
        report = store.verify()
        assert not report.ok, (label, how)
        assert any(name in p for p in report.problems), (label, report.problems)
        assert set(report.damaged_refs) == dependents, (label, report.damaged_refs)
        for ref in dependents:
            with pytest.raises(CkptError) as exc:
                store.load(ref)
            msg = str(exc.value)
            assert name in msg or name[:12] in msg, (label, how, msg)
            assert ref in msg or kind != "chunk", (label, how, msg)  # chunk errors say which ref needed it
        for ref in {"a", "b", "c"} - dependents:  # the rest is untouched and still served
            got = store.load(ref)
            assert {k: _bits(v) for k, v in got.items()} == {k: _bits(v) for k, v in want[ref].items()}
        assert path.read_bytes() == damaged, "nothing may be repaired behind the user's back"


@pytest.mark.parametrize("kind", ["chunk", "manifest"])
def test_repair_from_another_store(kind: str, pristine, tmp_path: Path) -> None:
    """Damaged and deleted objects come back from a second store holding the same checkpoints."""
    _, want = pristine
    store, url = _copy(pristine, tmp_path / "damaged")
    if kind == "chunk":  # chunks: an independent store holding the same tensors, its own encodings
        backup = ckpt.Store.init(str(tmp_path / "backup"))
        for ref in ("a", "b", "c"):
            backup.push(want[ref], ref)
    else:  # a manifest's id covers its lineage: it comes from a mirror of this store
        shutil.copytree(pristine[0], tmp_path / "backup")
    targets = _targets(store, kind)
    for i, (rel, _) in enumerate(targets.values()):
        if i == 0:
            _damage(Path(url) / rel, "flip@0.6")
        else:
            os.unlink(Path(url) / rel)
    assert not store.verify().ok

    r = store.repair(str(tmp_path / "backup"))
    assert {oid for _, oid in r.repaired} == {rel.rsplit("/", 1)[-1] for rel, _ in targets.values()}
    assert not r.unavailable and r.after.ok
    assert store.verify().ok
    for ref in ("a", "b", "c"):
        got = store.load(ref)
        assert {k: _bits(v) for k, v in got.items()} == {k: _bits(v) for k, v in want[ref].items()}


def test_repair_reports_what_the_source_lacks(pristine, tmp_path: Path) -> None:
    store, url = _copy(pristine, tmp_path / "damaged")
    empty = ckpt.Store.init(str(tmp_path / "empty"))
    rel, _ = _targets(store, "chunk")["base chunk"]
    _damage(Path(url) / rel, "truncate-half")
    r = store.repair(empty)
    assert not r.repaired and [k for k, _, _ in r.unavailable] == ["chunk"]
    assert not r.after.ok and set(r.after.damaged_refs) == {"a", "b"}


def test_repair_goes_on_past_an_object_it_cannot_write(pristine, tmp_path: Path) -> None:
    """A folder in place of one damaged chunk made `ckpt verify --repair-from` stop at that chunk
    with "cannot write ...: Is a directory": every other damaged object, which the source held,
    was left damaged, and nothing said what had been put back. The folder is now listed as not
    repairable (left as it is: ckpt never deletes what it did not write) and the rest is repaired."""
    store, url = _copy(pristine, tmp_path / "damaged")
    targets = _targets(store, "chunk")
    first, second = targets["delta chunk"][0], targets["base chunk"][0]
    os.unlink(Path(url) / first)
    (Path(url) / first).mkdir()
    os.unlink(Path(url) / second)
    r = store.repair(pristine[0])
    assert r.repaired == [("chunk", second.rsplit("/", 1)[-1])]
    assert [(k, i) for k, i, _ in r.unavailable] == [("chunk", first.rsplit("/", 1)[-1])]
    assert "a folder" in r.unavailable[0][2] or "directory" in r.unavailable[0][2], r.unavailable
    assert (Path(url) / first).is_dir() and (Path(url) / second).is_file()
    assert not r.after.ok and all(first.rsplit("/", 1)[-1] in p for p in r.after.problems), r.after.problems


@pytest.mark.parametrize("how", ["flip@0.0", "flip@0.5", "flip@0.99", "truncate-half", "append"])
def test_raw_chunk_read_in_place_is_verified(how: str, tmp_path: Path) -> None:
    """Incompressible chunks are stored raw and read straight into the destination tensor:
    a damaged, short or overlong blob is an error there too, never accepted bytes."""
    store = ckpt.Store.init(str(tmp_path / "store"))
    g = torch.Generator().manual_seed(3)
    t = {"noise": torch.randint(-(2**31), 2**31 - 1, (300_000,), generator=g, dtype=torch.int32).view(torch.float32)}
    store.push(t, "n")
    (entry,) = store.manifest("n").tensors
    assert entry.codecs and set(entry.codecs) == {0}, entry.codecs  # codecs.RAW
    path = tmp_path / "store" / store.objects.path("chunks", entry.chunks[0])
    if how == "append":
        path.write_bytes(path.read_bytes() + b"\0")
    else:
        _damage(path, how)
    live = {"noise": torch.zeros(300_000)}
    with pytest.raises(CkptError, match=entry.chunks[0][:12]):
        store.load_into("n", live)
    with pytest.raises(CkptError, match=entry.chunks[0][:12]):
        store.load("n")


def test_verify_of_a_remote_store_checks_the_store_not_the_local_chunk_cache(s3_main_url, tmp_path: Path) -> None:
    """On an S3 store read once before (so its chunks were in the local chunk cache), a chunk deleted
    from the bucket, or damaged there, was read from the cache: `ckpt verify` said ok, and
    `--repair-from` found nothing to put back, while every reader without that cache (another
    machine, `--no-cache`) failed. verify now reads the store itself."""
    g = torch.Generator().manual_seed(5)
    want = {"w": torch.randn(256, 256, generator=g), "v": torch.randn(300, generator=g)}
    store = ckpt.Store.init(s3_main_url)
    store.push(want, "m")
    backup = ckpt.Store.init(str(tmp_path / "backup"))
    backup.push(want, "m")
    store = ckpt.Store.open(s3_main_url)
    store.load("m")  # fills the local chunk cache
    gone, damaged = (t.chunks[0] for t in store.manifest("m").tensors)
    store.backend.delete(store.objects.path("chunks", gone))
    path = store.objects.path("chunks", damaged)
    blob = bytearray(store.backend.read(path))
    blob[-1] ^= 1
    store.backend.write(path, bytes(blob))
    report = ckpt.Store.open(s3_main_url).verify()
    assert not report.ok and set(report.damaged_refs) == {"m"}
    assert {oid for _, oid in report.damaged_objects} == {gone, damaged}
    r = ckpt.Store.open(s3_main_url).repair(backup)
    assert sorted(oid for _, oid in r.repaired) == sorted([gone, damaged]) and r.after.ok
    fresh = ckpt.Store.open(s3_main_url, settings=ckpt.Settings.from_env(cache=False))
    assert {k: _bits(v) for k, v in fresh.load("m").items()} == {k: _bits(v) for k, v in want.items()}


def test_repair_does_not_claim_a_repair_that_left_the_object_damaged(tmp_path: Path) -> None:
    """A manifest whose bytes match its id but whose content is invalid (a lineage naming no
    checkpoint: what anyone who can write a store can publish) is damaged in every copy. `ckpt
    verify --repair-from` a mirror wrote the mirror's identical bytes over it and said "repaired
    manifest ...", then reported the same manifest damaged. It is now listed as not repairable."""
    import json
    import time

    from ckpt_store.storage.objects import object_id
    from ckpt_store.storage.records import canonical_json, sealed_json

    root = tmp_path / "store"
    store = ckpt.Store.init(str(root))
    store.push({"w": torch.ones(3)}, "m")
    m = json.loads(store.objects.get_manifest(store.resolve("m")))
    m["lineage"] = {"parent": 7, "base": None, "merge": None}
    data = canonical_json(m)
    mid = object_id(data)
    store.backend.write(store.objects.path("manifests", mid), data)
    last = json.loads((root / "refs/m/0000000001.ref").read_bytes())
    entry = {k: v for k, v in last.items() if k != "check"}
    entry.update(seq=2, target=mid, time=time.time())
    (root / "refs/m/0000000002.ref").write_bytes(sealed_json(entry))
    shutil.copytree(root, tmp_path / "mirror")

    r = store.repair(str(tmp_path / "mirror"))
    assert r.repaired == []
    assert [(k, i) for k, i, _ in r.unavailable] == [("manifest", mid)]
    assert "no copy" in r.unavailable[0][2], r.unavailable
    assert not r.after.ok and set(r.after.damaged_refs) == {"m"}
