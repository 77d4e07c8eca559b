"""A chart of a :class:`~ckpt.diffing.compare.DiffReport`: relative change per layer, by module type.

Tensor names of stacked models carry a layer index (``encoder.layer.3.attention.self.query.weight``).
Those tensors become a heatmap: one row per module type (the name with the index taken
out), one column per layer, colour = ‖B−A‖/‖A‖ on a log scale, the value written in
each cell. Tensors without an index (embeddings, final norm, head) get a bar chart
beside it. Identical tensors show as "0", tensors with no value (added, removed,
reshaped) as "n/a". Needs matplotlib (``pip install 'ckpt-store[plot]'``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ckpt.errors import CkptError, MissingDependencyError

if TYPE_CHECKING:
    from ckpt.diffing.compare import DiffReport, TensorDiff
    from ckpt.store.store import Store


# What one chart can hold: each tensor is one cell (or bar) drawn, about 2.5 ms and 130 KB each
# (10,000: 25 s, 1.3 GB); past this many, --include picks the tensors to plot.
MAX_CELLS = 20_000


def layer_key(name: str) -> tuple[str, int | None, str]:
    """(stack, layer index, module type) of a tensor name: its first segment that is a number
    (ASCII digits, no leading zero) is the layer index; what precedes it names the stack, what follows the module type.

    >>> layer_key("encoder.layer.3.attention.self.query.weight")
    ('encoder.layer', 3, 'attention.self.query.weight')
    >>> layer_key("embeddings.LayerNorm.bias")
    ('', None, 'embeddings.LayerNorm.bias')
    """
    parts = name.split(".")
    for i, p in enumerate(parts):
        # ASCII digits written as int() writes them: "²" is a digit int() refuses, and "03" or "٣" would
        # share layer 3's cell with "3", one tensor drawn over the other
        if p.isascii() and p.isdigit() and p == str(int(p)):
            return ".".join(parts[:i]), int(p), ".".join(parts[i + 1 :]) or "(tensor)"
    return "", None, name


# The figure's sides are bounded (a hostile checkpoint's 10,000 module types would make one of
# 3,000 inches, past what Agg can draw and many GB of pixels): rows and columns beyond what fits
# are drawn thinner, without the values written in their cells.
MAX_INCHES = 100.0
ROW_INCHES, LAYER_INCHES = 0.32, 0.8

# Text drawn as it is written: tensor names, refs and paths come from whoever made the checkpoint, and
# matplotlib reads "$...$" in them as mathtext (a name like 'w.$\\x$' ended the plot in a ValueError,
# one like 'w.$x$' was drawn as a formula).
_AS_WRITTEN = {"parse_math": False}


def _fmt(v: float | None) -> str:
    if v is None:
        return "n/a"
    if v == 0:
        return "0"
    if not math.isfinite(v):
        return str(v)  # "nan" / "inf": a diverged tensor is labelled, drawn in the "bad" colour
    return f"{v:.1e}".replace("e-0", "e-").replace("e+0", "e")


def check_not_an_input(path: str | os.PathLike[str], inputs: Iterable[object]) -> None:
    """Refuse a plot at the name of a file diffed (``inputs``: the sides as given; a weights file may have
    any name, and `ckpt diff a.safetensors b.png --plot b.png` replaced the file it had just read).
    A link at ``path`` is replaced, never written through (:func:`plot_report`): only the name counts."""
    from ckpt.errors import DestinationError

    path = os.fspath(path)
    target = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(path))), os.path.basename(path))
    for x in inputs:
        if isinstance(x, (str, os.PathLike)) and os.path.isfile(x) and os.path.realpath(x) == target:
            raise DestinationError(f"{path} is {os.fspath(x)}, a checkpoint diffed; a plot never replaces it",
                                   hint="give the plot another name")


def plot_report(report: DiffReport, path: str | os.PathLike[str], store: Store | None = None) -> str:
    """Write the chart to ``path`` (PNG, or the kind its suffix names); returns the path. Raises
    :class:`MissingDependencyError` without matplotlib, :class:`DestinationError` when it cannot
    be written, lies inside a local store (``store``, the one diffed from, or any other) or is
    a file the report compares."""
    from ckpt.store.destination import check_file_destination, create_new, write_files

    path = os.fspath(path)
    # A file in a store's folder is garbage to its gc, or read as one of its objects or refs.
    check_file_destination(path, store, "a plot")
    check_not_an_input(path, (report.a, report.b))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.collections import PatchCollection
        from matplotlib.colors import LogNorm
        from matplotlib.patches import Rectangle
        from matplotlib.ticker import NullFormatter
    except ImportError:
        raise MissingDependencyError("--plot needs matplotlib", hint="pip install 'ckpt-store[plot]'") from None
    import numpy as np

    layered: dict[tuple[str, str], dict[int, TensorDiff]] = {}
    flat: list[TensorDiff] = []
    stacks = set()
    for t in report.tensors:
        stack, idx, module = layer_key(t.name)
        if idx is None:
            flat.append(t)
        else:
            stacks.add(stack)
            layered.setdefault((stack, module), {})[idx] = t
    layers = sorted({i for row in layered.values() for i in row})
    rows = list(layered)  # first appearance: the model's own order of module types
    drawn = sum(len(row) for row in layered.values()) + len(flat)
    if drawn > MAX_CELLS:
        raise CkptError(f"too many tensors for one chart: {drawn:,} (at most {MAX_CELLS:,})",
                        hint="plot fewer tensors: ckpt diff --include 'PATTERN' ... --plot")
    values = [t.relative_change for t in report.tensors if t.relative_change and math.isfinite(t.relative_change)]
    lo, hi = (min(values), max(values)) if values else (1e-6, 1.0)
    if lo == hi:
        lo, hi = lo / 10, hi * 10
    norm = LogNorm(vmin=lo, vmax=hi)
    cmap = plt.get_cmap("viridis").with_extremes(bad="#dddddd")

    panels = [p for p in ("heat", "bars") if (p == "heat" and rows) or (p == "bars" and flat)] or ["bars"]
    tall = ROW_INCHES * max(len(rows), len(flat)) + 2.0
    wide = LAYER_INCHES * len(layers) + 3.5
    written = tall <= MAX_INCHES  # each row tall enough for the value written in it
    height = max(3.5, min(tall, MAX_INCHES))
    widths = [max(6.0, min(wide, MAX_INCHES)) if p == "heat" else 6.5 for p in panels]
    fig, axes = plt.subplots(1, len(panels), figsize=(sum(widths) + 3.5, height), layout="constrained",
                             gridspec_kw={"width_ratios": widths}, squeeze=False)
    title = f"relative change ‖B−A‖/‖A‖ per tensor — A: {report.a}   B: {report.b}"
    s = report.summary
    fig.suptitle(f"{title}\n{s.changed} changed, {s.identical} identical, {s.added} added, {s.removed} removed, "
                 f"{s.shape_changed + s.dtype_changed} reshaped/retyped of {s.tensors} tensors", fontsize=10, **_AS_WRITTEN)
    image = None
    for ax, panel in zip(axes[0], panels):
        if panel == "heat":
            # One cell per tensor, placed at its (module type, layer): a dense rows x layers grid is the
            # square of the tensors where module names differ from layer to layer (10,000: 10^8 cells).
            column = {layer: c for c, layer in enumerate(layers)}
            cells = [(r, column[layer], t) for r, key in enumerate(rows) for layer, t in sorted(layered[key].items())]
            shade = [t.relative_change if t.relative_change and math.isfinite(t.relative_change) else np.nan
                     for _, _, t in cells]
            image = PatchCollection([Rectangle((c - 0.5, r - 0.5), 1, 1) for r, c, _ in cells], cmap=cmap, norm=norm)
            image.set_array(np.ma.masked_invalid(np.array(shade, dtype=float)))
            ax.add_collection(image)
            ax.set_xlim(-0.5, len(layers) - 0.5)
            ax.set_ylim(len(rows) - 0.5, -0.5)  # the first row on top, as an image is drawn
            if written and wide <= MAX_INCHES:
                for (r, c, t), v in zip(cells, shade):
                    dark = not math.isnan(v) and norm(v) < 0.6
                    ax.text(c, r, _fmt(t.relative_change), ha="center", va="center", fontsize=7,
                            color="white" if dark else "black", **_AS_WRITTEN)
            cols = _ticks(len(layers), MAX_INCHES / LAYER_INCHES)
            ax.set_xticks(cols, [str(layers[c]) for c in cols])
            label = "layer index" + (f" ({', '.join(sorted(stacks))})" if len(stacks) == 1 else "")
            ax.set_xlabel(label, **_AS_WRITTEN)
            ys = _ticks(len(rows), MAX_INCHES / ROW_INCHES)
            ax.set_yticks(ys, [rows[r][1] if len(stacks) == 1 else f"{rows[r][0]}.*.{rows[r][1]}" for r in ys], fontsize=8, **_AS_WRITTEN)
            ax.set_title("layers, grouped by module type", fontsize=9)
        else:
            names = [t.name for t in flat]
            vals = [t.relative_change if t.relative_change and math.isfinite(t.relative_change) else 0.0 for t in flat]
            y = np.arange(len(flat))
            # Bars start at the axis' left edge (log scale has no zero); no bar for 0 or n/a.
            left = lo / 3
            ax.barh(y, [v - left if v else 0.0 for v in vals], left=left, color=[cmap(norm(v)) if v else "none" for v in vals])
            ax.set_xscale("log")
            ax.set_xlim(left, hi * 3)
            ax.xaxis.set_minor_formatter(NullFormatter())
            ys = _ticks(len(flat), MAX_INCHES / ROW_INCHES)
            ax.set_yticks(ys, [names[i] for i in ys], fontsize=8, **_AS_WRITTEN)
            ax.invert_yaxis()
            for i, t in enumerate(flat if written else ()):
                note = "identical" if t.status == "identical" else t.status if t.status != "changed" else ""
                ax.text(left * 1.1, i, f"{_fmt(t.relative_change)}" + (f"  ({note})" if note else ""), va="center", fontsize=7, **_AS_WRITTEN)
            ax.set_xlabel("relative change (log)")
            ax.set_title("tensors outside the layer stack", fontsize=9)
    if image is not None:
        fig.colorbar(image, ax=axes[0].tolist(), label="‖B−A‖/‖A‖ (log)", shrink=0.9)
    kind = os.path.splitext(path)[1][1:].lower() or "png"  # the temporary's name ends otherwise

    def fill(tmps: list[str]) -> None:
        with os.fdopen(create_new(tmps[0]), "wb") as f:
            fig.savefig(f, dpi=110, bbox_inches="tight", format=kind)
            f.flush()
            os.fsync(f.fileno())

    try:
        # As a pull writes a file: whole or not at all (Ctrl-C while drawing leaves no half image
        # under the name), and a symbolic link at the name is replaced, never written through.
        write_files([path], fill)
    finally:
        plt.close(fig)
    return path


def _ticks(n: int, room: float) -> list[int]:
    """Which of ``n`` rows (or columns) get a label: every one where ``room`` labels fit, else evenly spaced ones."""
    step = max(1, math.ceil(n / max(1.0, room)))
    return list(range(0, n, step))
