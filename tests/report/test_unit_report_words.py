"""What the user reads around a run: the export command the report offers names the run
where it is, the point-by-point section opens with the study's own rule, and the
progress bar counts the rounds that ran."""
from __future__ import annotations

import json

from synthetic_run import make_capacity_run, make_run
from vllm_study import executors, sweep
from vllm_study.report import answer, report
from vllm_study.records.results import ROUNDS, read_rounds
from paths import REPO

A, B, C, D = "mbt=256__kv=16MiB", "mbt=256__kv=128MiB", "mbt=512__kv=16MiB", "mbt=512__kv=128MiB"
VALUES = {p: {"output_throughput": v, "ttft_p90_ms": 300.0, "tpot_p50_ms": 20.0}
          for p, v in {A: 100.0, B: 200.0, C: 110.0, D: 120.0}.items()}


def test_the_freeze_command_names_the_run_where_it_was_written(tmp_path):
    elsewhere = make_run(tmp_path / "runs", VALUES)  # sweep --results runs
    md = answer.answer_markdown(report.Run.load(elsewhere.path))
    assert f"`python -m vllm_study export {elsewhere.path.resolve()} --best`" in md
    # --results /somewhere/results: a folder named results, but not the kit's
    named = make_run(tmp_path / "results", VALUES)
    md = answer.answer_markdown(report.Run.load(named.path))
    assert f"`python -m vllm_study export {named.path.resolve()} --best`" in md and " results/" not in md
    # the kit's own results folder, and a render copy of a run committed there (report, nbval)
    committed = sorted(answer.KIT_RESULTS.glob("*/manifest.json"))[0].parent
    assert answer.run_arg(committed) == f"results/{committed.name}"
    copy = tmp_path / "copy" / "results" / committed.name
    copy.mkdir(parents=True)
    assert answer.run_arg(copy) == f"results/{committed.name}"


def test_nothing_to_freeze_is_said_where_no_point_can_be_frozen(tmp_path, capsys):
    """Every capacity below the floor: the page says there is nothing to freeze, not the
    generic export command."""
    run = make_capacity_run(tmp_path / "r", {"mbt=256": 0.5, "mbt=512": 0.7}, lo=2.0, hi=8.0)
    r = report.Run.load(run.path)
    words = answer.freeze_words(r)
    assert words.startswith("Nothing to freeze: no point met the SLO at any load") and "--best" not in words
    assert "export" not in answer.answer_markdown(r)
    nb = json.loads((REPO / "notebooks" / "report.ipynb").read_text())
    sources = ["".join(c["source"]) for c in nb["cells"]]
    assert not any("export <run> --best" in text for text in sources)   # no generic command in the template
    assert sources.index("ns.freeze_line(r)") == sources.index("ns.recommendation(r)") + 1


def test_the_point_by_point_section_does_not_open_with_the_goodput_rule():
    nb = json.loads((REPO / "notebooks" / "report.ipynb").read_text())
    text = next("".join(c["source"]) for c in nb["cells"]
                if "".join(c["source"]).startswith("### The answer, point by point"))
    opening = text.splitlines()[1]
    assert "goodput" not in opening and "rule" in opening
    words = " ".join(text.split())
    assert words.index("capacity study") < words.index("goodput")


class _Done(executors.Executor):
    """Hands back units whose rounds are already on disk, as a Ray task's come back."""
    rounds_live = False

    def __call__(self, unit, slot, bar, release=None):
        return self.run.point(unit.point).summary()


def test_the_progress_bar_counts_the_steps_a_capacity_search_ran(tmp_path, capsys):
    run = make_capacity_run(tmp_path / "r", {"mbt=256": 3.0, "mbt=512": 5.0}, lo=2.0, hi=8.0)
    study = report.Run.load(run.path).study
    units = run.manifest().order
    ran = sum(len(read_rounds(run.point(u.point).start_dir(u.start) / ROUNDS)) for u in units)
    assert ran < len(units) * study.steps_per_start  # the searches stopped short of max_steps
    sweep._run_units(run, units, study, 0.0, None, _Done(run, study, "cpu", []))
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert f" {ran}/{ran} " in last, last


def test_a_capacity_start_that_failed_is_counted_in_searches_not_in_one_planned_round(tmp_path):
    """A capacity start's figures are one search of up to steps_per_start rounds: a failed
    start is '1 of its 2 planned capacity searches', never '1 of its 2 planned rounds'."""
    from vllm_study.measure.point import summarize
    from vllm_study.report import export
    run = make_capacity_run(tmp_path / "r", {"mbt=256": 3.0, "mbt=512": 5.0}, lo=2.0, hi=8.0)
    start = run.point("mbt=512").start_dir(2) / "start.json"
    rec = json.loads(start.read_text())
    start.write_text(json.dumps({**rec, "status": "failed", "reason": "server died"}))
    folder = run.point("mbt=512")
    summarize(folder, folder.plan())
    run.write_summary_csv()
    r = report.Run.load(run.path)
    words = export.slo_shortfall(r, "mbt=512", {"ttft_p90_ms": 400.0})
    steps = r.study.steps_per_start
    assert f"only 1 of its 2 planned capacity searches (one a server start, each up to {steps} rounds)" in words
    assert "planned rounds" not in words
    assert "capacity searches ok" in report.failures(r).columns


def test_prompts_under_the_template_floor_are_counted_out_of_the_rows_the_dry_run_counts():
    """The dry run counts a trace's every row (check_template: 1 of 9); the start keeps 8
    under max_model_len and records 1 short prompt: the report says 1 of 9 too."""
    record = {"inexact": 1, "requests": 8, "dropped_over_max_model_len": 1, "prompt_floor": 19}
    words = answer.floor_words(record)
    assert words.startswith("1 of 9 trace prompts are shorter than the chat template's floor of 19 tokens"), words
