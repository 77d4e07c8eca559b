from __future__ import annotations

import pytest

from ckpt.format.entries import FileEntry, TensorEntry
from ckpt.format.manifest import Manifest
from ckpt.format.names import check_file_path
from ckpt_store.storage.errors import InvalidNameError, StoreFormatError

A, B = "a" * 64, "b" * 64


def _manifest() -> Manifest:
    return Manifest(
        source="tensors",
        chunk_size=8,
        files=(FileEntry("model.safetensors", "safetensors", 24, (A,), 8, None),),
        tensors=(TensorEntry("w", "F32", (2, 2), 16, (B, B), "model.safetensors"),),
        created=1.0,
        message="m",
    )


def test_golden_bytes():
    """The encoding is part of the format: changing it changes every checkpoint id."""
    assert _manifest().to_json() == (
        b'{"chunk_size":8,"created":1.0,"extra":{},"files":[{"chunks":["' + A.encode() + b'"],"head_size":8,'
        b'"kind":"safetensors","metadata":null,"path":"model.safetensors","size":24}],"format":"ckpt-manifest",'
        b'"lineage":{"base":null,"merge":null,"parent":null},"message":"m","metadata":{},"source":"tensors",'
        b'"tensors":[{"chunks":["' + B.encode() + b'","' + B.encode() + b'"],"dtype":"F32","file":"model.safetensors",'
        b'"name":"w","nbytes":16,"shape":[2,2]}],"version":1}'
    )


def test_roundtrip():
    m = _manifest()
    assert Manifest.from_json(m.to_json()) == m


@pytest.mark.parametrize(
    "mutate",
    [
        lambda s: s.replace(b'"version":1', b'"version":7'),
        lambda s: s.replace(b'"nbytes":16', b'"nbytes":17'),
        lambda s: s.replace(b'"shape":[2,2]', b'"shape":[2,-2]'),
        lambda s: s.replace(b'"path":"model.safetensors"', b'"path":"../../etc/x"'),
        lambda s: s.replace(B.encode(), b"../" + B[3:].encode(), 1),
        lambda s: s[:-3],
        lambda s: b"[]",
        # What Python's JSON parser accepts and the format cannot hold (a manifest is named by the
        # hash of its bytes: anyone can store any bytes as one); each broke commands with a traceback.
        lambda s: s.replace(b'"created":1.0', b'"created":NaN'),
        lambda s: s.replace(b'"created":1.0', b'"created":-Infinity'),
        lambda s: s.replace(b'"created":1.0', b'"created":1e400'),
        lambda s: s.replace(b'"created":1.0', b'"created":1' + b"0" * 400),
        lambda s: s.replace(b'"head_size":8', b'"head_size":"8"'),
        lambda s: s.replace(b'"head_size":8', b'"head_size":30'),
        lambda s: s.replace(b'"name":"w"', b'"codecs":5,"name":"w"'),
        lambda s: s.replace(b'"lineage":{"base":null,"merge":null,"parent":null}', b'"lineage":"x"'),
        lambda s: s.replace(b'"metadata":{}', b'"metadata":[]'),
        # A file that is not its header and its tensors: a pull wrote zeros for the bytes no entry
        # held, or a file longer or shorter than it said, and exited 0.
        lambda s: s.replace(b'"size":24', b'"size":32'),
        lambda s: s.replace(b'"size":24', b'"size":20'),
        lambda s: s.replace(b'"file":"model.safetensors"', b'"file":"other.safetensors"'),
        lambda s: s.replace(b'"size":24', b'"size":40').replace(
            b'"tensors":[', b'"tensors":[' + s[s.index(b'"tensors":[') + 11 : s.rindex(b"]")] + b","),  # listed twice
    ],
)
def test_malformed_manifests_are_format_errors(mutate):
    with pytest.raises((StoreFormatError, InvalidNameError)):
        Manifest.from_json(mutate(_manifest().to_json()))


@pytest.mark.parametrize("bad", ["../x", "/etc/passwd", "a/../../b", "a\\b", "c:/x", "a/./b", "a\x00b", ""])
def test_file_paths_cannot_escape(bad):
    with pytest.raises(InvalidNameError):
        check_file_path(bad)


def test_bundles_round_trip_and_are_checked():
    """The optional bundles section: absent from the bytes when empty (the golden bytes above
    hold), round-trips, names chunks for gc and copy, and a malformed one is a format error."""
    import json
    from dataclasses import replace

    from ckpt.format.entries import BundleEntry
    from ckpt_store.storage.chunk_lists import referenced_chunks

    C = "c" * 64
    m = replace(_manifest(), bundles=(BundleEntry(12, (C, C), ((A, 0, 8), (B, 8, 4))),))
    data = m.to_json()
    assert b'"bundles":[{"chunks":["' + C.encode() in data
    assert Manifest.from_json(data) == m
    assert C in referenced_chunks(data) and m.chunk_lengths()[C] == 4  # 12 bytes cut at 8: the last piece is 4
    for bad in (
        data.replace(b'"nbytes":12', b'"nbytes":20'),  # 3 chunks' worth, 2 named
        data.replace(b'[["' + A.encode() + b'",0,8]', b'[["' + A.encode() + b'",8,8]'),  # past the end
        data.replace(b'[["' + A.encode() + b'",0,8]', b'[["' + A.encode() + b'",-1,8]'),
        data.replace(b'[["' + A.encode() + b'",0,8]', b'[["' + A.encode() + b'",0,true]'),
        data.replace(b'[["' + A.encode() + b'",0,8]', b'[["../x",0,8]'),
        json.dumps({**json.loads(data), "bundles": {"x": json.loads(data)["bundles"]}}).encode(),  # not a list
    ):
        assert bad != data
        with pytest.raises((StoreFormatError, InvalidNameError)):
            Manifest.from_json(bad)


def test_a_file_entry_records_the_chains_of_its_chunks():
    """A file's chunk stored as a delta names its chain as a tensor's does (gc keeps its bases: storage's
    reachability rule scans ``delta_bases`` in every entry); one chain per chunk, else damaged; a file
    entry without chains is written as before (same bytes, same id)."""
    plain = FileEntry("tok.dat", "blob", 16, (A, B))
    chained = FileEntry("tok.dat", "blob", 16, (A, B), delta_bases=((), ("c" * 64,)))
    assert "delta_bases" not in plain.to_obj()
    assert FileEntry.from_obj(chained.to_obj(), "m") == chained
    from ckpt_store.storage.chunk_lists import referenced_chunks

    m = Manifest(source="dir", chunk_size=8, files=(chained,), tensors=(), created=1.0, message="")
    assert referenced_chunks(m.to_json()) == {A, B, "c" * 64}
    bad = {**chained.to_obj(), "delta_bases": [["c" * 64]]}
    with pytest.raises(StoreFormatError, match="delta_bases for 1 of 2 chunks"):
        FileEntry.from_obj(bad, "m")


def test_a_bundle_claiming_another_length_of_a_tensors_chunk_never_makes_that_chunk_corrupt(store, tmp_path):
    """A bundle is an accelerator: a forged one naming a tensor's chunk as its own, at another length, is read around
    (its members fetched on their own). But its length replaced the tensor's in chunk_lengths(), so verify reported
    the tensor's intact chunk corrupt ('header says 256 bytes, manifest says 100'), in damaged_objects, which repair
    and a user act on. The tensor's length stands; the checkpoint verifies and pulls bit for bit."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    save_file({"w": torch.randn(64), "b": torch.randn(8)}, tmp_path / "m.safetensors")
    store.push(tmp_path / "m.safetensors", "m")
    doc = json.loads(store.objects.get_manifest(store.resolve("m")))
    (cid,) = next(t for t in doc["tensors"] if t["name"] == "w")["chunks"]
    doc["bundles"] = [{"nbytes": 100, "chunks": [cid], "members": [[cid, 0, 100]]}]
    store.refs_db.set("f", store.objects.put_manifest(json.dumps(doc).encode()))
    assert store.manifest("f").chunk_lengths()[cid] == 256
    report = store.verify(["f"])
    assert report.ok and not report.damaged_objects, report.problems
    want, got = load_file(tmp_path / "m.safetensors"), load_file(store.pull("f", tmp_path / "out.safetensors"))
    assert all(torch.equal(want[k].view(torch.int32), got[k].view(torch.int32)) for k in want) and set(got) == set(want)


def test_finding_clashing_paths_takes_memory_of_the_order_of_the_paths():
    """clashing_path, run on every manifest read, kept each directory above each path as a new string: a
    path of 500 segments cost ~260 KB (2,000 of them: ~520 MB for 2 MB of paths). Now its own segments."""
    import tracemalloc

    from ckpt.format.names import clashing_path

    deep = "/".join(["a"] * 500)
    paths = [f"f{i:05d}/{deep}" for i in range(2000)]
    tracemalloc.start()
    try:
        assert clashing_path(paths) is None
        assert clashing_path([*paths, f"f00007/{deep}/x"]) == f"f00007/{deep}"  # a file and a directory of another
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak  # (the segments: ~8 MB)


@pytest.mark.parametrize("lineage", [None, {}, {"merge": {}}, {"parent": A, "merge": {"inputs": [A, B], "method": "linear"}},
                                     {"base": B, "merge": {"inputs": [A], "input_refs": ["x"], "base": B, "base_ref": "y",
                                                           "params": {"t": 0.5}, "remix": {"k": 1}}}])
def test_lineage_fields_names_every_field_and_leaves_the_stored_lineage_as_it_is(lineage):
    """The web view and `ckpt show` each filled in a lineage's optional fields their own way (cli/web/data.py,
    cli/views.py); the format's module owns it now. Every field it names is present, and the manifest's own
    lineage, whose bytes its id hashes, is untouched."""
    import json

    from ckpt.format.manifest import MERGE_FIELDS, lineage_fields

    doc = json.loads(_manifest().to_json())
    if lineage is not None:
        doc["lineage"] = lineage
    data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    m = Manifest.from_json(data)
    stored = json.loads(json.dumps(m.lineage))
    lin = lineage_fields(m.lineage)
    assert set(lin) == {"parent", "base", "merge"}
    given = lineage or {}
    assert (lin["parent"], lin["base"]) == (given.get("parent"), given.get("base"))
    if "merge" in given:
        rec = given["merge"]
        assert set(lin["merge"]) == set(MERGE_FIELDS)
        assert lin["merge"]["inputs"] == rec.get("inputs", [])
        assert lin["merge"]["input_refs"] == rec.get("input_refs", [None] * len(rec.get("inputs", [])))
        assert all(lin["merge"][k] == rec.get(k) for k in ("method", "base", "params", "base_ref", "remix"))
    else:
        assert lin["merge"] is None
    assert m.lineage == stored and (lineage is None or m.to_json() == data)  # as stored: the same bytes, the same id


def test_the_chunk_rule_reads_the_versions_the_manifest_reader_reads():
    """gc, commit and copy take a manifest's chunks by storage's rule (ckpt_store.storage.chunk_lists), which refuses a
    version it does not know rather than guess where its chunks are named (gc freed a later version's chunks): the
    two lists of versions read must be one. A new version added to the reader alone fails here."""
    from ckpt.format import manifest
    from ckpt_store.storage import chunk_lists

    assert chunk_lists.MANIFEST_VERSIONS == manifest.READ_VERSIONS and chunk_lists.MANIFEST_FORMAT == manifest.MANIFEST_FORMAT
