"""``%gpumem --plot``: device memory per cell over the session, drawn three ways.

The data is ``timeline.series(records)`` (one series per device, one point per cell record); this module only
draws it: a matplotlib figure (:func:`figure`), an SVG (:func:`svg`) or sparklines (:func:`sparklines`), all
carried by :class:`TimelinePlot`.
"""

from __future__ import annotations

import html
import io
import math
import re
import struct
from typing import Any, List, Optional, Sequence, Tuple

from . import report, timeline

__all__ = ["TimelinePlot", "SERIES", "FREED_LABEL", "DRAIN_LABEL", "OUTSIDE_DRAIN_LABEL", "drains_label", "EMPTY",
           "figure", "png", "png_size", "svg", "sparklines", "positions"]

#: (key of a timeline point, label, colour), drawn in this order
SERIES: Tuple[Tuple[str, str, str], ...] = (
    ("used_bytes", "used (after cleanup)", "#1f5fa8"),
    ("live_bytes", "live", "#2a9d3a"),
    ("cached_bytes", "cached", "#e07b10"),
    ("outside_bytes", "outside every pool", "#6f6f6f"),
)
FREED_LABEL = "freed by the cleanup"
FREED_COLOR = "#c62828"
DRAIN_LABEL = "%gpumem --drain"
OUTSIDE_DRAIN_LABEL = "drain from outside"  # gpucleanup drain, the page's Drain


def drains_label(points: List[dict]) -> str:
    """The label of the drains among ``points`` (records with no cell): ``%gpumem --drain``, a drain from outside
    the kernel, or both."""
    kinds = {p.get("source") == "outside" for p in points if p.get("cell") is None}
    if kinds == {True}:
        return OUTSIDE_DRAIN_LABEL
    return f"{DRAIN_LABEL} or {OUTSIDE_DRAIN_LABEL}" if kinds == {True, False} else DRAIN_LABEL
DRAIN_COLOR = "#7b4fa8"

#: what --plot says when the history holds no GPU use
# A record is made as a cell ends: this cell's comes after the plot, and a cleanup before any cell (the
# extension loaded at startup) is its first cell's. So "no cell has used the GPU" would be untrue beside a line that
# freed memory.
EMPTY = (f"{report.PREFIX}{report.SEP}nothing to plot yet: a record is made as each cell ends (this cell's comes "
         "after it), so %gpumem --plot draws from the next cell on")

# what XML 1.0 cannot hold and a terminal would act on
_CONTROL = re.compile("[\x00-\x1f\x7f\ufffe\uffff]")
# the PNG is drawn this many times denser than it is shown (sharp on HiDPI screens)
_DENSITY = 2
# up to this many freed markers all get their amount written; past it, only this many, the largest
_LABELLED = 12
# more records than this are drawn in groups (a point per group): an image of 100,000 records
# would take seconds and, as SVG, tens of MiB in the notebook, for no more pixels
_DRAWN = 1000
# a sparkline is at most this many marks; more records share a mark (the largest value in it)
_SPARK_WIDTH = 60
_BLOCKS = "▁▂▃▄▅▆▇█"


# ---------------------------------------------------------------- shared layout


def positions(points: Sequence[dict]) -> Tuple[List[float], bool]:
    """Where each point goes on the x axis, and whether that is by order (True) or by cell number.

    Cells sit at their number; records with no cell (a drain between cells) share the gap
    between the cells around them, evenly, in the order they came. Cell numbers that do not
    go up (``%reset``) place every point by its order (1, 2, ...) instead."""
    cells = [p.get("cell") for p in points]
    known = [c for c in cells if c is not None]
    if any(b <= a for a, b in zip(known, known[1:])):
        return [float(i + 1) for i in range(len(points))], True
    xs: List[float] = [0.0] * len(points)
    i = 0
    while i < len(points):
        if cells[i] is not None:
            xs[i] = float(cells[i])
            i += 1
            continue
        j = i
        while j < len(points) and cells[j] is None:
            j += 1
        before = cells[i - 1] if i > 0 else None
        after = cells[j] if j < len(points) else None
        run = j - i
        if before is not None and after is not None:
            lo, hi = before, after
        elif before is not None:
            lo, hi = before, before + 1
        elif after is not None:
            lo, hi = after - 1, after
        else:
            lo, hi = 0, run + 1
        for k in range(run):
            xs[i + k] = lo + (hi - lo) * (k + 1) / (run + 1)
        i = j
    return xs, False


class _Panel:
    """One device's series, placed and scaled: what every drawing reads.

    X axis: the cell numbers (``In [N]``), placed by :func:`positions`. Y axis: GiB, MiB, ... as
    ``report.format_bytes`` would pick for the device's largest value."""

    def __init__(self, device: dict):
        self.index = device.get("index")
        self.name = device.get("name")
        self.total = device.get("total_bytes")
        #: every point of the device (the text reads these)
        self.records: List[dict] = list(device.get("points") or [])
        xs, self.by_order = positions(self.records)
        drains = [x for x, p in zip(xs, self.records) if p.get("cell") is None]
        #: records per drawn point: more than _DRAWN records are drawn in groups
        self.per = math.ceil(len(self.records) / _DRAWN) if len(self.records) > _DRAWN else 1
        #: the points drawn, and where
        self.points, self.xs = _grouped(self.records, xs, self.per) if self.per > 1 else (self.records, xs)
        self._drains = drains
        # the driver's name, without control characters (a terminal would act on them; XML cannot hold them)
        short = _CONTROL.sub("\ufffd", report.short_device_name(self.name))
        self.label = f"GPU{self.index}" + (f" {short}" if short else "")
        self.title = self.label + (f" · {report.format_bytes(self.total)} total" if self.total else "")
        highest = 0
        for p in self.points:
            for key, _, _ in SERIES:
                highest = max(highest, p.get(key) or 0)
            if p.get("freed_bytes"):
                highest = max(highest, self.freed_top(p))
        self.highest = highest
        self.unit, self.size = report._unit_for(highest)
        self._freed = [(x, p) for x, p in zip(self.xs, self.points) if p.get("freed_bytes")]
        #: how large the freed markers are drawn (1: few of them; smaller when there are many)
        self.marker_scale = 1.0 if len(self._freed) <= _LABELLED else 0.5

    @staticmethod
    def freed_top(point: dict) -> int:
        """Where a freed marker sits: the level before the cleanup."""
        before = point.get("used_before_bytes")
        if before is not None:
            return before
        used = point.get("used_bytes")
        return (used or 0) + (point.get("freed_bytes") or 0)

    def values(self, key: str) -> List[Optional[float]]:
        return [None if p.get(key) is None else p[key] / self.size for p in self.points]

    def freed(self) -> List[Tuple[float, dict]]:
        """(x, point) of each cleanup that freed something."""
        return self._freed

    def drains(self) -> List[float]:
        return self._drains

    def drain_label(self) -> str:
        """What this panel's drains were: ``%gpumem --drain``, drains from outside the kernel, or both."""
        return drains_label(self.records)

    def labelled(self) -> set:
        """The x of the freed markers whose amount is written: all of them when they are few, else
        the largest ones (the first of equals) that are not too close to one already written."""
        freed = self.freed()
        if len(freed) <= _LABELLED:
            return {x for x, _ in freed}
        gap = (max(self.xs) - min(self.xs)) / _LABELLED
        chosen: List[float] = []
        for x, _ in sorted(freed, key=lambda xp: -xp[1]["freed_bytes"]):
            if all(abs(x - c) >= gap for c in chosen):
                chosen.append(x)
                if len(chosen) == _LABELLED:
                    break
        return set(chosen)

    def label_at(self, x: float) -> str:
        """The tick label at ``x`` when points go by order: that record's cell ("drain": none)."""
        i = round(x) - 1
        if not self.by_order or not 0 <= i < len(self.records):
            return ""
        cell = self.records[i].get("cell")
        return "drain" if cell is None else str(cell)

    def xlabel(self) -> str:
        text = "cell (In [N])" if not self.by_order else "cell, in the order run (In [N])"
        if self.per > 1:
            text += f"; each point: the largest of {self.per} records (freed: their sum)"
        return text

    def cell_range(self) -> str:
        cells = [p.get("cell") for p in self.records if p.get("cell") is not None]
        drains = sum(1 for p in self.records if p.get("cell") is None)
        parts = []
        if self.by_order:
            parts.append(f"{len(cells)} cells (numbering restarted: [{cells[0]}] … [{cells[-1]}])")
        elif cells:
            parts.append(f"cell [{cells[0]}]" if len(cells) == 1 else f"cells [{cells[0]}]–[{cells[-1]}]")
        if drains:
            parts.append(f"{drains} drain{'s' if drains != 1 else ''}")
        return ", ".join(parts)


def _grouped(points: Sequence[dict], xs: Sequence[float], per: int) -> Tuple[List[dict], List[float]]:
    """Consecutive records ``per`` at a time, as one point each at the place of the group's last:
    the largest of each value (unknown only when unknown in all), freed bytes summed. More than 1,000 records of a
    device (``history_size`` allows 100,000) are drawn so, and the axis says so."""
    out: List[dict] = []
    where: List[float] = []
    for start in range(0, len(points), per):
        group = points[start:start + per]
        point: dict = {"cell": next((p.get("cell") for p in reversed(group) if p.get("cell") is not None), None)}
        for key in ("used_bytes", "used_before_bytes", "live_bytes", "cached_bytes", "outside_bytes"):
            known = [p.get(key) for p in group if p.get(key) is not None]
            point[key] = max(known) if known else None
        point["freed_bytes"] = sum(p.get("freed_bytes") or 0 for p in group)
        out.append(point)
        where.append(xs[start + len(group) - 1])
    return out, where


def _panels(data: dict) -> List[_Panel]:
    return [_Panel(d) for d in (data or {}).get("devices") or [] if d.get("points")]


def _nice_step(span: float, count: int) -> float:
    """A step of 1, 2, 2.5 or 5 times a power of ten that cuts ``span`` into about ``count`` parts."""
    if span <= 0:
        return 1.0
    raw = span / count
    magnitude = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if m * magnitude >= raw * 0.999:
            return m * magnitude
    return 10 * magnitude


def _tick_text(value: float) -> str:
    return f"{round(value, 6):g}"


# ---------------------------------------------------------------- matplotlib


def figure(data: dict):
    """The matplotlib ``Figure`` of a timeline: one panel (Axes) per device in use.

    Each panel has one line per series of ``SERIES`` that has a value (labelled as there),
    the freed markers (one scatter labelled ``FREED_LABEL``) and a dotted vertical line per
    drain (``DRAIN_LABEL``). Raises ValueError for a timeline with no point.

    The series are used (after the cleanup), live, cached and outside every pool, as lines over the cell numbers;
    what each cleanup freed is a downward marker at the level before it, sized by the bytes freed (the largest ones
    labelled). Built with ``matplotlib.figure.Figure`` and rendered by ``FigureCanvasAgg`` directly, never through
    pyplot: the user's backend, current figure and interactive state are left as they are, and nothing of theirs is
    closed.
    """
    from matplotlib import patheffects
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    panels = _panels(data)
    if not panels:
        raise ValueError("the timeline has no point to draw")
    fig = Figure(figsize=(9.0, 0.4 + 2.9 * len(panels)), dpi=100, layout="constrained", facecolor="white")
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    nan = float("nan")
    for ax, panel in zip(axes, panels):
        ax.set_facecolor("white")
        xs = panel.xs
        marker = "o" if len(xs) <= 40 else None
        for key, label, color in SERIES:
            ys = panel.values(key)
            if all(y is None for y in ys):
                continue  # never known (outside every pool on an old record): no line rather than a flat zero
            ys = [nan if y is None else y for y in ys]
            main = key == "used_bytes"
            ax.plot(xs, ys, label=label, color=color, linewidth=2.4 if main else 1.5,
                    linestyle="--" if key == "outside_bytes" else "-", marker=marker, markersize=3.5 if main else 2.5,
                    zorder=3 if main else 2)
            if main:
                ax.fill_between(xs, ys, 0, color=color, alpha=0.08, linewidth=0, zorder=1)
        freed = panel.freed()
        if freed:
            biggest = max(p["freed_bytes"] for _, p in freed)
            fx = [x for x, _ in freed]
            fy = [_Panel.freed_top(p) / panel.size for _, p in freed]
            sizes = [(30 + 150 * math.sqrt(p["freed_bytes"] / biggest)) * panel.marker_scale for _, p in freed]
            drops = [(x, top, p["used_bytes"] / panel.size) for x, top, (_, p) in zip(fx, fy, freed)
                     if p.get("used_bytes") is not None]
            if drops:  # from the level before the cleanup down to the level after it
                ax.vlines([d[0] for d in drops], [d[2] for d in drops], [d[1] for d in drops], colors=FREED_COLOR,
                          linewidth=1, linestyles=":", alpha=0.7, zorder=2)
            ax.scatter(fx, fy, s=sizes, marker="v", color=FREED_COLOR, edgecolors="white", linewidths=0.6,
                       label=FREED_LABEL, zorder=4)
            labelled = panel.labelled()
            for x, top, (_, p) in zip(fx, fy, freed):
                if x in labelled:
                    ax.annotate(report.format_bytes(p["freed_bytes"]), (x, top), xytext=(0, 7),
                                textcoords="offset points", ha="center", va="bottom", fontsize=8, color=FREED_COLOR,
                                path_effects=[patheffects.withStroke(linewidth=2.5, foreground="white")])
        if panel.drains():
            ax.vlines(panel.drains(), 0, 1, transform=ax.get_xaxis_transform(), colors=DRAIN_COLOR, linestyles=":",
                      linewidth=1.2, label=panel.drain_label(), zorder=1)
        ax.set_title(panel.title, loc="left", fontsize=11)
        ax.set_ylabel(panel.unit)
        ax.set_xlabel(panel.xlabel())
        top = panel.highest / panel.size if panel.highest else 1.0
        ax.set_ylim(0, top * 1.18)
        ax.set_xlim(min(xs) - 0.6, max(xs) + 0.6)
        ax.grid(True, color="#dddddd", linewidth=0.8)
        ax.set_axisbelow(True)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=12, integer=True))
        if panel.by_order:
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos, panel=panel: panel.label_at(v)))
    # one legend, beside the first panel, for what any panel draws
    handles = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    order = [label for _, label, _ in SERIES] + [FREED_LABEL, DRAIN_LABEL, OUTSIDE_DRAIN_LABEL,
                                                 f"{DRAIN_LABEL} or {OUTSIDE_DRAIN_LABEL}"]
    labels = [label for label in order if label in handles]
    axes[0].legend([handles[label] for label in labels], labels, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                   fontsize=9, frameon=False, borderaxespad=0)
    return fig


def png(data: dict, dpi: int = 100, scale: int = _DENSITY) -> bytes:
    """The timeline's figure as PNG bytes, drawn ``scale`` times denser than ``dpi`` (for HiDPI screens)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = figure(data)
    FigureCanvasAgg(fig)  # this figure's own canvas: no pyplot, no global backend
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=dpi * scale, facecolor="white")
    return out.getvalue()


def png_size(data: bytes) -> Tuple[int, int]:
    """(width, height) in pixels, from the PNG header."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise ValueError("not a PNG")
    return struct.unpack(">II", data[16:24])


# ---------------------------------------------------------------- SVG



def _esc(text: Any) -> str:
    """Text for an SVG element or attribute: XML-escaped, without the characters XML cannot hold."""
    return html.escape(_CONTROL.sub("\ufffd", str(text)), quote=True)


def _num(v: float) -> str:
    return f"{v:.1f}".rstrip("0").rstrip(".")


_W, _LEFT, _RIGHT, _PANEL_H, _TOP, _BOTTOM = 820, 62, 178, 250, 34, 44


def svg(data: dict) -> str:
    """The timeline as an SVG document (a str), the same picture as ``figure`` without matplotlib.

    Per device a ``<g class="device">`` with, per series that has a value, a
    ``<g class="series" data-series="KEY">`` of ``<polyline>`` (one per run of known points),
    a ``<g class="freed">`` of downward triangles (``<path>`` each with a ``<title>``) and a
    ``<g class="drains">`` of lines. Raises ValueError for a timeline with no point.

    Dependency-free, for kernels without matplotlib. Every text in it is escaped (device names come from the driver).
    """
    panels = _panels(data)
    if not panels:
        raise ValueError("the timeline has no point to draw")
    height = len(panels) * (_PANEL_H + _TOP + _BOTTOM) + 10
    plot_w = _W - _LEFT - _RIGHT
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{height}" viewBox="0 0 {_W} {height}" '
        'font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="11">',
        f'<rect class="background" x="0" y="0" width="{_W}" height="{height}" fill="#ffffff"/>',
    ]
    for n, panel in enumerate(panels):
        y0 = n * (_PANEL_H + _TOP + _BOTTOM) + _TOP
        out.extend(_svg_panel(panel, y0, plot_w))
    out.extend(_svg_legend(panels, _LEFT + plot_w + 14, _TOP + 4))
    out.append("</svg>")
    return "\n".join(out)


def _svg_panel(panel: _Panel, y0: float, plot_w: float) -> List[str]:
    top_value = (panel.highest / panel.size if panel.highest else 1.0)
    step = _nice_step(top_value, 5)
    y_max = max(top_value * 1.18, step)
    lo, hi = min(panel.xs) - 0.6, max(panel.xs) + 0.6

    def px(x: float) -> float:
        return _LEFT + (x - lo) / (hi - lo) * plot_w

    def py(v: float) -> float:
        return y0 + _PANEL_H - v / y_max * _PANEL_H

    out = [f'<g class="device" data-index="{_esc(panel.index)}">',
           f'<text class="title" x="{_LEFT}" y="{_num(y0 - 12)}" font-size="13" font-weight="bold">{_esc(panel.title)}</text>']
    # axes: horizontal grid and y ticks in the panel's unit
    out.append('<g class="axes" stroke="#dddddd" stroke-width="1">')
    v = 0.0
    while v <= y_max + 1e-9:
        out.append(f'<line x1="{_LEFT}" x2="{_num(_LEFT + plot_w)}" y1="{_num(py(v))}" y2="{_num(py(v))}"/>')
        v += step
    out.append("</g>")
    out.append('<g class="ticks" fill="#333333" font-size="10">')
    v = 0.0
    while v <= y_max + 1e-9:
        out.append(f'<text x="{_LEFT - 6}" y="{_num(py(v) + 3.5)}" text-anchor="end">{_esc(_tick_text(v))}</text>')
        v += step
    for x, text in _svg_x_ticks(panel):
        out.append(f'<text x="{_num(px(x))}" y="{_num(y0 + _PANEL_H + 15)}" text-anchor="middle">{_esc(text)}</text>')
    out.append("</g>")
    out.append(f'<text class="ylabel" x="{_LEFT - 44}" y="{_num(y0 + _PANEL_H / 2)}" text-anchor="middle" '
               f'transform="rotate(-90 {_LEFT - 44} {_num(y0 + _PANEL_H / 2)})">{_esc(panel.unit)}</text>')
    out.append(f'<text class="xlabel" x="{_num(_LEFT + plot_w / 2)}" y="{_num(y0 + _PANEL_H + 32)}" '
               f'text-anchor="middle">{_esc(panel.xlabel())}</text>')
    out.append(f'<line class="xaxis" x1="{_LEFT}" x2="{_num(_LEFT + plot_w)}" y1="{_num(py(0))}" y2="{_num(py(0))}" '
               'stroke="#333333" stroke-width="1"/>')
    out.append(f'<line class="yaxis" x1="{_LEFT}" x2="{_LEFT}" y1="{_num(y0)}" y2="{_num(py(0))}" '
               'stroke="#333333" stroke-width="1"/>')
    drains = panel.drains()
    if drains:
        out.append(f'<g class="drains" stroke="{DRAIN_COLOR}" stroke-width="1.2" stroke-dasharray="2,3">')
        for x in drains:
            out.append(f'<line x1="{_num(px(x))}" x2="{_num(px(x))}" y1="{_num(y0)}" y2="{_num(py(0))}">'
                       f'<title>{_esc(panel.drain_label())}</title></line>')
        out.append("</g>")
    # the area under "used", then the lines
    used = panel.values("used_bytes")
    for run in _runs(panel.xs, used):
        if len(run) > 1:
            pts = " ".join(f"{_num(px(x))},{_num(py(y))}" for x, y in run)
            out.append(f'<polygon class="used-area" points="{_num(px(run[0][0]))},{_num(py(0))} {pts} '
                       f'{_num(px(run[-1][0]))},{_num(py(0))}" fill="{SERIES[0][2]}" fill-opacity="0.08" stroke="none"/>')
    for key, label, color in SERIES:
        ys = panel.values(key)
        if all(y is None for y in ys):
            continue
        main = key == "used_bytes"
        dash = ' stroke-dasharray="6,4"' if key == "outside_bytes" else ""
        out.append(f'<g class="series" data-series="{_esc(key)}"><title>{_esc(label)}</title>')
        for run in _runs(panel.xs, ys):
            if len(run) == 1:
                run = run * 2  # one known point: a dot (round caps)
            pts = " ".join(f"{_num(px(x))},{_num(py(y))}" for x, y in run)
            out.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="{2.4 if main else 1.5}" '
                       f'stroke-linejoin="round" stroke-linecap="round"{dash}/>')
        out.append("</g>")
    freed = panel.freed()
    if freed:
        biggest = max(p["freed_bytes"] for _, p in freed)
        labelled = panel.labelled()
        out.append(f'<g class="freed" fill="{FREED_COLOR}">')
        for i, (x, p) in enumerate(freed):
            cx, cy = px(x), py(_Panel.freed_top(p) / panel.size)
            r = (3.5 + 5.5 * math.sqrt(p["freed_bytes"] / biggest)) * math.sqrt(panel.marker_scale)
            where = f"cell [{p['cell']}]" if p.get("cell") is not None else drains_label([p])
            amount = report.format_bytes(p["freed_bytes"])
            if p.get("used_bytes") is not None:
                out.append(f'<line x1="{_num(cx)}" x2="{_num(cx)}" y1="{_num(cy)}" '
                           f'y2="{_num(py(p["used_bytes"] / panel.size))}" stroke="{FREED_COLOR}" stroke-width="1" '
                           'stroke-dasharray="1,2" stroke-opacity="0.8"/>')
            out.append(f'<path d="M{_num(cx - r)},{_num(cy - r)} L{_num(cx + r)},{_num(cy - r)} L{_num(cx)},{_num(cy + r * 0.6)} Z" '
                       f'stroke="#ffffff" stroke-width="0.6"><title>{_esc(where)}: freed {_esc(amount)}</title></path>')
            if x in labelled:
                out.append(f'<text x="{_num(cx)}" y="{_num(cy - r - 3)}" text-anchor="middle" font-size="10" '
                           f'stroke="#ffffff" stroke-width="3" paint-order="stroke">{_esc(amount)}</text>')
        out.append("</g>")
    out.append("</g>")
    return out


def _runs(xs: Sequence[float], ys: Sequence[Optional[float]]) -> List[List[Tuple[float, float]]]:
    """The runs of known points: an unknown value breaks the line rather than drawing a guess."""
    runs: List[List[Tuple[float, float]]] = []
    current: List[Tuple[float, float]] = []
    for x, y in zip(xs, ys):
        if y is None:
            if current:
                runs.append(current)
            current = []
        else:
            current.append((x, y))
    if current:
        runs.append(current)
    return runs


def _svg_x_ticks(panel: _Panel) -> List[Tuple[float, str]]:
    if panel.by_order:
        every = max(1, math.ceil(len(panel.xs) / 12))
        return [(x, panel.label_at(x)) for i, x in enumerate(panel.xs) if i % every == 0]
    lo, hi = math.ceil(min(panel.xs)), math.floor(max(panel.xs))
    step = max(1, int(_nice_step(hi - lo, 12)) if hi > lo else 1)
    first = math.ceil(lo / step) * step
    return [(float(c), str(c)) for c in range(first, hi + 1, step)]


def _svg_legend(panels: Sequence[_Panel], x: float, y: float) -> List[str]:
    """One legend for what any panel draws."""
    out = ['<g class="legend" font-size="11">']
    row = 0
    for key, label, color in SERIES:
        if all(all(v is None for v in panel.values(key)) for panel in panels):
            continue
        yy = y + row * 18
        dash = ' stroke-dasharray="6,4"' if key == "outside_bytes" else ""
        out.append(f'<line x1="{_num(x)}" x2="{_num(x + 22)}" y1="{_num(yy)}" y2="{_num(yy)}" stroke="{color}" '
                   f'stroke-width="{2.4 if key == "used_bytes" else 1.5}"{dash}/>')
        out.append(f'<text x="{_num(x + 28)}" y="{_num(yy + 4)}">{_esc(label)}</text>')
        row += 1
    if any(panel.freed() for panel in panels):
        yy = y + row * 18
        out.append(f'<path d="M{_num(x + 6)},{_num(yy - 5)} L{_num(x + 16)},{_num(yy - 5)} L{_num(x + 11)},'
                   f'{_num(yy + 4)} Z" fill="{FREED_COLOR}"/>')
        out.append(f'<text x="{_num(x + 28)}" y="{_num(yy + 4)}">{_esc(FREED_LABEL)}</text>')
        row += 1
    if any(panel.drains() for panel in panels):
        yy = y + row * 18
        out.append(f'<line x1="{_num(x + 11)}" x2="{_num(x + 11)}" y1="{_num(yy - 7)}" y2="{_num(yy + 7)}" '
                   f'stroke="{DRAIN_COLOR}" stroke-width="1.2" stroke-dasharray="2,3"/>')
        label = drains_label([p for panel in panels for p in panel.records])
        out.append(f'<text x="{_num(x + 28)}" y="{_num(yy + 4)}">{_esc(label)}</text>')
    out.append("</g>")
    return out


# ---------------------------------------------------------------- text


def _spark_buckets(values: Sequence[Optional[int]], width: int, add: bool) -> List[Optional[int]]:
    """At most ``width`` values: consecutive records share a mark, with their largest value
    (``add``: their sum); a mark whose records are all unknown stays unknown."""
    if len(values) <= width:
        return list(values)
    per = math.ceil(len(values) / width)
    out: List[Optional[int]] = []
    for i in range(0, len(values), per):
        known = [v for v in values[i:i + per] if v is not None]
        out.append((sum(known) if add else max(known)) if known else None)
    return out


def _mark(value: Optional[int], top: int) -> str:
    if value is None:
        return " "
    level = 0 if top <= 0 else min(len(_BLOCKS) - 1, round(value / top * (len(_BLOCKS) - 1)))
    return _BLOCKS[level]


def sparklines(data: dict, width: int = _SPARK_WIDTH) -> str:
    """The timeline as text: per device a heading, then one sparkline per series.

    Every line of a device shares one scale, from 0 to the largest value on that device
    (so heights compare across lines); blank: not known. The freed line has ``·`` where the
    cleanup freed nothing. More than ``width`` records share marks (the largest value of
    each group; freed: their sum, on a scale of its own, to the largest sum).

    One line per device and series (``▁▂▃▄▅▆▇█``, zero-based, one scale per device), with min/max and the cell
    range.
    """
    panels = _panels(data)
    if not panels:
        return EMPTY
    blocks = []
    for panel in panels:
        top = max([p.get(key) or 0 for p in panel.records for key, _, _ in SERIES]
                  + [p.get("freed_bytes") or 0 for p in panel.records])
        per = math.ceil(len(panel.records) / width) if len(panel.records) > width else 1
        head = f"{panel.title} · {panel.cell_range()} · scale 0–{report.format_bytes(top)}"
        if per > 1:
            head += f" · each mark: {per} records"
        lines = [head]
        for key, label, _ in SERIES:
            raw = [p.get(key) for p in panel.records]
            known = [v for v in raw if v is not None]
            if not known:
                continue
            marks = "".join(_mark(v, top) for v in _spark_buckets(raw, width, add=False))
            lines.append(f"  {_short_label(key):<8} {marks}  min {report.format_bytes(min(known))}, "
                         f"max {report.format_bytes(max(known))}")
        freed = [p.get("freed_bytes") or 0 for p in panel.records]
        sums = _spark_buckets(freed, width, add=True)
        freed_top = top if per == 1 else max(sums)
        marks = "".join("·" if not v else _mark(v, freed_top) for v in sums)
        count = sum(1 for v in freed if v)
        if count:
            most = max(range(len(freed)), key=lambda i: freed[i])
            cell = panel.records[most].get("cell")
            where = f"[{cell}]" if cell is not None else "a drain"
            summary = (f"{report.format_bytes(sum(freed))} in {count} cleanup{'s' if count != 1 else ''}, "
                       f"most {report.format_bytes(freed[most])} in {where}")
            if per > 1:
                summary += f"; scale 0–{report.format_bytes(freed_top)} a mark"
        else:
            summary = "nothing freed"
        lines.append(f"  {'freed':<8} {marks}  {summary}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _short_label(key: str) -> str:
    return {"used_bytes": "used", "live_bytes": "live", "cached_bytes": "cached", "outside_bytes": "outside"}[key]


# ---------------------------------------------------------------- what %gpumem --plot displays


def _matplotlib_importable() -> bool:
    # "import a.b" form: it fails when sys.modules["matplotlib"] is None even if matplotlib.figure was imported
    try:
        import matplotlib.backends.backend_agg
        import matplotlib.figure
    except ImportError:
        return False
    return hasattr(matplotlib.figure, "Figure") and hasattr(matplotlib.backends.backend_agg, "FigureCanvasAgg")


class TimelinePlot:
    """What ``%gpumem --plot`` displays: a PNG (matplotlib importable) or else an SVG for rich
    frontends, the sparklines for text-only ones; IPython asks for what its frontend shows.

    ``data`` is ``timeline.series(records)``; ``figure()`` gives the matplotlib Figure to
    save or restyle (``TimelinePlot(records).figure().savefig("gpu.png")``).

    It carries all three drawings: ``_repr_png_`` (matplotlib importable) or else ``_repr_svg_``, and
    ``_repr_pretty_`` for text. IPython's display formatter computes only the types its frontend shows
    (``DisplayFormatter.active_types``): a Jupyter kernel computes them all and the notebook shows the image; the
    terminal IPython activates only text/plain (plus image/png in terminals with the kitty graphics protocol), so a
    plain terminal gets the sparklines and never draws a PNG; ``jupyter console`` shows the text. That is the check
    for "a terminal": what the frontend declared, not the shell's class name.
    """

    def __init__(self, records: Optional[Sequence[dict]] = None, data: Optional[dict] = None):
        self.data = data if data is not None else timeline.series(records or [])
        self._png: Any = None
        self._png_done = False
        #: why the PNG was not drawn, when matplotlib is there but failed (the SVG is shown instead)
        self.png_error: Optional[str] = None

    @property
    def empty(self) -> bool:
        return not any(d.get("points") for d in (self.data or {}).get("devices") or [])

    def text(self) -> str:
        return sparklines(self.data)

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p, cycle):
        p.text(self.text())

    def figure(self):
        return figure(self.data)

    def png(self) -> Optional[bytes]:
        """The PNG, drawn once; None with no point, without matplotlib, or when drawing failed."""
        if not self._png_done:
            self._png_done = True
            if not self.empty and _matplotlib_importable():
                try:
                    self._png = png(self.data)
                except Exception as exc:  # a broken matplotlib set-up (e.g. usetex without LaTeX): the SVG instead
                    self.png_error = f"{type(exc).__name__}: {exc}"
        return self._png

    def _repr_png_(self):
        data = self.png()
        if data is None:
            return None
        width, height = png_size(data)
        return data, {"width": width // _DENSITY, "height": height // _DENSITY}  # drawn denser, shown at 1x

    def _repr_svg_(self) -> Optional[str]:
        if self.empty or self.png() is not None:
            return None
        return svg(self.data)
