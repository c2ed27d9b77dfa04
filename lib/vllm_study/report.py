"""Read a run folder into tables for the report notebook and the sweep's last words."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from . import runfolder

# Metric columns of the report's main table, with the names shown there.
HEADLINE = {
    "ttft_p50_ms": "TTFT P50 ms", "ttft_p90_ms": "TTFT P90 ms", "itl_p50_ms": "ITL P50 ms",
    "itl_p90_ms": "ITL P90 ms", "tpot_p50_ms": "TPOT P50 ms", "e2e_p50_ms": "E2E P50 ms",
    "output_throughput": "out tok/s", "request_throughput": "req/s",
    "prefix_cache_hit_rate": "prefix hit", "expected_prefix_hit_rate": "hit if no eviction",
    "engine_steps": "steps", "tokens_per_step": "tok/step",
    "preemptions": "preempt", "kv_usage_peak": "KV peak", "gpu_mem_peak_frac": "GPU mem",
}


def load_manifest(run: str | Path) -> dict:
    m = runfolder.read_manifest(Path(run))
    if m is None:
        raise FileNotFoundError(f"{run} has no {runfolder.MANIFEST}: not a run folder")
    return m


def load_summary(run: str | Path) -> pd.DataFrame:
    """summary.csv as written by the sweep (rebuilt from the point folders if absent)."""
    f = Path(run) / "summary.csv"
    df = pd.read_csv(f) if f.exists() else runfolder.summary_table(Path(run))
    df["round"] = df["round"].astype(str)
    return df


def medians(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["round"] == "median"].reset_index(drop=True)


def rounds(df: pd.DataFrame) -> pd.DataFrame:
    out = df[df["round"] != "median"].copy()
    out["round"] = out["round"].astype(int)
    return out


def axes(manifest: dict) -> list[str]:
    return list(manifest["params"]["grid"])


def headline_table(df: pd.DataFrame, manifest: dict, digits: int = 1) -> pd.DataFrame:
    """Medians across rounds per point, rounded so re-renders compare equal."""
    med = medians(df)
    cols = [c for c in HEADLINE if c in med.columns and med[c].notna().any()]
    t = med[["point", "status", "startup_s", "effective_max_num_seqs", *cols]].rename(columns=HEADLINE)
    t = t.rename(columns={"startup_s": "start s", "effective_max_num_seqs": "max seqs"})
    return t.set_index("point").round({c: (3 if c in ("prefix hit", "hit if no eviction", "KV peak", "GPU mem") else digits)
                                       for c in t.columns if c not in ("point", "status")})


def target_comparison(df: pd.DataFrame, manifest: dict) -> pd.DataFrame | None:
    targets = manifest["params"].get("targets") or []
    if not targets:
        print("not an endpoint study (it has a grid, no targets)")
        return None
    med = medians(df).set_index("point")
    base = f"target={targets[0]['name']}"
    rows = []
    for t in targets:
        r = med.loc[f"target={t['name']}"]
        row = {"target": t["name"], "base_url": t["base_url"], "status": r["status"]}
        for m, label in (("ttft_p50_ms", "TTFT P50 ms"), ("itl_p50_ms", "ITL P50 ms"), ("e2e_p50_ms", "E2E P50 ms")):
            row[label] = r.get(m)
            row[f"{label} vs {targets[0]['name']}"] = r.get(m) - med.loc[base].get(m) if pd.notna(r.get(m)) else None
        rows.append(row)
    return pd.DataFrame(rows).set_index("target").round(2)


GROUP_COLUMNS = {"requests": "requests", "ttft_p50_ms": "TTFT P50 ms", "ttft_p99_ms": "TTFT P99 ms",
                 "itl_p50_ms": "ITL P50 ms", "itl_p90_ms": "ITL P90 ms", "tpot_p50_ms": "TPOT P50 ms"}


def _group_order(label: str):
    key, _, value = label.partition("=")
    try:
        return key, 0, float(value), ""
    except ValueError:
        return key, 1, 0.0, value


def group_table(df: pd.DataFrame) -> pd.DataFrame | None:
    """Medians per request class (long/short), per turn, or per ladder step, per point."""
    med = medians(df)
    labels = sorted({c[c.index("[") + 1:-1] for c in med.columns if c.endswith("]")}, key=_group_order)
    if not labels:
        print("this run's workload has no classes, turns or rate steps")
        return None
    rows = []
    for _, r in med.iterrows():
        for g in labels:
            vals = {label: r.get(f"{m}[{g}]") for m, label in GROUP_COLUMNS.items()}
            if pd.notna(vals["requests"]):
                rows.append({"point": r["point"], "group": g, **vals})
    return pd.DataFrame(rows).set_index(["point", "group"]).round(1)


def failures(df: pd.DataFrame) -> pd.DataFrame:
    med = medians(df)
    return med.loc[med["status"] != "ok", ["point", "reason"]].set_index("point")


def short_table(run: str | Path) -> pd.DataFrame:
    df = load_summary(run)
    t = headline_table(df, load_manifest(run))
    keep = [c for c in ("status", "TTFT P90 ms", "ITL P90 ms", "TPOT P50 ms", "out tok/s", "prefix hit")
            if c in t.columns]
    return t[keep]
