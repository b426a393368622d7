"""The pieces of a self-contained HTML page: escaping, tables, embedded images, interactive charts, the page.

A page carries everything it shows (report.css and report.js inline, images as ``data:`` URIs, the charts' data as
JSON) and its Content-Security-Policy lets nothing be fetched, so the file reads the same offline or anywhere else.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import numpy as np

# Nothing may be fetched: images are data: URIs, style and script are inline.
CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'"


class Html(str):
    """Markup that is already safe to write into the page as it is (everything else is escaped)."""


def esc(value: object) -> Html:
    """Text as HTML: escaped, unless it is Html already."""
    return value if isinstance(value, Html) else Html(html.escape(str(value), quote=True))


def join(parts: Iterable[object]) -> Html:
    return Html("".join(esc(p) for p in parts))


def tag(name: str, body: object = "", **attrs: object) -> Html:
    """<name attrs>body</name>; attribute names written with _ for - (``aria_label``), ``cls`` for class;
    None and False leave an attribute out, True writes it bare."""
    parts = [name]
    for key, value in attrs.items():
        if value is None or value is False:
            continue
        key = "class" if key == "cls" else key.rstrip("_").replace("_", "-")
        parts.append(key if value is True else f'{key}="{esc(value)}"')
    return Html(f"<{' '.join(parts)}>{esc(body)}</{name}>")


def fmt(value: Any, digits: int = 4) -> str:
    """A number as a person reads it: ints with thousands separators, floats to ``digits`` significant figures."""
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.{digits}g}"
    return str(value)


def percent(value: float, decimals: int = 2) -> str:
    return f"{100 * value:.{decimals}f}%"


@dataclass
class Row:
    """A table row: its cells (text, or Html) and a class for the row (``changed``, ...)."""

    cells: Sequence[object]
    cls: str | None = None


def table(
    header: Sequence[object],
    rows: Iterable[Row | Sequence[object]],
    caption: str | None = None,
    cls: str | None = None,
    row_headers: bool = True,
) -> Html:
    """A real <table> in a horizontally scrolling box (wide tables stay readable in a narrow window); the first
    cell of each row is its header cell when ``row_headers``."""
    head = tag("thead", tag("tr", join(tag("th", h, scope="col") for h in header)))
    body = []
    for row in rows:
        r = row if isinstance(row, Row) else Row(row)
        cells = [tag("th", c, scope="row") if i == 0 and row_headers else tag("td", c) for i, c in enumerate(r.cells)]
        body.append(tag("tr", join(cells), cls=r.cls))
    cap = tag("caption", caption) if caption else ""
    return tag("div", tag("table", join([cap, head, tag("tbody", join(body))]), cls=cls), cls="table-box")


def definitions(items: Iterable[tuple[object, object]], cls: str = "facts") -> Html:
    """A <dl> of (term, description) pairs."""
    return tag("dl", join(join([tag("dt", k), tag("dd", v)]) for k, v in items), cls=cls)


def code_block(text: str, label: str | None = None) -> Html:
    return tag("pre", tag("code", text), cls="command", aria_label=label)


def png_of_array(pixels: np.ndarray, max_side: int = 160) -> bytes:
    """(H, W, C) or (H, W) pixels in [0, 1] as PNG bytes, shrunk to at most max_side pixels on the long side."""
    from PIL import Image

    a = np.clip(np.asarray(pixels, dtype=np.float64), 0.0, 1.0)
    if a.ndim == 3 and a.shape[2] != 3:
        a = a.mean(axis=2)  # grey, or neither grey nor RGB: one channel, the mean, as the inspection figures show it
    img = Image.fromarray(np.round(255 * a).astype(np.uint8))
    if max(img.size) > max_side:
        img.thumbnail((max_side, max_side))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def image(png: bytes, alt: str, caption: object = None, cls: str = "figure", pixelated: bool = False) -> Html:
    """A <figure> holding a PNG as a data: URI, with alt text and an optional caption."""
    uri = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
    img = Html(f'<img src="{uri}" alt="{esc(alt)}"{" class=pixelated" if pixelated else ""}>')
    return tag("figure", join([img, tag("figcaption", caption) if caption else ""]), cls=cls)


@dataclass
class Series:
    """One line of a chart: x and y values (None or non-finite y: a gap), drawn dashed or solid."""

    name: str
    x: Sequence[float]
    y: Sequence[float | None]
    dashed: bool = False

    def to_dict(self) -> dict[str, Any]:
        ys = [None if v is None or not math.isfinite(float(v)) else float(v) for v in self.y]
        return {"name": self.name, "x": [float(v) for v in self.x], "y": ys, "dashed": self.dashed}


@dataclass
class Chart:
    """An interactive line chart: hover for values, drag (or Ctrl + wheel, or pinch) to zoom the x range."""

    id: str
    title: str
    series: list[Series]
    x_label: str = "step"
    y_label: str = ""
    y_format: str = "number"  # number, percent (values in [0, 1]) or sci
    log: bool = False  # a log-scale y axis
    x_per_epoch: float | None = None  # steps per epoch, so the tooltip can name the epoch of a step
    description: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "title": self.title,
            "series": [s.to_dict() for s in self.series],
            "xLabel": self.x_label,
            "yLabel": self.y_label,
            "yFormat": self.y_format,
            "log": self.log,
            "xPerEpoch": self.x_per_epoch,
        }


@dataclass
class Section:
    id: str
    title: str
    body: Html


@dataclass
class Page:
    """A report page: a header, sections (each a table-of-contents entry), and the charts the script draws."""

    title: str
    subtitle: str = ""
    sections: list[Section] = field(default_factory=list)
    charts: dict[str, Chart] = field(default_factory=dict)

    def add(self, id: str, title: str, *body: object) -> None:
        self.sections.append(Section(id, title, join(body)))

    def chart(self, chart: Chart) -> Html:
        """The placeholder the script draws ``chart`` into (its numbers go into the page's data)."""
        if chart.id in self.charts:
            raise ValueError(f"two charts with the id {chart.id!r}")
        self.charts[chart.id] = chart
        label = chart.description or f"{chart.title}: {', '.join(s.name for s in chart.series)} against {chart.x_label}"
        plot = tag("div", "", cls="plot", role="img", aria_label=label, tabindex="0")
        controls = tag("button", "reset zoom", type="button", cls="reset", hidden=True)
        legend = tag("ul", "", cls="legend")
        head = tag("div", join([tag("h3", chart.title), controls]), cls="chart-head")
        return tag("figure", join([head, plot, legend]), cls="chart", data_chart=chart.id)

    def render(self) -> str:
        links = join(tag("li", tag("a", s.title, href=f"#{s.id}")) for s in self.sections)
        nav = tag("nav", tag("ul", links), aria_label="Sections")
        sections = join(tag("section", join([tag("h2", s.title), s.body]), id=s.id) for s in self.sections)
        data = json.dumps({k: c.to_dict() for k, c in self.charts.items()}, allow_nan=False, separators=(",", ":"))
        data = data.replace("<", "\\u003c")  # no "</script>" or "<!--" in a string can end or change the block
        header = tag("header", join([tag("h1", self.title), tag("p", self.subtitle, cls="subtitle")]))
        errors = tag("pre", "", id="report-errors", role="alert", hidden=True)
        hint = tag("noscript", tag("p", "The charts are drawn by the page's script; allow scripts to see them."))
        body = join([header, nav, hint, errors, tag("main", sections)])
        return (
            "<!DOCTYPE html>\n"
            '<html lang="en" data-status="loading">\n<head>\n<meta charset="utf-8">\n'
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">\n'
            '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            '<meta name="color-scheme" content="light dark">\n'
            f"<title>{esc(self.title)}</title>\n"
            f"<script>{_asset('errors.js')}</script>\n"
            f"<style>{_asset('report.css')}</style>\n</head>\n"
            f"<body>\n{body}\n"
            f'<script type="application/json" id="report-data">{data}</script>\n'
            f"<script>{_asset('report.js')}</script>\n</body>\n</html>\n"
        )


def _asset(name: str) -> str:
    text = (resources.files("vitkit.report") / name).read_text(encoding="utf-8")
    if "</script" in text.lower() or "</style" in text.lower():
        raise ValueError(f"{name}: may not contain a closing script or style tag")
    return text
