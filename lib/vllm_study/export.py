"""Freeze a measured point as a `vllm serve --config` file, with the exact command and
the evidence beside it, so the chosen configuration goes into version control with
its justification.

    python -m vllm_study export results/<run> --best        # the report's recommendation
    python -m vllm_study export results/<run> --point mbt=2048__gmu=0.90

writes `<study>.<point>.serve.yaml` (vLLM's config-file format: flag names without the
dashes in front) and `<study>.<point>.md` (the numbers with their intervals, the SLO,
the run, vLLM version, GPU, model) into --out.
"""
from __future__ import annotations

from pathlib import Path

import yaml

from . import decision, metrics, report
from .results import RunFolder

# The real checkpoints whose architectures the kit's cards stand for (dummy weights).
CARD_MODELS = {"qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B-Instruct", "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B-Instruct",
               "qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct", "qwen2.5-14b": "Qwen/Qwen2.5-14B-Instruct",
               "qwen2.5-32b": "Qwen/Qwen2.5-32B-Instruct", "qwen2.5-72b": "Qwen/Qwen2.5-72B-Instruct"}
# What the kit adds to measure (counters.budget_buckets, hardware.py): not serving settings.
MEASUREMENT_ONLY = {"custom-histogram-buckets", "enable-mfu-metrics"}


def parse_flags(args: list[str]) -> dict:
    """['--a', '1', '--b=2', '--c'] -> {'a': '1', 'b': '2', 'c': True}."""
    out, i = {}, 0
    while i < len(args):
        tok = args[i]
        if not tok.startswith("--"):
            i += 1
            continue
        key, eq, value = tok[2:].partition("=")
        if eq:
            out[key] = value
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            out[key] = args[i + 1]
            i += 1
        else:
            out[key] = True
        i += 1
    return out


def serve_config(r: report.Run, point: str) -> dict:
    """The point's engine arguments as a vllm serve config: the study's fixed args, the
    point's grid values and the extra flags it passed; the kit's measurement-only flags
    and the per-run port/host/model left out."""
    s = next((x for x in r.summaries if x.point == point), None)
    if s is None:
        raise ValueError(f"{point!r} is not a point of {r.folder.path}; its points: "
                         + ", ".join(x.point for x in r.summaries))
    cfg = {k.replace("_", "-"): v for k, v in s.engine_args.items()}
    params = r.manifest.params
    extra = parse_flags(params.get("server", {}).get("extra_cli_args", []))
    cfg.update({k: v for k, v in extra.items() if k not in MEASUREMENT_ONLY})
    cfg["served-model-name"] = params["model"]["served_name"]
    return cfg


def model_name(r: report.Run) -> tuple[str, str]:
    """(what to serve, a note on it)."""
    m = r.manifest.params["model"]
    if m.get("path"):
        return m["path"], ("measured with dummy weights of this model's config" if m.get("dummy_weights")
                           else "measured with these weights")
    real = CARD_MODELS.get(m["card"], m["card"])
    return real, f"measured with dummy weights of the {m['card']} architecture: serve the real checkpoint"


def export(run: str | Path, point: str | None = None, out: Path = Path("."),
           slo: dict[str, float] | None = None) -> tuple[Path, Path]:
    r = report.Run.load(RunFolder(run), slo)
    slo = r.slo
    rec = decision.recommend(r.rounds, r.intervals, slo)
    point = point or rec.point
    if point is None:
        raise ValueError(f"no point to export: {rec.reason}")
    cfg = serve_config(r, point)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{r.manifest.study}.{point}"
    cfg_path, note_path = out / f"{stem}.serve.yaml", out / f"{stem}.md"
    model, model_note = model_name(r)
    header = (f"# vllm serve config exported from {r.folder.path.name}, point {point}\n"
              f"# vllm serve {model} --config {cfg_path.name}\n# evidence: {note_path.name}\n")
    cfg_path.write_text(header + yaml.safe_dump(cfg, sort_keys=True))
    note_path.write_text(_justification(r, point, rec, slo, model, model_note, cfg_path.name))
    return cfg_path, note_path


def _justification(r: report.Run, point: str, rec: decision.Recommendation, slo: dict, model: str,
                   model_note: str, cfg_name: str) -> str:
    m, v = r.manifest, r.manifest.versions
    gpus = ", ".join(g.name for g in m.machine.gpus) or f"none ({m.machine.cpu.model}, engine {m.engine})"
    lines = [f"# {m.study}: {point}", "", f"    vllm serve {model} --config {cfg_name}", "",
             f"- model: {model} ({model_note})", f"- run: `{r.folder.path.name}` (commit {str(m.git.sha)[:8]})",
             f"- vLLM {v.vllm} ({v.vllm_distribution}), torch {v.torch}; hardware: {gpus}",
             f"- workload: {m.params['workload']['kind']}, " + (report._trace_line(m.params["workload"]["trace"])
                                                                if m.params["workload"].get("trace") else
                                                                f"load {_load(m.params['workload']['load'])}"),
             f"- SLO: {', '.join(f'{k} <= {b:g}' for k, b in slo.items()) or 'none set'}", ""]
    s = next(x for x in r.summaries if x.point == point)
    method = r.intervals[r.intervals["point"] == point]["method"]
    lines[-1:-1] = [f"- status: {report.status_label(s)}" + (f" ({'; '.join(s.reasons)})" if s.reasons else ""),
                    f"- intervals: {method.iloc[0] if len(method) else 'none'}"]
    if point == rec.point:
        # a capacity study is justified by the load each config sustains within the SLO
        lines += ["Why this point:", "", report.capacity_answer(r) or rec.text(), ""]
    else:
        lines += [f"Chosen by hand; the report recommends {rec.point}.", ""]
    lines += ["| metric | value [95% interval] |", "|---|---|"]
    for name in metrics.HEADLINE:
        iv = r.interval(point, name)
        if iv is not None:
            lines.append(f"| {metrics.get(name).title} | {report._cell(iv, metrics.get(name))} |")
    return "\n".join(lines) + "\n"


def _load(load: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in load.items() if v not in (None, [], 1.0) or k == "kind")
