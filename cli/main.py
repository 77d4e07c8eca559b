"""``ckpt``: push, pull and inspect checkpoints in a content-addressed store."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ckpt_store.cli import results, views
from ckpt_store.cli.render import PIPE_GONE, GuardedStdout, RichProgress, emit_json, err, out, safe

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
    typer.Option("--storage-option", metavar="KEY=VALUE", show_default=False,
                 help="fsspec/s3fs option for remote stores (repeatable), e.g. endpoint_url=http://host:9000, "
                      "profile=NAME, anon=true, config_kwargs.connect_timeout=5. Credentials are better left to the "
                      "AWS environment variables or config files, which are used by default."),
]
# Options for one store of a command that names two (copy's, push --to's, pull --from's), over --storage-option.
FromOptionOpt = Annotated[
    Optional[list[str]],
    typer.Option("--from-option", metavar="KEY=VALUE", show_default=False,
                 help="A storage option for the --from store only (repeatable), over --storage-option: "
                      "endpoint_url=..., profile=NAME."),
]
ToOptionOpt = Annotated[
    Optional[list[str]],
    typer.Option("--to-option", metavar="KEY=VALUE", show_default=False,
                 help="A storage option for the --to store only (repeatable), over --storage-option."),
]
# The global -o used to mean --storage-option; -o now means --output (merge, remix), and
# the old spelling still works for one release with a warning.
OldOptionsOpt = Annotated[Optional[list[str]], typer.Option("-o", hidden=True, show_default=False)]


def _json_requested(value: bool) -> bool:
    """--json was given: an error then prints {"error": MESSAGE} on stdout too (main)."""
    if value:
        _state["json"] = True
    return value


JsonOpt = Annotated[bool, typer.Option("--json", callback=_json_requested,
                                       help='Machine-readable JSON on stdout; an error too, as {"error": MESSAGE}.')]


def parse_storage_options(pairs: list[str] | None, option: str = "--storage-option") -> dict[str, Any] | None:
    """``["a=1", "b.c=x"]`` -> ``{"a": 1, "b": {"c": "x"}}``: values are JSON when they parse, else strings
    (a later pair overrides an earlier one). ``option``: the option they came from, for errors."""
    import json

    if not pairs:
        return None
    opts: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            # Never echo the pair itself: it may hold a credential.
            raise typer.BadParameter("expected KEY=VALUE", param_hint=option)
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        node = opts
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise typer.BadParameter(f"{key}: {part} is both a value and a group", param_hint=option)
        if isinstance(node.get(leaf), dict):  # (a group given first, then a value in its place)
            raise typer.BadParameter(f"{key}: {key} is both a value and a group", param_hint=option)
        node[leaf] = value
    return opts


@app.callback()
def _main(store: StoreOpt = None, storage_option: OptionsOpt = None, old_storage_option: OldOptionsOpt = None,
          no_cache: Annotated[bool, typer.Option("--no-cache", help="Read remote stores without the local chunk cache "
                                                 "(~/.cache/ckpt or $CKPT_CACHE_DIR; see `ckpt cache`).")] = False) -> None:
    if old_storage_option:
        err.print("warning: `ckpt -o KEY=VALUE` is deprecated, write `ckpt --storage-option KEY=VALUE` "
                  "(-o means --output, the name of what merge and remix make)")
    _state["store"] = store
    _state["option_pairs"] = (storage_option or []) + (old_storage_option or [])
    _state["options"] = parse_storage_options(_state["option_pairs"])
    _state["no_cache"] = no_cache


def _settings() -> Any:
    from ckpt.settings import Settings

    return Settings.from_env(**({"cache": False} if _state.get("no_cache") else {}))


def _emit(result: Any, as_json: bool, render: Any, *args: Any, failed: bool = False) -> None:
    """Print a command's one result: as JSON with --json, else drawn by ``render`` (cli/views.py).
    ``failed``: the command fails after it (an error it names, damage it lists): a reader that left
    ends nothing here, so that the command ends with its failure (1), never as a success whose
    reader left (141): the script reading the status must learn that it failed."""
    try:
        if as_json:
            _emit_json(result)
        else:
            render(result, *args)
    except SystemExit as e:
        if not failed or e.code != PIPE_GONE:
            raise


def _emit_json(doc: Any) -> None:
    """Print ``doc`` as --json's document (noted: an error after it adds no second document)."""
    _state["json_written"] = True
    emit_json(doc)


_OPTION_FLAGS = ("--storage-option", "-o", "--from-option", "--to-option")


def _named(argv: list[str]) -> list[str]:
    """The words of a command line but the storage options' values (an endpoint_url=http://... names no store)."""
    words, skip = [], False
    for a in argv:
        if not skip and a not in _OPTION_FLAGS and not a.startswith(tuple(f"{f}=" for f in _OPTION_FLAGS)):
            words.append(a)
        skip = a in _OPTION_FLAGS
    return words


def _open(create: bool = False, url: str | None = None, own: list[str] | None = None, flag: str = "") -> Any:
    """The store at ``url`` (None: --store), with --storage-option and then ``own``, the options
    given for this store alone (by ``flag``: copy's --from-option, say), which override them."""
    from ckpt.store.store import Store, is_local_url

    target = _state["store"] if url is None else url  # (an empty --from "$UNSET" is no store, not the default one)
    options = _state["options"]
    if own:
        if target != "" and is_local_url(target):  # ("" is refused by the open below: "empty store URL")
            raise typer.BadParameter(f"{target or 'the default store'} is a local folder: storage options are for "
                                     "remote stores (s3://BUCKET/PREFIX...)", param_hint=flag)
        options = parse_storage_options(_state.get("option_pairs", []) + own, f"--storage-option or {flag}")
    elif options and is_local_url(target):
        # Options dropped in silence where s3:// was forgotten: the push would land in a local folder.
        argv = _state.get("argv")
        if argv is not None and all(is_local_url(a) for a in _named(argv)):  # (no other store of the command is remote)
            raise typer.BadParameter(f"{target or 'the default store'} is a local folder, and every store this command "
                                     "names is: storage options are for remote stores (s3://BUCKET/PREFIX...)",
                                     param_hint="--storage-option")
    connect = Store.init if create else Store.open
    return connect(target, storage_options=options, settings=_settings())


cache_app = typer.Typer(help=("The local cache of chunks read from remote stores: show what it holds, or clear it.\n\n"
                              "\b\nExamples:\n"
                              "  ckpt cache                # where it is, what it holds per store, its size limit\n"
                              "  ckpt cache --json\n"
                              "  ckpt cache clear          # remote stores are untouched"),
                        no_args_is_help=False, invoke_without_command=True)
app.add_typer(cache_app, name="cache")


@cache_app.callback()
def cache_show(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """Where the cache is, how much it holds (per store), and its size limit."""
    if ctx.invoked_subcommand is not None:
        ctx.obj = {"json": as_json}  # `ckpt cache --json clear`: asked for before the subcommand, for it
        return
    from ckpt.store.cache import cache_usage

    s = _settings()
    u = cache_usage(s)
    _emit({"dir": u.root, "entries": u.entries, "bytes": u.bytes, "limit_bytes": s.cache_mb << 20, "enabled": s.cache,
           "stores": {k: {"entries": n, "bytes": b} for k, (n, b) in u.stores.items()}}, as_json, views.cache)


@cache_app.command("clear")
def cache_clear(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """Delete every cached chunk (remote stores are untouched; chunks are fetched again when needed).

    \b
    Examples:
      ckpt cache clear
      ckpt --no-cache pull m/ft-legal ./ft-legal   # or read without the cache, leaving it as it is
    """
    from ckpt.store.cache import clear_cache

    u = clear_cache(_settings())
    _emit({"dir": u.root, "entries_deleted": u.entries, "bytes_deleted": u.bytes}, as_json or (ctx.obj or {}).get("json", False),
          views.cache_clear)


@app.command()
def init(as_json: JsonOpt = False) -> None:
    """Create an empty store (a no-op if one exists). --storage-option applies.

    \b
    Examples:
      ckpt --store ./runs init
      ckpt --store s3://team/store --storage-option endpoint_url=http://minio:9000 init
    """
    from ckpt.errors import StoreNotFoundError

    try:
        store, created = _open(), False
    except StoreNotFoundError:
        store, created = _open(create=True), True
    _emit({"url": store.url, "created": created}, as_json, views.init)


@app.command()
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
    _only_with(to, to_option, "--to", "--to-option")
    if to is not None:
        if message or base or no_delta:
            raise typer.BadParameter("--message, --base and --no-delta do not apply to --to (a copy keeps the checkpoint as it is)")
        spec = str(source) if name is None else f"{source}:{name}"
        _emit(_copy([spec], None, to, None, to_option), as_json, views.copy)
        return
    if name is None:
        raise typer.BadParameter("NAME is required (the ref to point at the new checkpoint)", param_hint="NAME")
    from ckpt.store.sources import stat_source

    stat_source(os.fsdecode(source))  # a SOURCE that is not there creates no store
    store = _open(create=True)
    r = store.push(str(source), name, message, base=base, delta=not no_delta, progress=RichProgress())
    _emit({"id": r.id, "ref": name, "chunks": r.chunks, "new_chunks": r.new_chunks,
           "logical_bytes": r.logical_bytes, "written_bytes": r.written_bytes}, as_json, views.push)


@app.command()
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
    _only_with(from_, from_option, "--from", "--from-option")
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

            store = _open()
            # What REF names as the pull starts is what it writes and reports (a ref moved meanwhile, as a
            # run's `latest` does at every save, would make the document name another checkpoint).
            result["id"] = store.resolve(ref)
            result["path"] = pull_checkpoint(store, result["id"], str(dest), overwrite=force, include=include or None,
                                             progress=RichProgress(), label=ref)
        except CkptError as e:
            if copied is not None and as_json:  # the copy landed: the document says so, beside why the pull did not
                result["error"] = str(e)
                _emit(result, as_json, views.pull, failed=True)
            raise
    elif copied is not None:
        result["id"] = next(iter(copied["refs"].values()), None)
    _emit(result, as_json, views.pull)


@app.command("ls")
def ls(as_json: JsonOpt = False) -> None:
    """List refs: name, checkpoint id, size, when, message.

    A ref whose entry or checkpoint is damaged is named on stderr (in --json: a row with
    "error") and the others are listed; the exit code is then 1 (`ckpt verify` says more).

    \b
    Examples:
      ckpt ls
      ckpt --store s3://team/store ls --json
    """
    rows = results.ls_rows(_open().ls())
    _emit(rows, as_json, views.ls, failed=any("error" in r for r in rows))
    _exit_if_damaged({r["ref"]: r["error"] for r in rows if "error" in r}, quiet=as_json)


def _exit_if_damaged(damaged: dict[str, str], quiet: bool = False) -> None:
    """After a listing that went on past damaged refs: name them on stderr and exit 1."""
    if not damaged:
        return
    if not quiet:
        for name, why in damaged.items():
            err.print(f"DAMAGED {safe(name)}: {safe(why)}")
    raise typer.Exit(1)


@app.command()
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
    store = _open()
    entries, damaged = store.readable_log(name)
    rows = results.log_rows(entries, store.manifest, damaged)
    _emit(rows, as_json, views.log, name, failed=any("error" in r for r in rows))
    _exit_if_damaged({(f"{name}@{r['version']}" if r["version"] is not None else f"{name} entry #{r['seq']}"): r["error"]
                      for r in rows if "error" in r}, quiet=as_json)


@app.command()
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
    store = _open()
    mid = store.resolve(ref)
    m = store.manifest(mid)
    doc = results.show_doc(mid, m, store.stored_sizes(m.chunk_lengths()))
    _emit(doc, as_json, views.show, failed=bool(doc["missing_chunks"]))
    if doc["missing_chunks"]:  # damage, as in ls, du and log: shown, and exit code 1
        _exit_if_damaged({ref: f"{doc['missing_chunks']} of its chunks are not in the store (`ckpt verify` says more)"},
                         quiet=as_json)


@app.command()
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
    u = _open().du()
    _emit(results.du_doc(u), as_json, views.du, failed=bool(u.damaged))
    _exit_if_damaged(u.damaged, quiet=as_json)


@app.command()
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
    _only_with(repair_from, repair_option, "--repair-from", "--repair-option")
    store = _open()
    if repair_from is not None:
        # --storage-option, then --repair-option over it
        rr = store.repair(_open(url=repair_from, own=repair_option, flag="--repair-option"), refs or None,
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
    _emit(doc, as_json, views.verify, failed=not r.ok)
    if not r.ok:
        raise typer.Exit(1)


@app.command()
def rm(names: Annotated[list[str], typer.Argument(metavar="NAME...", help="Refs to remove.")], as_json: JsonOpt = False) -> None:
    """Remove refs. History stays in `ckpt log`; data is freed by `ckpt gc`.

    \b
    Examples:
      ckpt rm m/ft-old m/ft-older && ckpt gc
    """
    from ckpt.errors import CkptError

    store = _open()
    doc: dict[str, Any] = {"removed": []}
    try:
        for name in names:
            entry = store.remove(name)
            doc["removed"].append({"ref": name, "seq": entry.seq})
    except CkptError as e:  # the document printed below is the only one: it says why, as {"error"} would
        doc["error"] = str(e)
        raise
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM between two names: said as any interrupted command's document says it
        doc["error"] = f"terminated; {_AFTER}" if _terminated() else _INTERRUPTED
        raise
    finally:  # a name that fails stops the command; the ones removed before it are still reported
        _emit(doc, as_json, views.rm, failed="error" in doc)


@app.command()
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
    _emit(_copy(refs, from_, to, from_option, to_option), as_json, views.copy)


def _only_with(url: str | None, own: list[str] | None, flag: str, option: str) -> None:
    """Refuse ``option`` (the options of the store at ``flag`` URL) without ``flag``: they would be dropped."""
    if own and url is None:
        raise typer.BadParameter(f"it gives options for the store at {flag} URL, and no {flag} is given "
                                 "(--storage-option is for --store)", param_hint=option)


def _copy(refs: list[str], from_: str | None, to: str | None, from_option: list[str] | None = None,
          to_option: list[str] | None = None) -> dict[str, Any]:
    """Copy ``refs`` between stores; the copy's result (what --json prints)."""
    from ckpt.store.copy import check_copy_specs

    src = _open(url=from_, own=from_option, flag="--from-option")
    check_copy_specs(src, refs)  # a copy that cannot start leaves no new store at --to
    dst = _open(create=True, url=to, own=to_option, flag="--to-option")
    if src.url == dst.url and (from_option or []) == (to_option or []):  # (one URL on two servers is two stores)
        raise typer.BadParameter("source and destination are the same store")
    r = src.copy_to(dst, refs, progress=RichProgress())
    return {"from": src.url, "to": dst.url, "refs": r.refs, "chunks_sent": r.chunks_sent,
            "manifests_sent": r.manifests_sent, "refs_set": r.refs_set, "objects_sent": r.objects_sent,
            "bytes_sent": r.bytes_sent, "chunks_present": r.chunks_present, "manifests_present": r.manifests_present}


_DURATION = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([smhd]?)\Z")


def _seconds(text: str) -> float:
    m = _DURATION.match(text.strip())
    if not m:
        raise typer.BadParameter(f"{text!r} is not a duration like 30s, 10m, 1h or 2d")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


@app.command()
def gc(
    dry_run: Annotated[bool, typer.Option("--dry-run", "-n", help="Print the plan, a preview from the metadata index (the real run reads every ref and manifest); delete nothing.")] = False,
    grace: Annotated[str, typer.Option("--grace", metavar="DURATION", help="Keep unreferenced objects younger than this (protects pushes in progress).")] = "1h",
    no_history: Annotated[bool, typer.Option("--no-history", help="Also free earlier versions of live refs (NAME@1...).")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Delete objects no ref needs: plan first, then delete (or just print with --dry-run).

    Earlier versions of live refs (NAME@1...) are kept unless --no-history; objects younger
    than --grace are kept, so that a push in progress elsewhere loses nothing.

    \b
    Examples:
      ckpt gc --dry-run              # what would go, and how much
      ckpt gc --grace 10m --json
      ckpt gc --no-history           # keep only what refs name now
    """
    store = _open()
    grace_s = _seconds(grace)
    if grace_s < 60 and not dry_run:
        err.print(f"warning: --grace {safe(grace)}: objects of a push or copy running now elsewhere may be "
                  "deleted before its ref lands; use it only when nothing else writes to this store")
    r = store.gc(grace_s=grace_s, dry_run=dry_run, keep_history=not no_history)
    # "bytes" is the old spelling of deleted_bytes, kept for scripts (README).
    _emit({"dry_run": r.dry_run, "deleted": len(r.deleted), "deleted_bytes": r.bytes, "bytes": r.bytes, "young_kept": r.young,
           "live_manifests": r.live_manifests, "live_chunks": r.live_chunks, "grace": grace,
           "objects": [{"kind": d.kind, "name": d.name, "stored_bytes": d.size, "bytes": d.size} for d in r.deleted]},
          as_json, views.gc)


@app.command()
def diff(
    a: Annotated[str, typer.Argument(metavar="A", help="Ref, NAME@N, id prefix, or a local file/directory (an existing path wins).")],
    b: Annotated[str, typer.Argument(metavar="B", help="What to compare against A (same forms).")],
    include: Annotated[Optional[list[str]], typer.Option("--include", "-i", metavar="GLOB", help="Only tensors matching this glob (repeatable).")] = None,
    exclude: Annotated[Optional[list[str]], typer.Option("--exclude", "-x", metavar="GLOB", help="Leave out tensors matching this glob (repeatable).")] = None,
    sort: Annotated[str, typer.Option("--sort", metavar="KEY", help="order, name, status, relative_change, max_abs_diff, changed_elements, cosine or delta_bytes (largest change first).")] = "order",
    top: Annotated[Optional[int], typer.Option("--top", metavar="N", min=1, help="Show only the first N tensors after sorting (the summary still counts all).")] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", metavar="FILE.png", help="Draw relative change per layer, grouped by module type (needs matplotlib: pip install 'ckpt-store[plot]').")] = None,
    no_estimate: Annotated[bool, typer.Option("--no-estimate", help="Skip estimating the stored size of B as a delta against A.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """What changed from A to B, tensor by tensor: status, elements changed, relative change ‖B−A‖/‖A‖, max |B−A|, cosine.

    Tensors whose chunks are the same in both are reported identical without reading
    their data. The summary tells how many bytes storing B as a delta against A takes.

    \b
    Examples:
      ckpt diff m/base m/ft-legal --sort relative_change --top 20
      ckpt diff m/ft-legal@1 m/ft-legal -i 'layers.*' --json
      ckpt diff m/base ./finetuned.safetensors --plot change.png
    """
    from ckpt.diffing.compare import SORT_KEYS
    from ckpt.diffing.compare import diff as run_diff

    if sort not in SORT_KEYS:
        raise typer.BadParameter(f"{sort!r} is not one of {', '.join(SORT_KEYS)}", param_hint="--sort")
    if plot is not None:  # checked before the diff runs, not after
        from ckpt.errors import DestinationError

        if plot.suffix.lower() not in (".png", ".pdf", ".svg", ".jpg", ".jpeg"):
            raise DestinationError(f"--plot {safe(str(plot))}: give a .png, .pdf, .svg or .jpg file")
        if not plot.parent.is_dir():
            raise DestinationError(f"--plot {safe(str(plot))}: {safe(str(plot.parent))} is not a folder")
    store = _open() if not (os.path.exists(a) and os.path.exists(b)) else None
    if plot is not None:  # not inside a store (checked again as it is written)
        from ckpt.store.destination import check_outside_stores

        check_outside_stores(str(plot), store, "a plot")
    report = run_diff(a, b, store, include=include, exclude=exclude, estimate_delta=not no_estimate, progress=RichProgress())
    if plot is not None:
        from ckpt.diffing.plot import plot_report

        try:
            plot_report(report, plot, store)
        except OSError as e:
            raise DestinationError(f"cannot write {safe(str(plot))}: {e.strerror or e}") from None
    # diff's one result is its typed report; --json prints report.to_json.
    if as_json:
        _emit_json(report.to_json(sort, top))
    else:
        views.diff(report, sort, top, plot)


def _merge_epilog() -> str:
    from ckpt.merging.methods import default_registry

    return "Methods (details: --list-methods): " + "; ".join(f"{m.name}: {m.summary}" for m in default_registry())


@app.command(epilog=_merge_epilog())
def merge(
    refs: Annotated[Optional[list[str]], typer.Argument(metavar="REF...", help="Checkpoints to merge, in order (weights follow this order).", show_default=False)] = None,
    method: Annotated[str, typer.Option("--method", metavar="M", help="linear, task-arithmetic, ties, dare or slerp.")] = "linear",
    output: Annotated[Optional[str], typer.Option("--output", "-o", metavar="NAME", help="Ref name for the merged checkpoint.", show_default=False)] = None,
    base: Annotated[Optional[str], typer.Option("--base", "-b", metavar="REF", help="The checkpoint the inputs were fine-tuned from (task-arithmetic, ties, dare; also the source of --fill-from-base).")] = None,
    param: Annotated[Optional[list[str]], typer.Option("--param", "-p", metavar="KEY=VALUE", help="A method parameter, e.g. -p density=0.3 (repeatable; see --list-methods).")] = None,
    weights: Annotated[Optional[str], typer.Option("--weights", "-w", metavar="W1,W2,...", help="Shorthand for -p weights=W1,W2,...: one per REF.")] = None,
    fill_from_base: Annotated[bool, typer.Option("--fill-from-base", help="Take tensors missing from some input from --base instead of failing.")] = False,
    new_tensors: Annotated[str, typer.Option("--new-tensors", metavar="MODE", help="Tensors the base lacks (a classification head the fine-tunes added), or that some inputs lack and the base cannot fill: 'error' (default) or 'average' (the plain average of the inputs that have them).")] = "error",
    message: Annotated[Optional[str], typer.Option("--message", "-m", metavar="MSG", help="Note stored with the checkpoint.")] = None,
    list_methods: Annotated[bool, typer.Option("--list-methods", help="List the merge methods and their parameters, then exit.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Merge checkpoints tensor by tensor into a new checkpoint NAME (-o).

    Parameters are checked before any work. The math runs in float32 (float64 for
    float64 tensors) and is cast back; one tensor at a time is held per input (or a
    batch of small ones, up to 1 MiB per input, read together). The
    result dedups and delta-encodes like any push; `ckpt show NAME` prints its
    lineage: inputs, method and every parameter value.

    \b
    Examples:
      ckpt merge m/ft-a m/ft-b -o m/soup                     # the plain average
      ckpt merge m/ft-a m/ft-b -w 0.7,0.3 -o m/mix
      ckpt merge m/ft-a m/ft-b --method ties -b m/base -p density=0.3 -o m/ties
      ckpt merge --list-methods
    """
    from ckpt.merging.methods import default_registry, describe

    if list_methods:
        if as_json:
            _emit_json([{"name": m.name, "summary": m.summary, "min_inputs": m.min_inputs, "max_inputs": m.max_inputs,
                        "needs_base": m.needs_base,
                        "params": [{"name": p.name, "type": p.kind, "default": p.default, "range": p.range_text(), "help": p.help}
                                   for p in m.params]} for m in default_registry()])
        else:
            out.print("\n\n".join(describe(m) for m in default_registry()))  # (a reader that left: 141, as every view)
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
    r = run_merge(refs, method, name=output, store=store, params=params, base=base, missing="base" if fill_from_base else "error",
                  new_tensors=new_tensors, message=message, progress=RichProgress())
    _emit({"id": r.id, "ref": output, "method": r.method, "params": r.params, "inputs": list(r.inputs),
           "base": r.base, "merged_tensors": r.merged, "reused_tensors": r.reused, "from_base": list(r.from_base),
           "averaged": list(r.averaged), "files": list(r.files), "new_chunks": r.new_chunks, "written_bytes": r.written_bytes,
           "logical_bytes": r.logical_bytes, "seconds": r.seconds}, as_json, views.merge)


@app.command()
def remix(
    scores: Annotated[Path, typer.Option("--scores", metavar="FILE", help='JSON: {"REF": score, ...} (or [{"ref": ..., "score": ...}]), one score per past fine-tune on a sample of the new task.')],
    output: Annotated[str, typer.Option("--output", "-o", metavar="NAME", help="Ref name for the remixed starting point.", show_default=False)],
    k: Annotated[int, typer.Option("-k", metavar="K", help="How many of the best to average.")] = 2,
    weights: Annotated[str, typer.Option("--weights", metavar="MODE", help="equal, or proportional to the scores.")] = "equal",
    lower_is_better: Annotated[bool, typer.Option("--lower-is-better", help="Scores are losses: keep the lowest.")] = False,
    message: Annotated[Optional[str], typer.Option("--message", "-m", metavar="MSG", help="Note stored with the checkpoint.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Average the K best-scoring past fine-tunes into a starting point for a new fine-tune (Mashup Learning).

    \b
    Examples:
      ckpt remix --scores scores.json -k 3 -o m/start          # scores: {"m/ft-a": 0.71, ...}
      ckpt remix --scores losses.json --lower-is-better --weights proportional -o m/start
    """
    from ckpt.merging.remixing import choose, read_scores, remix_scores

    table = read_scores(scores)
    chosen, _ = choose(table, k, weights=weights, higher_is_better=not lower_is_better)
    store = _open()
    cid = remix_scores(table, k, store=store, weights=weights, higher_is_better=not lower_is_better, name=output,
                       message=message, progress=RichProgress())
    _emit({"id": cid, "ref": output, "chosen": chosen, "k": k, "weights": weights}, as_json, views.remix)


@app.command()
def serve(
    store: StoreOpt = None,
    port: Annotated[int, typer.Option("--port", "-p", help="TCP port.")] = 8765,
    host: Annotated[str, typer.Option("--host", help="Address to listen on; anything but loopback needs --token.")] = "127.0.0.1",
    token: Annotated[Optional[str], typer.Option("--token", metavar="TOKEN", envvar="CKPT_SERVE_TOKEN",
                                                 help="Secret every request must carry (the printed address has it); $CKPT_SERVE_TOKEN.")] = None,
    local_tier: Annotated[Optional[str], typer.Option("--local-tier", metavar="URL", help="A training run's local tier (a store), shown on run pages beside this one.")] = None,
) -> None:
    """A read-only web view of the store: lineage graph, versions, sizes, diffs, training runs.

    Pages and JSON (/api/refs, /api/lineage, /api/checkpoint/REF, /api/diff?a=REF&b=REF)
    carry what --json does. Needs the web extra: pip install 'ckpt-store[web]'.

    \b
    Examples:
      ckpt serve                                  # http://127.0.0.1:8765/
      ckpt serve --local-tier /dev/shm/ckpt-local-1000/abc123
    """
    from ckpt_store.cli.web.server import serve as run_server

    run_server(_open(url=store), host=host, port=port, token=token, announce=lambda line: out.print(line, markup=False),
               local=_open(url=local_tier) if local_tier is not None else None)


_signals: list[int] = []  # Ctrl-C and SIGTERM received, in order
# True of every command: a ref is written or removed whole, and a removal (`rm`, `gc`) done before
# the interruption stays done ("the store is unchanged" was wrong for an interrupted rm or gc).
_AFTER = "nothing is half-written: what was done before it is complete, unreferenced objects left behind go with `ckpt gc`"
_INTERRUPTED = f"interrupted; {_AFTER}"


def _interrupt(signum: int, frame: object) -> None:
    """Ctrl-C (SIGINT) or SIGTERM (``kill``, a job scheduler ending the job). The first unwinds
    (KeyboardInterrupt), so that a pull removes its temporary files (full-size, hidden) and puts
    back what ``--force`` had begun to replace; that waits for the requests in flight, which a
    server that stopped answering holds until their timeouts and retries (minutes). A second one
    while that goes on ends the process at once, once this process's temporaries are removed
    (:func:`~ckpt.store.destination.abandon`); while files are being renamed into place or back
    (moments) it is ignored."""
    _signals.append(signum)
    if len(_signals) == 1:
        raise KeyboardInterrupt
    from ckpt.store.destination import abandon

    if abandon():
        os.write(2, f"interrupted again: stopped at once, without waiting for requests in flight; {_AFTER}\n".encode())
        os._exit(143 if _terminated() else 130)


def _terminated() -> bool:
    """Whether SIGTERM came (typer reports its unwinding, as Ctrl-C's, as exit code 130)."""
    import signal

    return signal.SIGTERM in _signals


def main(argv: list[str] | None = None) -> None:
    """Console entry point: ckpt errors become one line on stderr and exit code 1."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return _main(argv)
    _signals.clear()
    # (a SIGINT the parent ignores, a job started in the background, stays ignored)
    handled = [s for s in (signal.SIGTERM, signal.SIGINT) if signal.getsignal(s) is not signal.SIG_IGN]
    before = {s: signal.signal(s, _interrupt) for s in handled}
    try:
        _main(argv)
    finally:  # (an in-process caller, a test, gets its own handlers back)
        for s, h in before.items():
            signal.signal(s, h)


def _main(argv: list[str] | None) -> None:
    from ckpt.errors import CkptError

    _state["json"] = _state["json_written"] = False
    words = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
    _state["argv"] = words  # this command's line, for _open (None for an app invoked otherwise: CliRunner)
    stdout, sys.stdout = sys.stdout, GuardedStdout(sys.stdout)  # (click prints --help there while it parses)
    try:
        # Without standalone mode click returns the code of a typer.Exit instead of exiting.
        code = app(args=argv, standalone_mode=False)
    except CkptError as e:
        err.print(f"error: {safe(str(e))}")
        _json_error(str(e))
        sys.exit(1)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:  # click's word for Ctrl-C (and SIGTERM, unwound the same way)
        _end_interrupted("aborted")
    except BrokenPipeError:  # `ckpt show X | head`: the reader left; not an error worth a traceback
        out.on_broken_pipe()
    except KeyboardInterrupt:
        _end_interrupted(_INTERRUPTED)
    except typer.TyperException as e:  # usage errors: bad option, missing argument...
        show = getattr(e, "show", None)
        if show is None:
            raise
        import io

        buf = io.StringIO()  # click echoes the offending argument as typed: escape it like any user text
        show(file=buf)
        sys.stderr.write("".join(safe(line) + "\n" for line in buf.getvalue().splitlines()))
        if "--json" in words[: words.index("--") if "--" in words else len(words)]:
            # Refused before --json was read (an unknown option, a bad value ahead of it, a bad
            # --storage-option): the script that asked for JSON still gets its document.
            _state["json"] = True
        _json_error(e.format_message())
        sys.exit(getattr(e, "exit_code", 2))
    finally:
        _state["argv"] = None
        sys.stdout = stdout
    if _terminated() or code == 130:  # typer returns Ctrl-C inside a command (or SIGTERM, unwound alike) as code 130, silently
        _end_interrupted(_INTERRUPTED)
    sys.exit(code if isinstance(code, int) else 0)


def _json_error(message: str) -> None:
    """With --json, an error is a document too, as the web view's /api/ answers one: {"error": MESSAGE}
    on stdout (exact text), unless the command printed its document already (`ls` naming damage)."""
    if _state.get("json") and not _state.get("json_written"):
        _emit({"error": message}, True, None, failed=True)


def _end_interrupted(message: str) -> None:
    """Exit after Ctrl-C (130) or SIGTERM (143), saying which (with --json, as its document too)."""
    if _terminated():
        message, code = f"terminated; {_AFTER}", 143
    else:
        code = 130
    err.print(message)
    _json_error(message)
    sys.exit(code)


if __name__ == "__main__":
    main()
