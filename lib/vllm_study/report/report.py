"""Read a run folder into the report's tables (the notebook and the sweep's last words
both use these), and export the executed report as a static page."""
from __future__ import annotations

import base64
import html
import io
import json
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import pandas as pd

from ..analysis import intervals as analysis
from ..vocab import axes, metrics
from ..vocab.axes import SCHEDULER_AXIS
from ..define.params import Search, Study, TraceSpec, _check_slo, study_from_dict
from ..records.results import Manifest, PointSummary, RunFolder
from ..analysis import decision
from ..define.grid import DEFAULTS_POINT


@dataclass
class Run:
    folder: RunFolder
    manifest: Manifest
    summaries: list[PointSummary]
    rounds: pd.DataFrame            # summary.csv: one row per point x start x round x group
    intervals: pd.DataFrame         # analysis.point_intervals: point x metric

    slo_override: dict[str, float] | None = None   # an SLO given at report time (parse_slo)
    trial_rounds: pd.DataFrame | None = None        # a search: its trials' rounds (one start each)

    @classmethod
    def load(cls, folder: RunFolder | str | Path, slo: dict[str, float] | None = None) -> "Run":
        """A search's Run is its confirmation: the points started again and their fresh
        starts only (the trials' own starts were selected for looking good); its trials
        are in trial_rounds."""
        folder = folder if isinstance(folder, RunFolder) else RunFolder(folder)
        rounds = pd.read_csv(folder.summary_csv) if folder.summary_csv.exists() else folder.rounds_table()
        run = cls(folder, folder.manifest(), folder.summaries(), rounds, pd.DataFrame(), slo or None)
        if run.search:
            from ..search.config_search import TRIAL_BLOCK  # optuna (0.6 s to import) only where a run searched
            confirmed = {u.point for u in run.manifest.order if u.block > TRIAL_BLOCK}
            run.trial_rounds = rounds[rounds["block"] == TRIAL_BLOCK] if not rounds.empty else rounds
            run.rounds = rounds[rounds["block"] > TRIAL_BLOCK] if not rounds.empty else rounds
            run.summaries = [s for s in run.summaries if s.point in confirmed]
        run.intervals = analysis.point_intervals(run.rounds)
        return run

    @cached_property
    def study(self) -> Study:
        """The study as today's kit reads it. Every committed run's manifest validates as it
        is: fields added since take their defaults, and params reads the older layouts'
        spellings itself (unset SLO bounds as null, start_ahead null). Validation reads no
        file (a trace's path is only made absolute), so runs made elsewhere load here."""
        return study_from_dict(self.manifest.params, source=str(self.folder.manifest_path))

    @property
    def search(self) -> Search | None:
        return self.study.search

    @property
    def baseline(self) -> str | None:
        """The point every other is compared with: the study's `baseline`; for a search,
        vLLM's defaults."""
        if self.search:
            return DEFAULTS_POINT
        return self.study.baseline

    def interval(self, point: str, metric: str) -> dict | None:
        return _lookup(self.intervals, point, metric)

    @property
    def axes(self) -> list[str]:
        """The grid's axes as the points have them: the study's grid, and the scheduler axis
        that grid.expand adds where a study sweeps the Prefix Reuse Budget's ratios."""
        grid = list(self.study.grid or (self.search.space if self.search else {}))
        return grid + [SCHEDULER_AXIS] if any(SCHEDULER_AXIS in s.values for s in self.summaries) else grid

    @property
    def slo(self) -> dict[str, float]:
        """The SLO given at report time, else the study's."""
        return self.slo_override or dict(self.study.slo)

    @property
    def measured(self) -> list[PointSummary]:
        """Points with at least one measured round (ok or partial); a search's: in its
        confirmation starts (a summary also counts the point's trial start)."""
        done = [s for s in self.summaries if s.estimates and s.status in ("ok", "partial")]
        if self.search:
            confirmed = set(analysis.ok_rounds(self.rounds)["point"]) if not self.rounds.empty else set()
            done = [s for s in done if s.point in confirmed]
        return done


def parse_slo(text: str) -> dict[str, float]:
    """'ttft_p90_ms=2500,itl_p90_ms=100' (or with ':') -> bounds, checked as a study's slo: is."""
    if not text.strip():
        return {}
    try:
        bounds = {k.strip(): float(v) for k, v in (re.split("[=:]", part, maxsplit=1) for part in text.split(","))}
    except ValueError:
        raise ValueError(f"SLO {text!r}: write it as metric=bound pairs, "
                         "e.g. ttft_p90_ms=2500,itl_p90_ms=100") from None
    return _check_slo(bounds)


def _lookup(iv: pd.DataFrame, point: str, metric: str) -> dict | None:
    """One point x metric row of an intervals frame, or None."""
    if iv.empty:
        return None
    row = iv[(iv["point"] == point) & (iv["metric"] == metric)]
    return row.iloc[0].to_dict() if len(row) else None


def describe(r: Run) -> str:
    m, v, s = r.manifest, r.manifest.versions, r.study
    w = s.workload
    gpus = ", ".join(f"{g.name} {g.memory_total_bytes / 2**30:.0f} GiB driver {g.driver}" for g in m.machine.gpus)
    lines = [
        f"study {m.study} created {m.created_utc}  git {str(m.git.sha)[:12]}"
        + (" (uncommitted changes)" if m.git.dirty else ""),
        f"engine {m.engine}: {v.vllm_distribution} {v.vllm}, torch {v.torch}, python {v.python}, kit {v.vllm_study}",
        f"CPU: {m.machine.cpu.model} ({m.machine.cpu.cores} cores"
        + (f", {m.machine.cpu.capability})" if m.machine.cpu.capability else ")")
        + (f"; dtype {m.cpu_dtype['dtype']}: {m.cpu_dtype['reason']}" if m.cpu_dtype else ""),
        f"GPU: {gpus or m.machine.no_gpu_reason}",
        f"grid: {json.dumps(s.grid)}" if s.grid else f"targets: {[t.name for t in s.targets]}",
        f"{s.replicates} server start(s) per point x {_per_start(s)}; workload {w.kind} via {w.api}, "
        + (_trace_line(w.trace) if w.trace else f"load {w.load.kind}, {w.requests_per_round} requests/round"),
        "fixed engine args: " + json.dumps(s.engine_args.model_dump(exclude_none=True), sort_keys=True),
    ]
    if m.resumes:
        lines.append(f"resumed {len(m.resumes)} time(s): see manifest.json")
    if m.overlaps:
        # a neighbour shares the host's CPU, PCIe and power: only a run without one can show its effect
        lines.append(f"executor {m.executor}: {len(m.overlaps)} pair(s) of server starts ran at the same time "
                     "(manifest.json: overlaps); whether a neighbour moved a number: `python -m vllm_study "
                     "compare <this study under --executor local> <this run>`")
    return "\n".join(lines)


def _per_start(s: Study) -> str:
    c = s.capacity
    if not c:
        return f"{s.rounds} rounds"
    bounds = ", ".join(f"{k} <= {v:g}" for k, v in c.slo.items())
    return f"a capacity search over {c.over} {c.lo:g}..{c.hi:g} (at most {c.max_steps} rounds) under {bounds}"


def _trace_line(t: TraceSpec) -> str:
    window = f"{t.requests} requests" if t.requests else f"{t.duration_s:g} s" if t.duration_s else "the whole file"
    return f"trace {t.file} ({t.format}), {window} from {t.start_s:g} s, speed {t.speed:g}"


def status_label(s: PointSummary) -> str:
    if s.status == "partial":
        return f"partial {s.rounds_ok}/{s.rounds_planned}"
    return s.status


def headline_table(r: Run) -> pd.DataFrame:
    """Per point: status, startup, and each headline metric's value [95% interval]."""
    names = [n for n in metrics.HEADLINE if n in set(r.intervals.get("metric", []))]
    rows = []
    for s in r.summaries:
        row = {"point": s.point, "status": status_label(s)}
        if s.effective:
            row["max seqs"] = s.effective.max_num_seqs
        if "startup_s" in s.estimates:
            row["startup (s)"] = metrics.get("startup_s").format(s.estimates["startup_s"].median)
        for n in names:
            m = metrics.get(n)
            row[m.title] = capacity_cell(r, s.point) if n == "capacity_rps" else \
                metrics.with_interval(r.interval(s.point, n), m)
        rows.append(row)
    return pd.DataFrame(rows).set_index("point") if rows else pd.DataFrame({"status": []})


def estimates_frame(s: PointSummary) -> pd.DataFrame:
    """One point on its own: each metric's median, range and per-start medians."""
    rows = [{"metric": n, "median": e.median, "min": e.min, "max": e.max, "rounds": e.rounds,
             "start medians": ", ".join(f"{v:.4g}" for v in e.start_medians)} for n, e in s.estimates.items()]
    return pd.DataFrame(rows).set_index("metric").round(3) if rows else pd.DataFrame({"median": []})


def long_estimates(r: Run) -> pd.DataFrame:
    """One row per point x metric: value and intervals with the point's axis values and
    status: what figures draw from."""
    if r.intervals.empty:
        return pd.DataFrame()
    base = pd.DataFrame([{"point": s.point, **s.values, "status": s.status} for s in r.summaries])
    return r.intervals.merge(base, on="point")


def failures(r: Run) -> pd.DataFrame:
    """Points that did not complete every planned round, with why."""
    rows = [{"point": s.point, "status": status_label(s), "rounds ok": f"{s.rounds_ok}/{s.rounds_planned}",
             "reason": " | ".join(s.reasons) or "-"} for s in r.summaries if s.status != "ok"]
    if not rows:
        return pd.DataFrame({"reason": ["(none: every point completed every round)"]}, index=["-"])
    return pd.DataFrame(rows).set_index("point")


def target_comparison(r: Run) -> pd.DataFrame | None:
    targets = r.study.targets
    if not targets:
        print("not an endpoint study (it has a grid, no targets)")
        return None
    by_id = {s.point: s for s in r.summaries}
    first = f"target={targets[0].name}"
    rows = []
    for t in targets:
        pid = f"target={t.name}"
        s = by_id.get(pid)
        row = {"target": t.name, "base_url": t.base_url, "status": status_label(s) if s else "not run"}
        for n in ("ttft_p50_ms", "itl_p50_ms", "e2e_p50_ms"):
            m = metrics.get(n)
            row[m.title] = metrics.with_interval(r.interval(pid, n), m)
            row[f"{m.label} vs {targets[0].name}"] = _change(r, n, pid, first) if pid != first else ""
        rows.append(row)
    return pd.DataFrame(rows).set_index("target")


def _change(r: Run, metric: str, a: str, b: str) -> str:
    """a relative to b, '+12.0% [+3.1%, +21.7%]', or '' where either was not measured."""
    data = analysis.MetricData.from_rounds(r.rounds, metric)
    if data is None or a not in data.starts or b not in data.starts:
        return ""
    d = analysis.difference(data, a, b)
    if d.relative:
        return f"{d.estimate:+.1%} [{d.low:+.1%}, {d.high:+.1%}]"
    m = metrics.get(metric)
    return f"{d.estimate:+{m.fmt}} [{d.low:+{m.fmt}}, {d.high:+{m.fmt}}]"


def _group_order(label: str):
    key, _, value = label.partition("=")
    try:
        return key, 0, float(value), ""
    except ValueError:
        return key, 1, 0.0, value


def has_groups(r: Run) -> bool:
    """Whether the rounds split into request groups (classes, turns, ladder steps)."""
    df = r.rounds
    return not df.empty and "group" in df.columns and bool((df["group"] != "all").any())


def group_table(r: Run) -> pd.DataFrame | None:
    """Per point and request class (long/short), turn, or ladder step: value [95% interval]."""
    df = r.rounds
    if not has_groups(r):
        print("this run's workload has no classes, turns or rate steps")
        return None
    groups = df.loc[df["group"] != "all", ["group", "group_value"]].drop_duplicates()
    labels = sorted((f"{g}={v}" for g, v in groups.itertuples(index=False)), key=_group_order)
    frames = {lab: analysis.point_intervals(df, metrics.GROUP_METRICS, tuple(lab.split("=", 1))) for lab in labels}
    rows = []
    for s in r.summaries:
        for lab in labels:
            cells = {metrics.get(n).title: metrics.with_interval(_lookup(frames[lab], s.point, n), metrics.get(n))
                     for n in metrics.GROUP_METRICS}
            if any(cells.values()):
                rows.append({"point": s.point, "group": lab, **cells})
    return pd.DataFrame(rows).set_index(["point", "group"])


def noise_table(r: Run) -> pd.DataFrame:
    """The study's noise floor: how much each headline metric moves between server starts
    and between rounds of a start."""
    nf = analysis.noise_floor(r.rounds, [n for n in metrics.HEADLINE if n in metrics.REGISTRY])
    if nf.empty:
        return pd.DataFrame({"summary": ["(nothing measured)"]})
    return nf[["scale", "summary"]].rename(index=lambda n: metrics.get(n).title)


def reported_metrics(r: Run) -> list[str]:
    present = set(r.intervals.get("metric", [])) | {n for s in r.summaries for n in s.estimates}
    return [n for n in metrics.REGISTRY if n in present]


def study_failed(r: Run) -> bool:
    """Nothing was measured at any point (a search: not even a trial): the study has no
    result but its failures."""
    trials = r.trial_rounds is not None and not analysis.ok_rounds(r.trial_rounds).empty
    return not r.measured and not trials


def short_table(folder: RunFolder) -> pd.DataFrame:
    t = headline_table(Run.load(folder))
    keep = [c for c in t.columns if c in ("status", "TTFT P90 (ms)", "ITL P90 (ms)", "TPOT P50 (ms)",
                                          "output tokens/s (tok/s)", "prefix-cache hit rate")]
    return t[keep]


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


# -- did each knob bind? ----------------------------------------------------------
KV_BOUND = 0.9          # KV usage peak at or above this share: memory was in short supply
EVICTION_GAP = 0.05     # a hit rate this far below the study's best: prefixes were evicted


def _per_point(r: Run, metric: str, how: str) -> pd.Series:
    """One metric aggregated over each point's measured rounds (whole rounds only)."""
    df = analysis.ok_rounds(r.rounds)
    if df.empty or metric not in df.columns or df[metric].isna().all():
        return pd.Series(dtype=float)
    return df.groupby("point")[metric].agg(how).dropna()


# (column, metric, aggregate over rounds, format). Each column names its aggregate: the
# per-point tables show a metric's value (medians of starts' rounds, averaged) with its interval,
# so a maximum here (the largest any round reached) may lie above that interval.
BINDING = [("KV peak (max over rounds)", "kv_usage_peak", "max", ".1%"),
           ("preemptions (sum over rounds)", "preemptions", "sum", ".0f"),
           ("prefills > chunk (median)", "long_prefills", "median", ".0f"),
           ("running peak (max over rounds)", "running_peak", "max", ".0f"),
           ("hit rate (median)", "prefix_cache_hit_rate", "median", ".3f"),
           ("hit if no eviction (median)", "expected_prefix_hit_rate", "median", ".3f")]


def binding_table(r: Run) -> pd.DataFrame:
    """Per point, vLLM's own evidence of which limits it ran into: KV cache peak (the
    maximum over rounds) and preemptions (summed over rounds) for memory, prefills longer
    than the chunk (chunk size), the running requests' peak (maximum over rounds) against
    max_num_seqs, measured vs never-evicting hit rate (medians over rounds). Each column
    names its aggregate."""
    if not r.measured:
        return pd.DataFrame({"note": ["(nothing measured)"]})
    t = pd.DataFrame(index=pd.Index([s.point for s in r.measured], name="point"))
    for col, metric, how, fmt in BINDING:
        v = _per_point(r, metric, how)
        if not v.empty:
            t[col] = [format(v[p], fmt) if p in v else "" for p in t.index]
    t["max seqs"] = [s.effective.max_num_seqs if s.effective else "" for s in r.measured]
    return t


def binding_notes(r: Run) -> list[str]:
    """One sentence per grid axis: did it bind anywhere, and on what evidence. An axis
    that never bound is named: the study cannot show its effect."""
    notes = []
    kv, pre = _per_point(r, "kv_usage_peak", "max"), _per_point(r, "preemptions", "sum")
    longp = _per_point(r, "long_prefills", "median")
    for axis in r.axes:
        binds = axes.get(axis).binds
        if binds == "kv":
            if kv.empty:
                notes.append(f"{axis}: no KV usage was sampled, so the study cannot say whether it bound")
                continue
            # every point runs the same requests: a hit rate well below the best one's means
            # cached prefixes were evicted for lack of room
            hits = _per_point(r, "prefix_cache_hit_rate", "median")
            evicted = set(hits[hits < hits.max() - EVICTION_GAP].index) if not hits.empty else set()
            bound = sorted(set(kv[kv >= KV_BOUND].index) | set(pre[pre > 0].index) | evicted)
            if bound:
                notes.append(f"{axis} bound at {len(bound)} of {len(kv)} points (KV peak, maximum over rounds, "
                             f">= {KV_BOUND:.0%}, preemptions, or a median prefix-cache hit rate {EVICTION_GAP:.2f} "
                             f"or more below the study's best: evictions): {', '.join(bound)}")
            else:
                notes.append(f"{axis} never bound: KV peak (maximum over rounds) at most {kv.max():.1%} at "
                             "every point and no preemption; this study cannot show its effect")
        elif binds == "chunk":
            notes.append(_chunk_binding(r, axis, longp))
        elif binds == "seqs":
            running = _per_point(r, "running_peak", "max")
            caps = {s.point: s.effective.max_num_seqs for s in r.measured if s.effective}
            bound = sorted(p for p, v in running.items() if p in caps and v >= caps[p])
            notes.append(f"{axis} bound (running requests, maximum over rounds, reached it) at: "
                         f"{', '.join(bound)}" if bound else
                         f"{axis} never bound: running requests stayed below max_num_seqs at every point")
        elif binds == "scheduler":
            budget = _scheduler_evidence(r)
            if budget and not budget["bound"]:  # where it deferred somewhere, the axis-effects cell says where
                notes.append(scheduler_binding(r))
    return notes


def _chunk_binding(r: Run, axis: str, longp: pd.Series) -> str:
    """The chunk size binds where a prompt needs more than one step to prefill. Exact
    where the server took the kit's histogram bound (the counted edge is the chunk
    itself); otherwise vLLM's default buckets count prefills above a bound below the chunk,
    and the note says so instead of claiming more."""
    if longp.empty:
        return f"{axis}: the server did not report prefill lengths, so the study cannot say whether it bound"
    edge = _per_point(r, "long_prefill_edge_tokens", "max")
    mbt = {s.point: (s.effective.max_num_batched_tokens if s.effective else None) for s in r.measured}
    exact = {p for p in longp.index if p in edge and mbt.get(p) and edge[p] >= mbt[p]}
    bound = sorted(p for p in exact if longp[p] > 0)
    unknown = sorted(p for p in longp.index if p not in exact and longp[p] > 0)
    parts = []
    if bound:
        parts.append(f"{axis} bound at {len(bound)} of {len(longp)} points (prefills longer than the chunk, "
                     f"split over steps): {', '.join(bound)}")
    if unknown:
        at = ", ".join(f"{p} (above {edge[p]:.0f})" if p in edge else f"{p} (bound not recorded)"
                       for p in unknown)
        parts.append(f"{axis}: this vLLM counts prefill lengths only in coarse buckets (no "
                     f"--custom-histogram-buckets), so prefills were counted above a bound below the chunk, "
                     f"and whether the chunk split them is not known at: {at}")
    if not parts:
        return f"{axis} never bound: no prefill was longer than the chunk; this study cannot show its effect"
    return "; ".join(parts)


# -- the scheduler axis: did the budget bind, and an axis's effect per request group ----
def scheduler_axis(r: Run) -> str | None:
    """min_reuse_ratio where the study sweeps the Prefix Reuse Budget (several values of
    scheduler.min_reuse_ratio make it an axis of the points' values, beside the grid)."""
    return SCHEDULER_AXIS if SCHEDULER_AXIS in r.axes else None


def _same(a, b) -> bool:
    return a == b or str(a) == str(b)


def _budget_points(r: Run, axis: str) -> list[str]:
    """Measured points that ran with the budget (min_reuse_ratio not off)."""
    return [s.point for s in r.measured if axis in s.values and not _same(s.values[axis], "off")]


def _scheduler_evidence(r: Run) -> dict | None:
    """The budget's points, split by its counters over every measured round: bound (a
    request deferred in some round), never (no request deferred in any round), unknown
    (no counter recorded); None where the study has no scheduler axis or no budget point
    was measured."""
    axis = scheduler_axis(r)
    points = _budget_points(r, axis) if axis else []
    if not points:
        return None
    deferred = _per_point(r, "pb_deferred", "max")
    return {"axis": axis, "points": points, "bound": sorted(p for p in points if p in deferred and deferred[p] > 0),
            "never": sorted(p for p in points if p in deferred and deferred[p] <= 0),
            "unknown": sorted(p for p in points if p not in deferred)}


def scheduler_binding(r: Run) -> str | None:
    """One sentence: where the budget bound (deferred a request in some round) and where
    it never did (none in any round: there the study cannot show its effect)."""
    ev = _scheduler_evidence(r)
    if ev is None:
        return None
    axis, n = ev["axis"], len(ev["points"])
    if not ev["bound"] and not ev["never"]:
        return (f"{axis}: the budget's counters were not recorded at its {n} point(s), so the study cannot say "
                "whether it bound")
    if not ev["bound"]:
        return (f"{axis} never bound: the budget deferred no request in any round at any of its {n} point(s) "
                f"({', '.join(ev['never'])}); this study cannot show its effect")
    parts = [f"{axis} bound at {len(ev['bound'])} of {n} budget point(s) (requests deferred in a round): "
             + ", ".join(ev["bound"])]
    if ev["never"]:
        parts.append("it never bound (no request deferred in any round; no effect to show there) at: "
                     + ", ".join(ev["never"]))
    if ev["unknown"]:
        parts.append("the budget's counters were not recorded at: " + ", ".join(ev["unknown"]))
    return "; ".join(parts)


DEFERRAL_COUNTS = (("deferred", "pb_deferred"), ("let in by the age bound", "pb_admitted_by_age"),
                   ("let in while idle", "pb_admitted_idle"))
DEFERRAL_TIMES = (("defer P50 (ms)", "pb_defer_ms_p50"), ("defer P99 (ms)", "pb_defer_ms_p99"))


def _median_range(v: pd.Series, fmt: str) -> str:
    return f"{format(v.median(), fmt)} ({format(v.min(), fmt)} to {format(v.max(), fmt)})"


def _column(rounds: pd.DataFrame, col: str) -> pd.Series:
    """A column's recorded values (none where the rounds lack it)."""
    return rounds[col].dropna() if col in rounds.columns else pd.Series(dtype=float)


def deferral_table(r: Run) -> pd.DataFrame | None:
    """Per point with the budget: requests deferred per round, and how many of those the
    age bound and the idle rule let in, as the median over its measured rounds with the
    range (min to max); the hold times likewise; whether it bound (never: it deferred no
    request in any round). None without a scheduler axis."""
    ev = _scheduler_evidence(r)
    if ev is None:
        return None
    axis, df = ev["axis"], analysis.ok_rounds(r.rounds)
    rows = []
    for p in ev["points"]:
        g = df[df["point"] == p]
        row = {"point": p, axis: axes.get(axis).fmt(next(s.values[axis] for s in r.measured if s.point == p)),
               "rounds": len(_column(g, "pb_deferred"))}
        for label, col in DEFERRAL_COUNTS:
            v = _column(g, col)
            row[f"{label} per round"] = _median_range(v, "g") if len(v) else "not recorded"
        for label, col in DEFERRAL_TIMES:
            v = _column(g, col)
            row[label] = _median_range(v, ".0f") if len(v) else ""
        row["bound"] = "yes" if p in ev["bound"] else "never" if p in ev["never"] else "not known"  # in no round
        rows.append(row)
    return pd.DataFrame(rows).set_index("point")


EFFECT_METRICS = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms")       # per request group and for all
WHOLE_ROUND_EFFECTS = ("output_throughput", "prefix_cache_hit_rate")  # the whole round's only


def axis_values(r: Run, axis: str) -> list:
    """An axis's values in the order the study lists them."""
    study = r.study
    if axis in study.grid:
        return list(study.grid[axis])
    if axis == SCHEDULER_AXIS:
        return study.scheduler.ratios
    return list(dict.fromkeys(s.values[axis] for s in r.summaries if axis in s.values))


def reference_value(r: Run, axis: str):
    """What an axis's other values are set against: vLLM's own scheduler (off) for the
    budget; else the baseline point's value; else the axis's first value."""
    values = axis_values(r, axis)
    if axis == SCHEDULER_AXIS and any(_same(v, "off") for v in values):
        return "off"
    base = next((s for s in r.summaries if s.point == r.baseline), None)
    if base is not None and axis in base.values:
        return base.values[axis]
    return values[0] if values else None


def axis_pairs(r: Run, axis: str, reference=None) -> list[tuple[str, str]]:
    """(point, the point it is set against): each point at another value of `axis` with
    the point at the reference value whose other axes' values are the same."""
    ref = reference_value(r, axis) if reference is None else reference
    values = {s.point: s.values for s in r.summaries if axis in s.values}
    at_ref = [q for q, v in values.items() if _same(v[axis], ref)]
    pairs = []
    for p, v in values.items():
        if _same(v[axis], ref):
            continue
        twin = next((q for q in at_ref if all(_same(values[q].get(k), x) for k, x in v.items() if k != axis)), None)
        if twin:
            pairs.append((p, twin))
    return pairs


def request_groups(rounds: pd.DataFrame) -> list[tuple[str, tuple[str, str] | None]]:
    """('all', None), then each request class, turn, rate step or prefix of the rounds
    (label 'class=shared', group ('class', 'shared')), in the group table's order."""
    if rounds.empty or "group" not in rounds.columns:
        return [("all", None)]
    groups = rounds.loc[rounds["group"] != "all", ["group", "group_value"]].drop_duplicates()
    labels = sorted((f"{g}={v}" for g, v in groups.itertuples(index=False)), key=_group_order)
    return [("all", None)] + [(lab, tuple(lab.split("=", 1))) for lab in labels]


def _change_text(d: analysis.Difference) -> str:
    if not np.isfinite(d.low):  # a point's spread was not measured (analysis.MetricData.spread): no interval
        return f"{d.estimate:+.1%} (no spread measured)" if d.relative else f"{d.estimate:+.3g} (no spread measured)"
    if d.low == d.high and metrics.get(d.metric).exact:  # both points exact by construction
        return f"{d.estimate:+.1%} (exact)" if d.relative else f"{d.estimate:+.3g} (exact)"
    if d.relative:
        return f"{d.estimate:+.1%} [{d.low:+.1%}, {d.high:+.1%}]"
    return f"{d.estimate:+.3g} [{d.low:+.3g}, {d.high:+.3g}]"


EFFECT_COLUMNS = ["point", "against", "group", "metric", "value", "reference value", "change", "verdict",
                  "estimate", "low", "high", "relative", "resolved"]


def axis_effect_frame(r: Run, axis: str, reference=None, names=EFFECT_METRICS,
                      whole=WHOLE_ROUND_EFFECTS) -> pd.DataFrame:
    """One row per (point, group, metric): each point at a non-reference value of `axis`
    against its twin at the reference value (axis_pairs), for all requests and each
    request group the rounds have (the budget's shared and cold classes, turns, rate
    steps): both values [95% interval], the difference with its 95% interval (analysis.
    difference: the start-to-start spread pooled over the run's points), its verdict, and
    the point's axis values. `whole` metrics are the whole round's only."""
    pairs = axis_pairs(r, axis, reference)
    values = {s.point: s.values for s in r.summaries}
    cols = list(dict.fromkeys(k for p, _ in pairs for k in values[p])) + EFFECT_COLUMNS
    groups = request_groups(r.rounds)
    found = {}
    for label, group in groups:
        for m in tuple(names) + (tuple(whole) if group is None else ()):
            data = analysis.MetricData.from_rounds(r.rounds, m, group)
            if data is not None:
                found[label, m] = (data, data.noise(), analysis.point_intervals(r.rounds, [m], group))
    rows = []
    for p, ref in pairs:
        for (label, m), (data, noise, iv) in found.items():
            if p not in data.starts or ref not in data.starts:
                continue
            d = analysis.difference(data, p, ref, noise)
            mm = metrics.get(m)
            rows.append({**values[p], "point": p, "against": ref, "group": label, "metric": m,
                         "value": metrics.with_interval(_lookup(iv, p, m), mm),
                         "reference value": metrics.with_interval(_lookup(iv, ref, m), mm),
                         "change": _change_text(d), "verdict": d.verdict(), "estimate": d.estimate, "low": d.low,
                         "high": d.high, "relative": d.relative, "resolved": d.resolved})
    return pd.DataFrame(rows, columns=cols)


def axis_effect_table(r: Run, axis: str, reference=None) -> pd.DataFrame | None:
    """Per point at a non-reference value of `axis` and request group: the point it is set
    against, and per metric the change [95% interval] with its verdict (better or worse
    only where the interval excludes 0: an effect; else not resolved)."""
    f = axis_effect_frame(r, axis, reference)
    if f.empty:
        return None
    f = f.assign(cell=[f"{c} {v}" for c, v in zip(f["change"], f["verdict"])])
    order = [m for m in EFFECT_METRICS + WHOLE_ROUND_EFFECTS if m in set(f["metric"])]
    t = f.pivot_table(index=["point", "group"], columns="metric", values="cell", aggfunc="first", sort=False)
    t = t.reindex(columns=order).fillna("")
    t.columns = [f"{metrics.get(m).label} change" for m in order]
    against = f.drop_duplicates(["point", "group"]).set_index(["point", "group"])["against"]
    t.insert(0, "against", against.reindex(t.index))
    return t


def axis_effect_notes(r: Run, axis: str, reference=None) -> list[str]:
    """What the effects table shows, in words: what each point is set against, every
    resolved effect (and only those called effects), and for the scheduler where the
    budget bound."""
    ref = reference_value(r, axis) if reference is None else reference
    notes = [f"{axis}: each point against the point at {axis}={axes.get(axis).fmt(ref)} with the same other values, "
             "for all requests and per request group: the change [95% interval], called an effect only where "
             "the interval excludes 0"]
    if axis == SCHEDULER_AXIS:
        notes.append(scheduler_binding(r) or f"{axis}: no point with the budget was measured")
    f = axis_effect_frame(r, axis, reference)
    if f.empty:
        notes.append(f"{axis}: no measured point has a measured twin at {axis}={axes.get(axis).fmt(ref)} "
                     "to be set against")
        return notes
    effects = f[f["resolved"]]
    if effects.empty:
        notes.append(f"no effect of {axis} this study resolves, in any request group: every interval includes 0")
    for row in effects.itertuples():
        notes.append(f"effect at {row.point} against {row.against}, {row.group}: {metrics.get(row.metric).label} "
                     f"{row.change} ({row.verdict})")
    return notes


# -- comparisons ----------------------------------------------------------------------
def comparison_table(r: Run, against: str | None = None) -> pd.DataFrame | None:
    """Each point against the best point of each headline metric (or against a named
    baseline point): the relative difference with its 95% interval, and a verdict."""
    names = [n for n in ("ttft_p90_ms", "itl_p90_ms", "tpot_p50_ms", "output_throughput")
             if n in set(r.intervals.get("metric", []))]
    if not names:
        print("nothing measured to compare")
        return None
    rows = {}
    for n in names:
        data = analysis.MetricData.from_rounds(r.rounds, n)
        ref = against if against in (data.starts if data else {}) else analysis.best_point(data)
        noise = data.noise()
        for p in data.starts:
            cell = "reference" if p == ref else _diff_cell(analysis.difference(data, p, ref, noise))
            rows.setdefault(p, {})[f"{metrics.get(n).label} vs {'baseline' if against else 'best'}"] = cell
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("point")


def _diff_cell(d: analysis.Difference) -> str:
    fmt = (lambda v: f"{v:+.1%}") if d.relative else (lambda v: f"{v:+.3g}")
    if not np.isfinite(d.low):  # a point's spread was not measured: never resolved
        return f"{fmt(d.estimate)} (no spread measured) not resolved"
    if d.low == d.high and metrics.get(d.metric).exact:  # both points exact by construction
        return f"{fmt(d.estimate)} (exact) {d.verdict()}"
    return f"{fmt(d.estimate)} [{fmt(d.low)}, {fmt(d.high)}] {d.verdict()}"


# -- capacity studies -------------------------------------------------------------
def is_capacity_study(r: Run) -> bool:
    return r.study.capacity is not None


def _trace_info(r: Run) -> dict | None:
    """A replayed trace's record (source, window, real rate), from the first start that has one."""
    for s in r.summaries:
        for st in r.folder.point(s.point).starts():
            if st.trace:
                return st.trace
    return None


def capacity_answer(r: Run) -> str | None:
    """The capacity study's answer in words: the best config's capacity with its interval
    (and as a multiple of the trace's real rate), the baseline's (vLLM's defaults where
    the study names them so), and the difference, called an effect only when resolved."""
    if not is_capacity_study(r):
        return None
    bounds = ", ".join(f"{metrics.get(k).label} <= {v:g} ms" for k, v in r.study.capacity.slo.items())
    rec = decision.recommend(r.rounds, r.intervals, {})
    if rec.point is None:
        return f"No capacity was measured: {rec.reason}."
    m = metrics.get("capacity_rps")
    trace = _trace_info(r)
    times = f" ({rec.value / trace['rate']:.2f} x the trace's real rate)" if trace and trace.get("rate") else ""
    sustains = metrics.with_interval(r.interval(rec.point, "capacity_rps"), m)
    lines = [f"{rec.point} sustains {sustains} req/s{times} within the SLO ({bounds})."]
    censored = _censored(r, rec.point)
    if censored:
        lines.append(censored)
    base = r.baseline
    below = _baseline_below(r, base) if base and base != rec.point else None
    if below:
        lines.append(below + _gain_over_below(r, rec.point, base))
    elif base and base != rec.point and r.interval(base, "capacity_rps"):
        data = analysis.MetricData.from_rounds(r.rounds, "capacity_rps")
        d = analysis.difference(data, rec.point, base)
        change = f"{d.estimate:+.0%} [{d.low:+.0%}, {d.high:+.0%}]" if d.relative else \
            f"{d.estimate:+.2f} [{d.low:+.2f}, {d.high:+.2f}] req/s"
        lines.append(f"The baseline {base} sustains {metrics.with_interval(r.interval(base, 'capacity_rps'), m)} "
                     "req/s: "
                     f"{change}, " + ("a resolved gain." if d.resolved and d.estimate > 0 else
                                      "a resolved loss." if d.resolved else "not resolved by this study."))
    elif base == rec.point:
        lines.append(f"That is the baseline ({base}) itself.")
    if rec.tied:
        lines.append("Not told apart from it by this study: " + ", ".join(rec.tied) + ".")
    at = [f"{metrics.get(k).label} {metrics.with_interval(r.interval(rec.point, k), metrics.get(k))} ms"
          for k in ("ttft_sched_p90_ms", "ttft_p90_ms", "itl_p99_ms", "tpot_p50_ms") if r.interval(rec.point, k)]
    if at:
        lines.append("At its capacity: " + "; ".join(at) + ".")
    cost = cost_per_million(r, rec.point)
    if cost:
        lines.append(f"Cost at capacity: {cost} per million output tokens "
                     f"(at {r.study.gpu_hour_price:g} a GPU-hour).")
    return "\n".join(lines)


def cost_per_million(r: Run, point: str) -> str | None:
    """price x GPUs / output tokens per hour at capacity, x 1e6, with the interval that
    the output throughput's interval maps to (a higher throughput is a lower cost)."""
    price = r.study.gpu_hour_price
    iv = r.interval(point, "output_throughput")
    if not price or not iv or not iv["value"]:
        return None
    gpus = r.study.engine_args.tensor_parallel_size or 1
    per = lambda tok_s: price * gpus / (tok_s * 3600) * 1e6  # noqa: E731
    if np.isfinite(iv["ci_low"]) and iv["ci_low"] > 0:
        return f"{per(iv['value']):.3g} [{per(iv['ci_high']):.3g}, {per(iv['ci_low']):.3g}]"
    return f"{per(iv['value']):.3g}"


def _completed_capacities(r: Run, point: str) -> list:
    """The capacity searches of the point's starts that completed."""
    return [st.capacity for st in r.folder.point(point).starts() if st.capacity and st.status == "ok"]


def _censored(r: Run, point: str) -> str | None:
    starts = _completed_capacities(r, point)
    above = sum(1 for c in starts if c.censored == "above")
    below = sum(1 for c in starts if c.censored == "below")
    cap = r.study.capacity
    if above:
        return (f"{above} of {len(starts)} starts met the SLO at the search's highest load ({cap.hi:g}): "
                "the capacity is at least that; raise capacity.hi to find it.")
    if below:
        return (f"{below} of {len(starts)} starts missed the SLO at the lowest load ({cap.lo:g}): "
                "their capacity counts as 0; lower capacity.lo.")
    return None


def _lowest_load(r: Run) -> tuple[str, float | None]:
    """The search's lowest load in words, and as requests/s where the load fixes the rate."""
    lo, over = r.study.capacity.lo, r.study.capacity.over
    trace = _trace_info(r)
    if over == "speed" and trace and trace.get("rate"):
        return f"speed {lo:g} ({lo * trace['rate']:.2f} req/s)", lo * trace["rate"]
    if over == "rate":
        return f"{lo:g} req/s", lo
    return f"{over} {lo:g}", None


def _baseline_below(r: Run, point: str) -> str | None:
    """Where every start of a point missed the SLO at the search's lowest load, say so with
    why each missed: its capacity is not 0 but unmeasured below the bracket."""
    starts = _completed_capacities(r, point)
    if not _all_below(starts):
        return None
    lo = r.study.capacity.lo
    why = "; ".join(sorted({s["why"] for c in starts for s in c.steps if s["load"] == lo and s.get("why")}))
    words, _ = _lowest_load(r)
    return (f"The baseline {point} met the SLO at no load tried: each of its {len(starts)} starts missed at the "
            f"lowest, {words}: {why}.")


def _gain_over_below(r: Run, best: str, base: str) -> str:
    """The gain over a baseline below the bracket is a lower bound: the best point's
    interval low less the lowest load's rate."""
    words, lo_rps = _lowest_load(r)
    iv = r.interval(best, "capacity_rps")
    if lo_rps is None or not iv or not np.isfinite(iv["ci_low"]):
        return f" Its capacity is below {words}; lower capacity.lo to measure it."
    more = iv["ci_low"] - lo_rps
    if more <= 0:
        return f" Its capacity is below {lo_rps:.2f} req/s; the gain is not resolved (lower capacity.lo to measure it)."
    return (f" Its capacity is below {lo_rps:.2f} req/s, so {best} sustains at least {more:+.2f} req/s more "
            f"({iv['ci_low'] / lo_rps:.1f} x or more: its interval's low end over that rate), a resolved gain.")


def _all_below(completed: list) -> bool:
    """Every completed start of a point (_completed_capacities) missed the SLO at the
    search's lowest load: its capacity is unmeasured below the bracket (recorded as 0,
    which it is not)."""
    return bool(completed) and all(c.censored == "below" for c in completed)


def lowest_load_rps(r: Run) -> float | None:
    """The capacity search's lowest load as requests/s, where the load fixes the rate."""
    return _lowest_load(r)[1] if is_capacity_study(r) else None


def below_lowest_load(r: Run) -> str:
    """'below 3.08' (req/s), or the load in the search's own unit where no rate fixes it."""
    words, lo_rps = _lowest_load(r)
    return f"below {lo_rps:.2f}" if lo_rps else f"below {words}"


def capacity_cell(r: Run, point: str, completed: list | None = None) -> str:
    """A point's capacity in req/s [95% interval] for a table, or 'below ...' where every
    start missed at the lowest load (`completed`: its _completed_capacities, if read)."""
    if _all_below(_completed_capacities(r, point) if completed is None else completed):
        return below_lowest_load(r)
    return metrics.with_interval(r.interval(point, "capacity_rps"), metrics.get("capacity_rps"))


def search_trials(r: Run) -> pd.DataFrame | None:
    """A search's trials, one row per server start; in a capacity search, a trial that
    missed the SLO missed it at the lowest load and shows that bound."""
    from ..search import search_report  # optuna (0.6 s to import) only where a run searched
    return search_report.trials_table(r, below=below_lowest_load(r) if is_capacity_study(r) else None)


def capacity_table(r: Run) -> pd.DataFrame | None:
    """Per point: capacity [95% interval] in req/s and in the search's unit, each start's
    bracket and steps, and the latencies at capacity."""
    if not is_capacity_study(r):
        return None
    over = r.study.capacity.over
    rows = []
    for s in r.summaries:
        starts = [st for st in r.folder.point(s.point).starts() if st.capacity]
        brackets = "; ".join(f"s{st.start}: [{st.capacity.bracket[0]:.3g}, "
                             f"{'...' if st.capacity.bracket[1] is None else format(st.capacity.bracket[1], '.3g')}"
                             f"] in {len(st.capacity.steps)} steps" + ("" if st.status == "ok" else " (failed)")
                             for st in starts)
        completed = [st.capacity for st in starts if st.status == "ok"]
        below = _all_below(completed)
        row = {"point": s.point, "status": status_label(s),
               "capacity (req/s)": capacity_cell(r, s.point, completed),
               f"capacity ({over})": f"below {r.study.capacity.lo:g}" if below else
               metrics.with_interval(r.interval(s.point, "capacity_load"), metrics.get("capacity_load")),
               f"{over} bracket per start": brackets}
        for k in ("ttft_sched_p90_ms", "itl_p99_ms", "output_throughput", "prefix_cache_hit_rate"):
            row[f"{metrics.get(k).title} at capacity"] = metrics.with_interval(r.interval(s.point, k), metrics.get(k))
        if r.study.gpu_hour_price:
            row["cost per 1M output tokens"] = cost_per_million(r, s.point) or ""
        rows.append(row)
    return pd.DataFrame(rows).set_index("point") if rows else None


FIDELITY = ("prompt_tokens_vs_trace", "expected_prefix_hit_rate", "prefix_cache_hit_rate", "send_lateness_p50_ms",
            "send_lateness_p99_ms", "offered_rate")


def fidelity_table(r: Run) -> pd.DataFrame | None:
    """Does the replay reproduce the trace? Over every measured round of each point (each
    capacity step included): prompt tokens against the trace's, the hit rate a never-evicting
    cache would reach on the window against vLLM's, and how late the client sent."""
    trace = _trace_info(r)
    if trace is None:
        return None
    df = r.rounds[(r.rounds["group"] == "all") & (r.rounds["round_status"] == "ok")]
    rows = []
    for point, g in df.groupby("point", sort=False):
        row = {"point": point, "rounds": len(g)}
        for k in FIDELITY:
            if k in g.columns and g[k].notna().any():
                m = metrics.get(k)
                row[m.title] = f"{m.format(g[k].median())} ({m.format(g[k].min())} to {m.format(g[k].max())})"
        rows.append(row)
    note = (f"trace {trace['source']}: {trace['requests']} requests kept, {trace['dropped_over_max_model_len']} "
            f"longer than max_model_len={trace['max_model_len']} left out; real rate {trace['rate']:.2f} req/s")
    print(note)
    return pd.DataFrame(rows).set_index("point") if rows else None


# -- the answer in words, for the top of the page --------------------------------
NO_SLO_NOTE = ("(the study sets no `slo:`; with one, the recommendation is the highest goodput among "
               "the points that meet it)")


def answer_text(r: Run) -> str:
    """The answer as `notebook_support.recommendation` prints it: a capacity study's
    capacity, else the recommendation under the SLO (with the note a study without one
    gets)."""
    if r.search:
        from ..search import search_report  # optuna (0.6 s to import) only where a run searched
        if not r.measured:  # stopped before (or during) its confirmation
            return search_report.summary_line(r) + "\n" + search_report.NOT_CONFIRMED.format(run=r.folder.path)
        decided = capacity_answer(r) or "\n".join(search_report.objective_lines(r))
        return search_report.summary_line(r) + "\n" + decided
    answer = capacity_answer(r)
    if answer:
        return answer
    text = decision.recommend(r.rounds, r.intervals, r.slo).text()
    return text if r.slo else f"{text}\n\n{NO_SLO_NOTE}"


def md_escape(text: str) -> str:
    """Plain text as Markdown that shows it as written (backslash before the punctuation
    Markdown would read as emphasis, links, code, HTML or headings)."""
    return re.sub(r"([\\`*_\[\]<>#|~])", r"\\\1", text)


def _md_prose(text: str, points: list[str], strong: str | None = None) -> str:
    """One line of the answer as Markdown: `code` spans kept, point ids set as code (and
    `strong` in bold too: the recommended point, where the line names it first), the
    rest escaped."""
    ids = sorted(points, key=len, reverse=True)
    name = re.compile(r"(?<![\w.=])(" + "|".join(map(re.escape, ids)) + r")(?![\w=]|\.\d)") if ids else None
    out = []
    for i, part in enumerate(re.split(r"(`[^`]*`)", text)):
        if i % 2:  # already a code span
            out.append(part)
            continue
        pos = 0
        for hit in (name.finditer(part) if name else ()):
            out.append(md_escape(part[pos:hit.start()]))
            code = f"`{hit.group(1)}`"
            if hit.group(1) == strong:
                code, strong = f"**{code}**", None
            out.append(code)
            pos = hit.end()
        out.append(md_escape(part[pos:]))
    return "".join(out)


def _bound_words(slo: dict[str, float]) -> str:
    words = []
    for k, v in slo.items():
        m = metrics.get(k)
        unit = f" {m.unit}" if m.unit and m.unit != "share" else ""
        words.append(f"{m.label} {'≥' if m.better == 'higher' else '≤'} {v:g}{unit}")
    return ", ".join(words)


def answer_context(r: Run) -> str:
    """One sentence or two beside the answer: the SLO it was judged under (and how many
    points meet it), the study's size and where it ran, and the failures, if any."""
    m = r.manifest
    n = len(r.summaries)
    parts = []
    if r.slo and not is_capacity_study(r):
        verdicts = decision.slo_table(r.intervals, r.slo) if not r.intervals.empty else pd.DataFrame()
        meets = int((verdicts["SLO"] == "meets").sum()) if "SLO" in verdicts else 0
        given = " (given at report time)" if r.slo_override else ""
        parts.append(f"SLO{given}: {_bound_words(r.slo)}; {meets} of {n} points meet every bound with their whole "
                     "95% interval.")
    gpus = sorted({g.name for g in m.machine.gpus})
    where = " and ".join(gpus) if gpus else f"CPU ({m.machine.cpu.model})"
    starts = r.search.confirm_starts if r.search else r.study.replicates  # a search: its confirmation starts
    parts.append(f"Study {m.study}: {n} point{'s' * (n != 1)}, {starts} server start{'s' * (starts != 1)} "
                 f"{'each ' * (n != 1)}of {_per_start(r.study)}, on {where} with {m.versions.vllm_distribution} "
                 f"{m.versions.vllm}.")
    short = [s for s in r.summaries if s.status != "ok"]
    parts.append(f"{len(short)} of {n} points did not complete every planned round: see Failures below."
                 if short else "Every point completed every planned round.")
    return " ".join(parts)


def best_point(r: Run) -> str | None:
    """The point the answer names: a search's best confirmed configuration by its
    objective, else the recommendation (by capacity, or under the SLO)."""
    if not r.measured:
        return None
    if r.search:
        from ..search import search_report  # optuna (0.6 s to import) only where a run searched
        return search_report.best(r)
    return decision.recommend(r.rounds, r.intervals, {} if is_capacity_study(r) else r.slo).point


def answer_markdown(r: Run) -> str:
    """The answer as prose for the top of the report: `answer_text`, a paragraph per line
    (the recommended point in bold), then its context and how to freeze it."""
    points = [s.point for s in r.summaries]
    best = best_point(r)
    paras = []
    lines = [ln for ln in answer_text(r).splitlines() if ln.strip()]
    first = 1 if r.search else 0  # a search's first line says what it did; the answer follows
    for i, line in enumerate(lines):
        paras.append(_md_prose(line, points, strong=best if i == first else None))
    paras.append(_md_prose(answer_context(r), points))
    if best and not r.study.targets:  # an endpoint is run elsewhere: nothing to export
        paras.append(f"Freeze it as a `vllm serve --config` file with this evidence beside it: "
                     f"`python -m vllm_study export results/{r.folder.path.resolve().name} --best`.")
    return "\n\n".join(paras)
