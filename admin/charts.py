"""The console's charts as geometry: rectangles and labels in an SVG's coordinates, which the
templates draw (admin/templates/chart.j2), escaped like any other text. Computed here, on the
server, so the pages need no script."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

WIDTH = 720.0
ROW_H = 18.0  # a row of a bars chart
LABEL_W = 150.0  # the rows' labels, left of the bars
COLUMNS_H = 160.0  # the plot of a columns chart, above its labels
GAP = 4.0


@dataclass(frozen=True)
class Span:
    """A part of a row: from `start` for `length`, in the row's unit; `kind` is its CSS class."""

    start: float
    length: float
    kind: str


@dataclass(frozen=True)
class Row:
    label: str
    spans: tuple[Span, ...]
    title: str = ""  # the tooltip of its bars


@dataclass(frozen=True)
class Rect:
    x: float
    y: float
    w: float
    h: float
    kind: str
    title: str


@dataclass(frozen=True)
class Label:
    x: float
    y: float
    text: str
    anchor: str = "start"


@dataclass(frozen=True)
class Chart:
    width: float
    height: float
    rects: tuple[Rect, ...]
    labels: tuple[Label, ...]


def bars(rows: Sequence[Row], unit: str) -> Chart:
    """Horizontal bars, a row each, on one scale: the largest end spans the plot. A session's
    timeline (a request a row: queue, prefill, decode from its start) and a tier's tokens."""
    end = max((s.start + s.length for r in rows for s in r.spans), default=0.0) or 1.0
    scale = (WIDTH - LABEL_W - GAP) / end
    rects: list[Rect] = []
    labels: list[Label] = []
    for i, row in enumerate(rows):
        y = i * ROW_H
        labels.append(Label(LABEL_W - GAP, y + ROW_H - 5, row.label, "end"))
        for s in row.spans:
            if s.length > 0:
                w = max(s.length * scale, 1.0)  # a short stage stays visible
                x = LABEL_W + s.start * scale
                rects.append(Rect(x, y + 2, w, ROW_H - 4, s.kind, f"{row.title} {s.kind}"))
    height = len(rows) * ROW_H + ROW_H
    labels.append(Label(LABEL_W, height - 4, "0"))
    labels.append(Label(WIDTH, height - 4, f"{end:,.0f} {unit}", "end"))
    return Chart(WIDTH, height, tuple(rects), tuple(labels))


def columns(points: Sequence[tuple[str, float]], unit: str, kind: str = "value") -> Chart:
    """Vertical bars, a point each (a day's cost), from zero to the largest."""
    top = max((v for _, v in points), default=0.0) or 1.0
    step = WIDTH / max(len(points), 1)
    rects: list[Rect] = []
    labels: list[Label] = [Label(0, 12, f"{top:,.2f} {unit}")]
    for i, (name, value) in enumerate(points):
        h = value / top * (COLUMNS_H - ROW_H)
        x = i * step + 1
        rects.append(Rect(x, COLUMNS_H - h, step - 2, h, kind, f"{name}: {value:,.2f} {unit}"))
        if i % max(len(points) // 6, 1) == 0:  # a few dates along the axis, not all
            labels.append(Label(x, COLUMNS_H + 14, name))
    return Chart(WIDTH, COLUMNS_H + ROW_H, tuple(rects), tuple(labels))
