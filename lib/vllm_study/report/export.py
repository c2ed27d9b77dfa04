"""Freeze a measured point as a `vllm serve --config` file, with the exact command and
the evidence beside it, so the chosen configuration goes into version control with
its justification.

    python -m vllm_study export results/<run> --best        # the report's recommendation
    python -m vllm_study export results/<run> --point mbt=2048__gmu=0.90
    python -m vllm_study export results/<run> --best --slo ttft_p90_ms=150   # exit 3 unless it surely meets it

writes `<study>.<point>.serve.yaml` (vLLM's config-file format: flag names without the
dashes in front) and `<study>.<point>.md` (the numbers with their intervals, the SLO,
the run, vLLM version, GPU, model) into --out. The command beside them is the one a
start of the point ran (start.json's launch: model folder or id, load format, the
environment the kit set), less its port and the flags the config file now holds; where
the run was made on another machine, with this machine's interpreter and card folder.
"""
from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..analysis import decision
from ..vocab import metrics
from ..define import models
from . import report
from . import answer, capacity_section, run as report_run
from ..launch import server
from ..define.params import Load, ModelSpec
from ..launch.deployment import MEASUREMENT_ONLY, PER_START, VllmServe
from ..launch.flags import Flag, Flags
from ..measure.launcher import KIT_SCHEDULER_PATHS, PLACE_ENV, STEPS_SCHEDULER_CLS
from ..measure.live_knobs import SCHEDULER_CLS as LIVE_SCHEDULER_CLS
from ..records.results import RunFolder

# The real checkpoints whose architectures the kit's cards stand for (dummy weights).
CARD_MODELS = {"qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B-Instruct", "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B-Instruct",
               "qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct", "qwen2.5-14b": "Qwen/Qwen2.5-14B-Instruct",
               "qwen2.5-32b": "Qwen/Qwen2.5-32B-Instruct", "qwen2.5-72b": "Qwen/Qwen2.5-72B-Instruct"}
# The kit's schedulers that only measured (the live-limits one let the kit lower limits
# between rounds, the step-records one recorded steps), by every path a run recorded them
# under; and today's path of each old one (a run made before the rename names a module
# that no longer exists).
MEASURING_SCHEDULERS = frozenset(path for today, old in KIT_SCHEDULER_PATHS
                                 if today in (LIVE_SCHEDULER_CLS, STEPS_SCHEDULER_CLS) for path in (today, old))
TODAYS_SCHEDULER = {old: today for today, old in KIT_SCHEDULER_PATHS}
# what the printed command leaves out of the one that ran (_drop_flags), said in the evidence
DROPPED = "less its port (pick one with --port) and the flags the config holds"


def refuse_predicted_only(run: RunFolder, point: str) -> None:
    """A config is exported on its measurement, never on a prediction (predict/study.py):
    raise ValueError for a point that has no completed start."""
    from ..predict import study as predicted
    if any(s.status == "ok" for s in run.point(point).starts()):
        return
    pred = predicted.read(run.path)
    p = pred.of(point) if pred else None
    if p is not None:
        said = (f"predicted only ({p.verdict}" + (f", capacity {p.value:.3g}, rank {p.rank}" if p.predicted else "")
                + f"; {predicted.PREDICTIONS})")
        raise ValueError(f"{point} has no measured start in {run.path}: it was {said}. A config is exported on "
                         "its measurement only: measure it (a study whose grid or baseline names it), then export")


def serve_config(r: report.Run, point: str) -> dict:
    """The point's engine arguments as a vllm serve config: the study's fixed args, the
    point's grid values and the extra flags it passed; the kit's measurement-only flags
    and the per-run port/host/model left out (deployment.VllmServe.serve_config)."""
    s = next((x for x in r.summaries if x.point == point), None)
    if s is None:
        raise ValueError(f"{point!r} is not a point of {r.folder.path}; its points: "
                         + ", ".join(x.point for x in r.summaries))
    return deployment_of(r, s.engine_args).serve_config()


def deployment_of(r: report.Run, engine_args: dict) -> VllmServe:
    """The deployment a point of the run describes, its configuration read by the codec
    (the model as the study names it: the config file leaves the model to the command)."""
    m = r.study.model
    return VllmServe(m.path or m.card, m.served_name, m.dummy, engine=Flags.of(engine_args),
                     extra=Flags.parse(r.study.server.extra_cli_args))


def model_name(r: report.Run) -> tuple[str, str]:
    """(the real model to serve in production, a note on what was measured)."""
    m = r.study.model
    if m.path:
        return m.path, ("measured with dummy weights of this model's config" if m.dummy
                        else "measured with these weights")
    real = CARD_MODELS.get(m.card)
    if real is None:  # the kit's own small card: no checkpoint has its weights
        return m.card, f"measured with dummy weights of the kit's {m.card} architecture"
    return real, (f"measured with dummy weights of the {m.card} architecture: for real answers serve {real} "
                  "in place of the card's folder, without --load-format dummy")


def _drop_flags(argv: list[str], keys: set[str]) -> list[str]:
    """argv less each flag named in keys (`--key [value]`, `--key=value`, `--no-key`,
    underscores or dashes: the codec's reading)."""
    return Flags.parse(argv).without(keys).argv()


def launch(r: report.Run, point: str, cfg: dict) -> tuple[list[str], dict[str, str], str]:
    """(argv, environment, where they come from) that start `point` as it was measured,
    with `--config` left to the caller. The launch a start of the point recorded (the
    summary's: its first start that came up) wins; a run that recorded none gets what
    server.py would build for its plan on this machine."""
    s = next(x for x in r.summaries if x.point == point)
    study_env = dict(r.study.server.env)  # the study's own: part of what ran
    if s.launch and s.launch.command:
        cmd, env = s.launch.command, {**study_env, **s.launch.kit_env}
        cmd, moved = _here(cmd, r.study.model)
        source = f"the launch a start of this point recorded (start.json), {DROPPED}" + "".join(
            f"; {what}" for what in moved)
    else:
        plan = r.folder.point(point).plan()
        model, dummy = models.resolve(plan.study.model)
        cmd = VllmServe(model, plan.study.model.served_name, dummy, engine=plan.point.engine_args.flags(),
                        extra=Flags.parse(plan.study.server.extra_cli_args),  # served as the run was
                        program=plan.study.server.program() or server.vllm_program()).command(0)
        env = {**study_env, **server.cpu_uni_env(cmd, study_env)}
        source = f"rebuilt by this kit, here (no start of this point recorded its launch), {DROPPED}"
    argv = _drop_flags(cmd, PER_START | MEASUREMENT_ONLY | set(cfg)
                       # the kit's measuring schedulers are measurement, as --enable-mfu-metrics is.
                       # The Prefix Reuse Budget's stays: it is the point's admission rule.
                       | ({"scheduler-cls"} if Flags.parse(cmd).get("scheduler-cls") in MEASURING_SCHEDULERS
                          else set()))
    argv, renamed = _todays_scheduler(argv)
    source += "".join(f"; {what}" for what in renamed)
    return argv, {k: v for k, v in env.items() if k not in PLACE_ENV}, source


def _todays_scheduler(argv: list[str]) -> tuple[list[str], list[str]]:
    """argv with a kit scheduler class named by its path before the plugin's package was
    renamed (KIT_SCHEDULER_PATHS) named by today's, and what was replaced, said. The
    codec reads the flag in either form (`--scheduler-cls path`, `--scheduler-cls=path`)."""
    entries, said = [], []
    for e in Flags.parse(argv).entries:
        if e.name == "scheduler-cls" and e.value in TODAYS_SCHEDULER:
            today = TODAYS_SCHEDULER[e.value]
            said.append(f"its --scheduler-cls {e.value} is where the kit's plugin lived when the run was made: "
                        f"{today}, the same class today, stands in")
            e = Flag(e.name, today, tuple(t.replace(e.value, today) for t in e.tokens))
        entries.append(e)
    return Flags(entries).argv(), said


def _here(cmd: list[str], model: ModelSpec) -> tuple[list[str], list[str]]:
    """The recorded launch with the paths that only held where the run was made (its
    interpreter; the folder the kit wrote a card's config and tokenizer into) replaced by
    this machine's, and what was replaced, said. A model path or hub id is kept as is."""
    cmd, moved = list(cmd), []
    if Path(cmd[0]).is_absolute() and not Path(cmd[0]).exists():
        moved.append(f"its interpreter {cmd[0]} is not on this machine: this one stands in")
        cmd[0] = sys.executable
    at = cmd.index("serve") + 1 if "serve" in cmd else cmd.index("--model") + 1 if "--model" in cmd else None
    if model.card and not model.path and at is not None and not Path(cmd[at]).exists():
        folder, _ = models.resolve(model)  # writes the card's folder here, as a sweep would
        where = "there" if folder == cmd[at] else f"at {folder}"
        moved.append(f"the card's folder {cmd[at]} was not on this machine: the kit wrote it {where}")
        cmd[at] = folder
    return cmd, moved


def shell_command(argv: list[str], env: dict[str, str], cfg_name: str) -> str:
    """One line for a POSIX shell: `VAR=value ... argv --config cfg_name`."""
    assigns = [f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())]  # quoted whole, VAR=... would not assign
    return " ".join(assigns + [shlex.join(argv + ["--config", cfg_name])])


# `python -m vllm_study export` exits with this where an SLO applies (given with --slo, else
# the study's `slo:`) and the exported point does not surely meet it (--force: 0)
EXIT_SLO_NOT_MET = 3


@dataclass
class Exported:
    config: Path
    notes: Path
    point: str
    slo: dict[str, float]          # the SLO the point was judged on (empty: none)
    slo_given: bool                # given at export time, not the study's
    shortfall: str | None          # why the point does not surely meet the SLO; None: it does, or no SLO
    by_capacity: bool = False      # judged by its capacity under the study's capacity.slo


def by_capacity(r: report.Run, slo: dict[str, float]) -> bool:
    """A capacity study under its own capacity.slo: its points are judged by their capacity."""
    return capacity_section.is_capacity_study(r) and slo == dict(r.study.capacity.slo)


def slo_shortfall(r: report.Run, point: str, slo: dict[str, float]) -> str | None:
    """Why `point` does not surely meet `slo`: each bound its 95% interval does not lie
    within (misses it, or not resolved: the interval straddles it, or there is none; or
    not measured), rounds that did not run and requests that failed (neither is in the
    intervals). None where it meets every bound, or no SLO is set. A capacity study under
    its own capacity.slo is judged by its capacity: none found, or not resolved."""
    parts = []
    s = next(x for x in r.summaries if x.point == point)
    if slo and s.status != "ok":
        parts.append(f"only {report_run.planned_words(r.study, s)} completed"
                     + (f" ({'; '.join(s.reasons)})" if s.reasons else "")
                     + ": the rounds that did not run are not in its figures")
    failed = decision.failed_requests(r.rounds).get(point)
    if slo and failed and not capacity_section.is_capacity_study(r):  # a capacity's fit counts them as misses
        parts.append(f"{failed} of its requests failed (an error or a timeout): its latencies are those of the "
                     "requests that completed")
    if by_capacity(r, slo):
        # the capacity is the verdict: the fit found the load where the SLO stops being met;
        # the latencies "at capacity" sit at their bounds by construction (below_everywhere:
        # export_point's, with its words)
        pc = r.capacity(point)
        if pc is None:
            parts.append("no start's capacity search completed")
        elif pc.config.kind == "unresolved":
            parts.append(f"its capacity is {pc.cell()}")
        return "; ".join(parts) or None
    for metric, bound in (slo or {}).items():
        t = decision.slo_table(r.intervals[r.intervals["point"] == point], {metric: bound})
        verdict = t.at[point, "SLO"] if point in t.index else "not measured"
        if verdict == "meets":
            continue
        m, iv = metrics.get(metric), r.interval(point, metric)
        sign = ">=" if m.better == "higher" else "<="
        parts.append(f"{metric} {sign} {bound:g}: {verdict}"
                     + (f" ({metrics.with_interval(iv, m)} {m.unit})" if iv else ""))
    return "; ".join(parts) or None


def export(run: str | Path, point: str | None = None, out: Path = Path("."),
           slo: dict[str, float] | None = None) -> tuple[Path, Path]:
    e = export_point(run, point, out, slo)
    return e.config, e.notes


def export_point(run: str | Path, point: str | None = None, out: Path = Path("."),
                 slo: dict[str, float] | None = None) -> Exported:
    """export's files, and whether the point surely meets the SLO (the files are written
    either way: the caller decides what a shortfall means)."""
    r = report.Run.load(RunFolder(run), slo)
    # a capacity was searched under capacity.slo (which may differ from the study's slo)
    capacity_slo = dict(r.study.capacity.slo) if capacity_section.is_capacity_study(r) else None
    slo = r.slo_override or capacity_slo or r.slo
    rec = r.recommendation()
    point = point or answer.best_point(r)
    if point is None:
        # a capacity study's answer says why (e.g. every capacity is a bound below the lowest load)
        why = rec.reason if rec.point is None and not capacity_section.is_capacity_study(r) else \
            answer.answer_text(r).splitlines()[0]
        raise ValueError(f"no point to export: {why}")
    refuse_predicted_only(r.folder, point)
    if r.study.server.command:  # the tests' fake engine, or another program: no figure here is vLLM's
        raise ValueError(f"{r.folder.path} was served by `{' '.join(r.study.server.command)}` (server.command), "
                         "not vLLM: a config is exported from a run vLLM served; run the study without "
                         "server.command, then export")
    cfg = serve_config(r, point)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{r.manifest.study}.{point}"
    cfg_path, note_path = out / f"{stem}.serve.yaml", out / f"{stem}.md"
    model, model_note = model_name(r)
    argv, env, source = launch(r, point, cfg)
    command = shell_command(argv, env, cfg_path.name)
    # the config file cannot hold the environment or the model: the command line does
    header = (f"# vllm serve config exported from {r.folder.path.name}, point {point}\n"
              f"# {command}\n# evidence: {note_path.name}\n")
    cfg_path.write_text(header + yaml.safe_dump(cfg, sort_keys=True))
    note_path.write_text(_justification(r, point, rec, slo, model, model_note, command, source))
    shortfall = slo_shortfall(r, point, slo)
    if capacity_section.below_everywhere(r, point):
        shortfall = "; ".join(filter(None, [f"the SLO was missed at every load measured (capacity "
                                            f"{capacity_section.below_lowest_load_words(r, point)})", shortfall]))
    return Exported(cfg_path, note_path, point, slo, bool(r.slo_override), shortfall, by_capacity(r, slo))


def _justification(r: report.Run, point: str, rec: decision.Recommendation, slo: dict, model: str,
                   model_note: str, command: str, source: str) -> str:
    m, v, w = r.manifest, r.manifest.versions, r.study.workload
    gpus = ", ".join(g.name for g in m.machine.gpus) or f"none ({m.machine.cpu.model}, engine {m.engine})"
    lines = [f"# {m.study}: {point}", "", f"    {command}", "",
             f"- command: {source}",
             f"- model: {model} ({model_note})", f"- run: `{r.folder.path.name}` (commit {str(m.git.sha)[:8]})",
             f"- vLLM {v.vllm} ({v.vllm_distribution}), torch {v.torch}; hardware: {gpus}",
             f"- workload: {w.kind}, " + (report.trace_line(w.trace) if w.trace else f"load {_load(w.load)}"),
             f"- SLO: {', '.join(f'{k} <= {b:g}' for k, b in slo.items()) or 'none set'}", ""]
    s = next(x for x in r.summaries if x.point == point)
    method = r.intervals[r.intervals["point"] == point]["method"]
    status = report_run.status_label(s)
    if capacity_section.below_everywhere(r, point):
        below = capacity_section.below_lowest_load_words(r, point)
        status = (f"missed the SLO at every load measured: capacity {below} "
                  "(each start's search completed)")
    lines[-1:-1] = [f"- status: {status}" + (f" ({'; '.join(s.reasons)})" if s.reasons else ""),
                    f"- intervals: {method.iloc[0] if len(method) else 'none'}"]
    best = answer.best_point(r)
    if point == best:
        # a capacity study is justified by the load each config sustains within the SLO
        lines += ["Why this point:", "", capacity_section.capacity_answer(r) or rec.text(), ""]
    else:
        lines += [f"Chosen by hand; the report recommends {best}." if best else
                  f"Chosen by hand; the report recommends no point: {answer.answer_text(r).splitlines()[0]}", ""]
    lines += ["| metric | value [95% interval] |", "|---|---|"]
    for name in metrics.HEADLINE:
        iv = r.interval(point, name)
        if name == "capacity_rps" and capacity_section.is_capacity_study(r):
            # capacity.estimate's: a censored capacity is a bound, never 0
            lines.append(f"| {capacity_section.capacity_column(r)} | {capacity_section.capacity_cell(r, point)} |")
        elif iv is not None:
            lines.append(f"| {metrics.get(name).title} | {metrics.with_interval(iv, metrics.get(name))} |")
    return "\n".join(lines) + "\n"


def _load(load: Load) -> str:
    return ", ".join(f"{k} {v}" for k, v in load.model_dump().items() if v not in (None, [], 1.0) or k == "kind")
