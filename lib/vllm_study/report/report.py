"""The report's tables over a run (the notebook and the sweep's last words both use
these): the headline per point, estimates, failures, request groups, the noise floor.

The report's other subjects are its siblings: the run as loaded (run.py, whose `Run` is
used here as `report.Run` too), the static page (page.py), whether each knob bound
(binding.py), an axis's effects and comparisons (effects.py), capacity
(capacity_section.py) and the answer in words (answer.py)."""
from __future__ import annotations

import json
import math
import shlex

import pandas as pd

from ..analysis import intervals
from ..vocab import metrics
from ..define.params import TraceSpec
from ..capacity import estimate
from ..records.results import PointSummary
from .capacity_section import capacity_cell, capacity_column, capacity_table, is_capacity_study, slo_metrics
from .run import Run, interval_row, per_start_work, status_label


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
        f"{s.replicates} server start(s) per point x {per_start_work(s)}; workload {w.kind} via {w.api}, "
        + (trace_line(w.trace) if w.trace else f"load {w.load.kind}, {w.requests_per_round} requests/round"),
        "fixed engine args: " + json.dumps(s.engine_args.model_dump(exclude_none=True), sort_keys=True),
    ]
    if s.server.command:
        # no figure of a run served by another program (the tests' fake engine) is vLLM's
        lines.insert(2, f"NOT vLLM: every start ran `{shlex.join(s.server.command)}` (server.command) with "
                     "vLLM's command line; no figure here is vLLM's")
    if m.resumes:
        lines.append(f"resumed {len(m.resumes)} time(s): see manifest.json")
    if m.overlaps:
        # a neighbour shares the host's CPU, PCIe and power: only a run without one can show its effect
        lines.append(f"executor {m.executor}: {len(m.overlaps)} pair(s) of server starts ran at the same time "
                     "(manifest.json: overlaps); whether a neighbour moved a number: `python -m vllm_study "
                     "compare <this study under --executor local> <this run>`")
    return "\n".join(lines)


def trace_line(t: TraceSpec) -> str:
    window = f"{t.requests} requests" if t.requests else f"{t.duration_s:g} s" if t.duration_s else "the whole file"
    where = (f"{t.windows} windows of {window} from across the whole trace" if t.windows
             else f"{window} from {t.start_s:g} s")
    prime = ", each round primed with its window's history" if t.prime == "history" else ""
    return f"trace {t.file} ({t.format}), {where}, speed {t.speed:g}{prime}"


def headline_table(r: Run) -> pd.DataFrame:
    """Per point: status, startup, and each headline metric's value [95% interval]."""
    # a capacity study's capacity is shown for every point, a bound where it is one
    measured = set(r.intervals.get("metric", []))
    # a metric the run did not record has no column: per-request figures (stall) came later than
    # the pooled ITL, and a committed run's table stays as it was rendered (nbval checks it)
    names = [n for n in metrics.HEADLINE if n in measured or (n == "capacity_rps" and is_capacity_study(r))]
    rows = []
    for s in r.summaries:
        row = {"point": s.point, "status": status_label(s)}
        if s.effective:
            row["max seqs"] = s.effective.max_num_seqs
        if "startup_s" in s.estimates:
            row["startup (s)"] = metrics.get("startup_s").format(s.estimates["startup_s"].median)
        for n in names:
            m = metrics.get(n)
            if n == "capacity_rps":   # in req/s, or the search's own unit where no rate fixes it
                row[capacity_column(r)] = capacity_cell(r, s.point)
            else:
                row[m.title] = metrics.with_interval(r.interval(s.point, n), m)
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
    # a capacity study's figures are one search a start (up to steps_per_start rounds each)
    done = "capacity searches ok" if is_capacity_study(r) else "rounds ok"
    rows = [{"point": s.point, "status": status_label(s), done: f"{s.rounds_ok}/{s.rounds_planned}",
             "reason": " | ".join(s.reasons) or "-"} for s in r.summaries if s.status != "ok"]
    if not rows:
        return pd.DataFrame({"reason": ["(none: every point completed every round)"]}, index=["-"])
    return pd.DataFrame(rows).set_index("point")


def within_run_note(r: Run) -> str | None:
    """intervals.SINGLE_START_NOTE where no point of the run had two starts. One count
    stands for both sides: a run's intervals pool start-to-start spread over its points,
    so one point with two starts measures it for every comparison in the run."""
    n = intervals.starts_per_point(r.rounds)
    return intervals.SINGLE_START_NOTE if intervals.one_start_note(n) else None


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
    if note := within_run_note(r):
        print(note)
    return pd.DataFrame(rows).set_index("target")


def _change(r: Run, metric: str, a: str, b: str) -> str:
    """a relative to b, '+12.0% [+3.1%, +21.7%]', or '' where either was not measured."""
    data = intervals.MetricData.from_rounds(r.rounds, metric)
    if data is None or a not in data.starts or b not in data.starts:
        return ""
    d = intervals.difference(data, a, b)
    if d.relative:
        return f"{d.estimate:+.1%} [{d.low:+.1%}, {d.high:+.1%}]"
    m = metrics.get(metric)
    return f"{d.estimate:+{m.fmt}} [{d.low:+{m.fmt}}, {d.high:+{m.fmt}}]"


def group_order(label: str):
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
    labels = sorted((f"{g}={v}" for g, v in groups.itertuples(index=False)), key=group_order)
    frames = {lab: intervals.point_intervals(df, metrics.GROUP_METRICS, tuple(lab.split("=", 1))) for lab in labels}
    rows = []
    for s in r.summaries:
        for lab in labels:
            cells = {metrics.get(n).title: metrics.with_interval(interval_row(frames[lab], s.point, n), metrics.get(n))
                     for n in metrics.GROUP_METRICS}
            if any(cells.values()):
                rows.append({"point": s.point, "group": lab, **cells})
    table = pd.DataFrame(rows).set_index(["point", "group"])
    # a metric no group recorded has no column (the stall figures came after many runs), as
    # in headline_table
    return table[[c for c in table.columns if (table[c] != "").any()]]


def noise_table(r: Run) -> pd.DataFrame:
    """The study's noise floor: how much each headline metric moves between server starts
    and between rounds of a start."""
    nf = intervals.noise_floor(r.rounds, [n for n in metrics.HEADLINE if n in metrics.REGISTRY])
    if nf.empty:
        return pd.DataFrame({"summary": ["(nothing measured)"]})
    if is_capacity_study(r) and "capacity_rps" in nf.index:
        nf.loc["capacity_rps", "summary"] = capacity_noise(r)
    return nf[["scale", "summary"]].rename(index=lambda n: metrics.get(n).title)


def capacity_noise(r: Run) -> str:
    """Capacity's start-to-start spread as its statistic measures it (capacity.estimate
    .start_spread over the fitted starts): the raw spread beside what is left of it beyond
    each start's bootstrap noise, never a 0 where the correction went below nothing."""
    sp = estimate.start_spread([pc.starts for pc in r.capacities.values() if pc])
    if not sp.df:
        return "start-to-start n/a (one resolved start per point)"
    pct = lambda sd: f"{math.expm1(sd) * 100:.1f}%"  # noqa: E731
    raw = f"start-to-start {pct(sp.raw)} (df {sp.df}) between the fitted capacities"
    if sp.within is None:
        return raw
    left = sp.corrected
    return raw + (f", {pct(left)} beyond each start's bootstrap noise ({pct(sp.within)})" if left else
                  f", within each start's bootstrap noise ({pct(sp.within)}): the starts differ no more than that")


def reported_metrics(r: Run) -> list[str]:
    present = set(r.intervals.get("metric", [])) | {n for s in r.summaries for n in s.estimates}
    return [n for n in metrics.REGISTRY if n in present]


def study_failed(r: Run) -> bool:
    """Nothing was measured at any point (a search: not even a trial): the study has no
    result but its failures."""
    trials = r.trial_rounds is not None and not intervals.ok_rounds(r.trial_rounds).empty
    return not r.measured and not trials


SHORT = ("ttft_p90_ms", "itl_p90_ms", "tpot_p50_ms", "output_throughput", "prefix_cache_hit_rate")


def short_table(r: Run) -> pd.DataFrame:
    """The console's table (sweep's and report's last words): the SLO's own metrics first,
    then the usual few. A capacity study's leads with each point's capacity, its interval,
    each start's bracket, the bound that decided it and the load its figures were measured
    at, then those figures (the capacity table's: with trace.windows, the hit rate per
    window)."""
    if is_capacity_study(r):
        cap = capacity_table(r)
        lead = [c for c in ("status", capacity_column(r), f"{r.study.capacity.over} bracket per start",
                            "binding SLO bound", "measured at") if c in cap.columns]
        return cap[lead + [c for c in cap.columns if " at capacity" in c and c not in lead]]
    t = headline_table(r)
    names = list(dict.fromkeys([*slo_metrics(r), *SHORT]))
    for n in names:   # an SLO metric outside the headline's (e.g. ITL P99)
        m = metrics.get(n)
        if m.title not in t.columns and any(r.interval(s.point, n) for s in r.summaries):
            t[m.title] = [metrics.with_interval(r.interval(s.point, n), m) for s in r.summaries]
    return t[["status"] + [metrics.get(n).title for n in names if metrics.get(n).title in t.columns]]
