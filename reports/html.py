"""Page assembly: escaping, tables, sections and the one self-contained HTML document.

Every string that reaches the page from a user (model spec, file names, host names) goes through
`esc`; figures are embedded as plotly divs whose JSON plotly itself escapes (`</` becomes `<\\/`),
and plotly.js is inlined exactly once so the file opens offline.
"""
from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

GIB = 1024**3
MIB = 1024**2


def esc(value: Any) -> str:
    """HTML-escape anything (quotes included, so it is safe inside attributes too)."""
    return html.escape(str(value), quote=True)


def fmt_ms(time_s: float | None) -> str:
    return "n/a" if time_s is None else f"{time_s * 1e3:,.2f} ms"


def fmt_bytes(num_bytes: float | None) -> str:
    """GiB from 1 GiB up, MiB below (small models on CPU would all read 0.00 GiB)."""
    if num_bytes is None:
        return "n/a"
    return f"{num_bytes / GIB:,.2f} GiB" if abs(num_bytes) >= GIB else f"{num_bytes / MIB:,.1f} MiB"


def bytes_unit(largest_bytes: float) -> tuple[float, str]:
    """(divisor, label) for an axis whose largest value is `largest_bytes`."""
    return (GIB, "GiB") if largest_bytes >= GIB else (MIB, "MiB")


def fmt_pct(fraction: float | None, signed: bool = False) -> str:
    if fraction is None:
        return "n/a"
    return f"{fraction * 100:+.1f}%" if signed else f"{fraction * 100:.1f}%"


@dataclass(frozen=True)
class Cell:
    """One table cell: text (escaped on output), optional CSS class and background colour."""

    text: Any
    css_class: str = ""
    background: str = ""
    title: str = ""


@dataclass(frozen=True)
class Section:
    """One report section: `anchor` is its id in the page, `body_html` is already safe HTML."""

    anchor: str
    title: str
    body_html: str


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], css_class: str = "data") -> str:
    """A plain HTML table; cells are strings/numbers or `Cell`s, all escaped."""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = []
        for value in row:
            cell = value if isinstance(value, Cell) else Cell(value)
            attrs = ""
            if cell.css_class:
                attrs += f' class="{esc(cell.css_class)}"'
            if cell.background:
                attrs += f' style="background:{esc(cell.background)}"'
            if cell.title:
                attrs += f' title="{esc(cell.title)}"'
            cells.append(f"<td{attrs}>{esc(cell.text)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f'<table class="{esc(css_class)}"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def key_values(pairs: Sequence[tuple[str, Any]]) -> str:
    """A two-column definition table (label, value), escaped."""
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in pairs)
    return f'<table class="kv">{rows}</table>'


def paragraph(text: str, css_class: str = "") -> str:
    cls = f' class="{esc(css_class)}"' if css_class else ""
    return f"<p{cls}>{esc(text)}</p>"


def figure_div(fig, div_id: str) -> str:
    """A plotly figure as a div + script, without plotly.js (the page inlines it once)."""
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id,
                       config={"displaylogo": False, "responsive": True})


_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 auto; max-width: 1200px;
       padding: 1em 2em; color: #1b1f23; background: #fff; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #d0d7de; padding-bottom: 0.2em; }
nav ol { columns: 2; } nav a { text-decoration: none; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.9em; }
th, td { border: 1px solid #d0d7de; padding: 0.25em 0.6em; text-align: right; }
th { background: #f6f8fa; } td:first-child, th:first-child { text-align: left; }
table.kv th, table.kv td { text-align: left; } table.kv th { font-weight: 600; }
.flag { background: #ffd8d3; color: #8a1c0f; font-weight: 700; }
.ok { background: #dafbe1; }
.warn { border-left: 4px solid #d1242f; background: #fff5f4; padding: 0.5em 1em; }
.note { color: #57606a; font-size: 0.9em; }
.winner { font-weight: 700; background: #ddf4ff; }
details summary { cursor: pointer; color: #0969da; }
.fig { margin: 0.5em 0 1.2em 0; }
"""


def page(title: str, subtitle: str, sections: Sequence[Section], plotly_js: str) -> str:
    """The whole document: inline CSS, plotly.js once, table of contents, sections."""
    toc = "".join(f'<li><a href="#{esc(s.anchor)}">{esc(s.title)}</a></li>' for s in sections)
    body = "".join(f'<section id="{esc(s.anchor)}"><h2>{esc(s.title)}</h2>{s.body_html}</section>'
                   for s in sections)
    # plotly.js never contains "</script>" literally (checked when the page is built).
    if "</script" in plotly_js.lower():
        raise RuntimeError("plotly.js bundle contains a closing script tag; cannot inline it")
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"><title>{esc(title)}</title>"
        f"<style>{_CSS}</style><script type=\"text/javascript\">{plotly_js}</script></head><body>"
        f"<h1>{esc(title)}</h1><p class=\"note\">{esc(subtitle)}</p>"
        f"<nav><ol>{toc}</ol></nav>{body}</body></html>\n"
    )
