"""Commands that tidy a store and the machine: rm, gc, and the local chunk cache (cache, cache clear)."""

from __future__ import annotations

import re
from typing import Annotated, Any

import typer

from ckpt_store.cli import views
from ckpt_store.cli.app import JsonOpt, emit, open_store, settings
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
