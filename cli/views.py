"""Text output of each command, rendered from the one result the command built.

A command builds its result (a dict, or for ``diff`` the typed report); ``--json``
prints that result as it is, and these functions draw it for a terminal. Every piece of
user text goes through :func:`safe` (control characters become visible escapes), nested
values through :func:`as_text` (JSON, never a Python repr), and the consoles never
interpret rich markup, so a message like ``fix [/b] typo`` prints as written.
"""

from __future__ import annotations

from typing import Any

from rich.cells import cell_len
from rich.text import Text

from ckpt.format.manifest import lineage_fields
from ckpt_store.cli.render import as_text, err, out, ratio, safe
from ckpt_store.cli.units import human_bytes, when


class _Columns:
    """Aligned text columns, two spaces apart, with a bold header: what a rich ``Table(box=None)``
    drew, in one pass over the cells. Rich measured every cell: 1,000 refs took 1.5 s to draw,
    longer than listing them. Cells are user text, made safe (:func:`safe`) and never markup;
    widths are terminal cells (wide characters count 2); a long line is left to the terminal
    to wrap, as ``ls -l`` does."""

    def __init__(self, columns: tuple[str, ...], right: tuple[str, ...]) -> None:
        self.columns = columns
        self.right = [c in right for c in columns]
        self.rows: list[list[str]] = []

    def add_row(self, values: tuple[str, ...]) -> None:
        self.rows.append([safe(v) for v in values])

    def print(self) -> None:
        widths = [max([cell_len(h), *(cell_len(r[i]) for r in self.rows)]) for i, h in enumerate(self.columns)]
        last = len(widths) - 1

        def line(values: list[str] | tuple[str, ...]) -> str:
            parts = []
            for i, v in enumerate(values):
                pad = " " * (widths[i] - cell_len(v))
                parts.append(pad + v if self.right[i] else v if i == last else v + pad)
            return "  ".join(parts)

        out.print(Text(line(self.columns), style="bold"))
        if self.rows:
            out.print(Text("\n".join(line(r) for r in self.rows)))


def init(v: dict[str, Any]) -> None:
    out.print(f"store ready at {safe(v['url'])}" + (" (created)" if v.get("created") else ""))


def push(v: dict[str, Any]) -> None:
    out.print(f"{safe(v['ref'])} -> {v['id'][:12]}  {human_bytes(v['logical_bytes'])} in {v['chunks']} chunks; "
              f"{v['new_chunks']} new, {human_bytes(v['written_bytes'])} written")


def pull(v: dict[str, Any]) -> None:
    if v.get("copy") is not None and v.get("path") is None:
        copy(v["copy"])
    if v.get("path") is not None:
        out.print(f"wrote {safe(v['path'])}")


def ls(rows: list[dict[str, Any]]) -> None:
    """Readable refs as a table; damaged ones (rows with "error") are named by the caller on stderr."""
    damaged = [r for r in rows if "error" in r]
    rows = [r for r in rows if "error" not in r]
    if not rows:
        out.print("no readable refs" if damaged else "no refs yet: `ckpt push FILE NAME` stores a checkpoint")
        return
    t = _Columns(("REF", "ID", "SIZE", "TENSORS", "UPDATED", "MESSAGE"), ("SIZE", "TENSORS"))
    for r in rows:
        t.add_row((r["ref"], r["id"][:12], human_bytes(r["logical_bytes"]), str(r["tensors"]), when(r["time"]), r["message"] or ""))
    t.print()


def log(rows: list[dict[str, Any]], name: str) -> None:
    """History rows; damaged ones (with "error") are named by the caller on stderr."""
    for r in rows:
        if r["time"] is None:  # an entry that cannot be read
            out.print(f"#{r['seq']:<4} {'-':<19}  DAMAGED entry (named below): older versions show {safe(name)}@?, "
                      "name them by id")
            continue
        version = "?" if r["version"] is None else r["version"]  # past a damaged entry: no NAME@N
        label = "removed" if r["removed"] else f"{safe(name)}@{version}  {r['id'][:12]}"
        out.print(f"#{r['seq']:<4} {when(r['time'])}  {label}  {safe(r['message'])}".rstrip())


def show(v: dict[str, Any]) -> None:
    files, tensors = v["files"], v["tensors"]
    out.print(f"checkpoint {v['id']}\nsource     {safe(v['source'])}, {len(files)} file(s), {len(tensors)} tensors, "
              f"{human_bytes(v['logical_bytes'])} ({human_bytes(v['stored_bytes'])} stored)")
    out.print(f"created    {when(v['created'])}")
    if v.get("missing_chunks"):
        out.print(f"missing    {v['missing_chunks']} of its chunks are not in the store (`ckpt verify` names the damage)")
    if v["message"]:
        out.print(f"message    {safe(v['message'])}")
    for k, val in v["metadata"].items():
        out.print(f"meta       {safe(k)} = {as_text(val)}")
    lineage = {k: val for k, val in v["lineage"].items() if val and k != "merge"}
    if lineage:
        out.print(f"lineage    {as_text(lineage)}")
    lin = lineage_fields(v["lineage"])
    if lin["merge"] is not None:
        _merge_record(lin["merge"])
    if lin["base"]:
        out.print(f"delta base {safe(str(lin['base'])[:12])} (delta-coded tensors show their chain depth)")
    # A folder of several models (a diffusers pipeline's unet/, vae/...) may hold one name in each:
    # each row then says which file it is.
    names = [r["name"] for r in tensors]
    by_file = len(set(names)) < len(names) or len({(r.get("file") or "").rpartition("/")[0] for r in tensors}) > 1
    head = ("TENSOR", "FILE") if by_file else ("TENSOR",)
    t = _Columns((*head, "DTYPE", "SHAPE", "BYTES", "STORED", "CODEC"), ("BYTES", "STORED"))
    for r in tensors:
        codec = "+".join(r["codecs"]) + (f" (depth {r['delta_depth']})" if r["delta_depth"] else "")
        t.add_row((r["name"], *((r.get("file") or "",) if by_file else ()), r["dtype"],
                   "x".join(map(str, r["shape"])) or "scalar", human_bytes(r["logical_bytes"]), human_bytes(r["stored_bytes"]),
                   codec))
    t.print()
    others = [f for f in files if f["kind"] == "blob"]
    if others:
        out.print("other files: " + ", ".join(f"{safe(f['path'])} ({human_bytes(f['logical_bytes'])})" for f in others))
    # Safetensors metadata of the files; shards that carry the same (often {"format": "pt"}) print once.
    groups: dict[str, list[dict[str, Any]]] = {}
    for f in files:
        if f.get("metadata"):
            groups.setdefault(as_text(f["metadata"]), []).append(f)
    for same in groups.values():
        where = safe(same[0]["path"]) if len(same) == 1 else f"{len(same)} files"
        for k, val in same[0]["metadata"].items():
            out.print(f"file meta  {where}: {safe(k)} = {as_text(val)}")


def _merge_record(rec: dict[str, Any]) -> None:
    """The merge record of a manifest's lineage (:func:`~ckpt.format.manifest.lineage_fields`): method,
    parameters (as JSON), inputs and base."""
    params = ", ".join(f"{safe(k)}={as_text(val)}" for k, val in sorted((rec["params"] or {}).items()))
    out.print(f"merged     {safe(rec['method'])} ({params})")
    for cid, ref in zip(rec["inputs"], rec["input_refs"]):
        out.print(f"  input    {safe(str(cid)[:12])}" + (f"  ({safe(ref)})" if ref else ""))
    if rec["base"]:
        out.print(f"  base     {safe(str(rec['base'])[:12])}" + (f"  ({safe(rec['base_ref'])})" if rec["base_ref"] else ""))
    remix = rec["remix"]
    if isinstance(remix, dict):
        scores = ", ".join(f"{safe(r)}={as_text(s) if not isinstance(s, (int, float)) else format(s, '.4g')}"
                           for r, s in (remix.get("scores") or {}).items())
        better = "higher" if remix.get("higher_is_better") else "lower"
        out.print(f"  remix    best {as_text(remix.get('k'))} by score ({better} is better): {scores}")


def du(v: dict[str, Any]) -> None:
    t = _Columns(("REF", "LOGICAL", "STORED", "ONLY THIS REF"), ("LOGICAL", "STORED", "ONLY THIS REF"))
    for r in v["refs"]:
        t.add_row((r["ref"], human_bytes(r["logical_bytes"]), human_bytes(r["stored_bytes"]), human_bytes(r["exclusive_bytes"])))
    t.print()
    logical, stored = v["logical_bytes"], v["stored_bytes"]
    out.print(
        f"\ntotal: {human_bytes(logical)} in {len(v['refs'])} refs stored as {human_bytes(stored)} "
        f"({ratio(stored, logical)} of logical)\n"
        f"  dedup saved        {human_bytes(v['dedup_saved_bytes'])} ({ratio(v['dedup_saved_bytes'], logical)})\n"
        f"  compression saved  {human_bytes(v['compression_saved_bytes'])} ({ratio(v['compression_saved_bytes'], logical)})"
    )
    for codec, c in v["codecs"].items():
        decoded, st = c["decoded_bytes"], c["stored_bytes"]
        out.print(f"    {safe(codec):<10} {human_bytes(decoded):>10} stored as {human_bytes(st):>10} "
                  f"(saved {human_bytes(decoded - st)}, {ratio(decoded - st, decoded)} of its input)")


def verify(v: dict[str, Any]) -> None:
    for r in v.get("repaired", []):
        out.print(f"repaired {safe(r['kind'])} {safe(r['id'])} from {safe(v['repair_from'])}")
    for r in v.get("unavailable", []):
        err.print(f"cannot repair {safe(r['kind'])} {safe(r['id'])}: {safe(r['error'])}")
    for name, problems in v["damaged_refs"].items():
        err.print(f"DAMAGED {safe(name)}: {safe(problems[0])}" + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""))
    for p in v["problems"]:
        if p.startswith("store config"):
            err.print(f"DAMAGED {safe(p)}")
    if v.get("freed"):
        out.print(f"note: {len(v['freed'])} earlier version(s) no longer in the store (freed by `ckpt gc --no-history`): "
                  + ", ".join(safe(f) for f in v["freed"]))
    status = "ok" if v["ok"] else f"{len(v['problems'])} problem(s)"
    versions = f" (+{v['versions_checked']} earlier versions)" if v.get("versions_checked") else ""
    out.print(f"verified {v['refs_checked']} refs{versions}, {v['chunks_checked']} chunks, {human_bytes(v['bytes_checked'])}: {status}")


def rm(v: dict[str, Any]) -> None:
    for r in v["removed"]:
        out.print(f"removed {safe(r['ref'])}")


def copy(v: dict[str, Any]) -> None:
    names = ", ".join(safe(r) for r in v["refs"]) or "no refs"
    out.print(f"copied {names} to {safe(v['to'])}: sent {v['chunks_sent']} chunks, {v['manifests_sent']} manifests, "
              f"{v['refs_set']} ref updates ({human_bytes(v['bytes_sent'])}); {v['chunks_present']} chunks were already there")


def gc(v: dict[str, Any]) -> None:
    verb = "would delete" if v["dry_run"] else "deleted"
    uploads = sum(1 for o in v.get("objects", ()) if o.get("kind") == "upload")
    aborted = f", including {uploads} unfinished upload(s) of writes that never ended" if uploads else ""
    out.print(f"{verb} {v['deleted']} objects ({human_bytes(v['deleted_bytes'])}{aborted}); kept {v['live_manifests']} live "
              f"checkpoints, {v['live_chunks']} live chunks, {v['young_kept']} recent unreferenced objects (grace {safe(v['grace'])})")


def _num(x: Any, spec: str = ".3e") -> str:
    if x is None:
        return "-"
    return format(x, spec) if isinstance(x, (int, float)) else safe(x)


def diff(report: Any, sort: str, top: int | None, plot: Any) -> None:
    """``diff``'s result is its typed :class:`DiffReport`; ``--json`` prints ``report.to_json``."""
    t = _Columns(("TENSOR", "STATUS", "CHANGED", "REL CHANGE", "MAX |B-A|", "COSINE", "DELTA"),
               ("CHANGED", "REL CHANGE", "MAX |B-A|", "COSINE", "DELTA"))
    for r in report.select(sort, top):
        changed = "-" if r.changed_elements is None else f"{r.changed_elements}/{r.numel}"
        t.add_row((r.name, r.status + ("" if r.read else " *"), changed, _num(r.relative_change),
                          _num(r.max_abs_diff), _num(r.cosine, ".6f"), "-" if r.delta_bytes is None else human_bytes(r.delta_bytes)))
    t.print()
    s = report.summary
    out.print(
        f"\n{s.tensors} tensors: {s.changed} changed, {s.identical} identical ({s.identical_unread} by chunk ids, not read: *), "
        f"{s.added} added, {s.removed} removed, {s.shape_changed} shape changed, {s.dtype_changed} dtype changed\n"
        f"elements changed: {s.changed_elements} of {s.elements} ({ratio(s.changed_elements, s.elements)}); "
        f"relative change overall {_num(s.relative_change)}"
    )
    if s.nonfinite:
        out.print(f"{s.nonfinite} tensor(s) changed to or from NaN/inf (listed first when sorted by a statistic)")
    if s.delta_bytes is not None:
        out.print(f"B as a delta against A stores about {human_bytes(s.delta_bytes)} "
                  f"({ratio(s.delta_bytes, s.bytes_b)} of B's {human_bytes(s.bytes_b)} of tensor data)")
    if plot is not None:
        out.print(f"plot written to {safe(plot)}")


def merge(v: dict[str, Any]) -> None:
    from_base = f", {len(v['from_base'])} from the base" if v["from_base"] else ""
    from_base += f", {len(v['averaged'])} the base lacks averaged" if v.get("averaged") else ""
    from_base += f", {len(v['files'])} other files of {safe(v['inputs'][0][:12])} carried over" if v.get("files") else ""
    out.print(f"{safe(v['ref'])} -> {v['id'][:12]}  {safe(v['method'])} of {len(v['inputs'])} inputs: {v['merged_tensors']} tensors merged, "
              f"{v['reused_tensors']} reused unread{from_base}; {human_bytes(v['logical_bytes'])}, "
              f"{human_bytes(v['written_bytes'])} written in {v['seconds']:.1f} s")


def remix(v: dict[str, Any]) -> None:
    out.print(f"{safe(v['ref'])} -> {v['id'][:12]}  average of {', '.join(safe(c) for c in v['chosen'])}")


def cache(v: dict[str, Any]) -> None:
    out.print(f"cache {safe(v['dir'])}: {v['entries']} chunks, {human_bytes(v['bytes'])} of {human_bytes(v['limit_bytes'])}"
              + ("" if v["enabled"] else " (off)"))
    for sid, st in v["stores"].items():
        out.print(f"  store {safe(sid[:12])}  {st['entries']} chunks  {human_bytes(st['bytes'])}")


def cache_clear(v: dict[str, Any]) -> None:
    out.print(f"cleared {v['entries_deleted']} chunks ({human_bytes(v['bytes_deleted'])}) from {safe(v['dir'])}")


_NOT_TIERS = {"unmarked": "(no marker: not a tier)", "damaged": "(damaged marker)", "link": "(a link: not followed)",
              "file": "(a file: not a tier)"}


def _steps(steps: list[int] | None) -> str:
    if not steps:
        return "-"
    return ",".join(map(str, steps)) if len(steps) <= 4 else f"{steps[0]}..{steps[-1]} ({len(steps)})"


def tiers(v: dict[str, Any]) -> None:
    rows = v["tiers"]
    if not rows:
        where = ", ".join(safe(d) for d in v["dirs"]) or "the default folders (none exists)"
        out.print(f"no local tiers under {where}")
        return
    t = _Columns(("PATH", "RUN", "STORE", "STEPS", "SIZE", "HELD", "DURABLE", "PERSISTED"), ("SIZE",))
    for r in rows:
        held = {True: "held", False: "no", None: "-"}[r["held"]]
        if r["kind"] != "tier":
            t.add_row((r["path"], _NOT_TIERS.get(r["kind"], r["kind"]), "", "", human_bytes(r["bytes"]), held, "", ""))
            continue
        alone = ", ".join(filter(None, (_steps(r["unpersisted_steps"]) if r["unpersisted_steps"] else "",
                                        "other refs" if r["other_refs"] else "")))
        persisted = "-" if r["persisted"] is None else "yes" if r["persisted"] else f"NO: {alone}"
        durable = "-" if r["unpersisted_steps"] is None else "none" if r["durable_step"] is None else str(r["durable_step"])
        t.add_row((r["path"], r["run"], r["store_id"][:12], _steps(r["steps"]) if r["error"] is None else "?",
                   human_bytes(r["bytes"]), held, durable, persisted))
    t.print()
    for r in rows:
        if r["error"] is not None:
            err.print(f"{safe(r['path'])}: {safe(r['error'])}")
    known = "" if v["store"] is not None else " (persisted: `ckpt --store URL tiers` checks against that store)"
    n = sum(r["kind"] == "tier" for r in rows)
    out.print(f"\n{n} tier{'' if n == 1 else 's'}, {human_bytes(v['bytes'])}{known}; "
              "free one with `ckpt tiers rm PATH`")


def tiers_rm(v: dict[str, Any]) -> None:
    """The tiers removed (the refused ones are named on stderr by the command)."""
    for r in v["removed"]:
        out.print(f"removed {safe(r['path'])} (run {safe(r['run'])}, steps {_steps(r['steps'])}): "
                  f"{human_bytes(r['bytes'])} freed")
    if not v["removed"] and not v["refused"]:
        out.print("no local tiers to remove")
