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
from typing import TYPE_CHECKING

from ckpt.errors import CkptError, MissingDependencyError

if TYPE_CHECKING:
    from ckpt.diffing.compare import DiffReport, TensorDiff
    from ckpt.store.store import Store


# What one chart can hold: every cell of the heatmap is drawn and labelled (a millisecond each), and an
# image past 2**16 pixels a side cannot be saved. Names that put each tensor in a layer and a module
# type of its own ("s.7.m7") made the grid quadratic in the tensors: 300 of them took three minutes.
MAX_CELLS = 20_000  # module types x layers
MAX_ROWS = 1_500  # module types, or tensors outside the stack
MAX_LAYERS = 600


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


def _fmt(v: float | None) -> str:
    if v is None:
        return "n/a"
    if v == 0:
        return "0"
    if not math.isfinite(v):
        return str(v)  # "nan" / "inf": a diverged tensor is labelled, drawn in the "bad" colour
    return f"{v:.1e}".replace("e-0", "e-").replace("e+0", "e")


def plot_report(report: DiffReport, path: str | os.PathLike[str], store: Store | None = None) -> str:
    """Write the chart to ``path`` (PNG, or the kind its suffix names); returns the path. Raises
    :class:`MissingDependencyError` without matplotlib, :class:`DestinationError` when it cannot
    be written or lies inside a local store (``store``, the one diffed from, or any other)."""
    from ckpt.store.destination import check_outside_stores, create_new, write_files

    path = os.fspath(path)
    # A file in a store's folder is garbage to its gc, or read as one of its objects or refs.
    check_outside_stores(path, store, "a plot")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import LogNorm
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
    if len(rows) * len(layers) > MAX_CELLS or max(len(rows), len(flat)) > MAX_ROWS or len(layers) > MAX_LAYERS:
        raise CkptError(f"too many tensors for one chart: {len(rows)} module types x {len(layers)} layers, "
                        f"{len(flat)} tensors outside the stack (at most {MAX_CELLS:,} cells, {MAX_ROWS:,} rows, "
                        f"{MAX_LAYERS} layers)", hint="plot fewer tensors: ckpt diff --include 'PATTERN' ... --plot")
    values = [t.relative_change for t in report.tensors if t.relative_change and math.isfinite(t.relative_change)]
    lo, hi = (min(values), max(values)) if values else (1e-6, 1.0)
    if lo == hi:
        lo, hi = lo / 10, hi * 10
    norm = LogNorm(vmin=lo, vmax=hi)
    cmap = plt.get_cmap("viridis").with_extremes(bad="#dddddd")

    panels = [p for p in ("heat", "bars") if (p == "heat" and rows) or (p == "bars" and flat)] or ["bars"]
    height = max(3.5, 0.32 * max(len(rows), len(flat)) + 2.0)
    widths = [max(6.0, 0.8 * len(layers) + 3.5) if p == "heat" else 6.5 for p in panels]
    fig, axes = plt.subplots(1, len(panels), figsize=(sum(widths) + 3.5, height), layout="constrained",
                             gridspec_kw={"width_ratios": widths}, squeeze=False)
    title = f"relative change ‖B−A‖/‖A‖ per tensor — A: {report.a}   B: {report.b}"
    s = report.summary
    fig.suptitle(f"{title}\n{s.changed} changed, {s.identical} identical, {s.added} added, {s.removed} removed, "
                 f"{s.shape_changed + s.dtype_changed} reshaped/retyped of {s.tensors} tensors", fontsize=10)
    image = None
    for ax, panel in zip(axes[0], panels):
        if panel == "heat":
            grid = np.full((len(rows), len(layers)), np.nan)
            text = [["" for _ in layers] for _ in rows]
            for r, key in enumerate(rows):
                for c, layer in enumerate(layers):
                    t = layered[key].get(layer)
                    if t is None:
                        continue
                    v = t.relative_change
                    grid[r, c] = v if v and math.isfinite(v) else np.nan
                    text[r][c] = _fmt(v)
            image = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap=cmap, norm=norm)
            for r in range(len(rows)):
                for c in range(len(layers)):
                    v = grid[r, c]
                    dark = not math.isnan(v) and norm(v) < 0.6
                    ax.text(c, r, text[r][c], ha="center", va="center", fontsize=7, color="white" if dark else "black")
            ax.set_xticks(range(len(layers)), [str(i) for i in layers])
            label = "layer index" + (f" ({', '.join(sorted(stacks))})" if len(stacks) == 1 else "")
            ax.set_xlabel(label)
            ax.set_yticks(range(len(rows)), [m if len(stacks) == 1 else f"{st}.*.{m}" for st, m in rows], fontsize=8)
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
            ax.set_yticks(y, names, fontsize=8)
            ax.invert_yaxis()
            for i, t in enumerate(flat):
                note = "identical" if t.status == "identical" else t.status if t.status != "changed" else ""
                ax.text(left * 1.1, i, f"{_fmt(t.relative_change)}" + (f"  ({note})" if note else ""), va="center", fontsize=7)
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
