"""Commands that look at a store: ls, log, show, du, verify (and repair), and the web view (serve)."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer

from ckpt_store.cli import results, views
from ckpt_store.cli.app import JsonOpt, StoreOpt, emit, only_with, open_store
from ckpt_store.cli.render import RichProgress, err, out, safe


def ls(as_json: JsonOpt = False) -> None:
    """List refs: name, checkpoint id, size, when, message.

    A ref whose entry or checkpoint is damaged is named on stderr (in --json: a row with
    "error") and the others are listed; the exit code is then 1 (`ckpt verify` says more).

    \b
    Examples:
      ckpt ls
      ckpt --store s3://team/store ls --json
    """
    rows = results.ls_rows(open_store().ls())
    damaged = {r["ref"]: r["error"] for r in rows if "error" in r}
    emit(rows, as_json, views.ls)
    _exit_if_damaged(damaged, quiet=as_json)


def _exit_if_damaged(damaged: dict[str, str], quiet: bool = False) -> None:
    """After a listing that went on past damaged refs: name them on stderr and exit 1."""
    if not damaged:
        return
    if not quiet:
        for name, why in damaged.items():
            err.print(f"DAMAGED {safe(name)}: {safe(why)}")
    raise typer.Exit(1)


def log(name: Annotated[str, typer.Argument(metavar="NAME", help="Ref name.")], as_json: JsonOpt = False) -> None:
    """History of a ref, newest first: NAME@0 is the current version (of a removed ref: its last one), NAME@1 the one before...

    A damaged entry or checkpoint is named on stderr (in --json: a row with "error") and
    the rest is listed; the exit code is then 1. Versions older than a damaged entry show
    NAME@? (whether it was a removal is unknown): name them by id.

    \b
    Examples:
      ckpt log m/ft-legal
      ckpt pull m/ft-legal@1 ./previous    # any version it lists
    """
    store = open_store()
    entries, damaged = store.readable_log(name)
    rows = results.log_rows(entries, store.manifest, damaged)
    bad = {(f"{name}@{r['version']}" if r["version"] is not None else f"{name} entry #{r['seq']}"): r["error"]
           for r in rows if "error" in r}
    emit(rows, as_json, views.log, name)
    _exit_if_damaged(bad, quiet=as_json)


def show(ref: Annotated[str, typer.Argument(metavar="REF", help="Ref, NAME@N or id prefix.")], as_json: JsonOpt = False) -> None:
    """A checkpoint's files and tensors: dtype, shape, logical and stored bytes.

    Stored bytes count this checkpoint's own chunks (delta bases included), sized one by
    one: showing a checkpoint never lists the whole store. Chunks missing from the store
    are counted ("missing_chunks" in --json) and named on stderr; the exit code is then 1.

    \b
    Examples:
      ckpt show m/ft-legal
      ckpt show m/ft-legal@2 --json
    """
    store = open_store()
    mid = store.resolve(ref)
    m = store.manifest(mid)
    doc = results.show_doc(mid, m, store.stored_sizes(m.chunk_lengths()))
    emit(doc, as_json, views.show)
    if doc["missing_chunks"]:  # damage, as in ls, du and log: shown, and exit code 1
        _exit_if_damaged({ref: f"{doc['missing_chunks']} of its chunks are not in the store (`ckpt verify` says more)"},
                         quiet=as_json)


def du(as_json: JsonOpt = False) -> None:
    """Logical vs stored bytes per ref and for the whole store; what dedup and compression saved.

    STORED counts every chunk a ref uses (shared ones included); ONLY THIS REF counts
    the chunks no other ref uses, i.e. what `ckpt rm` + `ckpt gc` would free. A ref whose
    entry or checkpoint is damaged is left out, named on stderr (in --json: "damaged"),
    and the exit code is 1.

    \b
    Examples:
      ckpt du
      ckpt du --json
    """
    u = open_store().du()
    emit(results.du_doc(u), as_json, views.du)
    _exit_if_damaged(u.damaged, quiet=as_json)


def verify(
    refs: Annotated[Optional[list[str]], typer.Argument(metavar="[REF]...", help="Refs to check (default: all).")] = None,
    repair_from: Annotated[Optional[str], typer.Option("--repair-from", metavar="URL",
                           help="Put back damaged or missing chunks and manifests from the store at URL "
                                "(each verified there first), then verify again.")] = None,
    repair_option: Annotated[Optional[list[str]], typer.Option(
        "--repair-option", metavar="KEY=VALUE", show_default=False,
        help="A storage option for the --repair-from store only (repeatable), over --storage-option: "
             "a mirror on another S3 server, endpoint_url=..., profile=NAME.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Re-read and re-hash every object the refs need; name each damaged ref. Exit 1 if any.

    By default everything `ckpt gc` keeps: every ref and its earlier versions (NAME@1...),
    each damaged one named as commands accept it. Earlier versions freed by
    `ckpt gc --no-history` are listed in a note, not counted as damage.

    Nothing is repaired unless you ask: with --repair-from, objects are copied from
    another store that holds them (a mirror, a backup, the S3 store a team pushes to).

    \b
    Examples:
      ckpt verify                                # every ref and its history
      ckpt verify m/base m/ft-legal --json
      ckpt verify --repair-from s3://team/store   # put damaged objects back
      ckpt --store s3://team/store verify --repair-from s3://backup/store --repair-option endpoint_url=http://minio:9000
    """
    only_with(repair_from, repair_option, "--repair-from", "--repair-option")
    store = open_store()
    if repair_from is not None:
        # --storage-option, then --repair-option over it
        rr = store.repair(open_store(url=repair_from, own=repair_option, flag="--repair-option"), refs or None,
                          progress=RichProgress())
        r = rr.after
    else:
        r = store.verify(refs or None, progress=RichProgress())
    doc: dict[str, Any] = {"ok": r.ok, "refs_checked": r.refs_checked, "versions_checked": r.versions_checked,
                           "chunks_checked": r.chunks_checked, "bytes_checked": r.bytes_checked, "problems": r.problems,
                           "damaged_refs": r.damaged_refs, "freed": r.freed}
    if repair_from is not None:
        doc["repair_from"] = repair_from
        doc["repaired"] = [{"kind": k, "id": i} for k, i in rr.repaired]
        doc["unavailable"] = [{"kind": k, "id": i, "error": w} for k, i, w in rr.unavailable]
    emit(doc, as_json, views.verify)
    if not r.ok:
        raise typer.Exit(1)


def serve(
    store: StoreOpt = None,
    port: Annotated[int, typer.Option("--port", "-p", help="TCP port.")] = 8765,
    host: Annotated[str, typer.Option("--host", help="Address to listen on; anything but loopback needs --token.")] = "127.0.0.1",
    token: Annotated[Optional[str], typer.Option("--token", metavar="TOKEN", envvar="CKPT_SERVE_TOKEN",
                                                 help="Secret every request must carry (the printed address has it); $CKPT_SERVE_TOKEN.")] = None,
    local_tier: Annotated[Optional[str], typer.Option("--local-tier", metavar="URL", help="A training run's local tier (a store), shown on run pages beside this one.")] = None,
) -> None:
    """A read-only web view of the store: lineage graph, versions, sizes, diffs, training runs.

    Pages and JSON (/api/refs, /api/lineage, /api/checkpoint/REF, /api/diff?a=REF&b=REF,
    /api/du, /api/run/RUN) carry what --json does. Needs the web extra: pip install 'ckpt-store[web]'.

    \b
    Examples:
      ckpt serve                                  # http://127.0.0.1:8765/
      ckpt serve --local-tier /dev/shm/ckpt-local-1000/abc123
    """
    from ckpt_store.cli.web.server import serve as run_server

    run_server(open_store(url=store), host=host, port=port, token=token, announce=lambda line: out.print(line, markup=False),
               local=open_store(url=local_tier) if local_tier is not None else None)
