"""``ckpt``: push, pull and inspect checkpoints in a content-addressed store."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ckpt_store.cli.render import (
    RichProgress,
    emit_json,
    err,
    human_bytes,
    out,
    ratio,
    when,
)

app = typer.Typer(
    name="ckpt",
    help=(
        "Store PyTorch checkpoints once: chunked, deduplicated, compressed, verified.\n\n"
        "The store is --store URL, else $CKPT_STORE, else ~/.local/share/ckpt/store "
        "($XDG_DATA_HOME/ckpt/store). A URL is a local path, file://..., s3://BUCKET/PREFIX "
        "(credentials and endpoint from the AWS environment variables and config files, or "
        "--storage-option), memory://... or any fsspec URL.\n\n"
        "A REF is a name (minilm/legal), NAME@N (N versions back, see `ckpt log`), or a "
        "checkpoint id prefix (at least 4 hex digits).\n\n"
        "Quick start:  ckpt push model.safetensors minilm/base  |  ckpt ls  |  ckpt du  |  "
        "ckpt pull minilm/base out.safetensors"
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

_state: dict[str, Any] = {"store": None, "options": None}

StoreOpt = Annotated[
    Optional[str],
    typer.Option("--store", "-s", metavar="URL", help="Store URL (default: $CKPT_STORE, else ~/.local/share/ckpt/store).", show_default=False),
]
OptionsOpt = Annotated[
    Optional[list[str]],
    typer.Option("--storage-option", "-o", metavar="KEY=VALUE", show_default=False,
                 help="fsspec/s3fs option for remote stores (repeatable), e.g. endpoint_url=http://host:9000, "
                      "profile=NAME, anon=true, config_kwargs.connect_timeout=5. Credentials are better left to the "
                      "AWS environment variables or config files, which are used by default."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout.")]


def parse_storage_options(pairs: list[str] | None) -> dict[str, Any] | None:
    """``["a=1", "b.c=x"]`` -> ``{"a": 1, "b": {"c": "x"}}``: values are JSON when they parse, else strings."""
    import json

    if not pairs:
        return None
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            # Never echo the pair itself: it may hold a credential.
            raise typer.BadParameter("expected KEY=VALUE", param_hint="--storage-option")
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise typer.BadParameter(f"{key}: {part} is both a value and a group", param_hint="--storage-option")
        node[leaf] = value
    return out


@app.callback()
def _main(store: StoreOpt = None, storage_option: OptionsOpt = None) -> None:
    _state["store"] = store
    _state["options"] = parse_storage_options(storage_option)


def _open(create: bool = False, url: str | None = None) -> Any:
    from ckpt.store.store import Store

    return Store.open(url or _state["store"], storage_options=_state["options"], create=create)


@app.command()
def init() -> None:
    """Create an empty store (a no-op if one exists)."""
    from ckpt.store.store import Store

    store = Store.init(_state["store"])
    out.print(f"store ready at {store.url}")


@app.command()
def push(
    source: Annotated[Path, typer.Argument(metavar="SOURCE", help="A .safetensors file, a Hugging Face model directory, or a .pt/.bin state dict; with --to, a REF in this store.")],
    name: Annotated[Optional[str], typer.Argument(metavar="NAME", help="Ref name to point at the new checkpoint, e.g. minilm/legal (with --to: the name there, default the same).", show_default=False)] = None,
    message: Annotated[Optional[str], typer.Option("--message", "-m", metavar="MSG", help="Note stored with the checkpoint.")] = None,
    base: Annotated[Optional[str], typer.Option("--base", "-b", metavar="REF", help="Delta-encode against this checkpoint (default: NAME's previous version, else the stored checkpoint sharing the most tensors).")] = None,
    no_delta: Annotated[bool, typer.Option("--no-delta", help="Store new chunks whole, without a base.")] = False,
    to: Annotated[Optional[str], typer.Option("--to", metavar="URL", help="Push REF from this store to the store at URL instead (same as `ckpt copy REF --to URL`).", show_default=False)] = None,
    as_json: JsonOpt = False,
) -> None:
    """Store a checkpoint and point NAME at it. Only chunks the store lacks are written.

    .pt/.bin files are read with torch.load(weights_only=True): a file that needs
    arbitrary unpickling is refused, never executed. Creates the store if needed.

    With --to URL, SOURCE is a ref in this store, copied with everything it needs to the
    store at URL (only what is missing there travels).
    """
    if to is not None:
        if message or base or no_delta:
            raise typer.BadParameter("--message, --base and --no-delta do not apply to --to (a copy keeps the checkpoint as it is)")
        spec = str(source) if name is None else f"{source}:{name}"
        _copy([spec], None, to, as_json)
        return
    if name is None:
        raise typer.BadParameter("NAME is required (the ref to point at the new checkpoint)", param_hint="NAME")
    store = _open(create=True)
    r = store.push_report(str(source), name, message, base=base, delta=not no_delta, progress=RichProgress())
    if as_json:
        emit_json({"id": r.id, "ref": name, "chunks": r.chunks, "new_chunks": r.new_chunks,
                   "logical_bytes": r.logical_bytes, "written_bytes": r.written_bytes})
        return
    out.print(
        f"{name} -> {r.id[:12]}  {human_bytes(r.logical_bytes)} in {r.chunks} chunks; "
        f"{r.new_chunks} new, {human_bytes(r.written_bytes)} written"
    )


@app.command()
def pull(
    ref: Annotated[str, typer.Argument(metavar="REF", help="Ref, NAME@N or id prefix.")],
    dest: Annotated[Optional[Path], typer.Argument(metavar="DEST", help="Output file (single-file checkpoints) or directory (model directories). Optional with --from.", show_default=False)] = None,
    force: Annotated[bool, typer.Option("--force", "-f", help="Replace the checkpoint's own files in DEST if they exist; nothing else in DEST is touched.")] = False,
    include: Annotated[Optional[list[str]], typer.Option("--include", "-i", metavar="GLOB", help="Only tensors matching this glob (repeatable); writes one safetensors (or, named .pt, torch) file.")] = None,
    from_: Annotated[Optional[str], typer.Option("--from", metavar="URL", help="First copy REF from the store at URL into this store (only what is missing here travels).", show_default=False)] = None,
) -> None:
    """Write a checkpoint back out, bit-identical to what was pushed, verifying every chunk.

    Each file appears only when complete (written under a temporary name, then renamed).
    A model directory goes to a new or empty DEST; into a DEST holding other files only
    with --force, which replaces the checkpoint's own files and leaves the rest. A pull
    never writes inside a store or into a directory holding the store, and replaces a
    symbolic link at a file's name rather than writing through it.

    DEST named .pt/.pth/.bin/.ckpt gets a torch file (torch.load(weights_only=True)):
    a flat dict of the tensors, bit-identical, plus the non-tensor values of a
    checkpoint pushed from a .pt file, under their flat (dotted) keys.

    With --from URL, REF is first copied from the store at URL into this store (like
    `ckpt copy REF --from URL`); DEST, if given, is then written from this store.
    """
    if from_ is not None:
        _copy([ref], from_, None, False, quiet=dest is not None)
        if dest is None:
            return
    elif dest is None:
        raise typer.BadParameter("DEST is required (or --from URL to copy REF into this store)", param_hint="DEST")
    store = _open()
    path = store.pull(ref, str(dest), overwrite=force, include=include or None, progress=RichProgress())
    out.print(f"wrote {path}")


@app.command("ls")
def ls(as_json: JsonOpt = False) -> None:
    """List refs: name, checkpoint id, size, when, message."""
    store = _open()
    rows = [{"ref": r.name, "id": r.id, "time": r.time, "bytes": r.bytes, "tensors": r.tensors, "message": r.message,
             "source": r.source} for r in store.ls()]
    if as_json:
        emit_json(rows)
        return
    if not rows:
        out.print("no refs yet: `ckpt push FILE NAME` stores a checkpoint")
        return
    from rich.table import Table

    t = Table(box=None, pad_edge=False)
    for c in ("REF", "ID", "SIZE", "TENSORS", "UPDATED", "MESSAGE"):
        t.add_column(c, justify="right" if c in ("SIZE", "TENSORS") else "left")
    for r in rows:
        t.add_row(r["ref"], r["id"][:12], human_bytes(r["bytes"]), str(r["tensors"]), when(r["time"]), r["message"] or "")
    out.print(t)


@app.command()
def log(name: Annotated[str, typer.Argument(metavar="NAME", help="Ref name.")], as_json: JsonOpt = False) -> None:
    """History of a ref, newest first (NAME@0 is the current version, NAME@1 the one before...)."""
    store = _open()
    entries = store.log(name)
    rows = []
    version = 0
    for e in entries:
        msg = None
        if e.target is not None:
            try:
                msg = store.get_manifest(e.target).message
            except Exception:  # noqa: BLE001 - a collected manifest still has a history line
                msg = "(checkpoint no longer in the store)"
        rows.append({"seq": e.seq, "version": None if e.target is None else version, "id": e.target,
                     "time": e.time, "message": msg, "removed": e.target is None})
        if e.target is not None:
            version += 1
    if as_json:
        emit_json(rows)
        return
    for r in rows:
        label = "removed" if r["removed"] else f"{name}@{r['version']}  {r['id'][:12]}"
        out.print(f"#{r['seq']:<4} {when(r['time'])}  {label}  {r['message'] or ''}".rstrip())


@app.command()
def show(ref: Annotated[str, typer.Argument(metavar="REF", help="Ref, NAME@N or id prefix.")], as_json: JsonOpt = False) -> None:
    """A checkpoint's files and tensors: dtype, shape, logical and stored bytes."""
    from ckpt.codecs.chunk import CODEC_NAMES

    store = _open()
    mid = store.resolve(ref)
    m = store.get_manifest(mid)
    sizes = {o.id: o.size for o in store.objects.list("chunks")}
    tensors = [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes, "file": t.file,
                "stored_bytes": sum(sizes.get(c, 0) for c in t.chunks), "chunks": len(t.chunks),
                "codecs": sorted({CODEC_NAMES.get(c, str(c)) for c in t.codecs}),
                "delta_depth": max((len(c) for c in t.delta_bases), default=0)} for t in m.tensors]
    files = [{"path": f.path, "kind": f.kind, "bytes": f.size, "metadata": f.metadata} for f in m.files]
    info = {"id": mid, "source": m.source, "created": m.created, "message": m.message, "metadata": m.metadata,
            "lineage": m.lineage, "extra": m.extra, "chunk_size": m.chunk_size, "files": files, "tensors": tensors,
            "bytes": m.logical_bytes}
    if as_json:
        emit_json(info)
        return
    from rich.table import Table

    out.print(f"checkpoint {mid}\nsource     {m.source}, {len(files)} file(s), {len(tensors)} tensors, {human_bytes(m.logical_bytes)}")
    out.print(f"created    {when(m.created)}")
    if m.message:
        out.print(f"message    {m.message}")
    for k, v in m.metadata.items():
        out.print(f"meta       {k} = {v}")
    lineage = {k: v for k, v in m.lineage.items() if v and k != "merge"}
    if lineage:
        out.print(f"lineage    {lineage}")
    if isinstance(m.lineage.get("merge"), dict):
        _print_merge(m.lineage["merge"])
    t = Table(box=None, pad_edge=False)
    if m.lineage.get("base"):
        out.print(f"delta base {m.lineage['base'][:12]} (delta-coded tensors show their chain depth)")
    for c in ("TENSOR", "DTYPE", "SHAPE", "BYTES", "STORED", "CODEC"):
        t.add_column(c, justify="right" if c in ("BYTES", "STORED") else "left")
    for r in tensors:
        codec = "+".join(r["codecs"]) + (f" (depth {r['delta_depth']})" if r["delta_depth"] else "")
        t.add_row(r["name"], r["dtype"], "x".join(map(str, r["shape"])) or "scalar", human_bytes(r["bytes"]),
                  human_bytes(r["stored_bytes"]), codec)
    out.print(t)
    others = [f for f in files if f["kind"] == "blob"]
    if others:
        out.print("other files: " + ", ".join(f"{f['path']} ({human_bytes(f['bytes'])})" for f in others))


@app.command()
def du(as_json: JsonOpt = False) -> None:
    """Logical vs stored bytes per ref and for the whole store; what dedup and compression saved.

    STORED counts every chunk a ref uses (shared ones included); ONLY THIS REF counts
    the chunks no other ref uses, i.e. what `ckpt rm` + `ckpt gc` would free.
    """
    store = _open()
    u = store.du()
    if as_json:
        emit_json({
            "refs": [{"ref": r.name, "id": r.id, "logical_bytes": r.logical, "unique_bytes": r.unique,
                      "stored_bytes": r.stored, "exclusive_bytes": r.exclusive} for r in u.refs],
            "logical_bytes": u.logical, "unique_bytes": u.unique, "stored_bytes": u.stored,
            "dedup_saved_bytes": u.dedup_saved, "compression_saved_bytes": u.compression_saved, "chunks": u.objects,
            "codecs": {k: {"decoded_bytes": d, "stored_bytes": st} for k, (d, st) in u.by_codec.items()},
        })
        return
    from rich.table import Table

    t = Table(box=None, pad_edge=False)
    for c in ("REF", "LOGICAL", "STORED", "ONLY THIS REF"):
        t.add_column(c, justify="left" if c == "REF" else "right")
    for r in u.refs:
        t.add_row(r.name, human_bytes(r.logical), human_bytes(r.stored), human_bytes(r.exclusive))
    out.print(t)
    out.print(
        f"\ntotal: {human_bytes(u.logical)} in {len(u.refs)} refs stored as {human_bytes(u.stored)} "
        f"({ratio(u.stored, u.logical)} of logical)\n"
        f"  dedup saved        {human_bytes(u.dedup_saved)} ({ratio(u.dedup_saved, u.logical)})\n"
        f"  compression saved  {human_bytes(u.compression_saved)} ({ratio(u.compression_saved, u.logical)})"
    )
    for codec, (decoded, stored) in u.by_codec.items():
        out.print(f"    {codec:<10} {human_bytes(decoded):>10} stored as {human_bytes(stored):>10} "
                  f"(saved {human_bytes(decoded - stored)}, {ratio(stored, decoded)} of its input)")


@app.command()
def verify(
    refs: Annotated[Optional[list[str]], typer.Argument(metavar="[REF]...", help="Refs to check (default: all).")] = None,
    repair_from: Annotated[Optional[str], typer.Option("--repair-from", metavar="URL",
                           help="Put back damaged or missing chunks and manifests from the store at URL "
                                "(each verified there first), then verify again.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Re-read and re-hash every object the refs need; name each damaged ref. Exit 1 if any.

    Nothing is repaired unless you ask: with --repair-from, objects are copied from
    another store that holds them (a mirror, a backup, the S3 store a team pushes to).
    """
    store = _open()
    repaired: list[tuple[str, str]] = []
    unavailable: list[tuple[str, str, str]] = []
    if repair_from is not None:
        rr = store.repair(repair_from, refs or None, progress=RichProgress())
        r, repaired, unavailable = rr.after, rr.repaired, rr.unavailable
        if not as_json:
            for kind, oid in repaired:
                out.print(f"repaired {kind} {oid} from {repair_from}")
            for kind, oid, why in unavailable:
                err.print(f"cannot repair {kind} {oid}: {why}")
    else:
        r = store.verify(refs or None, progress=RichProgress())
    if as_json:
        doc = {"ok": r.ok, "refs_checked": r.refs_checked, "chunks_checked": r.chunks_checked,
               "bytes_checked": r.bytes_checked, "problems": r.problems, "damaged_refs": r.damaged_refs}
        if repair_from is not None:
            doc["repaired"] = [{"kind": k, "id": i} for k, i in repaired]
            doc["unavailable"] = [{"kind": k, "id": i, "error": w} for k, i, w in unavailable]
        emit_json(doc)
    else:
        for name, problems in r.damaged_refs.items():
            err.print(f"DAMAGED {name}: {problems[0]}" + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""))
        for p in r.problems:
            if p.startswith("store config"):
                err.print(f"DAMAGED {p}")
        status = "ok" if r.ok else f"{len(r.problems)} problem(s)"
        out.print(f"verified {r.refs_checked} refs, {r.chunks_checked} chunks, {human_bytes(r.bytes_checked)}: {status}")
    if not r.ok:
        raise typer.Exit(1)


@app.command()
def rm(names: Annotated[list[str], typer.Argument(metavar="NAME...", help="Refs to remove.")]) -> None:
    """Remove refs. History stays in `ckpt log`; data is freed by `ckpt gc`."""
    store = _open()
    for name in names:
        store.remove(name)
        out.print(f"removed {name}")


@app.command()
def copy(
    refs: Annotated[list[str], typer.Argument(metavar="REF...", help="Refs to copy; REF:NAME sets NAME at the destination; NAME@N or an id prefix copies the checkpoint only.")],
    from_: Annotated[Optional[str], typer.Option("--from", metavar="URL", help="Source store (default: --store).", show_default=False)] = None,
    to: Annotated[Optional[str], typer.Option("--to", metavar="URL", help="Destination store, created if needed (default: --store).", show_default=False)] = None,
    as_json: JsonOpt = False,
) -> None:
    """Copy checkpoints between stores (local <-> S3, S3 <-> S3, local <-> local).

    Only objects the destination lacks travel -- a fine-tune whose base is already there
    costs about its delta -- in the order chunks, manifests, refs, each verified before it
    is written. An interrupted copy, run again, sends only what is left. --storage-option
    applies to both stores.
    """
    if from_ is None and to is None:
        raise typer.BadParameter("give --from URL, --to URL or both (the other defaults to --store)")
    _copy(refs, from_, to, as_json)


def _copy(refs: list[str], from_: str | None, to: str | None, as_json: bool, quiet: bool = False) -> None:
    src = _open(url=from_)
    dst = _open(create=True, url=to)
    if src.url == dst.url:
        raise typer.BadParameter("source and destination are the same store")
    r = src.copy_to(dst, refs, progress=RichProgress())
    if as_json:
        emit_json({"from": src.url, "to": dst.url, "refs": r.refs, "chunks_sent": r.chunks_sent,
                   "manifests_sent": r.manifests_sent, "refs_set": r.refs_set, "objects_sent": r.objects_sent,
                   "bytes_sent": r.bytes_sent, "chunks_present": r.chunks_present,
                   "manifests_present": r.manifests_present})
        return
    if quiet:
        return
    names = ", ".join(r.refs) or "no refs"
    out.print(f"copied {names} to {dst.url}: sent {r.chunks_sent} chunks, {r.manifests_sent} manifests, "
              f"{r.refs_set} ref updates ({human_bytes(r.bytes_sent)}); {r.chunks_present} chunks were already there")


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")


def _seconds(text: str) -> float:
    m = _DURATION.match(text.strip())
    if not m:
        raise typer.BadParameter(f"{text!r} is not a duration like 30s, 10m, 1h or 2d")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


@app.command()
def gc(
    dry_run: Annotated[bool, typer.Option("--dry-run", "-n", help="Print the plan; delete nothing.")] = False,
    grace: Annotated[str, typer.Option("--grace", metavar="DURATION", help="Keep unreferenced objects younger than this (protects pushes in progress).")] = "1h",
    no_history: Annotated[bool, typer.Option("--no-history", help="Also free earlier versions of live refs (NAME@1...).")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Delete objects no ref needs: plan first, then delete (or just print with --dry-run)."""
    store = _open()
    r = store.gc(grace_s=_seconds(grace), dry_run=dry_run, keep_history=not no_history)
    if as_json:
        emit_json({"dry_run": r.dry_run, "deleted": len(r.deleted), "bytes": r.bytes, "young_kept": r.young,
                   "live_manifests": r.live_manifests, "live_chunks": r.live_chunks,
                   "objects": [{"kind": d.kind, "name": d.name, "bytes": d.size} for d in r.deleted]})
        return
    verb = "would delete" if dry_run else "deleted"
    out.print(f"{verb} {len(r.deleted)} objects ({human_bytes(r.bytes)}); kept {r.live_manifests} live checkpoints, "
              f"{r.live_chunks} live chunks, {r.young} recent unreferenced objects (grace {grace})")


def _print_merge(rec: dict[str, Any]) -> None:
    """The merge record of a manifest's lineage: method, parameters, inputs and base."""
    params = ", ".join(f"{k}={v}" for k, v in sorted((rec.get("params") or {}).items()))
    out.print(f"merged     {rec.get('method')} ({params})", markup=False)
    refs = rec.get("input_refs") or [None] * len(rec.get("inputs") or [])
    for cid, ref in zip(rec.get("inputs") or [], refs):
        out.print(f"  input    {str(cid)[:12]}" + (f"  ({ref})" if ref else ""), markup=False)
    if rec.get("base"):
        out.print(f"  base     {rec['base'][:12]}" + (f"  ({rec['base_ref']})" if rec.get("base_ref") else ""), markup=False)
    remix = rec.get("remix")
    if isinstance(remix, dict):
        scores = ", ".join(f"{r}={s:.4g}" for r, s in (remix.get("scores") or {}).items())
        out.print(f"  remix    best {remix.get('k')} by score ({'higher' if remix.get('higher_is_better') else 'lower'} is better): {scores}", markup=False)


def _fmt_num(x: float | None, spec: str = ".3e") -> str:
    return "-" if x is None else format(x, spec)


@app.command()
def diff(
    a: Annotated[str, typer.Argument(metavar="A", help="Ref, NAME@N, id prefix, or a local file/directory (an existing path wins).")],
    b: Annotated[str, typer.Argument(metavar="B", help="What to compare against A (same forms).")],
    include: Annotated[Optional[list[str]], typer.Option("--include", "-i", metavar="GLOB", help="Only tensors matching this glob (repeatable).")] = None,
    exclude: Annotated[Optional[list[str]], typer.Option("--exclude", "-x", metavar="GLOB", help="Leave out tensors matching this glob (repeatable).")] = None,
    sort: Annotated[str, typer.Option("--sort", metavar="KEY", help="order, name, status, relative_change, max_abs_diff, changed_elements, cosine or delta_bytes (largest change first).")] = "order",
    top: Annotated[Optional[int], typer.Option("--top", metavar="N", help="Show only the first N tensors after sorting (the summary still counts all).")] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", metavar="FILE.png", help="Draw relative change per layer, grouped by module type (needs matplotlib: pip install 'ckpt[plot]').")] = None,
    no_estimate: Annotated[bool, typer.Option("--no-estimate", help="Skip estimating the stored size of B as a delta against A.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """What changed from A to B, tensor by tensor: status, elements changed, relative change ‖B−A‖/‖A‖, max |B−A|, cosine.

    Tensors whose chunks are the same in both are reported identical without reading
    their data. The summary tells how many bytes storing B as a delta against A takes.
    """
    from ckpt.diffing.compare import SORT_KEYS
    from ckpt.diffing.compare import diff as run_diff

    if sort not in SORT_KEYS:
        raise typer.BadParameter(f"{sort!r} is not one of {', '.join(SORT_KEYS)}", param_hint="--sort")
    store = _open() if not (os.path.exists(a) and os.path.exists(b)) else None
    report = run_diff(a, b, store, include=include, exclude=exclude, estimate_delta=not no_estimate, progress=RichProgress())
    if plot is not None:
        from ckpt.diffing.plot import plot_report

        plot_report(report, plot)
    if as_json:
        emit_json(report.to_json(sort, top))
        return
    from rich.table import Table

    t = Table(box=None, pad_edge=False)
    for c in ("TENSOR", "STATUS", "CHANGED", "REL CHANGE", "MAX |B-A|", "COSINE", "DELTA"):
        t.add_column(c, justify="left" if c in ("TENSOR", "STATUS") else "right")
    for r in report.select(sort, top):
        changed = "-" if r.changed_elements is None else f"{r.changed_elements}/{r.numel}"
        t.add_row(r.name, r.status + ("" if r.read else " *"), changed, _fmt_num(r.relative_change),
                  _fmt_num(r.max_abs_diff), _fmt_num(r.cosine, ".6f"), "-" if r.delta_bytes is None else human_bytes(r.delta_bytes))
    out.print(t)
    s = report.summary
    out.print(
        f"\n{s.tensors} tensors: {s.changed} changed, {s.identical} identical ({s.identical_unread} by chunk ids, not read: *), "
        f"{s.added} added, {s.removed} removed, {s.shape_changed} shape changed, {s.dtype_changed} dtype changed\n"
        f"elements changed: {s.changed_elements} of {s.elements} ({ratio(s.changed_elements, s.elements)}); "
        f"relative change overall {_fmt_num(s.relative_change)}"
    )
    if s.delta_bytes is not None:
        out.print(f"B as a delta against A stores about {human_bytes(s.delta_bytes)} "
                  f"({ratio(s.delta_bytes, s.bytes_b)} of B's {human_bytes(s.bytes_b)} of tensor data)")
    if plot is not None:
        out.print(f"plot written to {plot}")


def _merge_epilog() -> str:
    from ckpt.merging.methods import default_registry

    return "Methods (details: --list-methods): " + "; ".join(f"{m.name}: {m.summary}" for m in default_registry())


@app.command(epilog=_merge_epilog())
def merge(
    refs: Annotated[Optional[list[str]], typer.Argument(metavar="REF...", help="Checkpoints to merge, in order (weights follow this order).", show_default=False)] = None,
    method: Annotated[str, typer.Option("--method", metavar="M", help="linear, task-arithmetic, ties, dare or slerp.")] = "linear",
    output: Annotated[Optional[str], typer.Option("--output", "-o", metavar="NAME", help="Ref name for the merged checkpoint.")] = None,
    base: Annotated[Optional[str], typer.Option("--base", "-b", metavar="REF", help="The checkpoint the inputs were fine-tuned from (task-arithmetic, ties, dare; also the source of --fill-from-base).")] = None,
    param: Annotated[Optional[list[str]], typer.Option("--param", "-p", metavar="KEY=VALUE", help="A method parameter, e.g. -p density=0.3 (repeatable; see --list-methods).")] = None,
    weights: Annotated[Optional[str], typer.Option("--weights", "-w", metavar="W1,W2,...", help="Shorthand for -p weights=W1,W2,...: one per REF.")] = None,
    fill_from_base: Annotated[bool, typer.Option("--fill-from-base", help="Take tensors missing from some input from --base instead of failing.")] = False,
    message: Annotated[Optional[str], typer.Option("--message", "-m", metavar="MSG", help="Note stored with the checkpoint.")] = None,
    list_methods: Annotated[bool, typer.Option("--list-methods", help="List the merge methods and their parameters, then exit.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Merge checkpoints tensor by tensor into a new checkpoint NAME (-o).

    Parameters are checked before any work. The math runs in float32 (float64 for
    float64 tensors) and is cast back; one tensor at a time is held per input. The
    result dedups and delta-encodes like any push; `ckpt show NAME` prints its
    lineage: inputs, method and every parameter value.
    """
    from ckpt.merging.methods import default_registry, describe

    if list_methods:
        if as_json:
            emit_json([{"name": m.name, "summary": m.summary, "min_inputs": m.min_inputs, "max_inputs": m.max_inputs,
                        "needs_base": m.needs_base,
                        "params": [{"name": p.name, "type": p.kind, "default": p.default, "range": p.range_text(), "help": p.help}
                                   for p in m.params]} for m in default_registry()])
        else:
            out.print("\n\n".join(describe(m) for m in default_registry()), markup=False)
        return
    if not refs:
        raise typer.BadParameter("give the checkpoints to merge", param_hint="REF...")
    if output is None:
        raise typer.BadParameter("name the merged checkpoint", param_hint="--output")
    params: dict[str, str] = {}
    for item in param or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--param")
        params[key.strip()] = value.strip()
    if weights is not None:
        params["weights"] = weights
    from ckpt.merging.combine import merge as run_merge

    store = _open()
    r = run_merge(store, refs, method, name=output, params=params, base=base, missing="base" if fill_from_base else "error",
                  message=message, progress=RichProgress())
    if as_json:
        emit_json({"id": r.id, "ref": output, "method": r.method, "params": r.params, "inputs": list(r.inputs),
                   "base": r.base, "merged_tensors": r.merged, "reused_tensors": r.reused, "from_base": list(r.from_base),
                   "new_chunks": r.new_chunks, "written_bytes": r.written_bytes, "logical_bytes": r.logical_bytes,
                   "seconds": r.seconds})
        return
    out.print(f"{output} -> {r.id[:12]}  {r.method} of {len(r.inputs)} inputs: {r.merged} tensors merged, "
              f"{r.reused} reused unread" + (f", {len(r.from_base)} from the base" if r.from_base else "")
              + f"; {human_bytes(r.logical_bytes)}, {human_bytes(r.written_bytes)} written in {r.seconds:.1f} s")


def _read_scores(path: Path) -> dict[str, float]:
    import json

    from ckpt.errors import InvalidMergeError

    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InvalidMergeError(f"{path}: cannot read scores ({e})") from None
    if isinstance(obj, list):
        try:
            obj = {row["ref"]: row["score"] for row in obj}
        except (TypeError, KeyError):
            raise InvalidMergeError(f"{path}: a list of scores needs {{\"ref\": ..., \"score\": ...}} objects") from None
    if not isinstance(obj, dict):
        raise InvalidMergeError(f"{path}: expected a JSON object mapping refs to scores")
    return obj


@app.command()
def remix(
    scores: Annotated[Path, typer.Option("--scores", metavar="FILE", help='JSON: {"REF": score, ...} (or [{"ref": ..., "score": ...}]), one score per past fine-tune on a sample of the new task.')],
    output: Annotated[str, typer.Option("--output", "-o", metavar="NAME", help="Ref name for the remixed starting point.")],
    k: Annotated[int, typer.Option("-k", metavar="K", help="How many of the best to average.")] = 2,
    weights: Annotated[str, typer.Option("--weights", metavar="MODE", help="equal, or proportional to the scores.")] = "equal",
    lower_is_better: Annotated[bool, typer.Option("--lower-is-better", help="Scores are losses: keep the lowest.")] = False,
    message: Annotated[Optional[str], typer.Option("--message", "-m", metavar="MSG", help="Note stored with the checkpoint.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Average the K best-scoring past fine-tunes into a starting point for a new fine-tune (Mashup Learning)."""
    from ckpt.merging.remixing import choose, remix_scores

    table = _read_scores(scores)
    chosen, _ = choose(table, k, weights=weights, higher_is_better=not lower_is_better)
    store = _open()
    cid = remix_scores(store, table, k, weights=weights, higher_is_better=not lower_is_better, name=output,
                       message=message, progress=RichProgress())
    if as_json:
        emit_json({"id": cid, "ref": output, "chosen": chosen, "k": k, "weights": weights})
        return
    out.print(f"{output} -> {cid[:12]}  average of {', '.join(chosen)}")


def main(argv: list[str] | None = None) -> None:
    """Console entry point: ckpt errors become one line on stderr and exit code 1."""
    from ckpt_store.storage.errors import CkptError

    try:
        # Without standalone mode click returns the code of a typer.Exit instead of exiting.
        code = app(args=argv, standalone_mode=False)
    except CkptError as e:
        err.print(f"error: {e}", markup=False)
        sys.exit(1)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        err.print("aborted")
        sys.exit(130)
    except BrokenPipeError:  # `ckpt show X | head`: the reader left; not an error worth a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
    except KeyboardInterrupt:
        err.print("interrupted; the store is unchanged except for unreferenced objects that `ckpt gc` removes")
        sys.exit(130)
    except typer.TyperException as e:  # usage errors: bad option, missing argument...
        show = getattr(e, "show", None)
        if show is None:
            raise
        show()
        sys.exit(getattr(e, "exit_code", 2))
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
