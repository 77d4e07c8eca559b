"""Geometry of the pages' charts, computed here and drawn by the templates as inline SVG.

Pure functions of the documents in :mod:`ckpt_store.cli.web.data`: the layer x module
heatmap of a diff (the grouping of ``ckpt diff --plot``: :func:`ckpt.diffing.plot.layer_key`),
the bars of what dedup and each codec saved, and a run's metrics against its steps.
"""

from __future__ import annotations

import math
from typing import Any

from ckpt.diffing.plot import layer_key
from ckpt_store.cli.units import human_bytes

# viridis at five stops: dark = small change, yellow = large
_VIRIDIS = [(0.0, (68, 1, 84)), (0.25, (59, 82, 139)), (0.5, (33, 145, 140)), (0.75, (94, 201, 98)), (1.0, (253, 231, 37))]


def color(t: float) -> str:
    """Viridis at ``t`` in [0, 1] as #rrggbb."""
    t = min(1.0, max(0.0, t))
    for (t0, c0), (t1, c1) in zip(_VIRIDIS, _VIRIDIS[1:]):
        if t <= t1:
            f = (t - t0) / (t1 - t0)
            return "#%02x%02x%02x" % tuple(round(a + (b - a) * f) for a, b in zip(c0, c1))
    return "#fde725"


def fmt(v: float | str | None) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, str):  # "nan", "inf", "-inf": how a diff's JSON carries a diverged tensor's change
        return v
    if v == 0:
        return "0"
    return f"{v:.1e}".replace("e-0", "e-").replace("e+0", "e")


def heatmap(tensors: list[dict[str, Any]], cell_w: int = 46, cell_h: int = 22) -> dict[str, Any]:
    """Cells of relative change ‖B−A‖/‖A‖: one row per (stack, module type), one column per
    layer index, colour on a log scale; tensors without a layer index as a list beside it."""
    grid: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    flat = []
    for t in tensors:
        stack, idx, module = layer_key(t["name"])
        if idx is None:
            flat.append(t)
        else:
            grid.setdefault((stack, module), {})[idx] = t
    layers = sorted({i for row in grid.values() for i in row})
    stacks = {s for s, _ in grid}
    values = [v for t in tensors if (v := _finite(t.get("relative_change")))]  # not "nan"/"inf" (diverged)
    lo, hi = (min(values), max(values)) if values else (1e-6, 1.0)
    if lo == hi:
        lo, hi = lo / 10, hi * 10
    span = math.log10(hi) - math.log10(lo)
    labels = [f"{s}.*.{m}" if len(stacks) > 1 else m for s, m in grid] + [t["name"] for t in flat]
    label_w = 16 + 7 * min(40, max((len(x) for x in labels), default=10))  # labels are cut at 40 characters

    def cell(t: dict[str, Any]) -> dict[str, Any]:
        v = t.get("relative_change")
        if v is None:
            return {"fill": "#dddddd", "text": "n/a", "title": f"{t['name']}: {t['status']}", "name": t["name"], "dark": False}
        if v == 0:
            return {"fill": "#eeeeee", "text": "0", "title": f"{t['name']}: identical", "name": t["name"], "dark": False}
        if _finite(v) is None:  # "nan" / "inf": labelled, in the grey of what cannot be placed on the scale
            return {"fill": "#dddddd", "text": fmt(v), "title": f"{t['name']}: {t['status']}, relative change {v}",
                    "name": t["name"], "dark": False}
        f = (math.log10(v) - math.log10(lo)) / span
        return {"fill": color(f), "text": fmt(v), "title": f"{t['name']}: {t['status']}, relative change {v:.4g}",
                "name": t["name"], "dark": f < 0.6, "value": v}

    rows = []
    column = {layer: c for c, layer in enumerate(layers)}
    for r, ((stack, module), by_layer) in enumerate(grid.items()):
        label = f"{stack}.*.{module}" if len(stacks) > 1 else module
        # the cells of its tensors only: rows x layers of them, mostly empty, grew as the square of the
        # tensors where module names differ from layer to layer (10,000 such tensors: 10^8 cells, many GB)
        rows.append({"label": label, "y": 24 + r * cell_h,
                     "cells": [{"x": label_w + column[layer] * cell_w, **cell(t)} for layer, t in sorted(by_layer.items())]})
    bars = []
    for k, t in enumerate(flat):
        c = cell(t)
        v = t.get("relative_change")
        w = 0 if not _finite(v) else max(2.0, 200 * (math.log10(v) - math.log10(lo)) / span + 8)
        bars.append({"label": t["name"], "y": 4 + k * cell_h, "w": w, **c})
    return {"layers": [{"x": label_w + c * cell_w, "label": layer} for c, layer in enumerate(layers)], "rows": rows,
            "cell_w": cell_w, "cell_h": cell_h - 2, "label_w": label_w,
            "width": label_w + len(layers) * cell_w + 10, "height": 30 + len(rows) * cell_h,
            "bars": bars, "bars_height": 10 + len(bars) * cell_h, "lo": fmt(lo), "hi": fmt(hi), "drawn": len(tensors),
            "legend": [color(i / 10) for i in range(11)]}


def savings_bars(du: dict[str, Any], width: int = 520) -> dict[str, Any]:
    """Bars of ``ckpt du``: logical, after dedup, stored; and per codec what it saved."""
    logical = du["logical_bytes"] or 1
    scale = max(logical, du["unique_bytes"], du["stored_bytes"], 1)  # a store of tiny tensors stores more than it holds
    rows = [("logical (as pushed)", du["logical_bytes"], "#8899aa"),
            ("after dedup", du["unique_bytes"], "#4477aa"),
            ("stored (chunks + manifests)", du["stored_bytes"], "#228833")]
    bars = [{"label": label, "value": v, "text": human_bytes(v), "w": max(1.0, width * v / scale), "fill": fill} for label, v, fill in rows]
    saved = [("dedup saved", du["dedup_saved_bytes"])] + [
        (f"{name} saved", c["decoded_bytes"] - c["stored_bytes"]) for name, c in du["codecs"].items()]
    top = max([v for _, v in saved] + [1])
    saved_bars = [{"label": label, "value": v, "text": human_bytes(v) + (f" ({100 * v / logical:.1f}% of logical)" if v > 0 else ""),
                   "w": max(1.0, width * max(v, 0) / top), "fill": "#cc6677" if label == "dedup saved" else "#ddaa33"} for label, v in saved]
    for i, b in enumerate(bars + saved_bars):
        b["y"] = 10 + i * 28 + (14 if i >= len(bars) else 0)
    return {"bars": bars + saved_bars, "label_w": 230, "width": 230 + width + 220, "height": 30 + 28 * (len(bars) + len(saved_bars))}


def _finite(v: Any) -> float | None:
    """``v`` as a float, where it is a number a chart can place (not a bool, NaN, infinity, or an
    integer too large for a float: a manifest's metrics are any JSON)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def metric_text(v: Any) -> str:
    """A metric's value in a table cell: numbers to 6 significant digits, anything else as it is."""
    f = _finite(v)
    return format(f, ".6g") if f is not None else str(v)


def run_chart(snapshots: list[dict[str, Any]], metric: str, width: int = 720, height: int = 180) -> dict[str, Any]:
    """Points (step, metric) of a run's snapshots; kept ones filled, removed ones hollow."""
    pts = [(s, v) for s in snapshots if (v := _finite(s["metrics"].get(metric))) is not None]
    steps = [s["step"] for s in snapshots] or [0]
    x0, x1 = min(steps), max(steps)
    vals = [v for _, v in pts] or [0.0]
    y0, y1 = min(vals), max(vals)
    if x0 == x1:
        x1 = x0 + 1
    if y0 == y1 and abs(y0) < 1e15:  # one value: a band around it (at 1e308, y0 - 1 is y0: drawn across the middle)
        y0, y1 = y0 - 1, y1 + 1
    left, right, top, bottom = 70, 20, 16, 30

    span = y1 - y0

    def px(step: float) -> float:
        return left + (width - left - right) * (step - x0) / (x1 - x0)

    def py(v: float) -> float:  # values are any finite floats: halved first where the span overflows (1e308 - -1e308)
        f = 0.5 if span == 0 else (v - y0) / span if math.isfinite(span) else (v / 2 - y0 / 2) / (y1 / 2 - y0 / 2)
        return top + (height - top - bottom) * (1 - f)

    points = [{"x": round(px(s["step"]), 1), "y": round(py(v), 1), "step": s["step"],
               "value": s["metrics"][metric], "live": s["live"], "latest": s["latest"], "ref": s["ref"],
               "url": s.get("url"), "local_only": s.get("local_only", False)} for s, v in pts]
    marks = [{"x": round(px(s["step"]), 1), "live": s["live"], "step": s["step"]} for s in snapshots]
    return {"metric": metric, "width": width, "height": height, "points": points, "marks": marks,
            "path": " ".join(f"{'M' if i == 0 else 'L'}{p['x']},{p['y']}" for i, p in enumerate(points)),
            "axis_y": height - bottom, "left": left, "right": width - right,
            "y_labels": [{"y": round(py(v), 1), "text": f"{v:.4g}"} for v in (y0, y0 / 2 + y1 / 2, y1)],
            "x_labels": [{"x": round(px(v), 1), "text": str(round(v))} for v in (x0, (x0 + x1) / 2, x1)]}
