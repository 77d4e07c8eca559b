"""Commands that move checkpoints: into a store (init, push), out of it (pull), between stores (copy)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ckpt_store.cli import views
from ckpt_store.cli.app import FromOptionOpt, JsonOpt, ToOptionOpt, emit, only_with, open_store
from ckpt_store.cli.render import RichProgress


def init(as_json: JsonOpt = False) -> None:
    """Create an empty store (a no-op if one exists). --storage-option applies.

    \b
    Examples:
      ckpt --store ./runs init
      ckpt --store s3://team/store --storage-option endpoint_url=http://minio:9000 init
    """
    from ckpt.errors import StoreNotFoundError

    try:
        store, created = open_store(), False
    except StoreNotFoundError:
        store, created = open_store(create=True), True
    emit({"url": store.url, "created": created}, as_json, views.init)


def push(
    source: Annotated[Path, typer.Argument(metavar="SOURCE", help="A .safetensors file, a Hugging Face model directory, or a .pt/.bin state dict; with --to, a REF in this store.")],
    name: Annotated[Optional[str], typer.Argument(metavar="NAME", help="Ref name to point at the new checkpoint, e.g. minilm/legal (with --to: the name there, default the same).", show_default=False)] = None,
    message: Annotated[Optional[str], typer.Option("--message", "-m", metavar="MSG", help="Note stored with the checkpoint.")] = None,
    base: Annotated[Optional[str], typer.Option("--base", "-b", metavar="REF", help="Delta-encode against this checkpoint (default: NAME's previous version, else the stored checkpoint sharing the most tensors).")] = None,
    no_delta: Annotated[bool, typer.Option("--no-delta", help="Store new chunks whole, without a base.")] = False,
    to: Annotated[Optional[str], typer.Option("--to", metavar="URL", help="Push REF from this store to the store at URL instead (same as `ckpt copy REF --to URL`).", show_default=False)] = None,
    to_option: ToOptionOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Store a checkpoint and point NAME at it. Only chunks the store lacks are written.

    .pt/.bin files are read with torch.load(weights_only=True): a file that needs
    arbitrary unpickling is refused, never executed. Creates the store if needed.

    With --to URL, SOURCE is a ref in this store, copied with everything it needs to the
    store at URL (only what is missing there travels).

    \b
    Examples:
      ckpt push ./minilm m/base -m 'the base'          # a model folder
      ckpt push ft.safetensors m/ft-legal --base m/base  # stored as a delta against it
      ckpt push m/ft-legal --to s3://team/store
      ckpt push m/ft-legal --to s3://team/store --to-option endpoint_url=http://minio:9000
    """
    only_with(to, to_option, "--to", "--to-option")
    if to is not None:
        if message or base or no_delta:
            raise typer.BadParameter("--message, --base and --no-delta do not apply to --to (a copy keeps the checkpoint as it is)")
        spec = str(source) if name is None else f"{source}:{name}"
        emit(_copy([spec], None, to, None, to_option), as_json, views.copy)
        return
    if name is None:
        raise typer.BadParameter("NAME is required (the ref to point at the new checkpoint)", param_hint="NAME")
    from ckpt.store.sources import stat_source

    stat_source(os.fsdecode(source))  # a SOURCE that is not there creates no store
    store = open_store(create=True)
    r = store.push(str(source), name, message, base=base, delta=not no_delta, progress=RichProgress())
    emit({"id": r.id, "ref": name, "chunks": r.chunks, "new_chunks": r.new_chunks,
           "logical_bytes": r.logical_bytes, "written_bytes": r.written_bytes}, as_json, views.push)


def pull(
    ref: Annotated[str, typer.Argument(metavar="REF", help="Ref, NAME@N or id prefix.")],
    # A str, not a Path: a Path drops the trailing slash of "out/", which says "a directory".
    dest: Annotated[Optional[str], typer.Argument(metavar="DEST", help="Output file (single-file checkpoints) or directory (model directories). Optional with --from.", show_default=False)] = None,
    force: Annotated[bool, typer.Option("--force", "-f", help="Replace the checkpoint's own files in DEST if they exist; nothing else in DEST is touched.")] = False,
    include: Annotated[Optional[list[str]], typer.Option("--include", "-i", metavar="GLOB", help="Only tensors matching this glob (repeatable); writes one safetensors (or, named .pt, torch) file.")] = None,
    from_: Annotated[Optional[str], typer.Option("--from", metavar="URL", help="First copy REF from the store at URL into this store (only what is missing here travels).", show_default=False)] = None,
    from_option: FromOptionOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Write a checkpoint back out, bit-identical to what was pushed, verifying every chunk.

    Each file appears only when complete (written under a temporary name, then renamed).
    A model directory goes to a new or empty DEST; into a DEST holding other files only
    with --force, which replaces the checkpoint's own files and leaves the rest (but not
    beside weights files that are not the checkpoint's: a loader would read those too). A pull
    never writes inside a store or into a directory holding the store, and replaces a
    symbolic link at a file's name rather than writing through it.

    DEST named .pt/.pth/.bin/.ckpt gets a torch file (torch.load(weights_only=True)):
    for a checkpoint pushed from a nested .pt/.ckpt, the object that was pushed, as
    it was (a Lightning checkpoint resumes from it); otherwise a flat dict of the
    tensors, bit-identical, plus the non-tensor values of a checkpoint pushed from a
    .pt file or saved through torch.distributed.checkpoint, under their flat (dotted)
    keys. A model directory is not pulled to a DEST named like
    one file (.safetensors or a torch name) unless --include '*' asks for its tensors
    as that one file.

    With --from URL, REF is first copied from the store at URL into this store (like
    `ckpt copy REF --from URL`); DEST, if given, is then written from this store.

    \b
    Examples:
      ckpt pull m/ft-legal ./ft-legal                   # a folder, or a file
      ckpt pull m/ft-legal@1 old.pt                     # an earlier version, as a torch file
      ckpt pull m/ft-legal ./ft-legal --force           # replace its files there, nothing else
      ckpt pull m/ft-legal layer0.safetensors --from s3://team/store -i 'layers.0.*'
    """
    only_with(from_, from_option, "--from", "--from-option")
    if dest == "-":  # the usual word for standard output: it would be a file named "-" in the current folder
        from ckpt.errors import DestinationError

        raise DestinationError("DEST - would be a file named '-': a pull writes files, never to standard output",
                               hint="give a file or folder; ./- for a file of that name")
    copied = None
    if from_ is not None:
        copied = _copy([ref], from_, None, from_option)
    elif dest is None:
        raise typer.BadParameter("DEST is required (or --from URL to copy REF into this store)", param_hint="DEST")
    result: dict[str, Any] = {"ref": ref, "id": None, "path": None, "copy": copied}
    if dest is not None:
        from ckpt.errors import CkptError

        try:
            from ckpt.store.pull import pull as pull_checkpoint

            store = open_store()
            # What REF names as the pull starts is what it writes and reports (a ref moved meanwhile, as a
            # run's `latest` does at every save, would make the document name another checkpoint).
            result["id"] = store.resolve(ref)
            result["path"] = pull_checkpoint(store, result["id"], str(dest), overwrite=force, include=include or None,
                                             progress=RichProgress(), label=ref)
        except CkptError as e:
            if copied is not None and as_json:  # the copy landed: the document says so, beside why the pull did not
                result["error"] = str(e)
                emit(result, as_json, views.pull)
            raise
    elif copied is not None:
        result["id"] = next(iter(copied["refs"].values()), None)
    emit(result, as_json, views.pull)


def copy(
    refs: Annotated[list[str], typer.Argument(metavar="REF...", help="Refs to copy; REF:NAME sets NAME at the destination; NAME@N or an id prefix copies the checkpoint only.")],
    from_: Annotated[Optional[str], typer.Option("--from", metavar="URL", help="Source store (default: --store).", show_default=False)] = None,
    to: Annotated[Optional[str], typer.Option("--to", metavar="URL", help="Destination store, created if needed (default: --store).", show_default=False)] = None,
    from_option: FromOptionOpt = None,
    to_option: ToOptionOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Copy checkpoints between stores (local <-> S3, S3 <-> S3, local <-> local).

    Only objects the destination lacks travel -- a fine-tune whose base is already there
    costs about its delta -- in the order chunks, manifests, refs, each verified before it
    is written. An interrupted copy, run again, sends only what is left. --storage-option
    applies to both stores; --from-option and --to-option to one (two S3 servers, or two
    accounts: profile=NAME).

    \b
    Examples:
      ckpt copy m/ft-legal --to s3://team/store        # publish (the base goes once)
      ckpt copy m/ft-legal:legal/v2 --to s3://team/store
      ckpt copy m/ft-legal --from s3://team/store     # fetch into --store
      ckpt copy m/ft --from s3://a/store --from-option endpoint_url=http://minio:9000 --to s3://b/store
    """
    if from_ is None and to is None:
        raise typer.BadParameter("give --from URL, --to URL or both (the other defaults to --store)")
    emit(_copy(refs, from_, to, from_option, to_option), as_json, views.copy)


def _copy(refs: list[str], from_: str | None, to: str | None, from_option: list[str] | None = None,
          to_option: list[str] | None = None) -> dict[str, Any]:
    """Copy ``refs`` between stores; the copy's result (what --json prints)."""
    from ckpt.store.copy import check_copy_specs

    src = open_store(url=from_, own=from_option, flag="--from-option")
    check_copy_specs(src, refs)  # a copy that cannot start leaves no new store at --to
    dst = open_store(create=True, url=to, own=to_option, flag="--to-option")
    if src.url == dst.url and (from_option or []) == (to_option or []):  # (one URL on two servers is two stores)
        raise typer.BadParameter("source and destination are the same store")
    r = src.copy_to(dst, refs, progress=RichProgress())
    return {"from": src.url, "to": dst.url, "refs": r.refs, "chunks_sent": r.chunks_sent,
            "manifests_sent": r.manifests_sent, "refs_set": r.refs_set, "objects_sent": r.objects_sent,
            "bytes_sent": r.bytes_sent, "chunks_present": r.chunks_present, "manifests_present": r.manifests_present}
