"""A store folder handed over by someone else (crafted, or damaged), read through the real
``ckpt`` command: every command ends, in bounded memory, with one line on stderr where it
fails, and nothing copied from it makes a good store unverifiable; and what a copy into a good
store must send for the copy to stay readable there."""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_cli_subprocess import CMD, fails, ok, run, same_tree

import ckpt
from ckpt_store.storage.objects import object_id
from ckpt_store.storage.records import canonical_json, sealed_json


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "CKPT_CACHE_DIR": str(tmp_path / "cache"), "NO_COLOR": "1"}


@pytest.fixture
def good(tmp_path: Path) -> Path:
    """A store with ``base`` and its fine-tune ``ft/x`` (a delta of it), from a real torch model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "a.safetensors")
    with torch.no_grad():
        model[0].weight.add_(0.001)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "b.safetensors")
    store = ckpt.Store.init(str(tmp_path / "good"))
    store.push(str(tmp_path / "a.safetensors"), "base")
    store.push(str(tmp_path / "b.safetensors"), "ft/x")
    return tmp_path / "good"


def republish(root: Path, ref: str, manifest: dict) -> str:
    """Write ``manifest`` (a dict) into the store at ``root`` and a new, correctly sealed entry of
    ``ref`` naming it: what anyone with write access to a store can do."""
    data = canonical_json(manifest)
    mid = object_id(data)
    (root / "objects/manifests" / mid[:2]).mkdir(parents=True, exist_ok=True)
    (root / "objects/manifests" / mid[:2] / mid).write_bytes(data)
    entries = sorted((root / "refs" / ref).glob("*.ref"))
    last = json.loads(entries[-1].read_bytes())
    entry = {k: v for k, v in last.items() if k != "check"}
    entry.update(seq=last["seq"] + 1, target=mid, time=time.time())
    (root / "refs" / ref / f"{entry['seq']:010d}.ref").write_bytes(sealed_json(entry))
    return mid


def manifest_of(root: Path, ref: str) -> dict:
    return json.loads(ckpt.Store.open(str(root)).objects.get_manifest(ckpt.Store.open(str(root)).resolve(ref)))


@pytest.mark.slow  # (3-7 s: CI time, run by .ci/run's slow pass)
@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_fifo_or_a_device_in_the_store_folder_is_refused_not_read(kind, good, env):
    """A ref entry that is a FIFO made every command wait forever for a writer; one that is a
    symlink to /dev/zero made them read until memory ran out (a MemoryError traceback). It is
    damage to that ref: ls, log and verify name it (DAMAGED, exit 1) beside what they can read."""
    entry = good / "refs/ft/x/0000000002.ref"
    if kind == "fifo":
        os.mkfifo(entry)
    else:
        entry.symlink_to("/dev/zero")
    for args in (["show", "ft/x"], ["gc", "--dry-run"]):
        line = fails(*args, store=good, env=env)
        assert "not a regular file" in line and "0000000002.ref" in line, line
    for args in (["ls"], ["log", "ft/x"], ["verify"]):
        r = run(*args, store=good, env=env)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert "DAMAGED ft/x" in r.stderr and "not a regular file" in r.stderr and "0000000002.ref" in r.stderr
    assert "base" in run("ls", store=good, env=env).stdout
    ok("show", "base", store=good, env=env)


@pytest.mark.parametrize("lineage", [
    {"parent": None, "base": None, "merge": {"inputs": 5, "method": "linear"}},
    {"parent": None, "base": {"a": 1}, "merge": None},
    {"parent": 7, "base": None, "merge": None},
    {"parent": None, "base": None, "merge": {"inputs": ["zz"], "base": [1], "params": "x"}},
    {"parent": None, "base": None, "merge": {"inputs": ["a" * 64, "b" * 64], "input_refs": ["x"], "method": "linear"}},
])
def test_a_lineage_of_the_wrong_types_is_a_damaged_manifest(lineage, good, tmp_path, env):
    """`ckpt show` of a manifest whose lineage held a number where ids go crashed with a
    traceback, and copying it made a good store's web lineage page fail; it is now a damaged
    manifest: one line from every command, and copy leaves the good store as it was."""
    m = manifest_of(good, "ft/x")
    m["lineage"] = lineage
    republish(good, "ft/x", m)
    for args in (["show", "ft/x"], ["show", "ft/x", "--json"], ["pull", "ft/x", tmp_path / "out.safetensors"]):
        line = fails(*args, store=good, env=env)
        assert "lineage" in line or "merge" in line, line
    dest = tmp_path / "dest"
    ckpt.Store.init(str(dest))
    fails("copy", "--to", dest, "ft/x", store=good, env=env)
    assert ckpt.Store.open(str(dest)).refs() == {} and not (tmp_path / "out.safetensors").exists()


def _swap_chunks(m: dict) -> None:
    """0.bias names 0.weight's chunks and back: every chunk intact, each given another's length."""
    a, b = m["tensors"][0], m["tensors"][1]
    assert a["nbytes"] != b["nbytes"]
    a["chunks"], b["chunks"] = b["chunks"], a["chunks"]
    for t in (a, b):
        t.pop("delta_bases", None)
        t.pop("codecs", None)


def _one_chunk_twice(m: dict) -> None:
    """0.weight names 0.bias's chunk: one chunk id given two lengths within one manifest."""
    a, b = m["tensors"][0], m["tensors"][1]
    b["chunks"] = list(a["chunks"])
    for t in (a, b):
        t.pop("delta_bases", None)
        t.pop("codecs", None)


def _swap_order(m: dict) -> None:
    """The first two tensors listed the other way round: the file's stored header places them otherwise."""
    m["tensors"][0], m["tensors"][1] = m["tensors"][1], m["tensors"][0]


@pytest.mark.slow  # (3-7 s: CI time, run by .ci/run's slow pass)
@pytest.mark.parametrize("damage", [_swap_chunks, _one_chunk_twice, _swap_order])
def test_a_manifest_that_disagrees_with_its_chunks_is_named_by_verify_and_never_copied(damage, good, tmp_path, env):
    """Intact chunks, a manifest (hashing to its id) that disagrees with them. Before: `ckpt verify`
    said ok where another checkpoint gave the chunks their right lengths, `ckpt copy` put the
    checkpoint into a good store that then held a ref that could not load, and with the tensors
    listed out of order `ckpt pull` wrote, exit 0, a file whose tensors were not the ones
    `ckpt load` and `ckpt diff` read."""
    m = manifest_of(good, "ft/x")
    damage(m)
    republish(good, "ft/x", m)
    r = run("verify", store=good, env=env)
    assert r.returncode == 1 and "DAMAGED ft/x" in r.stderr and "Traceback" not in r.stderr, r.stderr
    fails("pull", "ft/x", tmp_path / "out.safetensors", store=good, env=env)
    assert not (tmp_path / "out.safetensors").exists()
    # into a store that has none of it, and into one that has every chunk already (base and ft/x@1)
    empty, full = tmp_path / "empty", tmp_path / "full"
    ckpt.Store.init(str(empty))
    shutil.copytree(good, full)
    shutil.rmtree(full / "refs/ft")
    for dest, refs in ((empty, set()), (full, {"base"})):
        fails("copy", "--to", dest, "ft/x", store=good, env=env)
        assert set(ckpt.Store.open(str(dest)).refs()) == refs
        ok("verify", store=dest, env=env)


@pytest.mark.parametrize("damage", ["chunk gone", "chunk damaged", "manifest of a newer version"])
def test_a_copy_from_a_damaged_store_says_the_source_is_damaged_not_the_store_it_runs_in(damage, good, tmp_path, env):
    """`ckpt --store MINE copy REF --from THEIRS` where theirs lacks a chunk, holds one damaged, or
    a manifest of a newer version: the one line said "chunk ... is missing from the store (run `ckpt
    verify`...)", and `ckpt verify` on MINE, the store the command ran in, said ok. It names the
    source store now; MINE is left as it was."""
    m = manifest_of(good, "ft/x")
    cid = m["tensors"][0]["chunks"][0]
    path = good / "objects/chunks" / cid[:2] / cid
    if damage == "chunk gone":
        path.unlink()
    elif damage == "chunk damaged":
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x10
        path.write_bytes(bytes(data))
    else:
        m["version"] = 99
        republish(good, "ft/x", m)
    mine = tmp_path / "mine"
    ckpt.Store.init(str(mine)).push({"w": torch.ones(8)}, "own")
    line = fails("copy", "ft/x", "--from", good, store=mine, env=env)
    assert line.startswith(f"error: source store {good}: "), line
    assert "`ckpt verify` on the source store" in line or "upgrade ckpt" in line, line
    ok("verify", store=mine, env=env)
    assert set(ckpt.Store.open(str(mine)).refs()) == {"own"}


def test_a_copy_of_a_delta_whose_base_the_source_lacks_says_the_source_is_damaged(good, tmp_path, env):
    """Theirs holds ft/x's chunks as deltas against base's, but lost those bases, and its manifest does not
    name them (delta_bases dropped); mine holds base. Each blob checked out (its base read from mine), but a
    delta against a chunk the copied manifest does not name is written whole, from the source, whose base is
    missing: the one line said "chunk ... is missing from the store (run `ckpt verify` ...)", sending the user
    to verify mine, the store the command ran in. It names the source store now, and mine is left as it was."""
    mine = tmp_path / "mine"
    ckpt.Store.init(str(mine))
    ok("copy", "base", "--from", good, store=mine, env=env)
    m = manifest_of(good, "ft/x")
    bases = {b for t in m["tensors"] for chain in t.pop("delta_bases", []) for b in chain}
    assert bases
    for b in bases:
        (good / "objects/chunks" / b[:2] / b).unlink()
    republish(good, "ft/x", m)
    line = fails("copy", "ft/x", "--from", good, store=mine, env=env)
    assert line.startswith(f"error: source store {good}: ") and "`ckpt verify` on the source store" in line, line
    assert set(ckpt.Store.open(str(mine)).refs()) == {"base"}
    ok("verify", store=mine, env=env)


def _chunk_id_not_an_id(m: dict) -> None:
    m["tensors"][0]["chunks"][0] = "model.safetensors"


def _path_out_of_the_folder(m: dict) -> None:
    m["files"][0]["path"] = "../../.bashrc"
    for t in m["tensors"]:
        t["file"] = "../../.bashrc"


def _tensor_name_with_nul(m: dict) -> None:
    m["tensors"][0]["name"] = "0.weight\u0000"


@pytest.mark.parametrize("damage", [_chunk_id_not_an_id, _path_out_of_the_folder, _tensor_name_with_nul])
def test_a_manifest_naming_what_no_name_can_be_is_a_damaged_manifest_named_in_one_line(damage, good, tmp_path, env):
    """A manifest (hashing to its id) whose chunk id, file path or tensor name is none that can be: the
    one line said "'model.safetensors' is not an object id" or "file path '../../.bashrc' would escape
    the checkpoint directory", naming no manifest or ref, as for a name the user typed (InvalidNameError:
    the web view answered 400 "bad request", and `ckpt copy --from` did not say the source was damaged).
    It is a damaged manifest now, named, wherever it is read: show, pull, copy, the web view, gc."""
    m = manifest_of(good, "ft/x")
    damage(m)
    mid = republish(good, "ft/x", m)
    for args in (["show", "ft/x"], ["pull", "ft/x", tmp_path / "out"]):
        line = fails(*args, store=good, env=env)
        assert f"manifest {mid}: " in line, line
    assert not (tmp_path / "out").exists()
    mine = tmp_path / "mine"
    ckpt.Store.init(str(mine))
    line = fails("copy", "ft/x", "--from", good, store=mine, env=env)
    assert line.startswith(f"error: source store {good}: manifest {mid}: "), line
    assert ckpt.Store.open(str(mine)).refs() == {}
    # gc's plan names the manifest and the ref, and offers no repair from another store, whose copy is the same
    # bytes (it offered `ckpt verify --repair-from`, which fails so). gc reads only chunk ids, and a dry run reads
    # what the gc does (test_gc_dry_run_reads_a_manifest_as_the_gc_does)
    runs = [["gc", "--dry-run"], ["gc"]] if damage is _chunk_id_not_an_id else []
    for args in runs:
        line = fails(*args, store=good, env=env)
        assert line.startswith("error: gc deleted nothing: the checkpoint of ft/x cannot be read") and mid in line, line
        assert f"manifest {mid} names what cannot be: " in line and "repair" not in line and "`ckpt rm ft/x`" in line, line
    pytest.importorskip("httpx", reason="starlette's TestClient needs httpx")
    from starlette.testclient import TestClient

    from ckpt_store.cli.web.app import create_app

    r = TestClient(create_app(ckpt.Store.open(str(good)))).get("/api/checkpoint/ft/x")
    assert r.status_code == 500 and r.json()["error"].startswith(f"manifest {mid}: "), (r.status_code, r.text)



@pytest.mark.parametrize("damage", [_path_out_of_the_folder, _tensor_name_with_nul])
def test_gc_dry_run_reads_a_manifest_as_the_gc_does(damage, good, tmp_path, env):
    """A live manifest naming a file path or tensor name no name can be, whose chunk ids are sound: `ckpt gc`
    reads only its chunk ids and goes on, but `ckpt gc --dry-run` (its plan took chunk lists from the metadata
    index, whose summary parses the whole manifest) said "gc deleted nothing: ... cannot be read", exit 1. The
    dry run now reads such a manifest as the gc does: same exit code, same objects to free, the same kept."""
    store = ckpt.Store.open(str(good))
    doomed = store.push({"gone": torch.full((300,), 7.0)}, "doomed").id  # something for the gc to free
    store.remove("doomed")
    m = manifest_of(good, "ft/x")
    damage(m)
    republish(good, "ft/x", m)
    dry = json.loads(ok("gc", "--dry-run", "--grace", "0", "--json", store=good, env=env).stdout)
    real = json.loads(ok("gc", "--grace", "0", "--json", store=good, env=env).stdout)
    assert ("manifests", doomed) in {(o["kind"], o["name"]) for o in real["objects"]}, real
    assert sorted((o["kind"], o["name"]) for o in dry["objects"]) == sorted((o["kind"], o["name"]) for o in real["objects"])
    assert {k: v for k, v in dry.items() if k not in ("dry_run", "objects")} == \
        {k: v for k, v in real.items() if k not in ("dry_run", "objects")}
    assert ckpt.Store.open(str(good)).load("base")  # what the gc kept is whole


def test_a_manifest_of_a_version_this_ckpt_does_not_know_stops_gc_and_its_dry_run_alike(good, env):
    """A live ref names a manifest of a later version (99 here, its chunk lists under keys this ckpt does not know):
    `ckpt gc` took its chunk ids by the keys it knows, found none, and deleted every chunk it needs; since the dry run
    reads such a manifest as gc does, it approved that too (review rev22k; before, only the dry run refused). A reader
    never guesses a format it does not know (docs/format.md): both refuse it now, naming the version, deleting nothing."""
    m = manifest_of(good, "ft/x")
    needed = sorted({c for t in m["tensors"] for c in t["chunks"]} | {c for f in m["files"] for c in f["chunks"]})
    m["version"] = 99
    m["tensors_v99"], m["files_v99"] = m.pop("tensors"), m.pop("files")  # (a later writer's layout)
    republish(good, "ft/x", m)
    time.sleep(1.2)  # (older than gc's grace of 0 s by the store's clock)
    for args in (["gc", "--dry-run", "--grace", "0"], ["gc", "--grace", "0"]):
        r = run(*args, store=good, env=env)
        line = r.stderr.strip().splitlines()[-1]  # (the real gc warns of --grace 0 first)
        assert r.returncode == 1 and "Traceback" not in r.stderr, (args, r.stderr)
        assert "ckpt-manifest version 99" in line and "(upgrade ckpt to read it" in line and "names what cannot be" not in line, (args, line)
    assert all((good / "objects" / "chunks" / c[:2] / c).is_file() for c in needed)


@pytest.mark.parametrize("version", [True, 99], ids=["true", "99"])
def test_a_manifest_version_no_reader_knows_is_damage_to_every_command(version, good, env):
    """A manifest whose version is JSON true, or one of a later ckpt: the manifest reader took true for version 1
    (Python's True == 1) and read it, while the chunk rule refused it as a later version, and `ckpt verify` stopped
    at it with no manifest named (review rev22m). Every reader refuses both alike now; verify names the ref damaged
    and goes on to the others."""
    m = manifest_of(good, "ft/x")
    m["version"] = version
    mid = republish(good, "ft/x", m)
    with pytest.raises(ckpt.CkptError, match="version"):
        ckpt.Store.open(str(good)).load("ft/x")
    r = run("verify", store=good, env=env)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    out = r.stdout + r.stderr
    assert "verified 2 refs" in out and "DAMAGED ft/x" in out and mid in out, out

@pytest.mark.parametrize("poison", ["info", "chunks"])
def test_a_crafted_metadata_index_is_read_past_not_trusted(poison, good, env):
    """The metadata index is a cache that anyone writing a store folder can write, sealed and hashed
    as ckpt does. Summaries of the wrong shape made `ckpt ls` and `ckpt du` crash with a traceback
    (and the web overview answer 500); they are read again from the manifests instead."""
    store = ckpt.Store.open(str(good))
    st = store.index.load(chunks=True)
    for mid in st.info:
        if poison == "info":
            st.info[mid] = {"bytes": "x", "tensors": [1], "message": {"a": 1}, "created": "y", "source": 5, "base": {"q": 1}}
        else:
            st.chunks[mid] = [st.chunks[mid][0], {"lengths": "x", "codecs": 5}]
    st.max_gen += 1
    store.index.write_snapshot(st)
    plain = {**env, "CKPT_INDEX": "0"}  # what the manifests say
    for args in (["ls"], ["du"]):
        assert json.loads(ok(*args, "--json", store=good, env=env).stdout) == json.loads(ok(*args, "--json", store=good, env=plain).stdout)


def test_dcp_shards_that_overlap_are_refused_not_consolidated_from_uninitialised_memory(tmp_path, env):
    """A distributed checkpoint whose two shards both hold rows 0-1 of a 4x4 tensor (their volumes add
    up to the tensor's): pull wrote rows 2-3 from uninitialised memory, exit 0, load returned them,
    verify said ok. Found by republishing a DCP manifest with overlapping shards."""
    import warnings

    import torch.distributed.checkpoint as dcp

    import ckpt.dcp

    root = tmp_path / "store"
    store = ckpt.Store.init(str(root))
    w = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP warns, and saves in this process
        dcp.save({"w": w, "b": torch.ones(3)}, storage_writer=ckpt.dcp.Writer(str(root), "one/a"))
    m = manifest_of(root, "one/a")
    helper = json.loads(store.objects.get_manifest(store.push({"top": w[:2].contiguous()}, "helper")))
    entry = next(t for t in m["tensors"] if t["name"] == "w")
    m["tensors"] = [t for t in m["tensors"] if t["name"] != "w"]
    for name in ("wa", "wb"):  # both hold rows 0-1; no shard holds rows 2-3
        m["tensors"].append({**entry, "name": name, "shape": [2, 4], "nbytes": 32, "chunks": helper["tensors"][0]["chunks"],
                             "codecs": helper["tensors"][0].get("codecs", [0]), "delta_bases": [[]]})
    m["extra"]["dcp"]["items"]["w"]["shards"] = [{"entry": n, "offsets": [0, 0], "sizes": [2, 4]} for n in ("wa", "wb")]
    republish(root, "one/a", m)
    assert "exactly once" in fails("pull", "one/a", tmp_path / "out.safetensors", store=root, env=env)
    assert not (tmp_path / "out.safetensors").exists()
    r = run("verify", "one/a", store=root, env=env)
    assert r.returncode == 1 and "exactly once" in r.stderr, r.stderr
    with pytest.raises(ckpt.CkptError, match="exactly once"):
        store.load("one/a")


def _dcp_key_with_nul(items: dict) -> str:
    items["b\x00"] = items.pop("b")
    return "invalid state dict key 'b\\x00'"


def _dcp_shard_naming_no_entry(items: dict) -> str:
    items["w"]["shards"][0]["entry"] = "nope"
    return "tensor w: shard 'nope' is missing or does not match its entry"


@pytest.mark.parametrize("damage", [_dcp_key_with_nul, _dcp_shard_naming_no_entry])
def test_a_damaged_dcp_record_is_a_damaged_manifest_named_by_its_ref_and_id(damage, tmp_path, env):
    """A distributed checkpoint whose DCP record holds the key 'b\\x00', or a shard naming no entry: pull and
    show said "invalid state dict key 'b\\x00'", as for a name the user typed (InvalidNameError), and the web
    view answered 400 "bad request", the client's mistake. It is a damaged manifest (a 500 there, naming the
    checkpoint); and `ckpt pull` said only "manifest: ..." (or, for the shard, nothing of the checkpoint at all):
    it names the ref and the manifest id now, as verify does, and Store.load names the ref."""
    import warnings

    import torch.distributed.checkpoint as dcp

    import ckpt.dcp

    root = tmp_path / "store"
    ckpt.Store.init(str(root))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP warns, and saves in this process
        dcp.save({"w": torch.ones(4, 4), "b": torch.ones(3)}, storage_writer=ckpt.dcp.Writer(str(root), "one/a"))
    m = manifest_of(root, "one/a")
    detail = damage(m["extra"]["dcp"]["items"])
    mid = republish(root, "one/a", m)
    for out in ("out.safetensors", "out.pt"):
        line = fails("pull", "one/a", tmp_path / out, store=root, env=env)
        assert line.startswith(f"error: checkpoint one/a: manifest {mid}: {detail}"), line
        assert not (tmp_path / out).exists()
    with pytest.raises(ckpt.CkptError, match=f"^checkpoint one/a: {re.escape(detail)}"):
        ckpt.Store.open(str(root)).load("one/a")
    if damage is _dcp_shard_naming_no_entry:
        return  # (show reads only the layout)
    pytest.importorskip("httpx", reason="starlette's TestClient needs httpx")
    from starlette.testclient import TestClient

    from ckpt_store.cli.web.app import create_app

    r = TestClient(create_app(ckpt.Store.open(str(root)))).get("/api/checkpoint/one/a")
    assert r.status_code == 500 and r.json()["error"].startswith(f"checkpoint {mid[:12]}: "), (r.status_code, r.text)


def _limited(args: list[str | Path], store: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``ckpt --store STORE ARGS`` with its address space capped at 4 GiB (a read of a 50 GB file fails
    fast with MemoryError instead of exhausting the machine)."""
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    return subprocess.run([*CMD, "--store", str(store), *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=120, preexec_fn=cap)


# (3-4 s each, CLI subprocesses: the chunk in the default run, the others in .ci/run's slow pass)
@pytest.mark.parametrize("which", ["chunk", *(pytest.param(w, marks=pytest.mark.slow) for w in ("manifest", "ref", "index"))])
def test_a_sparse_50_gb_file_in_a_store_folder_is_refused_by_its_size(which, good, tmp_path, env):
    """A file of a store folder extended to 50 GB (sparse: it costs no disk) was read whole into memory
    by every command that met it (a MemoryError traceback under a 4 GiB cap, the machine's memory
    without one). Each read is now refused by the file's size, as damage."""
    store = ckpt.Store.open(str(good))
    path = {"chunk": lambda: good / store.objects.path("chunks", store.manifest("base").tensors[0].chunks[0]),
            "manifest": lambda: good / store.objects.path("manifests", store.resolve("base")),
            "ref": lambda: next((good / "refs/base").glob("*.ref")),
            "index": lambda: next((good / "index").glob("*.snap"))}[which]()
    os.truncate(path, 50 << 30)
    for args in (["ls"], ["du"], ["verify"], ["show", "base"], ["pull", "base", tmp_path / "out.safetensors"],
                 ["copy", "--to", tmp_path / "dest", "base"], ["gc", "--dry-run"]):
        if args[0] == "copy":
            ckpt.Store.init(str(tmp_path / "dest"))
        r = _limited(args, good, env)
        assert "Traceback" not in r.stderr and "MemoryError" not in r.stderr, (args, r.stderr[-2000:])
        if which == "index":  # a cache: read as damaged, rebuilt from the refs and manifests
            assert r.returncode == 0, (args, r.stderr)
        else:
            assert r.returncode in (0, 1) and (r.returncode == 0 or "more than any valid object" in r.stderr), (args, r.stderr)
    assert _limited(["verify"], good, env).returncode == (0 if which == "index" else 1)


@pytest.mark.slow  # (3-7 s: CI time, run by .ci/run's slow pass)
def test_a_copy_onto_chunks_stored_there_as_deltas_stays_readable_after_gc(good, tmp_path, env):
    """The destination held the fine-tune's chunks as deltas against its base (pushed there); the
    copied checkpoint (pushed elsewhere without a base, so it names no delta bases) was not sent
    them. Once base and ft/x were removed there, gc deleted the bases and the copy could not be
    read: data lost after ordinary commands, and verify had said ok. Found by copying, removing
    and collecting."""
    other = tmp_path / "other"
    ckpt.Store.init(str(other))
    ok("push", tmp_path / "b.safetensors", "mine", "-m", "pushed where the base is not", store=other, env=env)
    ok("copy", "--to", good, "mine", store=other, env=env)
    ok("verify", store=good, env=env)
    ok("rm", "base", "ft/x", store=good, env=env)
    ok("gc", "--grace", "0", store=good, env=env)
    ok("verify", store=good, env=env)
    ok("pull", "mine", tmp_path / "out.safetensors", store=good, env=env)
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


def test_verify_names_a_delta_whose_base_no_manifest_naming_it_keeps(good, tmp_path, env):
    """A store left that way by a copy before the fix above: verify names it while it is still
    readable, and --repair-from writes the chunk whole, so that a gc can no longer break it."""
    m = manifest_of(good, "ft/x")
    for t in m["tensors"]:
        t.pop("delta_bases", None)  # names ft/x's chunks, not the base chunks they are deltas of
    m["message"] = "copied the old way"
    store = ckpt.Store.open(str(good))
    data = canonical_json(m)
    store.refs_db.set("mine", store.objects.put_manifest(data))
    r = run("verify", store=good, env=env)
    assert r.returncode == 1 and "DAMAGED mine" in r.stderr and "a gc would delete that base" in r.stderr, r.stderr
    source = tmp_path / "source"
    ckpt.Store.init(str(source))
    ok("push", tmp_path / "b.safetensors", "ft", store=source, env=env)
    ok("verify", "--repair-from", source, store=good, env=env)
    ok("rm", "base", "ft/x", store=good, env=env)
    ok("gc", "--grace", "0", store=good, env=env)
    ok("pull", "mine", tmp_path / "out.safetensors", store=good, env=env)
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


def test_a_push_onto_a_ref_whose_last_entry_is_numbered_9999999999_fails_instead_of_vanishing(good, tmp_path, env):
    """Entries are named by 10 digits: after a (crafted or damaged) entry 9999999999, a push wrote
    entry 10000000000, which no reader lists. It said 'base -> ID' and exited 0; the ref did not
    move, and the checkpoint pushed was left for gc to delete."""
    last = json.loads((good / "refs/base/0000000001.ref").read_bytes())
    entry = {k: v for k, v in last.items() if k != "check"}
    entry.update(seq=9_999_999_999, time=time.time())
    (good / "refs/base/9999999999.ref").write_bytes(sealed_json(entry))
    before = ckpt.Store.open(str(good)).resolve("base")
    assert "cannot be updated" in fails("push", tmp_path / "b.safetensors", "base", store=good, env=env)
    assert ckpt.Store.open(str(good)).resolve("base") == before
    assert sorted(p.name for p in (good / "refs/base").iterdir()) == ["0000000001.ref", "9999999999.ref"]


def test_a_copy_replaces_a_chunk_whose_header_is_damaged_at_the_destination(good, tmp_path, env):
    """A chunk the destination holds, its header damaged there: the copy sends the source's blob in
    its place (checked on the way) instead of pointing a ref at a checkpoint it cannot read."""
    dest = tmp_path / "dest"
    shutil.copytree(good, dest)
    shutil.rmtree(dest / "refs/ft")
    store = ckpt.Store.open(str(dest))
    chunk = dest / store.objects.path("chunks", store.manifest("base").tensors[1].chunks[0])
    blob = bytearray(chunk.read_bytes())
    blob[0] ^= 0xFF  # the magic
    chunk.write_bytes(bytes(blob))
    ok("copy", "--to", dest, "ft/x", store=good, env=env)
    ok("verify", store=dest, env=env)


@pytest.mark.slow  # (3-7 s: CI time, run by .ci/run's slow pass)
def test_a_chunk_replaced_by_a_copy_is_written_whole_so_no_checkpoint_there_needs_more(good, tmp_path, env):
    """ft/x's 0.weight is stored in `good` as a delta against base's, and in `other` as a delta against
    another base: the copy replaces the chunk (its base there is not one the copied checkpoint names),
    and must not make good's own ft/x depend on other's base, which only the copy names."""
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "a.safetensors"))
    near = {**a, "0.weight": (a["0.weight"] + 0.0005).contiguous()}
    save_file(near, tmp_path / "near.safetensors")
    other = tmp_path / "other"
    ckpt.Store.init(str(other))
    ok("push", tmp_path / "near.safetensors", "near", store=other, env=env)
    ok("push", tmp_path / "b.safetensors", "mine", "--base", "near", store=other, env=env)
    theirs = ckpt.Store.open(str(other))
    assert any(t.delta_bases and t.delta_bases[0] for t in theirs.manifest("mine").tensors)  # a delta there too
    ok("copy", "--to", good, "mine", store=other, env=env)
    ok("verify", store=good, env=env)
    ok("rm", "mine", store=good, env=env)
    ok("gc", "--grace", "0", "--no-history", store=good, env=env)
    ok("verify", store=good, env=env)
    ok("pull", "ft/x", tmp_path / "out.safetensors", store=good, env=env)
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


@pytest.mark.parametrize("link", ["index", "refs/ft", "objects/manifests"])
def test_a_folder_of_the_store_that_is_a_symlink_is_never_written_or_deleted_through(link, good, tmp_path, env):
    """A store folder whose ``index/`` was a symbolic link to a folder elsewhere: every push wrote its
    index log there, `ckpt ls` wrote a snapshot there and deleted the files there named like older
    ones, and `ckpt gc` deleted the stale temporaries there. The same held for any folder of the
    store (``refs/ft``, ``objects/manifests``). Writes and deletes there are now refused with one
    line; reads may follow the link (what they read is verified)."""
    outside = tmp_path / "outside"
    (good / link).rename(outside)
    (good / link).symlink_to(outside, target_is_directory=True)
    for snap in outside.glob("*.snap"):
        snap.unlink()  # so that `ls` rebuilds the index (and prunes older index files)
    (outside / "0000000000-0123456789abcdef.snap").write_bytes(b"precious, named like an old index snapshot")
    (outside / ".tmp-precious").write_bytes(b"precious, named like a temporary")
    old = time.time() - 3 * 86400
    for p in outside.rglob("*"):
        os.utime(p, (old, old))
    before = tmp_path / "before"
    shutil.copytree(outside, before)
    r = run("push", tmp_path / "b.safetensors", "ft/y", store=good, env=env)
    assert (r.returncode == 0) == (link == "index"), r.stderr  # the index is a cache: the ref lands without it
    ls = run("ls", store=good, env=env)  # refs/ft is damage to the refs through it, named beside the others
    assert (ls.returncode == 0) == (link != "refs/ft") and "base" in ls.stdout, ls.stderr
    gc = run("gc", "--grace", "1m", store=good, env=env)  # a link the listing does not follow lists nothing to delete
    # refs/ft: what the refs through it keep alive is unknown, so gc deletes nothing (it freed ft/x's chunks)
    assert (gc.returncode == 0) == (link == "objects/manifests"), gc.stderr
    for r in (r, ls, gc):
        assert "Traceback" not in r.stderr and (r.returncode == 0 or f"{link} in the store folder" in r.stderr), r.stderr
    same_tree(outside, before)
    assert sorted(p.name for p in outside.rglob("*")) == sorted(p.name for p in before.rglob("*"))


@pytest.mark.parametrize("command", ["ls", "du"])
def test_many_large_index_logs_are_read_one_at_a_time_and_no_larger_than_a_record(command, good, env):
    """Index logs after the snapshot, extended to 200 MiB and 1 GiB (sparse: they cost no disk). Every
    log was read whole (up to the 4 GiB allowed an index snapshot, though a log is one record) and all
    were held at once before any was decoded: `ckpt ls` and `ckpt du` needed the sum of their sizes
    in memory (4.4 GiB here: a MemoryError under a 4 GiB cap). Logs are now read one after another,
    each refused beyond a record's size (the 1 GiB ones, by their size: never read), and skipped as
    damaged."""
    index = good / "index"
    top = max(int(p.name[:10]) for p in index.iterdir())
    for k in range(1, 7):  # (few readable ones: each is read whole, zeros, by both commands run)
        with open(index / f"{top + k:010d}.log", "wb") as f:
            f.truncate((1 << 30) if k % 3 else (200 << 20))
    r = _limited([command, "--json"], good, env)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    plain = {**env, "CKPT_INDEX": "0"}  # what the manifests say
    assert json.loads(r.stdout) == json.loads(ok(command, "--json", store=good, env=plain).stdout)


@pytest.mark.parametrize("where", ["log", "snapshot"])
def test_an_index_record_whose_target_is_not_an_object_id_is_skipped_not_fatal(where, good, tmp_path, env):
    """The metadata index (sealed, not signed) named a ref whose target was '../../../etc/passwd':
    every push failed ("is not an object id") because base choice asked the object store for it,
    though the index is a cache. Such a record is now damage, read past like any other."""
    from ckpt_store.storage.index import RefRec

    store = ckpt.Store.open(str(good))
    rec = RefRec(1, "../../../etc/passwd", time.time() + 1000, "w", False, 0, None)
    if where == "log":
        gen = max(int(p.name[:10]) for p in (good / "index").iterdir()) + 1
        (good / "index" / f"{gen:010d}.log").write_bytes(sealed_json(
            {"format": "ckpt-index-log", "version": 1, "gen": gen, "ref": {"name": "evil", "rec": rec.to_obj()}, "manifest": None}))
    else:
        st = store.index.load(chunks=True)
        st.refs["evil"] = {1: rec}
        st.max_gen += 1
        store.index.write_snapshot(st)
    ok("push", tmp_path / "b.safetensors", "ft/new", store=good, env=env)
    assert [r["ref"] for r in json.loads(ok("ls", "--json", store=good, env=env).stdout)] == ["base", "ft/new", "ft/x"]
    ok("verify", store=good, env=env)


def _reseal(path: Path, change, **head) -> str:
    """Rewrite the index object at ``path`` (a sealed header line naming its body's hash, then the
    body: docs/format.md) with ``change(body)`` as its body and ``head`` in its header, sealed and
    hashed as ckpt does. Returns the new body's hash."""
    import blake3

    first, _, body = path.read_bytes().partition(b"\n")
    new = canonical_json(change(json.loads(body)))
    h = {k: v for k, v in json.loads(first).items() if k != "check"}
    h.update(body=blake3.blake3(new).hexdigest(), length=len(new), **head)
    path.write_bytes(sealed_json(h) + b"\n" + new)
    return h["body"]


@pytest.mark.parametrize("where", ["log", "snapshot", "recent", "ref records", "chunk lists"])
def test_an_index_of_the_wrong_shape_is_read_past_not_a_traceback(where, good, tmp_path, env):
    """A manifest summary in the index whose "sig" (the key of its tensor signature) was a list, a
    snapshot whose records of a ref were a number, chunk lists naming a list or a number as a chunk:
    `ckpt ls`, `ckpt du` and `ckpt push` crashed with a traceback (unhashable type: 'list'; 'int'
    object is not iterable), or `ckpt du` added up other figures than the manifests give."""
    store = ckpt.Store.open(str(good))
    store.ls()  # a snapshot naming both manifests
    mid = store.resolve("ft/x")

    def poison(body: dict) -> dict:
        if where == "ref records":
            body["refs"]["ft/x"] = 5
        for info in body["info"].values():
            info["sig"] = [1] if where != "ref records" else info["sig"]
        return body

    if where == "log":
        gen = max(int(p.name[:10]) for p in (good / "index").iterdir()) + 1
        rec = json.loads((good / "refs/ft/x/0000000001.ref").read_bytes())
        log = {"format": "ckpt-index-log", "version": 1, "gen": gen, "ref": {"name": "ft/x", "rec": [
            1, mid, rec["time"], rec["writer"], False, (good / "refs/ft/x/0000000001.ref").stat().st_size, None]},
            "manifest": {"id": mid, "info": {**store.index.load().info[mid], "sig": [1]}, "sig": None, "chunks": [], "detail": None}}
        (good / "index" / f"{gen:010d}.log").write_bytes(sealed_json(log))
    else:
        snap = max((good / "index").glob("*.snap"))
        if where in ("snapshot", "ref records"):
            _reseal(snap, poison)
        else:  # a part, named by the snapshot with its body's hash
            key = "recent" if where == "recent" else "chunks"
            part = good / "index" / json.loads(snap.read_bytes().partition(b"\n")[0])[key]
            change = poison if where == "recent" else lambda body: {m: [[[1], 7, *c[0][2:]], c[1]] for m, c in body.items()}
            _reseal(snap, lambda body: body, **{f"{key}_hash": _reseal(part, change)})
    plain = {**env, "CKPT_INDEX": "0"}  # what the manifests say
    for args in (["ls"], ["du"]):
        assert json.loads(ok(*args, "--json", store=good, env=env).stdout) == json.loads(ok(*args, "--json", store=good, env=plain).stdout)
    ok("push", tmp_path / "b.safetensors", "ft/new", store=good, env=env)


@pytest.mark.parametrize("poison", ["signature of one item", "signature items of four", "signature of a number", "no base"])
def test_a_crafted_summary_that_base_choice_reads_is_read_again_from_its_manifest(poison, good, tmp_path, env):
    """Found by mutating a real store's index objects (resealed and hashed as ckpt does) and running
    the commands: a tensor signature of the wrong shape stored under its checkpoint's own key (its
    summary dropped as not well formed and read again from the manifest, but the crafted signature
    kept, the key being taken), or a summary without "base", made every `ckpt push` to the store
    crash in base choice with a traceback (not enough values to unpack; KeyError: 'base')."""
    store = ckpt.Store.open(str(good))
    store.ls()
    bad = {"signature of one item": [[1]], "signature items of four": [["0.weight", "F32", 16384, 1]],
           "signature of a number": 5}.get(poison)

    def change(body: dict) -> dict:
        for key in body["sigs"]:
            if bad is not None:
                body["sigs"][key] = bad
        for info in body["info"].values():
            if bad is None:
                del info["base"]
        return body

    snap = max((good / "index").glob("*.snap"))
    part = good / "index" / json.loads(snap.read_bytes().partition(b"\n")[0])["recent"]
    _reseal(snap, change, recent_hash=_reseal(part, change))
    r = run("push", tmp_path / "b.safetensors", "ft/new", store=good, env=env)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    # as without the index: the same overlap with base and ft/x, and the tie goes to the one that is no delta
    assert manifest_of(good, "ft/new")["lineage"]["base"] == ckpt.Store.open(str(good)).resolve("base")
    ok("verify", store=good, env=env)


@pytest.mark.parametrize("part", ["recent", "chunks"])
def test_an_index_snapshot_naming_a_part_outside_index_is_not_followed(part, good, tmp_path, env):
    """A snapshot's header names its parts (``.recent``, ``.chunks``) by name; one naming
    '../../fifo' made ckpt open that path outside the store (here a FIFO there, so a push failed:
    'cannot read index/../../fifo'). Such a snapshot is damage: the index is rebuilt."""
    store = ckpt.Store.open(str(good))
    store.ls()
    os.mkfifo(tmp_path / "fifo")
    _reseal(max((good / "index").glob("*.snap")), lambda body: body, **{part: "../../fifo"})
    assert ckpt.Store.open(str(good)).index.load(chunks=part == "chunks", recent=part == "recent") is None
    r = run("push", tmp_path / "b.safetensors", "ft/new", store=good, env=env)
    assert r.returncode == 0 and "cannot read" not in r.stderr, r.stderr


def test_an_index_log_numbered_9999999999_leaves_no_unlisted_logs_behind(good, tmp_path, env):
    """Index objects are named by 10 digits: after a (crafted or damaged) log 9999999999, every push
    wrote an 11-digit log, which no reader lists and no compaction deletes (one more file in index/
    per update, for ever). Such an update is now not recorded (the index is a cache: exact readers
    read the refs), with a warning that says to delete index/."""
    index = good / "index"
    shutil.copy(max(index.glob("*.log")), index / "9999999999.log")
    for k in range(3):
        r = ok("push", tmp_path / "b.safetensors", f"ft/n{k}", store=good, env=env)
        assert "delete the store's index/ folder" in r.stderr, r.stderr
    assert all(len(p.name.split(".")[0].split("-")[0]) == 10 for p in index.iterdir()), sorted(p.name for p in index.iterdir())
    plain = {**env, "CKPT_INDEX": "0"}  # what the manifests say
    assert json.loads(ok("ls", "--json", store=good, env=env).stdout) == json.loads(ok("ls", "--json", store=good, env=plain).stdout)


@pytest.mark.slow  # (3-7 s: CI time, run by .ci/run's slow pass)
def test_an_index_snapshot_of_a_newer_version_is_ignored_and_left_in_place(good, tmp_path, env):
    """A newer ckpt's index snapshot (version 2) was read as damage: `ckpt ls` or a push by this
    ckpt rebuilt the index and deleted the newer snapshot, so that users of two versions kept
    deleting each other's index. It is now ignored (the commands read the refs and manifests)
    and left for the ckpt that can read it."""
    index = good / "index"
    top = max(int(p.name[:10]) for p in index.iterdir())
    head = {"format": "ckpt-index", "version": 2, "gen": top + 1, "body": "0" * 64, "length": 2, "layout": "new"}
    newer = index / f"{top + 1:010d}-0123456789abcdef.snap"
    newer.write_bytes(sealed_json(head) + b"\n{}")
    plain = {**env, "CKPT_INDEX": "0"}  # what the manifests say
    for k in range(3):
        ok("push", tmp_path / "b.safetensors", f"ft/n{k}", store=good, env=env)
        for args in (["ls"], ["du"]):
            got = json.loads(ok(*args, "--json", store=good, env=env).stdout)
            assert got == json.loads(ok(*args, "--json", store=good, env=plain).stdout)
    assert newer.exists() and max(index.glob("*.snap")) == newer


@pytest.mark.parametrize("what", ["recent", "chunks", "log"])
def test_a_folder_or_a_fifo_in_place_of_an_index_object_is_damage_not_a_failure(what, good, tmp_path, env):
    """A folder where a snapshot's .recent or .chunks part should be made `ckpt push` and `ckpt du`
    crash with a traceback (IsADirectoryError); a FIFO named like an index log made every push fail
    ('not a regular file'), though the index is a cache. Both are now read as damage."""
    store = ckpt.Store.open(str(good))
    store.ls()
    index = good / "index"
    if what == "log":
        os.mkfifo(index / f"{max(int(p.name[:10]) for p in index.iterdir()) + 1:010d}.log")
    else:
        part = index / json.loads(max(index.glob("*.snap")).read_bytes().partition(b"\n")[0])[what]
        part.unlink()
        part.mkdir()
    ok("push", tmp_path / "b.safetensors", "ft/new", store=good, env=env)
    plain = {**env, "CKPT_INDEX": "0"}  # what the manifests say
    for args in (["ls"], ["du"]):
        assert json.loads(ok(*args, "--json", store=good, env=env).stdout) == json.loads(ok(*args, "--json", store=good, env=plain).stdout)


@pytest.mark.parametrize("which", ["manifest", "chunk"])
def test_a_folder_in_place_of_an_object_is_refused_in_one_line(which, good, tmp_path, env):
    """A folder where a manifest or chunk should be: `ckpt verify`, `ckpt show`, `ckpt gc --dry-run`
    and `ckpt load` ended in an IsADirectoryError traceback, `ckpt pull` said it could not *write*
    the chunk. It is refused like a FIFO there, in one line naming it."""
    store = ckpt.Store.open(str(good))
    path = good / (store.objects.path("manifests", store.resolve("base")) if which == "manifest"
                   else store.objects.path("chunks", store.manifest("base").tensors[0].chunks[0]))
    path.unlink()
    path.mkdir()
    plain = {**env, "CKPT_INDEX": "0"}
    for args in (["show", "base"], ["pull", "base", tmp_path / "out.safetensors"], ["gc", "--dry-run"]):
        if which == "chunk" and args[0] != "pull":
            continue
        line = fails(*args, store=good, env=plain)
        assert "not a regular file (a folder" in line and path.name in line, line
    r = run("verify", store=good, env=env)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "a folder" in r.stderr, r.stderr
    with pytest.raises(ckpt.CkptError, match="a folder"):
        store.load("base")


@pytest.mark.parametrize("what", ["folder", "fifo"])
def test_a_folder_or_a_fifo_in_place_of_a_live_manifest_is_damage_in_ls_and_du(what, good, env):
    """With the metadata index, `ls` and `du` check that live manifests exist in one batch: a folder
    or a FIFO in place of one counted as present, so the ref was shown whole though nothing can read
    it. Both now report it damaged, as they do without the index."""
    store = ckpt.Store.open(str(good))
    store.ls()  # the index holds the summaries
    path = good / store.objects.path("manifests", store.resolve("base"))
    path.unlink()
    path.mkdir() if what == "folder" else os.mkfifo(path)
    plain = {**env, "CKPT_INDEX": "0"}
    for args in (["ls"], ["du"]):
        r, want = run(*args, "--json", store=good, env=env), run(*args, "--json", store=good, env=plain)
        assert r.returncode == want.returncode == 1 and json.loads(r.stdout) == json.loads(want.stdout), r.stdout
        assert "not a regular file" in r.stdout and "Traceback" not in r.stderr, r.stdout
