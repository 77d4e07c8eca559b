"""Local snapshot tiers across ranks: replication to peers, restore from the nearest verified copy
(ckpt/snapshot/peers.py, peer_group.py). Real processes, gloo on CPU, SIGKILL (tests/ckpt/dcp/dcp_workers.py)."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

import ckpt
from ckpt.codecs.chunk import parse_header
from ckpt.snapshot.peer_group import replica_ranks

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "dcp"))  # the rank programs
import dcp_workers as W  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def test_replica_placement():
    assert replica_ranks(0, 4, 1) == [1] and replica_ranks(3, 4, 1) == [0]
    assert replica_ranks(0, 8, 2, stride=4) == [4, 1]
    assert replica_ranks(0, 4, 2, nodes=["a", "a", "b", "b"]) == [2, 3]  # never on its own machine
    assert replica_ranks(0, 6, 2, nodes=["a", "a", "b", "b", "c", "c"]) == [2, 4]  # one per other machine
    assert replica_ranks(0, 1, 1) == [] and replica_ranks(0, 2, 5) == [1]


def test_replication_sends_only_what_the_replica_lacks(tmp_path):
    """A frozen 1 MB layer goes to the replica once: the second save sends only the trained head."""
    r0, r1 = W.run_ranks("tiers_replication", 2, str(tmp_path), store=str(tmp_path / "s"))
    for r in (r0, r1):
        assert "error" not in r, r.get("trace")
        assert r["local_steps"] == [1, 2] and r["durable_steps"] == []  # no every_n_steps: nothing persisted
    assert r0["sent"][0] > 1_000_000  # rank 0 saved the state shared by both ranks: all of it went to rank 1
    assert r0["sent"][1] < r0["sent"][0] / 20  # then only the changed head (and small records)
    assert r1["sent"][0] < 100_000  # rank 1 saved none of the shared state: little of its own to send


def test_a_bug_in_a_groups_save_is_logged_with_its_traceback_on_each_rank_and_the_next_save_lands(tmp_path):
    """A group's save into the local tiers that raises a TypeError (a bug of ours, no failure of a tier or a peer) was
    only the one line of a TierWarning on each rank, its traceback lost. Now each rank logs it with its traceback too
    (a rank logging an unexpected error where the test does not expect it fails it); training goes on, and the next
    save lands in every rank's tier."""
    out = W.run_ranks("tiers_replication", 2, str(tmp_path), store=str(tmp_path / "s"), bug=True, unexpected=(0, 1))
    for r in out:
        assert "error" not in r, r.get("trace")
        assert r["local_steps"] == [2] and r["durable_steps"] == []
        said = r.get("unexpected", [])
        assert len(said) == 1 and "local tier: unexpected TypeError" in said[0] and "in broken" in said[0], said
    assert out[0]["sent"][1] > 1_000_000  # the step 1 never reached the replica: step 2 sent all of the shared state


def test_a_bug_in_one_ranks_dcp_writer_is_logged_by_that_rank_with_where_it_was_raised(tmp_path):
    """A rank's failure in a DCP save reaches the ranks pickled, without its traceback: a bug there (a TypeError in
    the writer) was logged as unexpected with its last line only. Now the rank that met it logs the frames DCP sent
    beside it (the other rank only says it, in its warning); the next save lands in every rank's tier."""
    out = W.run_ranks("tiers_replication", 2, str(tmp_path), store=str(tmp_path / "s"), bug="writer", unexpected=(1,))
    for r in out:
        assert "error" not in r, r.get("trace")
        assert 2 in r["local_steps"], r
    said = out[1].get("unexpected", [])
    assert len(said) == 1 and "unexpected TypeError" in said[0] and "in broken_write" in said[0], said


def test_transfers_go_in_rounds_through_reused_buffers_and_every_blob_arrives_intact(tmp_path):
    """3 ranks send blobs of many sizes (some larger than a round) to two peers each, at once: every blob
    arrives byte for byte, handed over round by round (each at most the round size, or one larger
    blob), through at most two buffers per peer and direction, none larger than a round or a blob."""
    rb = 1 << 16
    out = W.run_ranks("tiers_exchange", 3, str(tmp_path), round_bytes=rb)
    for r in out:
        assert "error" not in r, r.get("trace")
    sizes = [10, rb // 3, rb // 2, 3 * rb, 7, rb, rb + 1, 100]
    for rank, r in enumerate(out):
        want = set(out[(rank - 1) % 3]["ids"]) | set(out[(rank - 2) % 3]["ids"][:2])
        assert set(r["got"]) == want and all(r["got"].values())  # each blob hashes to its id
        assert len(r["rounds"]) > 3 and all(n <= rb or count == 1 for n, count in r["rounds"])
        assert len(r["allocated"]) <= 2 * 4 and max(r["allocated"]) <= 3 * rb  # 2 peers each way
    assert [r["sent"] for r in out] == [sum(sizes[: 5 + k]) + sum(sizes[:2]) for k in range(3)]


def _crash(tmp_path, world, n, k, **kw):
    tmp_path.mkdir(parents=True, exist_ok=True)
    url = str(tmp_path / "s")
    crashed = W.run_ranks("tiers_resume", world, str(tmp_path), store=url, mode="crash", steps=n, at=k, **kw)
    assert crashed == [{"killed": True}] * world
    return url


def _same_run(full, resumed, start, n):
    for f, r in zip(full, resumed):
        assert "error" not in f, f.get("trace")
        assert "error" not in r, r.get("trace")
        assert sorted(map(int, r["losses"])) == list(range(start + 1, n + 1))
        assert {s: f["losses"][s] for s in r["losses"]} == r["losses"]  # float.hex: bit-identical
        assert r["bits"] == f["bits"]


def test_all_ranks_killed_restore_from_local_tiers_then_a_replaced_machine_from_its_replica(tmp_path):
    """(a) 2 DDP ranks, local snapshots every 2 steps, durable every 4, killed after step 6: every rank
    restores step 6 from its own tier, not one byte from the durable store. (b) Then rank 1's tier is
    wiped (a replaced machine): its chunks come from rank 0, its replica. Bit-identical runs throughout."""
    n, k = 8, 6
    full = W.run_ranks("tiers_resume", 2, str(tmp_path), store=str(tmp_path / "unused"), mode="full", steps=n)
    url = _crash(tmp_path, 2, n, k)
    store = ckpt.Store.open(url)
    assert store.manifest("ddp/latest").extra["snapshot"]["step"] == 4  # 6 lives in the local tiers only
    resumed = W.run_ranks("tiers_resume", 2, str(tmp_path), store=url, mode="resume", steps=n, at=k)
    _same_run(full, resumed, k, n)
    for r in resumed:
        assert r["restore"]["step"] == k and r["restore"]["store"] == 0 and r["restore"]["peer"] == 0 and r["restore"]["local"] > 0
    assert store.verify().ok

    url = _crash(tmp_path / "b", 2, n, k)
    restored = W.run_ranks("tiers_resume", 2, str(tmp_path / "b"), store=url, mode="resume", steps=k, at=k, wipe=[1])
    r0, r1 = (r["restore"] for r in restored)
    assert r0["step"] == r1["step"] == k and r0["store"] == r1["store"] == 0
    assert r1["local"] == 0 and r1["peer"] > 0  # everything rank 1 read came from rank 0
    assert restored[1]["local_steps"] == [k]  # ...and its tier keeps it: the replaced machine's tier refilled
    # (b') killed again before saving anything: rank 1 now restores step 6 from its own tier
    resumed = W.run_ranks("tiers_resume", 2, str(tmp_path / "b"), store=url, mode="resume", steps=n, at=k)
    _same_run(full, resumed, k, n)
    for r in resumed:
        assert r["restore"]["step"] == k and r["restore"]["local"] > 0 and r["restore"]["peer"] == r["restore"]["store"] == 0



def test_a_replaced_machine_decodes_chunks_from_its_replica_straight_into_its_tensors(tmp_path):
    """A replaced machine (rank 1's tier wiped) restores from rank 0: each chunk received is verified
    and decoded into the tensor it belongs to as it arrives, and the load does not read it back from
    the tier (0 chunk reads there, restore and refill together), nor written there before the restore
    returns (the refill writes it from the tensors). Bit-identical run; the tier holds the step again."""
    n, k = 8, 6
    full = W.run_ranks("tiers_resume", 2, str(tmp_path), store=str(tmp_path / "unused"), mode="full", steps=n)
    url = _crash(tmp_path / "a", 2, n, k)
    resumed = W.run_ranks("tiers_resume", 2, str(tmp_path / "a"), store=url, mode="resume", steps=n, at=k, wipe=[1], count=True)
    _same_run(full, resumed, k, n)
    r1 = resumed[1]["restore"]
    assert r1["step"] == k and r1["local"] == r1["store"] == 0 and r1["peer"] > 0
    assert resumed[1]["tier_chunk_reads"] == 0
    assert resumed[0]["tier_chunk_reads"] > 0  # (rank 0 reads its own tier: the count sees reads)
    # ...nor written to the tier while the restore runs (the refill writes them afterwards, from the tensors)
    assert resumed[1]["restore_chunk_writes"] == [0, 0]
    assert resumed[1]["local_steps"][-1] >= k


@pytest.mark.parametrize("fault", ["damaged", "bug"])
def test_a_bad_chunk_from_a_peer_is_not_taken_as_decoded_and_the_load_reads_it_from_the_next_tier(
        tmp_path, monkeypatch, unexpected_errors, fault):
    """A wiped rank's peer restore (ckpt/snapshot/peer_targets.py): each chunk received is decoded
    straight into its region of the target tensor and the load skips that region. A blob with one
    byte flipped must not count as decoded: the load reads that chunk from the durable store (one
    read), the others it serves with no read, as the peers'; the tensor comes out bit-exact.
    ``bug``: the decode of that chunk raises a TypeError instead (a bug; the decode runs in the transfer's
    sink, which catches every error): the same, and the bug is logged with its traceback (it was silent)."""
    import torch

    import ckpt.codecs.chunk as chunk_codec
    from ckpt.progress import NullProgress
    from ckpt.snapshot.peer_targets import decode_into_targets
    from ckpt.snapshot.tiers import Tiers
    from ckpt.transfer.reading import into_tasks

    settings = ckpt.Settings.from_env(chunk_size=64 << 10, min_saving=1.0)  # raw chunks of 64 KiB
    durable = ckpt.Store.init(str(tmp_path / "durable"), settings=settings)
    want = torch.randn(4 * (16 << 10), generator=torch.Generator().manual_seed(0))  # 4 chunks
    durable.push({"w": want}, "m")
    entry = durable.manifest("m").tensors[0]
    assert len(set(entry.chunks)) == 4
    tier = ckpt.Store.init(str(tmp_path / "tier"), settings=settings)  # the wiped rank's tier: empty
    reads = W.count_chunk_reads(durable.objects.backend)

    def restore(bad: str | None) -> tuple[torch.Tensor, Tiers]:
        got = torch.zeros_like(want)
        tiers = Tiers([("local", tier), ("store", durable)])
        tasks = into_tasks(settings.chunk_size, [(entry, got)])
        for t in tasks:  # what Peers.fetch does with each chunk received from the replica
            blob = bytearray(durable.objects.get("chunks", t.id))
            if t.id == bad and fault == "damaged":
                blob[len(blob) // 2] ^= 0xFF
            decode_into_targets(t.id, memoryview(blob), [t.into], tiers, settings.max_chunk_size)
        reads[0] = 0
        tiers.get(tasks, NullProgress())
        return got, tiers

    got, tiers = restore(bad=None)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert reads[0] == 0 and tiers.served == {"local": 0, "peer": want.nbytes, "store": 0}

    bad = entry.chunks[1]
    if fault == "bug":
        decode = chunk_codec.decode_chunk

        def broken(blob, oid, *args, **kw):
            return decode(blob, oid, *args, **kw) if oid != bad else len(blob) + None  # (TypeError)

        monkeypatch.setattr(chunk_codec, "decode_chunk", broken)
    got, tiers = restore(bad)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert {f[0] for f in tiers.filled} == set(entry.chunks) - {bad}
    n = want.nbytes // 4
    assert reads[0] == 1 and tiers.served == {"local": 0, "peer": want.nbytes - n, "store": n}
    if fault == "bug":
        [record] = unexpected_errors.records
        assert record.levelname == "WARNING" and record.exc_info[0] is TypeError
        assert "in broken" in unexpected_errors.format(record)  # the traceback, to the line that failed
        unexpected_errors.records.clear()  # (caused on purpose)


def test_a_refill_from_tensors_training_changed_names_no_chunk_by_the_bytes_restored(tmp_path):
    """The chunks a peer restore decoded into the tensors reach the tier afterwards, from the tensors
    (ckpt/snapshot/peer_targets.py keep_decoded), while training may already change them: each is
    copied and hashed again, so a changed one is never stored under the id of the bytes restored, and
    the refill says the step is not whole in the tier (its ref is then not written). Unchanged, every
    chunk lands there intact."""
    import torch

    from ckpt.snapshot.peer_targets import decode_into_targets, keep_decoded
    from ckpt.snapshot.tiers import Tiers
    from ckpt.store.copy import chunk_checker
    from ckpt.transfer.reading import into_tasks

    settings = ckpt.Settings.from_env(chunk_size=64 << 10, min_saving=1.0)  # raw chunks of 64 KiB
    durable = ckpt.Store.init(str(tmp_path / "durable"), settings=settings)
    want = torch.randn(4 * (16 << 10), generator=torch.Generator().manual_seed(0))  # 4 chunks
    durable.push({"w": want}, "m")
    entry = durable.manifest("m").tensors[0]

    def refill(change: bool) -> tuple[bool, ckpt.Store]:
        tier = ckpt.Store.init(str(tmp_path / f"tier-{change}"), settings=settings)
        got = torch.zeros_like(want)
        tiers = Tiers([("local", tier), ("store", durable)])
        for t in into_tasks(settings.chunk_size, [(entry, got)]):  # as Peers.fetch decodes each chunk received
            assert decode_into_targets(t.id, memoryview(durable.objects.get("chunks", t.id)), [t.into], tiers, settings.max_chunk_size)
        assert set(tiers.decoded) == set(entry.chunks)
        if change:
            got[(16 << 10) + 5] += 1  # an optimizer step, say, before the refill reads chunk 1
        return keep_decoded(tier, tiers.decoded), tier

    kept, tier = refill(change=False)
    assert kept and {i.id for i in tier.objects.list("chunks")} == set(entry.chunks)
    kept, tier = refill(change=True)
    held = {i.id for i in tier.objects.list("chunks")}
    assert not kept and entry.chunks[1] not in held
    check = chunk_checker(tier, tier)
    for cid in held:
        check(cid, tier.objects.get("chunks", cid))  # each is named by its own bytes


@pytest.mark.slow  # three runs of 2 processes
def test_chunks_damaged_on_the_way_to_a_replaced_machine_never_reach_its_tensors(tmp_path):
    """Rank 1's tier wiped (a replaced machine); rank 0, its replica, sends it a byte flipped in the
    first copy of half the chunks. Each damaged chunk is refused where it would be decoded straight
    into rank 1's tensors (ckpt/snapshot/peer_targets.py) and read again from a good copy; the others
    are decoded there, and none is written to rank 1's tier. Bit-identical run; every chunk rank 1's tier holds afterwards is intact, the
    garbled ones it fetched again among them (``verify`` does not apply: a rank's tier alone is not a
    whole snapshot, rank 0's chunks are missing from it)."""
    from ckpt.store.copy import chunk_checker

    n, k = 8, 6
    full = W.run_ranks("tiers_resume", 2, str(tmp_path), store=str(tmp_path / "unused"), mode="full", steps=n)
    url = _crash(tmp_path / "a", 2, n, k)
    resumed = W.run_ranks("tiers_resume", 2, str(tmp_path / "a"), store=url, mode="resume", steps=n, at=k, wipe=[1],
                          garble=0, count=True)
    _same_run(full, resumed, k, n)
    garbled, r1 = resumed[0]["garbled"], resumed[1]
    assert garbled and r1["refused"] == len(garbled) and r1["filled"] > 0
    assert r1["restore_chunk_writes"][1] == 0  # a damaged blob is dropped before it reaches the tier
    assert r1["restore"]["step"] == k and r1["restore"]["local"] == 0 and r1["restore"]["peer"] > 0
    tier = ckpt.Store.open(str(tmp_path / "a" / "local" / "rank-1"))
    held = {i.id for i in tier.objects.list("chunks")}
    durable = ckpt.Store.open(url)  # (a garbled chunk it holds may be read from there, and not kept in the tier)
    assert {c for c in garbled if not durable.objects.has("chunks", c)} <= held
    check = chunk_checker(tier, tier)
    for cid in held:
        check(cid, tier.objects.get("chunks", cid))  # raises CorruptObjectError on a bad copy


@pytest.mark.slow  # three runs of 2 processes
def test_a_replaced_machine_keeps_in_its_tier_the_chunks_it_took_from_the_durable_store(tmp_path):
    """Rank 1's tier wiped (a replaced machine) and every chunk of rank 0's tier damaged: rank 1 takes
    the persisted step 4 from the durable store (rank 0's copies refused). Its refill keeps those chunks
    too, not only the peers': restarted again, rank 1 reads the whole step from its own tier."""
    n, k = 8, 4
    full = W.run_ranks("tiers_resume", 2, str(tmp_path), store=str(tmp_path / "unused"), mode="full", steps=n)
    url = _crash(tmp_path / "a", 2, n, k)
    assert ckpt.Store.open(url).manifest("ddp/latest").extra["snapshot"]["step"] == k
    restored = W.run_ranks("tiers_resume", 2, str(tmp_path / "a"), store=url, mode="resume", steps=k, at=k, wipe=[1], flip=0)
    r1 = restored[1]["restore"]
    assert r1["step"] == k and r1["local"] == 0 and r1["store"] > 0
    assert restored[1]["local_steps"] == [k]
    resumed = W.run_ranks("tiers_resume", 2, str(tmp_path / "a"), store=url, mode="resume", steps=n, at=k)
    _same_run(full, resumed, k, n)
    r1 = resumed[1]["restore"]
    assert r1["step"] == k and r1["local"] > 0 and r1["peer"] == r1["store"] == 0


def _all_intact(tier_path):
    """Every chunk blob in the tier at ``tier_path`` decodes to its id, a delta's with its bases from the tier
    alone (a load decodes a delta with bases from the tier that holds it); returns the ids held."""
    from ckpt.store.copy import chunk_checker

    tier = ckpt.Store.open(str(tier_path))
    held = {i.id for i in tier.objects.list("chunks")}
    check = chunk_checker(tier, tier)
    for cid in held:
        check(cid, tier.objects.get("chunks", cid))  # raises CorruptObjectError on a bad copy
    return held


@pytest.mark.slow  # three runs of 2 processes
def test_a_replaced_machine_keeps_the_delta_bases_it_read_from_the_durable_store(tmp_path):
    """Snapshots stored as deltas against the previous one; rank 1's tier wiped and every chunk of rank 0's
    step 4 damaged, the delta bases its manifest records too: rank 1 takes the persisted step 4 from the
    durable store, where the drifting tensor's chunk is a delta against a chunk of step 2 that the load
    reads only as that delta's base (decoded into no tensor). The refill must keep that base too (copied
    from the durable store, verified), or the tier lacks a chunk the step needs and does not name it
    (before: a TierWarning, step 4 not kept). Restarted again, rank 1 reads the whole step from its tier."""
    n, k = 8, 4
    full = W.run_ranks("tiers_resume", 2, str(tmp_path), store=str(tmp_path / "unused"), mode="full", steps=n, delta=True)
    url = _crash(tmp_path / "a", 2, n, k, delta=True)
    restored = W.run_ranks("tiers_resume", 2, str(tmp_path / "a"), store=url, mode="resume", steps=k, at=k, wipe=[1],
                           flip=0, flip_bases=True, delta=True)
    for r in restored:
        assert "error" not in r, r.get("trace")
    r1 = restored[1]["restore"]
    assert r1["step"] == k and r1["local"] == r1["peer"] == 0 and r1["store"] > 0
    assert restored[1]["local_steps"] == [k]
    _all_intact(tmp_path / "a" / "local" / "rank-1")  # (every base beside its deltas: checked against the tier alone)
    resumed = W.run_ranks("tiers_resume", 2, str(tmp_path / "a"), store=url, mode="resume", steps=n, at=k, delta=True)
    _same_run(full, resumed, k, n)
    for r in resumed:  # (rank 0 too: the damaged copies its load read from the durable store were replaced)
        assert r["restore"]["step"] == k and r["restore"]["local"] > 0 and r["restore"]["peer"] == r["restore"]["store"] == 0


@pytest.mark.slow  # three runs of 2 processes
def test_a_tier_that_names_the_step_gets_verified_copies_of_its_damaged_chunks(tmp_path):
    """A byte flipped in every chunk of step 4 in both ranks' tiers (persisted, so the durable store holds
    it): each rank's tier names the step, its load finds the local copies damaged, the peer's too, and
    reads them from the durable store. The refill must replace the damaged copies it read with verified
    ones (before: they stayed, named by the step, and every later restore fell through to the durable
    store; a later save would reuse them on their presence). Restarted again, both ranks read the whole
    step from their own tiers, bit-identically."""
    n, k = 8, 4
    full = W.run_ranks("tiers_resume", 2, str(tmp_path), store=str(tmp_path / "unused"), mode="full", steps=n)
    url = _crash(tmp_path / "a", 2, n, k)
    restored = W.run_ranks("tiers_resume", 2, str(tmp_path / "a"), store=url, mode="resume", steps=k, at=k, flip=[0, 1])
    for r in restored:
        assert "error" not in r, r.get("trace")
        assert r["flipped"] > 0 and r["restore"]["step"] == k and r["restore"]["store"] > 0 and k in r["local_steps"]
    # (each tier may still hold damaged replicas of the other rank's own state: its load never reads them)
    resumed = W.run_ranks("tiers_resume", 2, str(tmp_path / "a"), store=url, mode="resume", steps=n, at=k)
    _same_run(full, resumed, k, n)
    for r in resumed:  # every chunk each rank reads, intact in its own tier
        assert r["restore"]["step"] == k and r["restore"]["local"] > 0 and r["restore"]["peer"] == r["restore"]["store"] == 0


@pytest.mark.slow  # three runs of 2 processes
def test_a_replaced_machine_killed_in_its_refill_leaves_its_tier_consistent_and_restarts_exactly(tmp_path):
    """Rank 1's tier wiped; it restores from rank 0 and is SIGKILLed while its refill writes the chunks
    it decoded into its tensors to its tier. What the tier holds is intact and it names no step (the
    ref comes last); restarted, the ranks resume bit-identically."""
    from ckpt.store.copy import chunk_checker

    n, k = 8, 6
    full = W.run_ranks("tiers_resume", 2, str(tmp_path), store=str(tmp_path / "unused"), mode="full", steps=n)
    url = _crash(tmp_path / "a", 2, n, k)
    killed = W.run_ranks("tiers_resume", 2, str(tmp_path / "a"), store=url, mode="resume", steps=k, at=k, wipe=[1],
                         kill_refill=True)
    assert killed[1] == {"killed": True} and "error" not in killed[0], killed[0].get("trace")
    tier = ckpt.Store.open(str(tmp_path / "a" / "local" / "rank-1"))
    held = {i.id for i in tier.objects.list("chunks")}
    first = json.loads((tmp_path / "a" / "first-batch.json").read_text())
    assert first and set(first) <= held  # the refill's first batch went in before the kill (in its second)
    check = chunk_checker(tier, tier)
    for cid in held:
        check(cid, tier.objects.get("chunks", cid))
    assert not [name for name in tier.refs() if "step-" in name]
    resumed = W.run_ranks("tiers_resume", 2, str(tmp_path / "a"), store=url, mode="resume", steps=n, at=k)
    _same_run(full, resumed, k, n)
    assert resumed[1]["restore"]["step"] == k and resumed[1]["restore"]["store"] == 0


def _delta_chunks(tmp, k):
    """Of step ``k`` of a ``delta=True`` run (rank 0's tier): X (the frozen tensor's chunk), Y (a delta
    against X), Z (a delta against W, a chunk of step 4 that step ``k`` does not name), W."""
    tier0 = ckpt.Store.open(str(tmp / "local" / "rank-0"))
    m = tier0.manifest(tier0.resolve(f"ddp/step-{k}"))
    (x,), (y,), (z,) = ({c for e in m.tensors if name in e.name for c in e.chunks} for name in ("frozen", "moving", "drift"))
    w = parse_header(tier0.objects.get("chunks", z), z).base
    assert parse_header(tier0.objects.get("chunks", y), y).base == x  # (the case: Y a delta against X)
    assert w is not None and w not in {c for e in m.tensors for c in e.chunks}  # (Z: against one of step 4's)
    return x, y, z, w


@pytest.mark.slow  # three runs of 2 processes
def test_a_replaced_machine_restores_deltas_against_chunks_it_decoded_into_its_tensors(tmp_path):
    """Snapshots stored as deltas against the previous one (``delta_vs_previous``, local tiers too), and a
    chunk X both in the state as it is (a frozen tensor) and the base of a delta Y (a tensor that held X's
    bytes at the step before), and a delta Z against a chunk of step 4 that step 6 does not name. Rank 1's
    tier wiped: X arrives from rank 0 and is decoded into rank 1's tensor, not written to its tier; Y must
    still decode against it, and Z's base must come too (the durable store lacks step 6, never
    persisted): the restore reads nothing from there. Y and Z are checked before they are written to the
    tier (nothing enters it unverified). The refill keeps X before Y, and restarted again rank 1 reads
    the whole step from its own tier. Bit-identical throughout."""
    n, k = 8, 6
    full = W.run_ranks("tiers_resume", 2, str(tmp_path), store=str(tmp_path / "unused"), mode="full", steps=n, delta=True)
    url = _crash(tmp_path / "a", 2, n, k, delta=True)
    x, y, _z, _w = _delta_chunks(tmp_path / "a", k)
    restored = W.run_ranks("tiers_resume", 2, str(tmp_path / "a"), store=url, mode="resume", steps=k, at=k, wipe=[1],
                           delta=True)
    for r in restored:
        assert "error" not in r, r.get("trace")
    r1 = restored[1]["restore"]
    assert r1["step"] == k and r1["store"] == 0 and r1["local"] == 0 and r1["peer"] > 0
    assert restored[1]["restore_checks"] > 0  # (Y and Z checked before they were written to the tier)
    assert restored[1]["local_steps"] == [k]
    tier1 = ckpt.Store.open(str(tmp_path / "a" / "local" / "rank-1"))
    assert tier1.objects.has("chunks", x) and tier1.objects.has("chunks", y)
    resumed = W.run_ranks("tiers_resume", 2, str(tmp_path / "a"), store=url, mode="resume", steps=n, at=k, delta=True)
    _same_run(full, resumed, k, n)
    assert [r["extra"] for r in resumed] == [f["extra"] for f in full]
    for r in resumed:
        assert r["restore"]["step"] == k and r["restore"]["local"] > 0 and r["restore"]["peer"] == r["restore"]["store"] == 0


def test_a_refill_after_training_changed_the_state_warns_once_and_leaves_nothing_unnamed(tmp_path):
    """Rank 1's tier wiped; right after its restore, before its refill reads the tensors, training
    changes one: the refill names no step, warns once (a TierWarning saying the tier holds the step again
    at the next save, and that ``wait()`` right after the restore avoids it), and leaves no chunk it wrote
    unnamed in the tier (the tier's bounds count only what a step names)."""
    n, k = 8, 6
    url = _crash(tmp_path / "a", 2, n, k)
    out = W.run_ranks("tiers_resume", 2, str(tmp_path / "a"), store=url, mode="resume", steps=k, at=k, wipe=[1],
                      change=True)
    for r in out:
        assert "error" not in r, r.get("trace")
    assert out[1]["local_steps"] == []
    (warning,) = out[1]["tier_warnings"]
    assert f"step {k}" in warning and "next save" in warning and "wait()" in warning
    tier = ckpt.Store.open(str(tmp_path / "a" / "local" / "rank-1"))
    assert not [name for name in tier.refs() if "step-" in name]
    assert {i.id for i in tier.objects.list("chunks")} == set()


@pytest.mark.slow  # two runs of 2 processes
def test_a_replaced_machine_killed_after_its_fetch_holds_only_verified_chunks_in_its_tier(tmp_path):
    """Deltas as above; rank 0 damages on the way the first copy of the deltas Y and Z it sends, and rank 1
    (its tier wiped) is SIGKILLed once its fetch from peers has returned, before its load reads anything.
    Every blob in rank 1's tier must verify against its id: a later save reuses a chunk there on its
    presence alone (ckpt.transfer.writing), so an unverified one would be named by a step as it is.
    (Before, the transfer wrote deltas to the tier unchecked, for the load to check: both damaged ones
    stayed there.)"""
    from ckpt.store.copy import chunk_checker

    n, k = 8, 6
    url = _crash(tmp_path / "a", 2, n, k, delta=True)
    x, y, z, w = _delta_chunks(tmp_path / "a", k)
    out = W.run_ranks("tiers_resume", 2, str(tmp_path / "a"), store=url, mode="resume", steps=k, at=k, wipe=[1],
                      delta=True, garble=0, garble_only=[y, z], kill_fetch=True, stuck=(0,))
    assert out[1] == {"killed": True}
    tier = ckpt.Store.open(str(tmp_path / "a" / "local" / "rank-1"))
    held = {i.id for i in tier.objects.list("chunks")}
    assert held and not held & {y, z}  # (W, Z's base, arrived intact; X, Y's, was decoded into its tensor)
    check = chunk_checker(ckpt.Store.open(url), tier)  # (a base from the tier, else the durable store)
    for cid in held:
        check(cid, tier.objects.get("chunks", cid))


@pytest.mark.slow  # three runs of 2 processes
def test_a_delta_base_damaged_on_the_way_is_fetched_again_with_its_delta(tmp_path):
    """Deltas as above; rank 0 damages on the way the first copy of X and W, the bases of the deltas Y and
    Z it sends to rank 1 (its tier wiped). Y and Z then cannot be decoded: the second fetch must bring
    their bases again too, not the deltas alone (a base damaged or missing here, and in no peer tier,
    left the load to the durable store, which lacks step 6, never persisted: the restore failed). The
    restore is bit-identical, and its last load reads nothing from the durable store. Its log says what
    became of Z after the first fetch: kept in memory, not dropped."""
    n, k = 8, 6
    full = W.run_ranks("tiers_resume", 2, str(tmp_path), store=str(tmp_path / "unused"), mode="full", steps=n, delta=True)
    url = _crash(tmp_path / "a", 2, n, k, delta=True)
    x, y, z, w = _delta_chunks(tmp_path / "a", k)
    restored = W.run_ranks("tiers_resume", 2, str(tmp_path / "a"), store=url, mode="resume", steps=n, at=k, wipe=[1],
                           delta=True, garble=0, garble_only=[x, w], logs=True)
    for r in restored:
        assert "error" not in r, r.get("trace")
    assert sorted(restored[0]["garbled"]) == sorted([x, w])
    # What rank 1 logged is what happened: Z, its base W dropped (damaged) in the first fetch, is kept in
    # memory for the load, and said so (it was logged 'dropped: its base is in no tier'); W is dropped.
    logs, memory = restored[1]["logs"], restored[1]["in_memory"][0]
    assert z in memory and w not in memory
    assert not [m for m in logs if "dropped" in m and any(c[:12] in m for c in memory)], logs
    assert [m for m in logs if z[:12] in m and "its base is in no tier" in m and "kept in memory" in m], logs
    assert [m for m in logs if w[:12] in m and "dropped" in m], logs
    r1 = restored[1]["restore"]
    assert r1["step"] == k and r1["store"] == 0 and r1["peer"] > 0
    _same_run(full, restored, k, n)
    assert [r["extra"] for r in restored] == [f["extra"] for f in full]


@pytest.mark.slow  # two runs of 2 processes
def test_a_delta_from_a_peer_waits_for_its_base_where_the_tier_holds_that_base_damaged(tmp_path):
    """Deltas as above; step 6 never persisted (peers alone hold it). Every chunk of rank 0's step 6 damaged
    in its tier, the delta bases its manifest records too: its load finds them damaged and fetches them from
    rank 1, a delta among them while the tier still holds its base damaged. That delta is intact: it must
    wait for its base (which comes from the peer too), not be dropped for its base's damage (before: the
    check raised the base's CorruptObjectError, the delta was dropped and deleted from memory, and the
    restore failed on rank 0 with ObjectNotFoundError). Bit-identical, nothing read from the durable store."""
    n, k = 8, 6
    full = W.run_ranks("tiers_resume", 2, str(tmp_path), store=str(tmp_path / "unused"), mode="full", steps=n, delta=True)
    url = _crash(tmp_path / "a", 2, n, k, delta=True)
    out = W.run_ranks("tiers_resume", 2, str(tmp_path / "a"), store=url, mode="resume", steps=n, at=k,
                      flip=[0], flip_bases=True, delta=True)
    for r in out:
        assert "error" not in r, (r.get("error"), r.get("trace", "")[-3000:])
    assert out[0]["flipped"] > 0 and out[0]["restore"]["step"] == k
    assert out[0]["restore"]["peer"] > 0 and out[0]["restore"]["store"] == 0
    _same_run(full, out, k, n)


@pytest.mark.slow  # three runs of 2 processes
def test_a_replaced_machine_with_a_full_tier_keeps_deltas_and_their_bases_in_memory(tmp_path, tmpfs):
    """Deltas as above; rank 1's tier wiped and its medium (a tmpfs) full but 16 KiB when it restores
    step 6 (never persisted: peers alone hold it). The chunks its tier cannot take, and the deltas
    waiting for bases it decoded into its tensors, with those bases, stay in memory for the restore
    (ckpt/snapshot/peer_targets.py settle_deltas): the restore reads nothing from the durable store and
    is bit-identical; the refill cannot keep the step (a TierWarning, nothing named), and what the tier
    holds is intact."""
    import shutil

    n, k = 8, 6
    full = W.run_ranks("tiers_resume", 2, str(tmp_path), store=str(tmp_path / "unused"), mode="full", steps=n, at=k,
                       delta=True)
    url = _crash(tmp_path / "a", 2, n, k, delta=True)
    x, y, z, w = _delta_chunks(tmp_path / "a", k)
    shutil.rmtree(tmp_path / "a" / "local" / "rank-1")
    tmpfs(tmp_path / "a" / "local" / "rank-1", "4m")
    out = W.run_ranks("tiers_resume", 2, str(tmp_path / "a"), store=url, mode="resume", steps=k, at=k, wipe=[1],
                      delta=True, room=16 << 10, logs=True)
    for f, r in zip(full, out):
        assert "error" not in r, r.get("trace")
        assert r["restore"]["step"] == k and r["restore"]["store"] == 0
        assert r["bits"] == f["bits_at"] and r["extra_at"] == f["extra_at"]
    assert out[1]["restore"]["peer"] > 0 and out[1]["local_steps"] == []
    # (the case: the tier could not take X, decoded into a tensor, so Y waits in memory with X beside it;
    # W (64 KiB) did not fit either, and Z stays beside it, not alone in the tier: a load decodes a delta
    # with bases from the tier that holds it; before, Z went to the tier and the restore failed on it)
    logs, memory = out[1]["logs"], set(out[1]["in_memory"][0])
    assert any("deltas fetched from peers kept in memory" in m and "disk is full" in m for m in logs), logs
    assert {x, y, z, w} <= memory
    _all_intact(tmp_path / "a" / "local" / "rank-1")  # (no delta there without its bases: checked against the tier alone)


@pytest.mark.parametrize("lost", ["z", "w"])
def test_a_refill_names_no_step_its_tier_lacks_a_chunk_of(tmp_path, lost):
    """Rank 1's tier wiped; after its restore, before its refill, a chunk the restore wrote to its tier
    (verified) is gone from there. Z (step 6's delta, never persisted: in no tier the rank can read but
    its own): the refill must not name the step in the tier (a TierWarning says so): a step a tier names
    has every chunk there, verified. W (Z's base, a chunk of step 4, persisted): the refill copies it back
    from the durable store, verified, and names the step."""
    n, k = 8, 6
    url = _crash(tmp_path / "a", 2, n, k, delta=True)
    chunks = dict(zip("xyzw", _delta_chunks(tmp_path / "a", k)))  # (W: fetched as Z's base, written to the tier)
    out = W.run_ranks("tiers_resume", 2, str(tmp_path / "a"), store=url, mode="resume", steps=k, at=k, wipe=[1],
                      delta=True, lose=chunks[lost])
    for r in out:
        assert "error" not in r, r.get("trace")
    tier = ckpt.Store.open(str(tmp_path / "a" / "local" / "rank-1"))
    if lost == "w":
        assert out[1]["restore"]["store"] == 0 and out[1]["local_steps"] == [k] and out[1]["tier_warnings"] == []
        assert chunks["w"] in _all_intact(tmp_path / "a" / "local" / "rank-1")
        return
    assert out[1]["restore"]["store"] == 0 and out[1]["local_steps"] == []
    (warning,) = out[1]["tier_warnings"]
    assert f"step {k}" in warning and "not kept" in warning
    assert not [name for name in tier.refs() if "step-" in name]


@pytest.mark.slow
def test_damaged_local_chunks_come_from_a_peer_and_lost_replicas_fall_back_to_the_durable_store(tmp_path):
    """(d) A byte flipped in every chunk of rank 0's tier: each comes from rank 1's copy (or the durable
    store, where the persisted step 4 has the same chunk). (c) Every rank's tier wiped (with one replica
    each, a rank and its replica): step 6 cannot be assembled; all restore step 4 from the durable store."""
    n, k = 8, 6
    full = W.run_ranks("tiers_resume", 2, str(tmp_path), store=str(tmp_path / "unused"), mode="full", steps=n)
    url = _crash(tmp_path / "a", 2, n, k)
    resumed = W.run_ranks("tiers_resume", 2, str(tmp_path / "a"), store=url, mode="resume", steps=n, at=k)
    read0 = resumed[0]["restore"]["local"]  # what rank 0 reads
    url = _crash(tmp_path / "d", 2, n, k)
    resumed = W.run_ranks("tiers_resume", 2, str(tmp_path / "d"), store=url, mode="resume", steps=n, at=k, flip=0)
    _same_run(full, resumed, k, n)
    r0 = resumed[0]["restore"]
    assert resumed[0]["flipped"] > 0 and r0["step"] == k and r0["local"] == 0
    # each damaged chunk came from rank 1's copy, or from the durable store where step 4 has it too
    assert r0["peer"] > 0 and r0["peer"] + r0["store"] == read0

    url = _crash(tmp_path / "c", 2, n, k)
    resumed = W.run_ranks("tiers_resume", 2, str(tmp_path / "c"), store=url, mode="resume", steps=n, at=k, wipe=[0, 1])
    _same_run(full, resumed, 4, n)
    for r in resumed:
        assert r["restore"]["step"] == 4 and r["restore"]["store"] > 0 and r["restore"]["local"] == 0


def test_a_bug_in_the_check_of_chunks_from_a_peer_is_logged_with_its_traceback_and_the_restore_stands(tmp_path):
    """Rank 0's damaged chunks come from rank 1's copies, each checked as it arrives, in the transfer's sink, which
    catches every error (the peers go on sending). A TypeError there (a bug) was the one line of a 'chunk dropped'
    warning, its traceback lost: now it is logged with its traceback too (on any other rank, the test would fail),
    and the chunk, dropped, is read from the durable store: the run is bit-identical."""
    n, k = 8, 6
    full = W.run_ranks("tiers_resume", 2, str(tmp_path), store=str(tmp_path / "unused"), mode="full", steps=n)
    url = _crash(tmp_path / "a", 2, n, k)
    resumed = W.run_ranks("tiers_resume", 2, str(tmp_path / "a"), store=url, mode="resume", steps=n, at=k, flip=0, bug=0,
                          unexpected=(0,))
    _same_run(full, resumed, k, n)
    r0 = resumed[0]["restore"]
    assert resumed[0]["flipped"] > 0 and r0["step"] == k and r0["local"] == 0 and r0["store"] > 0
    said = resumed[0].get("unexpected", [])
    assert said and all("peer restore: unexpected TypeError" in s and "in broken" in s for s in said), said
    assert "unexpected" not in resumed[1]


def test_a_group_taken_back_to_an_earlier_snapshot_restarts_on_its_new_timeline(tmp_path):
    """Trained to 12, taken back to 4 and trained to 6: a restart takes 6 from the local tiers, and with
    the tiers wiped from the durable store. Before, both restored the abandoned step 12: the tiers pruned
    the new steps first, as the oldest, and a save below the durable latest's step was not persisted."""
    for r in W.run_ranks("tiers_rollback", 2, str(tmp_path), store=str(tmp_path / "s")):
        assert "error" not in r, r.get("trace")
        assert r == {"wiped=False": [6, False, True], "wiped=True": [6, True, True]}


def test_ranks_agree_to_persist_a_new_timeline_when_one_cannot_read_the_durable_store(tmp_path):
    """Trained to 8, taken back to 4 and trained to 6 by a fresh manager, whose first read of the durable
    RUN/latest fails on rank 1 only. Step 6 must still be persisted by both ranks (one rank's view is
    enough to know the run went back), and a restart resumes it bit for bit. Before, each rank decided
    from its own read: rank 0 persisted alone and waited in a collective rank 1 never joined, so the
    durable store kept naming the abandoned step 8, which a restart resumed."""
    out = W.run_ranks("tiers_rollback_unread", 2, str(tmp_path), store=str(tmp_path / "s"), deadline_s=120)
    for r in out:
        assert "error" not in r, r.get("trace")
        assert r == {"durable_latest": 6, "restored": 6, "exact": True}


@pytest.mark.parametrize("failing,missing", [(1, False), (1, True), (0, False)], ids=["rank1-io", "rank1-missing", "rank0-io"])
def test_ranks_agree_on_the_snapshot_to_restore_when_one_cannot_read_the_durable_store(tmp_path, failing, missing):
    """Trained to 9 (durable 4, 8; local 6, 8); a restart where one rank's read of the durable RUN/latest
    fails. The ranks restore from one view of the durable store, read once: a failure of rank 1's read
    changes nothing (step 8, bit for bit), and one of the read they use is raised on every rank. Before,
    each rank read it and chose on its own: the rank whose read failed raised (or, reading no ref,
    chose another step and ran other collectives) while the others waited in a collective for
    timeout_s, then failed or diverged."""
    out = W.run_ranks("tiers_restore_unread", 2, str(tmp_path), store=str(tmp_path / "s"), failing=failing,
                      missing=missing, deadline_s=120)
    for r in out:
        assert "error" not in r, r.get("trace")
        assert r["seconds"] < 10, r  # not timeout_s=20
        if failing == 1:
            assert r["outcome"] == 8 and r["exact"], r
        else:
            assert r["outcome"].startswith("SnapshotError") and "rank 0" in r["outcome"], r


def test_a_checkpoint_pushed_as_run_latest_is_refused_by_a_group_as_by_one_process(tmp_path):
    """A user's checkpoint pushed as RUN/latest over a group's run at step 8: with local tiers the ranks
    passed over it in silence (the tiers' step 8, or None on fresh nodes: training began again), and
    latest_step said None without tiers. Every rank of every case now refuses it, as one process does."""
    out = W.run_ranks("tiers_pushed_latest", 2, str(tmp_path), store=str(tmp_path / "s"), deadline_s=150)
    for r in out:
        assert "error" not in r, r.get("trace")
        assert sorted(r) == sorted(f"{case} {call}" for case in ("tiers", "fresh", "none") for call in ("latest_step", "restore_latest"))
        for key, got in r.items():
            assert isinstance(got, str) and got.startswith("SnapshotError: ") and "is not a snapshot: it was pushed" in got, (key, got)


def test_a_groups_persist_over_a_checkpoint_pushed_as_run_latest_warns_on_rank_0(tmp_path):
    """A user's checkpoint pushed as ddp/latest while a group with local tiers trains: the next persist (step 8)
    moved ddp/latest to its snapshot without a word, as a save without tiers or one process's persist no longer
    do. Rank 0 (which alone reads the durable store) now warns once, naming it; the other ranks do not."""
    out = W.run_ranks("tiers_persist_over_pushed_latest", 2, str(tmp_path), store=str(tmp_path / "s"), deadline_s=150)
    for r in out:
        assert "error" not in r, r.get("trace")
        assert r["latest"] == 8
    pushed = out[0]["pushed"]
    assert [m for m in out[0]["warnings"] if "pushed there" in m] == [m for m in out[0]["warnings"] if pushed[:12] in m]
    assert len([m for m in out[0]["warnings"] if f"ddp/latest names checkpoint {pushed[:12]}, pushed there" in m]) == 1, out
    assert not any("pushed there" in m for m in out[1]["warnings"]), out[1]["warnings"]
    assert ckpt.Store.open(str(tmp_path / "s")).resolve("ddp/latest@1") == pushed


def test_a_group_resumes_the_newest_step_after_run_latest_was_removed(tmp_path):
    """Trained to 8 (durable 4, 8), then ``ckpt rm ddp/latest``, as the refusal of a checkpoint pushed there
    advises: with the run's tiers, fresh tiers or none, every rank resumes step 8 bit for bit, with a warning
    on rank 0 (which alone reads the durable store), one for latest_step and restore_latest. Before, fresh tiers and no tiers said None: training
    began again from step 0 while step 8 was in the store."""
    out = W.run_ranks("tiers_removed_latest", 2, str(tmp_path), store=str(tmp_path / "s"), deadline_s=150)
    for rank, r in enumerate(out):
        assert "error" not in r, r.get("trace")
        for case, got in r.items():
            assert got["got"] == [8, 8] and got["exact"], (rank, case, got)
            if rank == 0:  # once: latest_step and restore_latest meet the same missing ddp/latest
                assert len([m for m in got["warnings"] if "ddp/latest is missing" in m and "step 8" in m]) == 1, (case, got)


@pytest.mark.parametrize("failing", [0, 1])
def test_the_ranks_of_a_group_without_tiers_agree_on_latest_step(tmp_path, failing):
    """A group without tiers at step 4; latest_step while rank ``failing``'s manifest read fails. The ranks
    agreed on the manifest id, then each read the manifest itself: rank 1 raised alone while rank 0 said 4
    and went on to its next collective (a split run, or a hang). Rank 0 alone reads it now: a failure of
    rank 1's changes nothing, one of rank 0's is raised on every rank; both then restore step 4 bit for bit."""
    out = W.run_ranks("latest_step_unread", 2, str(tmp_path), store=str(tmp_path / "s"), failing=failing, deadline_s=120)
    for r in out:
        assert "error" not in r, r.get("trace")
        assert r["restored"] == 4 and r["exact"], r
    got = [r["latest_step"] for r in out]
    if failing == 1:
        assert got == [4, 4], got
    else:
        assert all(isinstance(g, str) and g.startswith("SnapshotError: ") and "rank 0" in g and "Input/output error" in g
                   for g in got), got


def test_a_nodes_tiers_left_from_a_timeline_the_run_has_left_are_not_resumed(tmp_path):
    """Trained to 12 with the tiers of node A, begun anew under the run's name on node B (its step 2
    persisted) and trained to 8, restarted on node A: node A's steps 10 and 12 predate the durable newest
    and are skipped (a TierWarning on each rank); every rank resumes step 2, bit for bit. Before, the
    ranks assembled node A's step 12 of the abandoned run and resumed it."""
    out = W.run_ranks("tiers_left_timeline", 2, str(tmp_path), store=str(tmp_path / "s"), deadline_s=120)
    for r in out:
        assert "error" not in r, r.get("trace")
        assert r["restored"] == 2 and r["exact"], r
        assert any("step 12 predates" in m for m in r["warnings"]), r["warnings"]


@pytest.mark.parametrize("full", [0, 1])
def test_a_full_local_tier_in_a_group_warns_and_training_and_durable_saves_go_on(tmp_path, tmpfs, full):
    """Rank ``full``'s tier is a 1 MiB tmpfs; the state is ~3 MB. Rank 0 saves the shared state: its
    tier fails every local save (ENOSPC), and the snapshots due to the durable store (4, 8) are written
    there directly by all ranks. Rank 1's tier fills with rank 0's replica: that rank warns and its
    tier holds what fits. Either way every step trains, the durable steps exist, and they restore
    bit-exactly on every rank."""
    tmpfs(tmp_path / "local" / f"rank-{full}", "1m")
    url = str(tmp_path / "s")
    trained = W.run_ranks("tiers_full", 2, str(tmp_path), store=url, mode="train")
    for r in trained:
        assert "error" not in r, r.get("trace")
        assert sorted(map(int, r["losses"])) == list(range(1, 9))  # training went on
        assert r["durable"] == [4, 8]
    assert any("step 2" in m for m in trained[full]["warnings"]), trained[full]["warnings"]
    if full == 0:  # no local snapshot anywhere: every rank was told, and 4 and 8 went to the store directly
        for r in trained:
            assert r["local_steps"] == [] and r["last_tier"] == "store"
            for step in (2, 4, 6, 8):
                assert any(f"step {step} not saved" in m for m in r["warnings"]), r["warnings"]
            assert sum("durable store directly" in m for m in r["warnings"]) == 2
        assert trained[0]["tier_bytes"] < 64 << 10  # what each failed save left there was freed for the next
    restored = W.run_ranks("tiers_full", 2, str(tmp_path), store=url, mode="restore")
    for t, r in zip(trained, restored):
        assert "error" not in r, r.get("trace")
        assert r["latest"] == 8 and r["restore"]["step"] == 8 and r["step4"] == 4
        assert r["bits"] == t["saved"]["8"] and r["bits4"] == t["saved"]["4"]  # bytes, every tensor and the RNG
        if full == 0:
            assert r["restore"]["store"] > 0 and r["restore"]["local"] == 0
    assert ckpt.Store.open(url).verify().ok


def test_a_tier_with_room_for_one_snapshot_in_a_group_makes_room_and_keeps_the_newest(tmp_path, tmpfs):
    """Rank 1's tier is a 5 MiB tmpfs: it holds one replica of rank 0's ~3 MB snapshot, not two. Step 4's
    replica fills it (ENOSPC on rank 1 only, a warning); at the next local save rank 1 drops step 2, which
    with its free space makes room (step 4 would have gone too before it checked the free space), and takes step 6 whole, so its tier keeps a recent step instead of step 2 forever. Training and
    the durable steps go on, and the latest step restores bit-exactly."""
    tmpfs(tmp_path / "local" / "rank-1", "5m")
    url = str(tmp_path / "s")
    r0, r1 = W.run_ranks("tiers_full", 2, str(tmp_path), store=url, mode="train")
    for r in (r0, r1):
        assert "error" not in r, r.get("trace")
        assert sorted(map(int, r["losses"])) == list(range(1, 9)) and r["durable"] == [4, 8]
    assert any("step 4" in m and "not kept" in m for m in r1["warnings"]), r1["warnings"]
    # (step 4 was named in rank 1's tier without the chunks that did not fit: a restore assembles a
    # step from every rank's tier, or passes it by)
    assert any("dropped step(s) 2 to make room for step 6" in m for m in r1["warnings"]), r1["warnings"]
    assert r1["local_steps"] == [6, 8] and r0["local_steps"] == [6, 8]
    assert not any("make room" in m for m in r0["warnings"]), r0["warnings"]
    restored = W.run_ranks("tiers_full", 2, str(tmp_path), store=url, mode="restore")
    for t, r in zip((r0, r1), restored):
        assert "error" not in r, r.get("trace")
        assert r["latest"] == 8 and r["bits"] == t["saved"]["8"] and r["bits4"] == t["saved"]["4"]
    assert ckpt.Store.open(url).verify().ok


def test_a_groups_room_after_a_full_tier_drops_the_oldest_first_never_the_step_it_continues_from(tmp_path, tmpfs):
    """Both ranks' tiers in one 16 MiB tmpfs, local_keep=4: on rank 0, step 1 (saved before training, ~1 MiB), 2 and
    4 (~3 MiB each); then the group goes back to 2. Another tenant fills the tmpfs: the save of 3 runs out of space.
    The tenant frees 1.5 MiB: the save of 5 makes room first, two snapshots' worth. A group's room named no snapshot
    it continues from: rank 0 dropped 1 and then 2, the step the group went back to, and kept the abandoned
    timeline's 4. It drops the oldest (1), then 4, never 2; 5 and 2 restore from the tiers alone, bit-exact, on
    every rank."""
    tmpfs(tmp_path / "local", "16m")
    url = str(tmp_path / "s")
    ranks = W.run_ranks("tiers_room_order", 2, str(tmp_path), store=url)
    for r in ranks:
        assert "error" not in r, r.get("trace")
        assert any("step 3 not saved" in m for m in r["warnings"]), r["warnings"]
        assert r["restored5"] == [5, 0, True] and r["restored2"] == [2, 0, True], r
    assert any("dropped step(s) 1, 4 to make room for step 5" in m for m in ranks[0]["warnings"]), ranks[0]["warnings"]
    assert not any("dropped step(s) 2" in m for r in ranks for m in r["warnings"]), ranks
    assert ranks[0]["local_steps"] == [2, 5]


@pytest.mark.slow
def test_a_rank_killed_while_replicating_leaves_the_previous_step_restorable_and_nothing_half_received(tmp_path):
    """(f) Step 8 holds 64 MB of new shared data; rank 0 is SIGKILLed while sending it to rank 1, its
    replica, once a first round of it has gone and the next is posted. Rank 1 warns and keeps nothing of it; the restarted
    ranks restore step 6 (in the local tiers only: 8 was never persisted) bit-identically."""
    n, k = 10, 8
    full = W.run_ranks("tiers_resume", 2, str(tmp_path), store=str(tmp_path / "unused"), mode="full", steps=n)
    url = str(tmp_path / "s")
    killed, survivor = W.run_ranks("tiers_resume", 2, str(tmp_path), store=url, mode="killrep", steps=n, at=k, big=True)
    assert killed == {"killed": True}
    assert "error" not in survivor, survivor.get("trace")
    assert any("step 8 not saved" in m for m in survivor["warnings"]), survivor["warnings"]
    assert survivor["local_steps"] == [4, 6]  # step 8 never named in its tier
    assert survivor["bad"] == [] and survivor["temporaries"] == 0  # every chunk it holds is whole and verified
    assert survivor["tier_bytes"] < 16 << 20  # none of the 64 MB in flight was kept (the tier is raw: ~4 MB of its own)
    assert ckpt.Store.open(url).manifest("ddp/latest").extra["snapshot"]["step"] == 4
    resumed = W.run_ranks("tiers_resume", 2, str(tmp_path), store=url, mode="resume", steps=n, at=k, big=True)
    _same_run(full, resumed, 6, n)
    for r in resumed:
        assert r["restore"]["step"] == 6 and r["restore"]["store"] == 0 and r["restore"]["peer"] == 0


@pytest.mark.slow  # waits out timeout_s (3-5 s) at least once: CI runs it in its slow pass
def test_a_peer_that_does_not_answer_makes_the_save_warn_after_the_timeout_and_training_goes_on(tmp_path):
    """Rank 1 stops (SIGSTOP, connections open) as it starts replicating step 2: rank 0's save gives
    up after timeout_s with a TierWarning, step 2 is not named in its tier, step 1 stays, and its
    training runs to the end."""
    ranks = W.run_ranks("tiers_stall", 2, str(tmp_path), store=str(tmp_path / "s"), steps=4, at=2, timeout_s=5,
                        stuck=(1,), deadline_s=120)
    r0 = ranks[0]
    assert "error" not in r0, r0.get("trace")
    assert sorted(map(int, r0["losses"])) == [1, 2, 3, 4]
    assert any("step 2 not saved" in m for m in r0["warnings"]), r0["warnings"]
    assert 4 < r0["waited"] < 60  # it waited for the timeout, not forever
    assert r0["local_steps"] == [1]


@pytest.mark.slow  # waits out timeout_s (3-5 s) at least once: CI runs it in its slow pass
def test_after_a_peer_timed_out_the_ranks_rebuild_their_group_and_later_saves_succeed(tmp_path):
    """Rank 1 stops (SIGSTOP) as it starts replicating step 2, for longer than timeout_s; rank 0 warns,
    then wakes it (SIGCONT). The timeout closed the connections of the checkpoint group: at the next
    save the ranks agree to rebuild it (and destroy the old one), and every later save succeeds on both
    ranks. The durable steps
    4 and 8 exist and restore bit-identically (parameters and AdamW state) in fresh processes."""
    url = str(tmp_path / "s")
    trained = W.run_ranks("tiers_stall_recover", 2, str(tmp_path), store=url, mode="train", steps=8, at=2, timeout_s=5,
                          deadline_s=150)
    for r in trained:
        assert "error" not in r, r.get("trace")
        assert r["errors"] == {}, r["errors"]  # no save raised: training never stopped
        assert sorted(map(int, r["losses"])) == list(range(1, 9))
        assert r["durable"] == [4, 8]
        assert r["local_steps"] == [7, 8]
        assert r["groups"][1] == r["groups"][0]  # the replaced group was destroyed, not left open
    assert trained[0]["losses"] == trained[1]["losses"]
    for r in trained:  # step 2 failed on both ranks (rank 1 learns it when it wakes); nothing after it did
        assert any("step 2 not saved" in m for m in r["warnings"]), r["warnings"]
        assert not any(f"step {s} " in m for m in r["warnings"] for s in range(3, 9)), r["warnings"]
    restored = W.run_ranks("tiers_stall_recover", 2, str(tmp_path), store=url, mode="restore")
    for t, r in zip(trained, restored):
        assert "error" not in r, r.get("trace")
        assert r["latest"] == 8 and r["restore"]["step"] == 8 and r["step4"] == 4
        assert r["restore4"]["store"] > 0  # step 4 lives in the durable store only
        assert r["bits"] == t["saved"]["8"] and r["bits4"] == t["saved"]["4"]
        assert r["durable"] == [4, 8]
    assert ckpt.Store.open(url).verify().ok


@pytest.mark.slow  # waits out timeout_s (3-5 s) at least once: CI runs it in its slow pass
def test_when_the_peer_is_gone_for_good_tier_saves_warn_and_durable_saves_raise(tmp_path):
    """As above, but rank 0 kills rank 1 instead of waking it: no rank joins the agreement of the
    next saves. Rank 0 waits timeout_s at each: the local save of step 3 warns, and the snapshot of
    step 4, due to the durable store, raises (as a durable save does without tiers); training goes on."""
    url = str(tmp_path / "s")
    r0, r1 = W.run_ranks("tiers_stall_recover", 2, str(tmp_path), store=url, mode="train", steps=4, at=2, timeout_s=3,
                         gone=True, deadline_s=120)
    assert r1 == {"killed": True}
    assert "error" not in r0, r0.get("trace")
    assert sorted(map(int, r0["losses"])) == [1, 2, 3, 4]
    assert any("step 2 not saved" in m for m in r0["warnings"]), r0["warnings"]
    assert any("step 3 not saved" in m and "arrived within timeout_s=3" in m for m in r0["warnings"]), r0["warnings"]
    assert list(r0["errors"]) == ["4"] and r0["errors"]["4"].startswith("GroupUnavailable: snapshot of step 4 not done")
    assert r0["durable"] == [] and r0["local_steps"] == [1]


@pytest.mark.slow  # waits out timeout_s (3-5 s) at least once: CI runs it in its slow pass
@pytest.mark.parametrize("asker", [0, 1])
def test_ranks_that_could_not_agree_on_a_group_raise_or_warn_alike(tmp_path, asker):
    """At step 2 one rank asks for the snapshot to be persisted and rank 1 arrives after rank 0 gave up
    waiting for it (timeout_s): GroupUnavailable on both. Whether it raises (a snapshot due to the
    durable store) or warns was each rank's own view: the asker raised and the other warned, so a loop
    that stops on an error left the other rank training on, waiting for it in its next collective.
    The ranks now decide alike, from what the ranks that arrived asked (rank 0 had asked: both raise;
    only the late rank had: both warn); step 3 saves on both, and is persisted."""
    url = str(tmp_path / "s")
    r0, r1 = W.run_ranks("tiers_late_rank_asks", 2, str(tmp_path), store=url, asker=asker, late=1, deadline_s=120)
    for r in (r0, r1):
        assert "error" not in r, r.get("trace")
        assert r["done"]["1"] == "ok" and r["done"]["3"] == "ok", r["done"]
    kinds = [r["done"]["2"].split(":")[0] for r in (r0, r1)]
    assert kinds == (["GroupUnavailable"] * 2 if asker == 0 else ["TierWarning"] * 2), (r0["done"], r1["done"])
    assert r0["durable"] == r1["durable"] == [3]  # the persist asked for at step 2 is made at the next save
    assert ckpt.Store.open(url).verify().ok


def test_replicas_are_staged_beside_the_tier_and_named_only_at_the_commit(tmp_path):
    """What a rank receives as replicas (ckpt/snapshot/peer_group.py: Staging), without processes: blobs are
    verified as they arrive and written beside their final names; nothing is named before the commit,
    a delta arriving before its base is named once the base is, a damaged blob is dropped, and a
    transfer dropped halfway leaves no chunk and no temporary behind."""
    import torch

    from ckpt.codecs.chunk import parse_header
    from ckpt.snapshot.peer_group import Staging
    from ckpt.store.copy import chunk_checker

    src = ckpt.Store.init(str(tmp_path / "src"))
    g = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(256, 1024, generator=g)}
    src.push(base, "base")
    tuned = {"w": base["w"].clone()}
    tuned["w"][:4] += 0.01
    src.push(tuned, "tuned", base="base")
    blobs = {i.id: src.objects.get("chunks", i.id) for i in src.objects.list("chunks")}
    deltas = [c for c, b in blobs.items() if parse_header(b, c).base is not None]
    assert deltas, "the fine-tune was stored as a delta"
    bases = {parse_header(blobs[c], c).base for c in deltas}
    order = deltas + [c for c in blobs if c not in deltas]  # every delta arrives before its base

    tier = ckpt.Store.init(str(tmp_path / "tier"))
    staging = Staging(tier)
    staging.add({c: memoryview(blobs[c]) for c in order[:2]})
    staging.add({c: memoryview(blobs[c]) for c in order[2:]})
    staging.add({"0" * 64: memoryview(b"not a chunk")})  # damaged: dropped
    assert list(tier.objects.list("chunks")) == []  # nothing named before the commit
    staging.commit()
    assert {i.id for i in tier.objects.list("chunks")} == set(blobs) and bases <= set(blobs)
    check = chunk_checker(tier, tier)
    for c in blobs:
        check(c, tier.objects.get("chunks", c))
    assert list(tier.objects.list_temporaries()) == []

    other = ckpt.Store.init(str(tmp_path / "other"))
    staging = Staging(other)
    staging.add({c: memoryview(blobs[c]) for c in order})
    staging.drop()  # the transfer was cut short
    assert list(other.objects.list("chunks")) == [] and list(other.objects.list_temporaries()) == []


def test_staging_holds_a_delta_whose_base_is_damaged_in_the_tier_and_drops_only_a_damaged_delta(tmp_path):
    """Staging (without processes): the tier holds a delta's base damaged. The intact delta waits (its base's
    damage is not its own: before, the base's CorruptObjectError dropped it) and is named once a verified
    base is in place; a copy of the delta with a byte flipped waits too, and is dropped once its base is
    whole (the error names the delta itself)."""
    import torch

    from ckpt.snapshot.peer_group import Staging

    tier = ckpt.Store.init(str(tmp_path / "tier"))
    g = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(256, 1024, generator=g)}
    tier.push(base, "base")
    tier.push({"w": base["w"] + 1e-3 * torch.randn(256, 1024, generator=g)}, "tuned", base="base")
    blobs = {i.id: tier.objects.get("chunks", i.id) for i in tier.objects.list("chunks")}
    d = next(c for c, b in blobs.items() if parse_header(b, c).base is not None)
    b = parse_header(blobs[d], d).base
    tier.objects.delete("chunks", d)
    path = tier.objects.path("chunks", b)

    bad = bytearray(blobs[d])
    bad[-1] ^= 1
    for blob, kept in ((bytes(bad), False), (blobs[d], True)):
        tier.objects.backend.write(path, blobs[b][:-1] + bytes([blobs[b][-1] ^ 1]))  # the base, damaged in the tier
        staging = Staging(tier)
        staging.add({d: memoryview(blob)})
        assert d in staging.waiting and not staging.rejected  # (its base unusable: nothing known of it yet)
        tier.objects.backend.write(path, blobs[b])  # a verified base written over the damaged one (from a peer)
        staging.commit()
        assert staging.rejected == (set() if kept else {d}) and tier.objects.has("chunks", d) == kept
    assert tier.objects.get("chunks", d) == blobs[d]


def _tier_with_a_damaged_base(tmp_path, durable_holds_it):
    """A rank's tier (compressing, so its snapshots are deltas) naming steps 4 and 6, step 6 a delta
    against W, a chunk of step 4 both name, RUN/latest step 6; W damaged there. The durable store holds
    step 4 (W intact) or nothing. Returns (tier, Tiers as a restore of step 6 leaves them, W, step 6's id)."""
    import torch

    from ckpt.snapshot.local_tier import LocalTier
    from ckpt.snapshot.tiers import Tiers

    settings = ckpt.Settings.from_env(chunk_size=64 << 10)
    tier = LocalTier(tmp_path / "tier", "run", keep=5, settings=settings, compress=True)
    durable = ckpt.Store.init(str(tmp_path / "durable"), settings=settings)
    g = torch.Generator().manual_seed(0)
    w4 = {"w": torch.randn(64 << 10, generator=g)}
    w6 = {"w": w4["w"] + 1e-3 * torch.randn(64 << 10, generator=g)}
    tier.store.push(w4, "run/step-4")
    mid = tier.store.push(w6, "run/step-6", base="run/step-4")
    tier.store.refs_db.set("run/latest", mid, alias=True)
    if durable_holds_it:
        durable.push(w4, "run/step-4")
    d = next(c for c in tier.store.manifest(mid).tensors[0].chunks if parse_header(tier.store.objects.get("chunks", c), c).base)
    w = parse_header(tier.store.objects.get("chunks", d), d).base
    blob = bytearray(tier.store.objects.get("chunks", w))
    blob[-1] ^= 1
    tier.store.objects.backend.write(tier.store.objects.path("chunks", w), bytes(blob))
    tiers = Tiers([("local", tier.store), ("peer", ckpt.Store.init(f"memory://{tmp_path.name}-peer")), ("store", durable)])
    tiers.damaged = {w}  # (the load found it so, and read step 6 elsewhere)
    return tier, tiers, w, mid


def test_a_damaged_base_no_farther_tier_holds_is_removed_with_every_step_naming_it(tmp_path):
    """The refill (ckpt/snapshot/peer_refill.py) cannot replace W: it removes it, and with it every step whose
    snapshot names it (4 and 6) and RUN/latest (step 6): before, only step 6's name went, so step 4 and
    RUN/latest named a snapshot whose chunk was gone."""
    from ckpt.snapshot.peer_refill import refill

    tier, tiers, w, mid = _tier_with_a_damaged_base(tmp_path, durable_holds_it=False)
    kept, why = refill(tier, 6, mid, tiers)
    assert tier.steps() == [] and not tier.store.objects.has("chunks", w)
    assert "run/latest" not in tier.store.refs()
    assert tier.store.verify().ok
    assert not kept and "could not be replaced" in why and "[4, 6]" in why


def test_a_bug_inside_the_refill_is_logged_with_its_traceback_and_the_damaged_copies_are_still_replaced(
        tmp_path, monkeypatch, unexpected_errors):
    """The refill runs beside training and must never fail it, so it catches every error: a TypeError (a bug, as a
    break between two branches was last session) became the one line 'TypeError: ...' of a TierWarning, its traceback
    lost. Now an error of a type no failure of a tier raises is logged at WARNING with its traceback (the tests fail on
    such a record: tests/conftest.py), and the refill still writes the durable store's W over the damaged one."""
    import ckpt.snapshot.peer_refill as peer_refill
    from ckpt.store.copy import chunk_checker

    tier, tiers, w, mid = _tier_with_a_damaged_base(tmp_path, durable_holds_it=True)

    def broken(local, decoded):
        return len(decoded) + None  # (a bug: TypeError)

    monkeypatch.setattr(peer_refill, "keep_decoded", broken)
    kept, why = peer_refill.refill(tier, 6, mid, tiers)
    assert not kept and why.startswith("TypeError: unsupported operand"), why
    [record] = unexpected_errors.records
    assert record.levelname == "WARNING" and record.exc_info[0] is TypeError
    assert "in broken" in unexpected_errors.format(record)  # the traceback, to the line that failed
    unexpected_errors.records.clear()  # (caused on purpose)
    chunk_checker(tier.store, tier.store)(w, tier.store.objects.get("chunks", w))  # replaced, verified
    assert tier.store.verify().ok


def test_a_damaged_base_is_deleted_though_the_tiers_collection_fails(tmp_path, monkeypatch):
    """LocalTier.forget removed the steps naming W, then its gc raised (a damaged ref entry it refuses, the medium
    failing): the loop deleting W never ran, and W stayed in chunks/, where a save, which dedups on presence, would
    name it again (a new step of the same tensor then failed to load: corrupt). W goes whatever the gc did, and the
    refill says what failed."""
    from ckpt.snapshot.peer_refill import refill

    tier, tiers, w, mid = _tier_with_a_damaged_base(tmp_path, durable_holds_it=False)

    def failing() -> None:
        raise OSError("the medium failing")

    monkeypatch.setattr(tier, "_collect", failing)
    kept, why = refill(tier, 6, mid, tiers)
    assert not kept and "could not be replaced nor removed" in why and "the medium failing" in why, why
    assert not tier.store.objects.has("chunks", w) and tier.steps() == []


def test_an_intact_delta_over_a_damaged_base_is_not_taken_for_damaged(tmp_path):
    """A read of step 6's delta D from the tier fails, its base W damaged: the tier records both as damaged (whether
    D is whole is known once W is), the refill wrote W over from the durable store, found no farther copy of D and
    removed it with step 6, though it was whole. Each is checked again before it goes: W replaced, D and both
    steps kept."""
    import numpy as np

    from ckpt.progress import NullProgress
    from ckpt.snapshot.peer_refill import refill
    from ckpt.store.copy import chunk_checker
    from ckpt.transfer.pipeline import GetTask

    tier, tiers, w, mid = _tier_with_a_damaged_base(tmp_path, durable_holds_it=True)
    tiers.damaged = set()
    d = next(c for c in tier.store.manifest(mid).tensors[0].chunks if parse_header(tier.store.objects.get("chunks", c), c).base)
    n = parse_header(tier.store.objects.get("chunks", d), d).length
    tiers.lenient = True  # (step 6 is in no farther tier: D stays unserved, as in a restore that fell back)
    tiers.get([GetTask(d, n, into=memoryview(np.empty(n, np.uint8)))], NullProgress())
    assert tiers.damaged == {d, w}
    kept, why = refill(tier, 6, mid, tiers)
    chunk_checker(tier.store, tier.store)(w, tier.store.objects.get("chunks", w))
    assert tier.steps() == [4, 6] and tier.store.objects.has("chunks", d), why


@pytest.mark.parametrize("stop", ["changed", "write"])
def test_a_refill_stopped_early_still_replaces_the_damaged_copies(tmp_path, stop):
    """The refill stops early where training changed a tensor before it read it (ckpt/snapshot/peer_targets.py
    keep_decoded), or where a write to the tier fails (a folder where a chunk fetched from a peer goes). The
    damaged W it must still write over, verified, from the durable store: before, that early return or the
    exception left it damaged in the tier, named by steps 4 and 6 (a later save would reuse it)."""
    import torch

    from ckpt.snapshot.peer_refill import refill
    from ckpt.store.copy import chunk_checker

    tier, tiers, w, mid = _tier_with_a_damaged_base(tmp_path, durable_holds_it=True)
    other = torch.randn(16 << 10, generator=torch.Generator().manual_seed(1))  # a target the restore decoded into
    cid = tiers.stores[2][1].push({"u": other}, "u")
    cid = tiers.stores[2][1].manifest(cid).tensors[0].chunks[0]
    if stop == "changed":
        other[5] += 1  # an optimizer step, before the refill read it
        tiers.decoded = {cid: memoryview(other.numpy()).cast("B")}
    else:  # fetched from a peer (in memory), its place in the tier taken
        tiers.stores[1][1].objects.put("chunks", cid, tiers.stores[2][1].objects.get("chunks", cid))
        (tmp_path / "tier" / tier.store.objects.path("chunks", cid)).mkdir(parents=True)
    kept, why = refill(tier, 6, mid, tiers)
    assert not kept and (why is None if stop == "changed" else "Is a directory" in why), why
    chunk_checker(tier.store, tier.store)(w, tier.store.objects.get("chunks", w))  # whole again
    assert tier.steps() == [4, 6] and tier.store.resolve("run/latest") == mid
    assert tier.store.verify().ok


def test_a_groups_failed_restore_removes_the_damaged_copies_it_found_before_the_run_saves_again(tmp_path):
    """A group's run (one rank: two would hold each other's replicas) in local tiers alone, the frozen weight's chunk
    damaged in its tier: no snapshot can be
    assembled and restore_latest fails. Before, a failed group restore (a SnapshotError, not a tier miss) mended
    nothing: the run begun again saved step 1 reusing the damaged copy, found by hash, and its only snapshot could not
    be read from the tier. Now each rank removes the copies no farther tier holds whole, with the steps naming them."""
    for r in W.run_ranks("tiers_damaged_frozen", 1, str(tmp_path), store=str(tmp_path / "s"), mode="local_only"):
        assert "error" not in r, r
        assert r["restored"] == "SnapshotError" and r["after"] == [] and r["steps"] == [1] and r["verify"], r
        assert any("damaged copies found by a failed restore" in w for w in r["warnings"]), r["warnings"]


def test_a_groups_save_after_a_refill_removed_the_step_restored_is_no_delta_against_it(tmp_path):
    """Deltas against the previous snapshot, compressed tiers. The restore of step 3 read the frozen weight's chunk from
    the durable store; writing the verified copy over the damaged one fails (ENOSPC), so the refill removes it with the
    steps naming it, step 3 too. Before, the group's next saves were deltas against step 3, which the tiers no longer
    held: every later tier save failed (RefNotFoundError) for the rest of the run. Now they are saved to the tier."""
    for r in W.run_ranks("tiers_damaged_frozen", 1, str(tmp_path), store=str(tmp_path / "s"), mode="no_room"):
        assert "error" not in r, r
        assert r["restored"] == 3 and r["after"] == [], r
        assert r["saved"] == ["local", "local"] and r["steps"][-2:] == [4, 5] and r["verify"], r


def test_a_rank_whose_refill_removed_the_delta_base_writes_its_chunks_whole(tmp_path):
    """Rank 1's refill removed step 3 from its tier (a damaged copy it could not write over), rank 0's tier kept it, and
    the coordinator names step 3 as the next saves' delta base. Rank 1 cannot read that base: it writes its chunks whole
    (before its save failed: 'refused', each later tier save too), and the run's state restores bit for bit."""
    out = W.run_ranks("tiers_rank_lost_base", 2, str(tmp_path), store=str(tmp_path / "s"))
    assert all("error" not in r for r in out), out
    r0, r1 = out
    assert r0["restored"] == r1["restored"] == 3 and 3 in r0["after"] and 3 not in r1["after"], out
    assert r0["saved"] == r1["saved"] == ["local", "local"], out
    assert r0["latest"] == r1["latest"] == 5 and r0["same"] and r1["same"], out
