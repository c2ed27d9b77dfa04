"""Read a run folder into the report's tables (the notebook and the sweep's last words
both use these), and export the executed report as a static page."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from . import metrics
from .results import Manifest, PointSummary, RunFolder


@dataclass
class Run:
    folder: RunFolder
    manifest: Manifest
    summaries: list[PointSummary]
    rounds: pd.DataFrame            # summary.csv: one row per point x start x round x group

    @classmethod
    def load(cls, folder: RunFolder | str | Path) -> "Run":
        folder = folder if isinstance(folder, RunFolder) else RunFolder(folder)
        manifest = folder.manifest()
        rounds = pd.read_csv(folder.summary_csv) if folder.summary_csv.exists() else folder.rounds_table()
        return cls(folder, manifest, folder.summaries(), rounds)

    @property
    def axes(self) -> list[str]:
        return list(self.manifest.params.get("grid") or {})

    @property
    def measured(self) -> list[PointSummary]:
        """Points with at least one measured round (ok or partial)."""
        return [s for s in self.summaries if s.estimates and s.status in ("ok", "partial")]


def describe(r: Run) -> str:
    m, v = r.manifest, r.manifest.versions
    p = m.params
    w = p["workload"]
    gpus = ", ".join(f"{g.name} {g.memory_total_bytes / 2**30:.0f} GiB driver {g.driver}" for g in m.machine.gpus)
    lines = [
        f"study {m.study} created {m.created_utc}  git {str(m.git.sha)[:12]}"
        + (" (uncommitted changes)" if m.git.dirty else ""),
        f"engine {m.engine}: {v.vllm_distribution} {v.vllm}, torch {v.torch}, python {v.python}, kit {v.vllm_study}",
        f"CPU: {m.machine.cpu.model} ({m.machine.cpu.cores} cores, {m.machine.cpu.capability})"
        + (f"; dtype {m.cpu_dtype['dtype']}: {m.cpu_dtype['reason']}" if m.cpu_dtype else ""),
        f"GPU: {gpus or m.machine.no_gpu_reason}",
        f"grid: {json.dumps(p['grid'])}" if p.get("grid") else f"targets: {[t['name'] for t in p['targets']]}",
        f"{p['replicates']} server start(s) per point x {p['rounds']} rounds; workload {w['kind']} via {w['api']}, "
        f"load {w['load']['kind']}, {w['requests_per_round']} requests/round",
        "fixed engine args: " + json.dumps(p["engine_args"], sort_keys=True),
    ]
    if m.resumes:
        lines.append(f"resumed {len(m.resumes)} time(s): see manifest.json")
    return "\n".join(lines)


def _cell(e, m: metrics.Metric) -> str:
    """'182 [140, 230]': the median and its 95% interval in the metric's format."""
    if e is None:
        return ""
    if e.ci_low is None or e.starts * e.rounds < 2:
        return m.format(e.median)
    return f"{m.format(e.median)} [{m.format(e.ci_low)}, {m.format(e.ci_high)}]"


def status_label(s: PointSummary) -> str:
    if s.status == "partial":
        return f"partial {s.rounds_ok}/{s.rounds_planned}"
    return s.status


def headline_table(r: Run) -> pd.DataFrame:
    """Per point: status, and each headline metric's median [95% interval]."""
    names = [n for n in ("startup_s", *metrics.HEADLINE) if any(n in s.estimates for s in r.summaries)]
    rows = []
    for s in r.summaries:
        row = {"point": s.point, "status": status_label(s)}
        if s.effective:
            row["max seqs"] = s.effective.max_num_seqs
        for n in names:
            m = metrics.get(n)
            row[m.title] = _cell(s.estimates.get(n), m)
        rows.append(row)
    return pd.DataFrame(rows).set_index("point") if rows else pd.DataFrame({"status": []})


def estimates_frame(s: PointSummary) -> pd.DataFrame:
    rows = [{"metric": n, "median": e.median, "ci_low": e.ci_low, "ci_high": e.ci_high, "min": e.min,
             "max": e.max, "rounds": e.rounds, "starts": e.starts} for n, e in s.estimates.items()]
    return pd.DataFrame(rows).set_index("metric").round(3) if rows else pd.DataFrame({"median": []})


def long_estimates(r: Run, groups: bool = False) -> pd.DataFrame:
    """One row per point x metric (x group): median, interval, range, with the point's
    axis values and status: what figures draw from."""
    rows = []
    for s in r.summaries:
        base = {"point": s.point, **s.values, "status": s.status}
        sets = s.groups.items() if groups else [("all", s.estimates)]
        for label, ests in sets:
            for n, e in ests.items():
                rows.append({**base, "group": label, "metric": n, **e.model_dump(exclude={"method"})})
    return pd.DataFrame(rows)


def failures(r: Run) -> pd.DataFrame:
    """Points that did not complete every planned round, with why."""
    rows = [{"point": s.point, "status": status_label(s), "rounds ok": f"{s.rounds_ok}/{s.rounds_planned}",
             "reason": " | ".join(s.reasons) or "-"} for s in r.summaries if s.status != "ok"]
    if not rows:
        return pd.DataFrame({"reason": ["(none: every point completed every round)"]}, index=["-"])
    return pd.DataFrame(rows).set_index("point")


def target_comparison(r: Run) -> pd.DataFrame | None:
    targets = r.manifest.params.get("targets") or []
    if not targets:
        print("not an endpoint study (it has a grid, no targets)")
        return None
    by_id = {s.point: s for s in r.summaries}
    first = by_id.get(f"target={targets[0]['name']}")
    rows = []
    for t in targets:
        s = by_id.get(f"target={t['name']}")
        row = {"target": t["name"], "base_url": t["base_url"], "status": status_label(s) if s else "not run"}
        for n in ("ttft_p50_ms", "itl_p50_ms", "e2e_p50_ms"):
            m = metrics.get(n)
            e = s.estimates.get(n) if s else None
            base = first.estimates.get(n) if first else None
            row[m.title] = _cell(e, m)
            row[f"{m.label} vs {targets[0]['name']}"] = \
                m.format(e.median - base.median) if e is not None and base is not None else ""
        rows.append(row)
    return pd.DataFrame(rows).set_index("target")


def _group_order(label: str):
    key, _, value = label.partition("=")
    try:
        return key, 0, float(value), ""
    except ValueError:
        return key, 1, 0.0, value


def group_table(r: Run) -> pd.DataFrame | None:
    """Per point and request class (long/short), turn, or ladder step."""
    rows = []
    for s in r.summaries:
        for label in sorted(s.groups, key=_group_order):
            ests = s.groups[label]
            rows.append({"point": s.point, "group": label,
                         **{metrics.get(n).title: _cell(ests.get(n), metrics.get(n)) for n in metrics.GROUP_METRICS}})
    if not rows:
        print("this run's workload has no classes, turns or rate steps")
        return None
    return pd.DataFrame(rows).set_index(["point", "group"])


def reported_metrics(r: Run) -> list[str]:
    present = {n for s in r.summaries for n in s.estimates}
    return [n for n in metrics.REGISTRY if n in present]


def study_failed(r: Run) -> bool:
    """Nothing was measured at any point: the study has no result but its failures."""
    return not r.measured


def short_table(folder: RunFolder) -> pd.DataFrame:
    t = headline_table(Run.load(folder))
    keep = [c for c in t.columns if c in ("status", "TTFT P90 (ms)", "ITL P90 (ms)", "TPOT P50 (ms)",
                                          "output tokens/s (tok/s)", "prefix-cache hit rate")]
    return t[keep]


def export_html(folder: RunFolder) -> Path:
    """report.html beside report.ipynb: static and self-contained (figures embedded,
    code hidden), readable without Jupyter."""
    import nbformat
    from nbconvert import HTMLExporter
    nb = nbformat.read(folder.path / "report.ipynb", as_version=4)
    exporter = HTMLExporter(exclude_input=True, exclude_input_prompt=True, exclude_output_prompt=True,
                            embed_images=True)
    body, _ = exporter.from_notebook_node(nb)
    out = folder.path / "report.html"
    out.write_text(body)
    return out
