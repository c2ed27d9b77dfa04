"""The answer at the top of the page: how faithful the replay was, the recommendation in
words and in Markdown."""
from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from ..define.traces import floor_warning
from ..vocab import metrics
from .capacity_section import trace_info, below_everywhere, capacity_answer, is_capacity_study
from .run import Run, per_start_work
from ..measure.primer import model_departure


FIDELITY = ("prompt_tokens_vs_trace", "expected_prefix_hit_rate", "model_prefix_hit_rate", "prefix_cache_hit_rate",
            "prime_requests", "prime_prompt_tokens", "prime_s", "send_lateness_p50_ms",
            "send_lateness_p99_ms", "offered_rate")


def fidelity_table(r: Run) -> pd.DataFrame | None:
    """Does the replay reproduce the trace? Over every measured round of each point (each
    capacity step included): prompt tokens against the trace's; the hit rate a never-evicting
    cache would reach on the window, the cache model's at the server's KV size and vLLM's
    measured one; priming's requests, tokens and time (trace.prime: history); and how late
    the client sent."""
    trace = trace_info(r)
    if trace is None:
        return None
    df = r.rounds[(r.rounds["group"] == "all") & (r.rounds["round_status"] == "ok")]
    # trace.windows: one row a point and window, each round beside its own window's trace
    keys = ["point", "window"] if "window" in df.columns and df["window"].notna().any() else ["point"]
    rows = []
    for key, g in df.groupby(keys, sort=False):
        row = {**dict(zip(keys, key if isinstance(key, tuple) else (key,))), "rounds": len(g)}
        if len(keys) > 1:
            row["window"] = int(row["window"])
        for k in FIDELITY:
            if k in g.columns and g[k].notna().any():
                m = metrics.get(k)
                row[m.title] = f"{m.format(g[k].median())} ({m.format(g[k].min())} to {m.format(g[k].max())})"
        rows.append(row)
    flags = [model_departure(row, f"{row['point']} start {int(row['start'])} round {int(row['round']) + 1}"
                             + (f" (window {int(row['window'])})" if len(keys) > 1 else ""))
             for row in df.to_dict("records")]
    note = (f"trace {trace['source']}: {trace['requests']} requests kept, {trace['dropped_over_max_model_len']} "
            f"longer than max_model_len={trace['max_model_len']} left out; real rate {trace['rate']:.2f} req/s")
    for w in trace.get("windows") or ():
        note += (f"\nwindow {w['window']}: requests {w['first'] + 1}-{w['last'] + 1} of the whole trace, "
                 f"{w['requests']} kept, {w['dropped_over_max_model_len']} left out; real rate {w['rate']:.2f} req/s")
    print(note + "".join(f"\n{n} rows {why} left out" for why, n in (trace.get("skipped") or {}).items()
                         if not why.startswith("longer than max_model_len")))  # (that one is said above)
    if trace.get("inexact"):  # older runs counted these prompts without recording the floor
        print("warning: " + floor_words(trace) if trace.get("prompt_floor") else f"warning: {trace['inexact']} "
              "prompts were shorter than the chat template allows and were sent longer than the trace says")
    for flag in filter(None, flags):
        print(f"flag: {flag}")
    return pd.DataFrame(rows).set_index(keys) if rows else None


def floor_words(trace: dict) -> str:
    """A start's trace record's prompts under the chat template's floor, out of the trace's
    rows as the dry run and the sweep count them (build_workload.check_template: every row
    of the trace or its windows), not out of the rows kept under max_model_len: a prompt
    under the floor is never too long, so both count the same short prompts."""
    rows = trace["requests"] + (trace.get("dropped_over_max_model_len") or 0)
    return floor_warning(trace["inexact"], rows, trace["prompt_floor"])


# -- the answer in words, for the top of the page --------------------------------
NO_SLO_NOTE = ("(the study sets no `slo:`; with one, the recommendation is the highest goodput among "
               "the points that meet it)")


def answer_text(r: Run) -> str:
    """The answer as `notebook_support.recommendation` prints it: a capacity study's
    capacity, else the recommendation under the SLO (with the note a study without one
    gets)."""
    if r.search:
        from ..search import search_report
        if not r.measured:  # stopped before (or during) its confirmation
            return search_report.summary_line(r) + "\n" + search_report.NOT_CONFIRMED.format(run=r.folder.path)
        decided = capacity_answer(r) or "\n".join(search_report.objective_lines(r))
        return search_report.summary_line(r) + "\n" + decided
    answer = capacity_answer(r)
    if answer:
        return answer
    text = r.recommendation().text()
    return text if r.slo else f"{text}\n\n{NO_SLO_NOTE}"


def md_escape(text: str) -> str:
    """Plain text as Markdown that shows it as written (backslash before the punctuation
    Markdown would read as emphasis, links, code, HTML or headings)."""
    return re.sub(r"([\\`*_\[\]<>#|~])", r"\\\1", text)


def md_prose(text: str, points: list[str], strong: str | None = None) -> str:
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
        verdicts = r.slo_verdicts()
        meets = int((verdicts["SLO"] == "meets").sum()) if "SLO" in verdicts else 0
        given = " (given at report time)" if r.slo_override else ""
        parts.append(f"SLO{given}: {_bound_words(r.slo)}; {meets} of {n} points meet every bound with their whole "
                     "95% interval.")
    gpus = sorted({g.name for g in m.machine.gpus})
    where = " and ".join(gpus) if gpus else f"CPU ({m.machine.cpu.model})"
    parts.append(f"Study {m.study}: {n} point{'s' * (n != 1)}, {_starts_words(r)} "
                 f"{'each ' * (n != 1)}of {per_start_work(r.study)}, on {where} with {m.versions.vllm_distribution} "
                 f"{m.versions.vllm}.")
    short = [s for s in r.summaries if s.status != "ok"]
    parts.append(f"{len(short)} of {n} points did not complete every planned round: see Failures below."
                 if short else "Every point completed every planned round.")
    return " ".join(parts)


def _starts_words(r: Run) -> str:
    """The server starts each point has: '2 server starts', or '2 to 5 server starts' where
    confirmation (or a resume) gave some points more than the study planned; a search: its
    confirmation starts."""
    if r.search:
        counts = [r.search.confirm_starts]
    else:
        counts = [len(r.folder.point(s.point).starts()) or r.study.replicates for s in r.summaries] \
            or [r.study.replicates]
    lo, hi = min(counts), max(counts)
    return f"{lo} server start{'s' * (lo != 1)}" if lo == hi else f"{lo} to {hi} server starts"


def best_point(r: Run) -> str | None:
    """The point the answer names: a search's best confirmed configuration by its
    objective, else the recommendation (by capacity, or under the SLO)."""
    if not r.measured:
        return None
    if is_capacity_study(r):   # the highest capacity of capacity.estimate, as the answer says
        from .capacity_section import best_capacity
        return best_capacity(r)
    if r.search:
        from ..search import search_report
        return search_report.best(r)
    best = r.recommendation().point
    if best and below_everywhere(r, best):
        return None  # no point met the SLO at any load: nothing to run
    return best


# The kit's own results folder in a source checkout (lib/vllm_study/report/answer.py -> the checkout)
KIT_RESULTS = Path(__file__).resolve().parents[3] / "results"


def run_arg(path: Path) -> str:
    """A run folder as a command takes it: results/<run> where it is the kit's own (in the
    checkout's results/, or a render copy of a run committed there: `report` renders a
    committed run in a copy kept under a folder named results, nbval in .nbval/results/),
    else its absolute path (a sweep with --results elsewhere, even a folder named results)."""
    p = path.resolve()
    ours = p.parent == KIT_RESULTS.resolve() or (p.parent.name == "results" and (KIT_RESULTS / p.name).is_dir())
    return f"results/{p.name}" if ours else str(p)


def freeze_words(r: Run) -> str:
    """The command that freezes the answer as a `vllm serve --config` file, or why this run
    has nothing to freeze."""
    best = best_point(r)
    if r.study.targets:
        return "Nothing to freeze: an endpoint study's targets are served elsewhere, with their own settings."
    if best:
        return (f"Freeze it as a `vllm serve --config` file with this evidence beside it: "
                f"`python -m vllm_study export {run_arg(r.folder.path)} --best`.")
    if not r.measured:
        return "Nothing to freeze: no point measured a round."
    if is_capacity_study(r):
        return ("Nothing to freeze: no point met the SLO at any load measured (every capacity is below its lowest "
                "load); `export --point <id>` freezes one all the same.")
    return f"Nothing to freeze: {r.recommendation().reason}."


def answer_markdown(r: Run) -> str:
    """The answer as prose for the top of the report: `answer_text`, a paragraph per line
    (the recommended point in bold), then its context and how to freeze it."""
    points = [s.point for s in r.summaries]
    best = best_point(r)
    paras = []
    lines = [ln for ln in answer_text(r).splitlines() if ln.strip()]
    first = 1 if r.search else 0  # a search's first line says what it did; the answer follows
    for i, line in enumerate(lines):
        paras.append(md_prose(line, points, strong=best if i == first else None))
    paras.append(md_prose(answer_context(r), points))
    if best and not r.study.targets:  # an endpoint is run elsewhere: nothing to export
        paras.append(freeze_words(r))
    return "\n\n".join(paras)
