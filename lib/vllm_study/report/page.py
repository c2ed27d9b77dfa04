"""The report as a static page: report.html beside report.ipynb, its sections laid out
for reading (figures embedded, code hidden)."""
from __future__ import annotations

import base64
import html
import io
import re
from pathlib import Path

from ..records.results import RunFolder


def export_html(folder: RunFolder) -> Path:
    """report.html beside report.ipynb: static and self-contained (figures embedded,
    code hidden), readable without Jupyter, laid out as a page to read (`page_notebook`,
    PAGE_CSS)."""
    import nbformat
    from nbconvert import HTMLExporter
    nb = page_notebook(nbformat.read(folder.path / "report.ipynb", as_version=4))
    nb.metadata["title"] = f"{folder.path.resolve().name}: study report"
    templates = Path(__file__).resolve().parent / "templates"
    exporter = HTMLExporter(template_name="static_report", extra_template_basedirs=[str(templates)],
                            raw_template=PAGE_TEMPLATE, exclude_input=True, exclude_input_prompt=True,
                            exclude_output_prompt=True, embed_images=True)
    body, _ = exporter.from_notebook_node(nb, resources={"report_page_css": PAGE_CSS})
    out = folder.path / "report.html"
    out.write_text(_mark_long_cells(body))
    return out


# -- the page: the notebook's sections as a reader gets them ----------------------
DETAILS_TAG = "report-details"   # on a heading cell: the page shows its section collapsed, the heading its summary
PNG_COLOURS = 256                # figures are flat colours, text and one colour map: a palette keeps them sharp

# The static_report template (JupyterLab's page without its scripts), with this page's
# stylesheet in place of JupyterLab's (240 kB of CSS for a notebook's UI, where this page
# needs text, tables and figures), and each cell between the markup page_notebook asks
# for before and after it (a <details> section's start and end).
PAGE_TEMPLATE = """{%- extends 'index.html.j2' -%}
{%- block notebook_css -%}
<style type="text/css">
{{ resources.report_page_css }}
</style>
{%- endblock notebook_css -%}
{%- block any_cell -%}
{%- set page = cell.metadata.get('report_page', {}) -%}
{{ page.get('before', '') }}{{ super() }}{{ page.get('after', '') }}
{%- endblock any_cell -%}
"""

# One column of text at a readable measure, figures and tables as wide as the column and
# never wider: long lines of printed text wrap, a table wider than the column scrolls
# inside its own box, an image shrinks to fit.
PAGE_CSS = """
html { -webkit-text-size-adjust: 100%; }
body { margin: 0; background: #fff; color: #1f2328;
  font: 16px/1.55 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
main { max-width: 1180px; margin: 0 auto; padding: 1.25rem 1.5rem 4rem; }
main, main * { box-sizing: border-box; }
main > *, .jp-Cell, .jp-OutputArea, .jp-OutputArea-child, .jp-OutputArea-output { max-width: 100%; min-width: 0; }
h1 { font-size: 1.75rem; margin: .25rem 0 .5rem; line-height: 1.25; }
h2 { font-size: 1.35rem; margin: 2rem 0 .5rem; padding-bottom: .2rem; border-bottom: 1px solid #d8dee4; }
h3 { font-size: 1.1rem; margin: 1.25rem 0 .4rem; }
p, li { max-width: 50rem; overflow-wrap: break-word; }
a.anchor-link { display: none; }
code { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, "DejaVu Sans Mono", monospace;
  font-size: .88em; background: #f3f4f6; padding: .05em .3em; border-radius: 3px; overflow-wrap: anywhere; }
pre { white-space: pre-wrap; word-break: break-word; overflow-wrap: anywhere; margin: .4rem 0;
  padding: .55rem .75rem; background: #f6f8fa; border-radius: 4px;
  font: 13px/1.45 ui-monospace, SFMono-Regular, Menlo, Consolas, "DejaVu Sans Mono", monospace; }
[data-mime-type="application/vnd.jupyter.stderr"] pre { background: #fff4f4; color: #8a1c1c; }
img { display: block; max-width: 100%; height: auto; margin: .5rem 0; }
.jp-RenderedHTML, .jp-RenderedMarkdown { overflow-x: auto; }
table { border: 0; border-collapse: collapse; margin: .4rem 0 .8rem; font-size: 13px;
  font-variant-numeric: tabular-nums; }
th, td { padding: .25rem .6rem; border: 0; border-bottom: 1px solid #e5e7eb; white-space: nowrap; vertical-align: top;
  text-align: right; }
thead th { border-bottom: 2px solid #9ca3af; vertical-align: bottom; }
tbody th { text-align: left; font-weight: 600; }
tbody tr:nth-child(odd) { background: #f8f9fb; }
td.prose { white-space: normal; min-width: 16rem; max-width: 42rem; text-align: left; }
details.report-section { margin: .5rem 0; padding: 0 1rem; border: 1px solid #d8dee4; border-radius: 6px; }
details.report-section > summary { cursor: pointer; padding: .55rem 0; }
details.report-section > summary > :is(h2, h3, h4) { display: inline; margin: 0; padding: 0; border: 0;
  font-size: 1.05rem; }
details.report-section[open] > summary { margin-bottom: .4rem; border-bottom: 1px solid #eaeef2; }
"""


def _heading(cell) -> tuple[int, str, str] | None:
    """A Markdown cell that opens with a heading: its level, its text, the rest of the cell."""
    if cell.cell_type != "markdown":
        return None
    first, _, rest = cell.source.lstrip().partition("\n")
    hit = re.match(r"(#{1,6})\s+(.*?)\s*#*\s*$", first)
    return (len(hit.group(1)), hit.group(2), rest.strip()) if hit else None


def _shows(cell) -> bool:
    """Did the cell output anything a reader would see (not an empty or blank print)?"""
    for o in cell.get("outputs", []):
        if o.output_type == "stream":
            if str(o.text).strip():
                return True
        elif o.output_type == "error" or o.get("data"):
            return True
    return False


def _sections(cells) -> list[tuple[int, int, tuple[int, str, str]]]:
    """(first, end, heading) per heading cell: its section runs to the next heading of the
    same or a higher level."""
    heads = [(i, h) for i, c in enumerate(cells) if (h := _heading(c))]
    return [(i, next((j for j, g in heads[k + 1:] if g[0] <= h[0]), len(cells)), h)
            for k, (i, h) in enumerate(heads)]


def page_notebook(nb):
    """The notebook as its page shows it (a copy: the notebook stays the page's source).
    A section (a heading cell and what follows up to the next heading of its level) whose
    code cells all printed nothing does not apply to this study and is left out; a heading
    cell tagged `report-details` becomes the summary of a collapsed <details> holding its
    section; each PNG figure is re-encoded with a palette (`small_png`)."""
    import copy
    nb = copy.deepcopy(nb)
    cells = list(nb.cells)
    drop = set()
    for first, end, _ in _sections(cells):
        code = [c for c in cells[first + 1:end] if c.cell_type == "code"]
        if code and not any(_shows(c) for c in code):
            drop.update(range(first, end))
    cells = [c for i, c in enumerate(cells) if i not in drop]
    for first, end, (level, title, rest) in _sections(cells):
        head = cells[first]
        if DETAILS_TAG not in head.metadata.get("tags", []):
            continue
        head.source = rest
        page = head.metadata.setdefault("report_page", {})
        page["before"] = (page.get("before", "") + f'<details class="report-section"><summary><h{level}>'
                          f"{html.escape(title)}</h{level}></summary>")
        last = cells[end - 1].metadata.setdefault("report_page", {})
        last["after"] = "</details>" + last.get("after", "")  # an inner section closes before its outer one
    for c in cells:
        for o in c.get("outputs", []):
            if "image/png" in o.get("data", {}):
                o.data["image/png"] = small_png(o.data["image/png"])
    nb.cells = cells
    return nb


def small_png(data: str) -> str:
    """A base64 PNG figure re-encoded with a palette of PNG_COLOURS (over white where it
    has transparency) and zlib's best effort: about a third of matplotlib's RGBA for the
    same pixels, at the dpi it was drawn at (100: the report's column shows it at about
    one pixel per CSS pixel). The original where that is not smaller."""
    from PIL import Image
    raw = base64.b64decode(data)
    im = Image.open(io.BytesIO(raw))
    if im.mode in ("RGBA", "LA", "PA", "P"):
        im = im.convert("RGBA")
        im = Image.alpha_composite(Image.new("RGBA", im.size, "white"), im)
    pal = im.convert("RGB").quantize(PNG_COLOURS, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE)
    buf = io.BytesIO()
    pal.save(buf, "PNG", optimize=True)
    return base64.b64encode(buf.getvalue()).decode("ascii") if buf.tell() < len(raw) else data


def _mark_long_cells(page: str) -> str:
    """Table cells of running text (a failure's reason, a metric's definition) wrap: class
    `prose`; the rest (numbers with intervals) stay on one line."""
    from bs4 import BeautifulSoup
    soup = BeautifulSoup(page, "html.parser")
    for td in soup.find_all("td"):
        if len(td.get_text(strip=True)) > 48:
            td["class"] = [*td.get("class", []), "prose"]
    return str(soup)
