"""Commands that tidy a store and the machine: rm, gc, the local chunk cache (cache, cache clear) and the local
tiers of training runs (tiers, tiers rm)."""

from __future__ import annotations

import os
import re
from typing import Annotated, Any, Optional

import typer

from ckpt_store.cli import views
from ckpt_store.cli.app import JsonOpt, emit, open_store, settings, state
from ckpt_store.cli.interrupts import AFTER_INTERRUPT, INTERRUPTED, terminated
from ckpt_store.cli.render import err, safe

cache_app = typer.Typer(help=("The local cache of chunks read from remote stores: show what it holds, or clear it.\n\n"
                              "\b\nExamples:\n"
                              "  ckpt cache                # where it is, what it holds per store, its size limit\n"
                              "  ckpt cache --json\n"
                              "  ckpt cache clear          # remote stores are untouched"),
                        no_args_is_help=False, invoke_without_command=True)


@cache_app.callback()
def cache_show(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """Where the cache is, how much it holds (per store), and its size limit."""
    if ctx.invoked_subcommand is not None:
        ctx.obj = {"json": as_json}  # `ckpt cache --json clear`: asked for before the subcommand, for it
        return
    from ckpt.store.cache import cache_usage

    s = settings()
    u = cache_usage(s)
    emit({"dir": u.root, "entries": u.entries, "bytes": u.bytes, "limit_bytes": s.cache_mb << 20, "enabled": s.cache,
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

    u = clear_cache(settings())
    emit({"dir": u.root, "entries_deleted": u.entries, "bytes_deleted": u.bytes}, as_json or (ctx.obj or {}).get("json", False),
          views.cache_clear)


tiers_app = typer.Typer(help=(
    "The local tiers training runs keep in host memory: show them, or free them.\n\n"
    "A CheckpointManager(..., local=True)'s close() keeps its tier, so that a preempted job restarts from host memory: every finished or "
    "abandoned run leaves its last local_keep snapshots in /dev/shm (RAM) until the machine restarts. Listed: "
    "each tier's run, steps, size, whether a live manager holds it, and, where --store is the run's durable "
    "store, its newest durable step and whether the tier holds steps that are not persisted.\n\n"
    "\b\nExamples:\n"
    "  ckpt tiers                               # under /dev/shm, $CKPT_LOCAL_DIR and the temp dir\n"
    "  ckpt --store s3://team/runs tiers        # and which steps only the tier holds\n"
    "  ckpt tiers --dir /nvme/tiers --json      # the parent of a local=PATH\n"
    "  ckpt --store ./runs tiers rm /dev/shm/ckpt-local-1000/3f2a9c01b7d4\n"
    "  ckpt --store ./runs tiers rm --all       # every tier not held and persisted"),
    no_args_is_help=False, invoke_without_command=True)

DirsOpt = Annotated[Optional[list[str]], typer.Option(
    "--dir", metavar="DIR", show_default=False,
    help="Look in DIR instead (repeatable): the parent of a local=PATH, or a root holding ckpt-local-UID.")]


def _durable() -> Any:
    """The CLI's store, that tiers of its runs are checked against; None where none is named and the default store
    cannot be opened (none there, say): a store named, by --store or $CKPT_STORE, must open."""
    from ckpt.errors import CkptError

    try:
        return open_store()
    except CkptError:
        if state["store"] is not None or os.environ.get("CKPT_STORE"):
            raise
        return None


def _folders(dirs: list[str] | None) -> list[str]:
    from ckpt.snapshot.local_inventory import default_folders

    return [os.path.abspath(os.path.expanduser(d)) for d in dirs] if dirs else default_folders()


@tiers_app.callback()
def tiers_show(ctx: typer.Context, dirs: DirsOpt = None, as_json: JsonOpt = False) -> None:
    """This user's local tiers: path, run, steps, size, held by a live manager, persisted or not."""
    if ctx.invoked_subcommand is not None:
        ctx.obj = {"json": as_json, "dirs": dirs}  # `ckpt tiers --json rm ...`: asked for before the subcommand, for it
        return
    from ckpt.snapshot.local_inventory import local_tiers

    durable, folders = _durable(), _folders(dirs)
    found = local_tiers(folders, durable)
    emit({"dirs": folders, "store": durable.url if durable is not None else None,
          "store_id": durable.config.store_id if durable is not None else None,
          "tiers": [t.to_json() for t in found], "bytes": sum(t.bytes for t in found if t.kind == "tier")}, as_json, views.tiers)
    if any(t.error is not None for t in found):  # (named on stderr, in --json in its row: as ls names damage)
        raise typer.Exit(1)


@tiers_app.command("rm")
def tiers_rm(ctx: typer.Context,
             paths: Annotated[Optional[list[str]], typer.Argument(metavar="PATH", show_default=False,
                                                                  help="Tier folders, as `ckpt tiers` lists them.")] = None,
             every: Annotated[bool, typer.Option("--all", help="Every tier listed (under --dir, else the default "
                                                 "folders); those held or not persisted are refused.")] = False,
             force: Annotated[bool, typer.Option("--force", help="Also remove tiers holding snapshots or checkpoints the "
                                                 "durable store lacks, damaged refs, another user's, or whose store is not "
                                                 "--store (what they hold alone is lost).")] = False,
             dirs: DirsOpt = None, as_json: JsonOpt = False) -> None:
    """Free local tiers: remove their folders (host memory under /dev/shm is freed at once).

    Refused, each in one line with nothing of it removed: a tier a live manager holds; a folder
    that is not a tier (no ckpt-local-tier.json: it may be yours) or a link; and, without
    --force, a tier holding a snapshot the durable store (--store) never held (its RUN/step-N
    never named that checkpoint; older steps than one it did are superseded, but not the tier's
    RUN/latest), a checkpoint that is no snapshot of its run, or damaged refs; another user's
    tier; or one whose durable store is not --store (whether it is persisted cannot be told).
    The exit code is then 1. A new manager of the run starts with an empty tier and restores
    from the durable store.

    \b
    Examples:
      ckpt --store ./runs tiers rm /dev/shm/ckpt-local-1000/3f2a9c01b7d4
      ckpt --store s3://team/runs tiers rm --all --json
      ckpt tiers rm --force /dev/shm/ckpt-local-1000/3f2a9c01b7d4/rank-0   # its snapshots are lost
    """
    from ckpt.errors import CkptError
    from ckpt.snapshot.local_inventory import local_tiers, remove_tier

    parent = ctx.obj or {}
    as_json = as_json or parent.get("json", False)
    dirs = dirs or parent.get("dirs")
    if every == bool(paths):
        raise typer.BadParameter("give the tiers to remove (PATH...) or --all, not both" if every else
                                 "give the tiers to remove (PATH...), or --all", param_hint="PATH")
    durable = _durable()
    if every:
        paths = [t.path for t in local_tiers(_folders(dirs)) if t.kind == "tier"]
    doc: dict[str, Any] = {"removed": [], "refused": []}
    for path in paths or []:
        try:
            doc["removed"].append(remove_tier(path, durable, force).to_json())
        except CkptError as e:  # refused: said in one line, and the others go on
            doc["refused"].append({"path": path, "error": str(e)})
    if doc["refused"]:
        doc["error"] = doc["refused"][0]["error"] if len(doc["refused"]) == 1 else \
            f"{len(doc['refused'])} of {len(paths or [])} tiers were refused (each is named)"
    emit(doc, as_json, views.tiers_rm)
    for r in doc["refused"]:
        err.print(f"error: {safe(r['error'])}")
    if doc["refused"]:
        raise typer.Exit(1)


def rm(names: Annotated[list[str], typer.Argument(metavar="NAME...", help="Refs to remove.")], as_json: JsonOpt = False) -> None:
    """Remove refs. History stays in `ckpt log`; data is freed by `ckpt gc`.

    \b
    Examples:
      ckpt rm m/ft-old m/ft-older && ckpt gc
    """
    from ckpt.errors import CkptError

    store = open_store()
    doc: dict[str, Any] = {"removed": []}
    try:
        for name in names:
            entry = store.remove(name)
            doc["removed"].append({"ref": name, "seq": entry.seq})
    except CkptError as e:  # the document printed below is the only one: it says why, as {"error"} would
        doc["error"] = str(e)
        raise
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM between two names: said as any interrupted command's document says it
        doc["error"] = f"terminated; {AFTER_INTERRUPT}" if terminated() else INTERRUPTED
        raise
    finally:  # a name that fails stops the command; the ones removed before it are still reported
        emit(doc, as_json, views.rm)


_DURATION = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([smhd]?)\Z")


def _seconds(text: str) -> float:
    m = _DURATION.match(text.strip())
    if not m:
        raise typer.BadParameter(f"{text!r} is not a duration like 30s, 10m, 1h or 2d")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


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
    store = open_store()
    grace_s = _seconds(grace)
    if grace_s < 60 and not dry_run:
        err.print(f"warning: --grace {safe(grace)}: objects of a push or copy running now elsewhere may be "
                  "deleted before its ref lands; use it only when nothing else writes to this store")
    r = store.gc(grace_s=grace_s, dry_run=dry_run, keep_history=not no_history)
    # "bytes" is the old spelling of deleted_bytes, kept for scripts (README).
    emit({"dry_run": r.dry_run, "deleted": len(r.deleted), "deleted_bytes": r.bytes, "bytes": r.bytes, "young_kept": r.young,
           "live_manifests": r.live_manifests, "live_chunks": r.live_chunks, "grace": grace,
           "objects": [{"kind": d.kind, "name": d.name, "stored_bytes": d.size, "bytes": d.size} for d in r.deleted]},
          as_json, views.gc)
