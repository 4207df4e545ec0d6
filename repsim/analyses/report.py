"""One self-contained ``report.html`` linking every rendered figure and table, with captions and skip notes."""
from __future__ import annotations

import datetime as _dt
import html
from pathlib import Path

from repsim.analyses.render import Outcome


def _table_html(outcome: Outcome) -> str:
    t = outcome.table
    shown = t.shown.astype(str)
    bold = t.bold.reindex_like(shown).fillna(False).astype(bool) if t.bold is not None else None
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in shown.columns)
    rows = []
    for i in range(len(shown)):
        cells = []
        for j, c in enumerate(shown.columns):
            v = html.escape(shown.iat[i, j])
            cells.append(f"<td><b>{v}</b></td>" if bold is not None and bold.iat[i, j] else f"<td>{v}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


CSS = """
body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.6em} h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd}
img{max-width:100%;border:1px solid #eee} .caption{color:#444;font-size:.92em}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0} td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}
th{background:#f4f4f4} td:first-child,td:nth-child(2){text-align:left}
.skipped{color:#777} .failed{color:#b00} .files a{margin-right:.8em;font-size:.85em}
.findings{background:#f7f7ff;border:1px solid #ccd;padding:.5em 1em}
"""


def write_report(outcomes: list[Outcome], out: Path, *, title: str = "repsim figures",
                 intro_html: str = "", sources: str = "") -> Path:
    """Write ``out/report.html``: every done item embedded (PNG) or inlined (table) with links to all
    its files and its caption, then a list of skipped (and failed) items with the reason."""
    done = [o for o in outcomes if o.status == "done"]
    skipped = [o for o in outcomes if o.status == "skipped"]
    failed = [o for o in outcomes if o.status == "failed"]
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>",
             f"<p class='caption'>Generated {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M UTC}. "
             f"{html.escape(sources)} {len(done)} item(s) rendered, {len(skipped)} skipped, {len(failed)} failed.</p>",
             intro_html, "<h2>Contents</h2><ul>"]
    for o in outcomes:
        mark = "" if o.status == "done" else f" <span class='{o.status}'>({o.status})</span>"
        parts.append(f"<li><a href='#{o.item.id}'>{html.escape(o.item.title)}</a>{mark}</li>")
    parts.append("</ul>")
    for o in done:
        links = " ".join(f"<a href='{html.escape(f)}'>{html.escape(f)}</a>" for f in o.files)
        parts.append(f"<h2 id='{o.item.id}'>{html.escape(o.item.title)}</h2>")
        if o.item.kind == "figure":
            # the PNG, else the SVG (a PDF alone: the links below)
            shown = next((f for ext in (".png", ".svg") for f in o.files if f.endswith(ext)), None)
            if shown is not None:
                parts.append(f"<a href='{html.escape(shown)}'><img src='{html.escape(shown)}' "
                             f"alt='{html.escape(o.item.title)}'></a>")
        else:
            parts.append(_table_html(o))
        parts.append(f"<p class='caption'>{html.escape(o.caption)}</p><p class='files'>{links}</p>")
    if skipped or failed:
        parts.append("<h2 id='skipped'>Skipped and failed items</h2><ul>")
        for o in skipped + failed:
            parts.append(f"<li id='{o.item.id}' class='{o.status}'><b>{html.escape(o.item.title)}</b> — {o.status}: "
                         f"needs {html.escape(', '.join(o.item.needs))}. <pre>{html.escape(o.note)}</pre></li>")
        parts.append("</ul>")
    parts.append("</body></html>")
    path = out / "report.html"
    path.write_text("\n".join(parts), encoding="utf-8")
    return path
