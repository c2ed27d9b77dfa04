"""Writes notebooks/point.ipynb and notebooks/report.ipynb from the cell lists below, so
their source is reviewable as Python and they carry no outputs."""
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parents[1] / "notebooks"
CHECK = {"tags": ["nbval-check-output"]}


def md(text, **meta):
    return new_markdown_cell(text.strip(), metadata=meta)


def code(text, **meta):
    return new_code_cell(text.strip(), metadata=meta)


POINT = [
    md("""
# One server start of one grid point

Starts vLLM with this point's engine arguments (or connects to the endpoint of a
`targets` study), warms it up, runs the study's rounds (prefix cache reset before each)
and records `start.json`, `rounds.jsonl`, `requests.jsonl.gz` and `server.log.gz` in
`out_dir`; then updates the point's `summary.json` over all its server starts.

The sweep (`python -m vllm_study sweep ...`) runs this notebook once per server start
through papermill, with `point_file` set to the point's resolved `point.json`. By hand:
leave `point_file` empty, set `study_file` (and `point_id`), and run all cells. A start
that fails (server never healthy, dies mid-round) is recorded with its reason; the
notebook still completes.
"""),
    code('''
point_file: str = ""  # a point.json written by the sweep; empty: expand study_file instead
study_file: str = "../params/default.yaml"  # by hand: a study definition
point_id: str = ""  # by hand: a point id as --dry-run lists them; empty: the first point
start: int = 1  # which server start of the point this is (1 .. replicates)
block: int = 0  # the block of the run order this start belongs to (0: none)
out_dir: str = ""  # this start's folder; empty: points/<id>/s<start> beside point_file, or a scratch folder
gpus: str = ""  # GPU indices this start may use, e.g. "0,1"; empty: what CUDA_VISIBLE_DEVICES allows
slot_lock: str = ""  # the sweep's lock for these GPUs: the server starts once the previous one has stopped
serves: str = ""  # live knobs: the points this one start serves (this point first), comma-separated
''', tags=["parameters"]),
    code('''
from vllm_study import point_notebook as pn

plan, start_dir = pn.select_point(point_file, study_file, point_id, out_dir, start)
pn.describe_point(plan, start)
'''),
    md("""
## Launch
Under the sweep, this start first waits for the previous server on its GPUs to stop
(this notebook was prepared while that one ran). Ready = the process is alive and
`/health` answers. The startup time and vLLM's effective cache config are recorded. An
endpoint target is checked instead: it must answer `/v1/models` with the study's model;
`/metrics` and the cache reset are used where it offers them.
"""),
    code('''
run = pn.make_start(plan, start_dir, start, block or None, pn.gpu_list(gpus), slot_lock or None, serves)
run.launch()
pn.show_launch(run)
'''),
    md("""
## Warm up
Requests from a separate stream, excluded from every statistic.
"""),
    code("run.warmup()"),
    md("""
## Rounds
Each round: reset the prefix cache, snapshot `/metrics`, build the round's requests,
then start the clock and send them under the study's load model while sampling KV
usage and running requests (and the GPU through NVML), stop the clock, snapshot again.
With `capacity:` in the study, each round is a step of the capacity search at its own
load, judged against the SLO; the search and its bracket are recorded in `start.json`.
A start that serves several points (live knobs) runs each point's rounds in turn, in a
seeded order (a capacity study: each point's whole search in turn), and first sets that
point's scheduler limits; each round records the limits the engine ran it under.
"""),
    code('''
run.run_rounds(progress=pn.round_progress(pn.planned_rounds(run)))
pn.rounds_table(run)
'''),
    md("""
## The point so far
The server is stopped here. Each metric's median over every measured round of the
point's starts so far, its range, and each start's median. Intervals need the whole run
(the start-to-start spread is pooled over the run's points): the report has them.
"""),
    code('''
summary = run.finish()
pn.summary_table(summary)
'''),
]

# The report's page (report.html) is this notebook as page.export_html lays it out: the
# answer and its figures first; then the evidence, each section under a heading tagged
# DETAILS, which the page shows collapsed; a section whose cells print nothing does not
# apply to the study (e.g. the endpoints in a grid study) and is left off the page.
DETAILS = {"tags": ["report-details"]}

REPORT = [
    md("# Study report"),
    code('''
run_dir: str = ""  # a run folder; empty: the newest under ../results
slo: str = ""  # an SLO for this report, as metric and bound pairs like ttft_p90_ms:2500 (empty: the study's own)
''', tags=["parameters"]),
    code('''
from vllm_study import notebook_support as ns

r = ns.load_run(ns.resolve_run(run_dir), slo, quiet=True)
'''),
    md("## The answer"),
    code("ns.answer(r)", **CHECK),
    code("ns.answer_figure(r)"),
    md("""
## Pareto fronts
Output tokens/s per GPU against the speed one request sees (1000 / TPOT P50), and against
TTFT P90. A point is on a front when no other point is at least as good on both axes
and better on one; equal points are ties and all stay. The front's points are named;
every point's values are in the details (*Pareto fronts: every point*).
"""),
    code("ns.pareto_figure(r)"),
    md("""
## Endpoints side by side
For a study of `targets` (running endpoints, e.g. a vLLM port and the same server behind
a gateway): each target's medians and the latency it adds over the first target.
"""),
    code("ns.target_comparison(r, quiet=True)", **CHECK),
    md("""
## Details
"""),
    md("""
### The answer, point by point
The point to run, by the study's own rule (its first line below says which): in a capacity
study, the highest capacity within the SLO, with each point's capacity below; otherwise the
highest goodput among the points whose 95% intervals meet every bound of the study's `slo:`
(without an SLO, the highest output throughput), with each point against each bound below.
Then the points this study cannot tell apart from it, and what the runner-up trades; last,
the command that freezes it (or why there is nothing to freeze).
""", **DETAILS),
    code("ns.recommendation(r)", **CHECK),
    code("ns.freeze_line(r)"),
    md("""
### Did the replay reproduce the trace?
A trace study: per point, over its measured rounds (median, and range), the prompt tokens vLLM
counted against the trace's, the hit rate a never-evicting cache would reach on the window
beside vLLM's, and how late the client sent against the trace's schedule; above them, the
requests left out (longer than `max_model_len`, or failed rows of the trace) and the prompts
shorter than the chat template allows (sent longer than the trace says). A capacity study
shows this beside its answer.
""", **DETAILS),
    code("ns.fidelity(r)", **CHECK),
    md("""
### The windows against the whole trace
A trace study that replays windows from across the trace (`trace.windows`) or primes a
window with its history (`trace.prime: history`): each window beside the whole trace, its
arrival rate, input and output length quantiles (tokens), and the share of its prompt
tokens a never-evicting cache would reuse, within the window alone and with all the
traffic before it. Then the cache model's hit rate over the whole trace against the
cache size, this server's KV size marked: what a larger cache (e.g. vLLM's CPU KV
offloading) would buy on this traffic.
""", **DETAILS),
    code("ns.trace_windows(r)", **CHECK),
    code("ns.draw_cache_curve(r)"),
    md("""
### Each point, with 95% intervals
Each cell: the point's value (each server start's median round, averaged over the
point's starts; on a log scale for metrics that are always positive), and in brackets
its 95% t interval, with the start-to-start spread pooled over the run's points
(`analysis.py`). With one server start per point the interval covers round-to-round
noise only: a restarted server can move TTFT further. Two points whose intervals overlap are not
told apart by this study. `partial k/n`: only k of the n planned rounds were measured.
""", **DETAILS),
    code("ns.headline_table(r)", **CHECK),
    md("""
### The search's trials
A search: every trial that started a server, in order, with what became of it (measured,
SLO missed, or failed with its reason) and its objective from that one start. Proposals
that never started (refused by vLLM's rules or `when:`, like a crashed configuration, or
measured already) are counted in the answer and kept in the run's `search.journal`.
""", **DETAILS),
    code("ns.search_trials(r, quiet=True)", **CHECK),
    md("""
### Predicted beside measured
A study with `predict:`: every point's capacity was predicted from the seed starts' step
records (vLLM's scheduler in virtual time, `predict/study.py`), then the best few and the
baseline were measured. For each measured config: the prediction with its interval (widened
by the model's end-to-end error at the time), the measurement with its 95% interval, and a
flag where the prediction lies outside the measured interval; the rank agreement and the
model's error so far. Only measured configs are recommended or exported.
""", **DETAILS),
    code("ns.predicted_vs_measured(r, quiet=True)", **CHECK),
    md("""
### Failures
The points that did not complete every planned round, and why.
""", **DETAILS),
    code("ns.failures(r, quiet=True)", **CHECK),
    md("""
### How precise is this study?
The noise floor per metric: how much a restarted server moves it (start to start) and
how much one server moves between rounds, pooled over the run's points. A difference
smaller than the start-to-start spread is not an effect this study can show.
""", **DETAILS),
    code("ns.noise_floor(r)", **CHECK),
    md("""
### Against the best, and against the baseline
Each point against the best point of each metric: the relative difference with its 95%
interval, and a verdict (better, worse, or not resolved: the study cannot tell them
apart). With `baseline:` set in the study, each point against that point too.
""", **DETAILS),
    code("ns.versus_best(r)", **CHECK),
    code("ns.versus_baseline(r, quiet=True)", **CHECK),
    md("""
### Did each knob bind?
vLLM's own counters per point: the KV cache's peak share and preemptions (memory), the
prefills longer than the chunk (chunk size: vLLM had to split them over steps), running
requests against `max_num_seqs`, and the measured
hit rate beside the one a never-evicting cache would reach. An axis that never bound
is named: the study cannot show its effect.
""", **DETAILS),
    code("ns.binding(r)", **CHECK),
    code("ns.axis_effects(r, quiet=True)  # the scheduler axis per request class, with the budget's deferrals",
         **CHECK),
    md("""
### By request class, turn or rate step
Mixed workloads: long documents vs short chats (the decode stalls chunked prefill is
meant to cap show in the short class's ITL). Multi-turn: TTFT per turn (prefix caching
should help from turn 2). Rate ladders: TTFT P50/P99 per step, to see where TTFT turns up.
""", **DETAILS),
    code("ns.group_table(r, quiet=True)", **CHECK),
    md("""
### Pareto fronts: every point
Each point's values on the fronts' axes, and whether it is on each front.
""", **DETAILS),
    code("ns.pareto_points(r)", **CHECK),
    md("""
### Trend lines
Latency and throughput against the first axis, one line per value of the second, with
95% interval bands.
""", **DETAILS),
    code("ns.trend_details(r)"),
    md("""
### Round to round
TTFT P90 of each round of each server start, per point: the spread is the noise the
medians sit on.
""", **DETAILS),
    code("ns.draw_round_trend(r, quiet=True)"),
    md("""
### The run: study, software, machine
""", **DETAILS),
    code("ns.describe_run(r)", **CHECK),
    md("""
### What the metrics mean
""", **DETAILS),
    code("ns.definitions(r)", **CHECK),
    md("""
### About this report
Reads one run folder (`results/<run>/`): its manifest, each point's `summary.json`
(status and estimates over all server starts) and `summary.csv` (one row per point,
server start, round and request group), and draws the figures into `figures/`.

The sweep executes this notebook into the run folder with `run_dir="."` and exports it
as `report.html`; re-executing that copy (nbval does, in the tests) must reproduce its
tables.
""", **DETAILS),
]


EXPLORE = [
    md("""
# Explore a run

Pick a run (and, to compare, a second one), a metric and the axes to slice by. Each
point's value is drawn with its 95% interval and every measured round behind it; a
second run is dashed beside the first, with the change per point and its verdict.
Metric names are those of the report's definitions table (e.g. `ttft_p99_ms`,
`itl_p50_ms`, `output_throughput`, `prefix_cache_hit_rate`, `kv_usage_peak`).
"""),
    code('''
run_dir: str = ""  # a run folder; empty: the newest under ../results
other_run: str = ""  # a second run folder to compare with; empty: none
metric: str = "ttft_p90_ms"  # any metric of the report's definitions table
x_axis: str = ""  # the grid axis along x; empty: the study's first
hue_axis: str = ""  # the axis drawn as separate lines; empty: the study's other one
''', tags=["parameters"]),
    code('''
from vllm_study import notebook_support as ns

r = ns.load_run(ns.resolve_run(run_dir))
other = ns.load_run(ns.resolve_run(other_run)) if other_run else None
ns.describe_run(r)
'''),
    code("ns.explore(r, metric, x_axis, hue_axis, other)"),
    md("""
Change `metric` (or the axes) and run the cell again; `ns.definitions(r)` lists every
metric this run measured.
"""),
]


NOTEBOOKS = {"point.ipynb": POINT, "report.ipynb": REPORT, "explore.ipynb": EXPLORE}


def write(cells, name, folder: Path = HERE):
    nb = new_notebook(cells=cells, metadata={
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"}})
    for c in nb.cells:  # stable ids: a re-write changes no line that did not change
        c.id = f"{name.split('.')[0]}-{nb.cells.index(c)}"
    nbformat.write(nb, Path(folder) / name)


if __name__ == "__main__":
    for name, cells in NOTEBOOKS.items():
        write(cells, name)
