from __future__ import annotations

import pytest

from ckpt_store.storage.backends import open_backend
from ckpt_store.storage.errors import CorruptObjectError, InvalidNameError, ObjectNotFoundError
from ckpt_store.storage.objects import ObjectStore, object_id


def test_put_is_noop_when_present(store_url, tmp_path):
    objs = ObjectStore(open_backend(store_url))
    data = b"x" * 1000
    oid = object_id(data)
    assert objs.put("chunks", oid, b"blob")
    assert not objs.put("chunks", oid, b"other")
    assert objs.get("chunks", oid) == b"blob"
    assert [o.id for o in objs.list("chunks")] == [oid]


def test_manifest_verified_on_read(tmp_path):
    backend = open_backend(str(tmp_path))
    objs = ObjectStore(backend)
    mid = objs.put_manifest(b'{"format":"x"}')
    assert objs.get_manifest(mid) == b'{"format":"x"}'
    (tmp_path / "objects" / "manifests" / mid[:2] / mid).write_bytes(b'{"format":"y"}')
    with pytest.raises(CorruptObjectError) as e:
        objs.get_manifest(mid)
    assert mid in str(e.value)


def test_missing_object(tmp_path):
    objs = ObjectStore(open_backend(str(tmp_path)))
    with pytest.raises(ObjectNotFoundError):
        objs.get("chunks", "0" * 64)


@pytest.mark.parametrize("bad", ["../../etc/passwd", "A" * 64, "0" * 63, "0" * 64 + "/x"])
def test_ids_are_validated(tmp_path, bad):
    objs = ObjectStore(open_backend(str(tmp_path)))
    with pytest.raises(InvalidNameError):
        objs.get("chunks", bad)


def test_find_manifests_by_prefix(tmp_path):
    objs = ObjectStore(open_backend(str(tmp_path)))
    ids = [objs.put_manifest(f'{{"n":{i}}}'.encode()) for i in range(5)]
    assert objs.find_manifests(ids[0][:10]) == [ids[0]]


def test_inventory_is_every_listing_in_one_walk(store_url, tmp_path):
    """gc and du take objects and temporaries from one walk of objects/: the same as listing
    each kind and the temporaries apart, with names that are not objects left out."""
    backend = open_backend(store_url)
    objs = ObjectStore(backend)
    chunks = [objs.put("chunks", object_id(bytes([i])), bytes([i]) * (i + 1)) and object_id(bytes([i])) for i in range(5)]
    mid = objs.put_manifest(b'{"format":"x"}')
    backend.write(f"objects/chunks/{chunks[0][:2]}/.tmp-leftover", b"half a chunk")
    backend.write("objects/chunks/zz/not-an-id", b"?")
    backend.write("objects/stray", b"?")
    found, temps = objs.inventory()
    assert sorted(o.id for o in found["chunks"]) == sorted(chunks) == sorted(o.id for o in objs.list("chunks"))
    assert [(o.id, o.size) for o in found["chunks"] if o.id == chunks[4]] == [(chunks[4], 5)]
    assert [o.id for o in found["manifests"]] == [mid] and found["manifests"][0].kind == "manifests"
    assert [p for p, _, _ in temps] == [p for p, _, _ in objs.list_temporaries()] == [f"objects/chunks/{chunks[0][:2]}/.tmp-leftover"]


def test_presence_without_times_asks_one_question_a_chunk(monkeypatch):
    """A push asks of each chunk whether the store holds it; when it was written matters only where a
    base's manifest records chains it may trust (put_chunks passes ``times`` then). On a remote fsspec
    store that cannot list (gs://, memory://), every chunk cost an existence check and a time query:
    without ``times``, the existence check alone."""
    import uuid

    objects = ObjectStore(open_backend(f"memory://ckpt-test-{uuid.uuid4().hex}"))
    held = object_id(b"held")
    objects.put("chunks", held, b"held")
    asked: list[str] = []
    real = objects.backend.mtime
    monkeypatch.setattr(objects.backend, "mtime", lambda p: asked.append(p) or real(p))
    if objects.backend.list_times("objects/chunks", 2) is not None:
        pytest.skip("this backend lists objects with their times")
    present = objects.written_times("chunks", 2, times=False)
    assert present(held) is not None and present(object_id(b"absent")) is None and asked == []
    timed = objects.written_times("chunks", 2)
    assert timed(held) and asked == [objects.path("chunks", held)]
