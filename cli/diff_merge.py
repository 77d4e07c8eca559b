"""Commands over the weights themselves: diff two checkpoints, merge several, remix the best-scoring."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from ckpt_store.cli import views
from ckpt_store.cli.app import JsonOpt, emit, emit_document, open_store
from ckpt_store.cli.render import RichProgress, out, safe


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
    store = open_store() if not (os.path.exists(a) and os.path.exists(b)) else None
    if plot is not None:  # not inside a store nor the system's folders (checked again as it is written)
        from ckpt.store.destination import check_file_destination

        check_file_destination(str(plot), store, "a plot")
        from ckpt.diffing.plot import check_not_an_input

        check_not_an_input(plot, (a, b))
    report = run_diff(a, b, store, include=include, exclude=exclude, estimate_delta=not no_estimate, progress=RichProgress())
    if plot is not None:
        from ckpt.diffing.plot import plot_report

        try:
            plot_report(report, plot, store)
        except OSError as e:
            raise DestinationError(f"cannot write {safe(str(plot))}: {e.strerror or e}") from None
    # diff's one result is its typed report; --json prints report.to_json.
    if as_json:
        emit_document(report.to_json(sort, top))
    else:
        views.diff(report, sort, top, plot)


def merge_epilog() -> str:
    """The line under `ckpt merge --help` that names each merge method."""
    from ckpt.merging.methods import default_registry

    return "Methods (details: --list-methods): " + "; ".join(f"{m.name}: {m.summary}" for m in default_registry())


def merge(
    refs: Annotated[Optional[list[str]], typer.Argument(metavar="REF...", help="Checkpoints to merge, in order (weights follow this order).", show_default=False)] = None,
    method: Annotated[str, typer.Option("--method", metavar="M", help="linear, task-arithmetic, ties, dare or slerp.")] = "linear",
    output: Annotated[Optional[str], typer.Option("--output", "-o", metavar="NAME", help="Ref name for the merged checkpoint.", show_default=False)] = None,
    base: Annotated[Optional[str], typer.Option("--base", "-b", metavar="REF", help="The checkpoint the inputs were fine-tuned from (task-arithmetic, ties, dare; also the source of --fill-from-base).")] = None,
    param: Annotated[Optional[list[str]], typer.Option("--param", "-p", metavar="KEY=VALUE", help="A method parameter, e.g. -p density=0.3 (repeatable; see --list-methods).")] = None,
    weights: Annotated[Optional[str], typer.Option("--weights", "-w", metavar="W1,W2,...", help="Shorthand for -p weights=W1,W2,...: one per REF.")] = None,
    fill_from_base: Annotated[bool, typer.Option("--fill-from-base", help="Take tensors missing from some input from --base instead of failing.")] = False,
    new_tensors: Annotated[str, typer.Option("--new-tensors", metavar="MODE", help="Tensors the base lacks (a classification head the fine-tunes added), or that some inputs lack and the base cannot fill: 'error' (default) or 'average' (the plain average of the inputs that have them).")] = "error",
    overflow: Annotated[str, typer.Option("--overflow", metavar="MODE", help="Merged values past their dtype's range (float16, bfloat16 and e5m2 would store inf; float8 without an infinity NaN or its largest): 'error' (default: the merge stops, naming the tensor, and writes no ref) or 'saturate' (clip them to the dtype's largest, ±65504 for float16, with a warning naming each tensor). An input's inf stays inf; a NaN the math makes from finite inputs stops the merge in either mode.")] = "error",
    message: Annotated[Optional[str], typer.Option("--message", "-m", metavar="MSG", help="Note stored with the checkpoint.")] = None,
    list_methods: Annotated[bool, typer.Option("--list-methods", help="List the merge methods and their parameters, then exit.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Merge checkpoints tensor by tensor into a new checkpoint NAME (-o).

    Parameters are checked before any work. The math runs in float32 (float64 for
    float64 tensors; linear's, task-arithmetic's and the plain average's elements
    where it overflows, again in float64) and is cast back (values past the
    dtype's range: see --overflow); one tensor at a time is held per input (or a
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
            emit_document([{"name": m.name, "summary": m.summary, "min_inputs": m.min_inputs, "max_inputs": m.max_inputs,
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

    store = open_store()
    r = run_merge(refs, method, name=output, store=store, params=params, base=base, missing="base" if fill_from_base else "error",
                  new_tensors=new_tensors, message=message, progress=RichProgress(), overflow=overflow)
    emit({"id": r.id, "ref": output, "method": r.method, "params": r.params, "inputs": list(r.inputs),
           "base": r.base, "merged_tensors": r.merged, "reused_tensors": r.reused, "from_base": list(r.from_base),
           "averaged": list(r.averaged), "files": list(r.files), "new_chunks": r.new_chunks, "written_bytes": r.written_bytes,
           "logical_bytes": r.logical_bytes, "seconds": r.seconds}, as_json, views.merge)


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
    store = open_store()
    cid = remix_scores(table, k, store=store, weights=weights, higher_is_better=not lower_is_better, name=output,
                       message=message, progress=RichProgress())
    emit({"id": cid, "ref": output, "chosen": chosen, "k": k, "weights": weights}, as_json, views.remix)
