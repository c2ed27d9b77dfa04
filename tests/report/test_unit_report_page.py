"""report.html as a page to read, checked without a browser (tests/e2e/test_e2e_report_html.py
opens it in one): the answer as prose, sections that do not apply left out, the details
collapsed, figures small, and the Pareto fronts' labels clear of each other."""
from __future__ import annotations

import base64
import contextlib
import io
import itertools
import json

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import nbformat  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from matplotlib.text import Text  # noqa: E402
from bs4 import BeautifulSoup  # noqa: E402
from nbconvert.filters import markdown2html  # noqa: E402
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output  # noqa: E402
from PIL import Image  # noqa: E402

from synthetic_run import make_run  # noqa: E402
from vllm_study.analysis import decision  # noqa: E402
from vllm_study import notebook_support  # noqa: E402
from vllm_study.report import plots, report  # noqa: E402
from vllm_study.report import answer, page as report_page
from vllm_study.records.results import RunFolder  # noqa: E402
from paths import REPO

A, B, C, D = "mbt=256__kv=16MiB", "mbt=256__kv=128MiB", "mbt=512__kv=16MiB", "mbt=512__kv=128MiB"
REPORT_NB = REPO / "notebooks" / "report.ipynb"


# -- the Pareto fronts' labels -------------------------------------------------------
def _crowded_front(n: int = 24) -> pd.DataFrame:
    """n points all on the speed front and nearly on top of each other (the overlapping
    labels of the committed 32B run, made worse), two pairs of them exact ties; on the
    TTFT front only the first pair (a tie: one place, two names)."""
    rng = np.random.default_rng(1)
    speed = np.sort(20 + rng.uniform(0, 0.3, n))
    tput = 700 - (speed - 20) * 50          # faster per user, less throughput: every point on the speed front
    ttft = 1900 + (700 - tput) * 2          # less throughput and a later TTFT: the first point dominates
    t = pd.DataFrame({"output tok/s per GPU": tput, "per-user tok/s": speed, "TTFT P90 (ms)": ttft},
                     index=[f"mbt={256 * (i + 1)}__gmu=0.{50 + i}" for i in range(n)])
    t.iloc[1] = t.iloc[0]                    # a tie: both stay on the front
    t.iloc[5] = t.iloc[4]
    t["front: speed"] = decision.pareto(t, "per-user tok/s", "output tok/s per GPU")
    t["front: TTFT"] = decision.pareto(t, "TTFT P90 (ms)", "output tok/s per GPU", x_better="lower")
    return t


@pytest.mark.parametrize("n", [6, 12, 24, 40])
def test_the_pareto_labels_never_overlap_each_other_nor_the_plot(n):
    t = _crowded_front(n)
    assert plots.pareto_plot(t) is None
    fig = plt.gcf()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    fig_box = fig.bbox
    axes = [ax for ax in fig.axes if ax.texts]
    assert len(axes) == 2
    for ax, front in zip(axes, ("front: speed", "front: TTFT")):
        labels = [a for a in ax.texts if a.get_text() in t.index]
        # every point of the front is named once, no other point
        assert sorted(a.get_text() for a in labels) == sorted(t.index[t[front]])
        boxes = [Text.get_window_extent(a, renderer) for a in labels]  # the name, not its leader line
        for p, q in itertools.combinations(boxes, 2):
            assert not p.overlaps(q), (p, q)
        # beside the plots, over no point and no other panel's tick labels
        taken = [other.get_window_extent(renderer) for other in fig.axes] + [
            tick.get_window_extent(renderer) for other in fig.axes for tick in other.get_yticklabels()]
        for box in boxes:
            assert not any(box.overlaps(area) for area in taken)
            assert fig_box.x0 <= box.x0 and box.x1 <= fig_box.x1 and fig_box.y0 <= box.y0 and box.y1 <= fig_box.y1
    plt.close(fig)


def test_the_spread_keeps_labels_a_gap_apart_and_inside():
    for wanted in ([0.5] * 10, [0.0, 0.0, 0.01, 1.0, 1.0], list(np.linspace(0, 1, 19))):
        got = plots._spread(sorted(wanted), 1 / 20)
        assert all(b - a >= 1 / 20 - 1e-12 for a, b in zip(got, got[1:]))
        assert 1 / 40 - 1e-12 <= got[0] and got[-1] <= 1 - 1 / 40 + 1e-12


# -- the answer in words -------------------------------------------------------------
def _vals(tput: dict[str, float]) -> dict:
    return {p: {"output_throughput": v, "ttft_p90_ms": 300.0, "tpot_p50_ms": 20.0} for p, v in tput.items()}


def test_the_answer_is_the_printed_recommendation_as_prose(tmp_path):
    run = make_run(tmp_path, _vals({A: 100.0, B: 200.0, C: 110.0, D: 120.0}))
    r = notebook_support.load_run(run)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        notebook_support.recommendation(r)
    assert printed.getvalue().startswith(answer.answer_text(r))
    md = answer.answer_markdown(r)
    assert md.startswith(f"Run **`{B}`**: output tokens/s")  # the point to run, in bold, first
    assert "\\[" in md  # the interval's brackets are text, not a link
    assert "Every point completed every planned round." in md
    assert f"`python -m vllm_study export {run.path.resolve()} --best`" in md  # not under results/: where it is
    html = markdown2html(md)
    soup = BeautifulSoup(html, "html.parser")
    assert soup.find("strong").get_text() == B and not soup.find("pre")
    assert soup.find("p").get_text().startswith(f"Run {B}: output tokens/s")


def test_the_answer_names_failures_and_the_slo_given_at_report_time(tmp_path):
    run = make_run(tmp_path, _vals({A: 100.0, B: 200.0, C: 110.0, D: 400.0}), died={D: (1, 1)})
    r = notebook_support.load_run(run, "ttft_p90_ms=500", quiet=True)
    md = answer.answer_markdown(r)
    assert "1 of 4 points did not complete every planned round" in md
    assert "SLO (given at report time): TTFT P90 ≤ 500 ms; 3 of 4 points meet every bound" in md  # not D
    assert f"`{D}`" in md  # left out, and named


def test_cells_that_do_not_apply_print_nothing_when_quiet(tmp_path):
    run = make_run(tmp_path, _vals({A: 100.0, B: 200.0, C: 110.0, D: 120.0}))
    r = notebook_support.load_run(run)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert notebook_support.target_comparison(r, quiet=True) is None
        assert notebook_support.versus_baseline(r, quiet=True) is None
        assert notebook_support.group_table(r, quiet=True) is None
        assert notebook_support.axis_effects(r, quiet=True) is None
        assert notebook_support.failures(r, quiet=True) is None
        notebook_support.load_run(run, "ttft_p90_ms=500", quiet=True)
    assert out.getvalue() == ""
    # without quiet they say what they said before (the committed reports' stored outputs)
    with contextlib.redirect_stdout(out):
        notebook_support.target_comparison(r)
        notebook_support.group_table(r)
    assert out.getvalue() == ("not an endpoint study (it has a grid, no targets)\n"
                              "this run's workload has no classes, turns or rate steps\n")


# -- the page's layout ---------------------------------------------------------------
def _png() -> str:
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.imshow(np.linspace(0, 1, 600).reshape(3, 200), aspect="auto", cmap="viridis")
    ax.set_title("a colour map and some text")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _stream(text):
    return new_output("stream", name="stdout", text=text)


def _notebook() -> nbformat.NotebookNode:
    details = {"tags": ["report-details"]}
    cells = [
        new_markdown_cell("# Study report"),
        new_code_cell("r = ...", outputs=[]),
        new_markdown_cell("## The answer"),
        new_code_cell("ns.answer(r)", outputs=[new_output("display_data", data={
            "text/markdown": "Run **`p1`**: the answer.", "text/plain": "Run p1: the answer."})]),
        new_code_cell("ns.answer_figure(r)", outputs=[new_output("display_data", data={
            "image/png": _png(), "text/plain": "<Figure>"})]),
        new_markdown_cell("## Endpoints side by side\nFor a study of targets."),
        new_code_cell("ns.target_comparison(r, quiet=True)", outputs=[]),
        new_markdown_cell("## Details"),
        new_markdown_cell("### Each point & <its> interval\nWhat the cells are.", metadata=details),
        new_code_cell("ns.headline_table(r)", outputs=[new_output("execute_result", execution_count=1, data={
            "text/html": "<table class='dataframe'><tr><td>" + "a long reason " * 8 + "</td><td>1 [0, 2]</td>"
                         "</tr></table>", "text/plain": "..."})]),
        new_markdown_cell("### Failures", metadata=details),
        new_code_cell("ns.failures(r, quiet=True)", outputs=[_stream("  \n")]),
        new_markdown_cell("### The run", metadata=details),
        new_code_cell("ns.describe_run(r)", outputs=[_stream("x" * 400 + "\n")]),
    ]
    return new_notebook(cells=cells)


def test_the_page_leaves_out_what_does_not_apply_and_collapses_the_details():
    nb = report_page.page_notebook(_notebook())
    sources = [c.source for c in nb.cells]
    assert not any("Endpoints" in s or "Failures" in s for s in sources)  # printed nothing: left out
    assert "ns.failures(r, quiet=True)" not in sources
    heads = [c for c in nb.cells if c.metadata.get("report_page", {}).get("before")]
    assert [c.metadata["report_page"]["before"] for c in heads] == [
        '<details class="report-section"><summary><h3>Each point &amp; &lt;its&gt; interval</h3></summary>',
        '<details class="report-section"><summary><h3>The run</h3></summary>']
    assert heads[0].source == "What the cells are."  # the heading is the summary now
    closing = [c.source for c in nb.cells if c.metadata.get("report_page", {}).get("after")]
    assert closing == ["ns.headline_table(r)", "ns.describe_run(r)"]
    # the notebook it came from is left as it was
    assert len(_notebook().cells) == 14


def test_nested_details_close_inner_first():
    details = {"tags": ["report-details"]}
    nb = new_notebook(cells=[new_markdown_cell("## Outer", metadata=details), new_markdown_cell("text"),
                             new_markdown_cell("### Inner", metadata=details),
                             new_code_cell("x", outputs=[_stream("shown\n")])])
    cells = report_page.page_notebook(nb).cells
    assert cells[-1].metadata["report_page"]["after"] == "</details></details>"
    assert cells[0].metadata["report_page"]["before"].startswith('<details class="report-section"><summary><h2>Outer')


def test_figures_are_reencoded_smaller_with_the_same_pixels_size():
    original = _png()
    small = report_page.small_png(original)
    assert len(small) < len(original) / 2
    a, b = (Image.open(io.BytesIO(base64.b64decode(x))) for x in (original, small))
    assert a.size == b.size and b.mode == "P"


def test_the_exported_page_is_small_wraps_and_scrolls(tmp_path):
    nbformat.write(_notebook(), tmp_path / "report.ipynb")
    page = report_page.export_html(RunFolder(tmp_path)).read_text()
    soup = BeautifulSoup(page, "html.parser")
    assert len(page) < 60_000  # the page's own stylesheet, not JupyterLab's 250 kB
    css = "".join(s.get_text() for s in soup.find_all("style"))
    assert "white-space: pre-wrap; word-break: break-word" in css
    assert ".jp-RenderedHTML, .jp-RenderedMarkdown { overflow-x: auto; }" in css
    assert not soup.find("script", src=True) and not soup.find("link", rel="stylesheet")  # nothing fetched
    assert [d.summary.get_text() for d in soup.find_all("details")] == ["Each point & <its> interval", "The run"]
    assert all(not d.has_attr("open") for d in soup.find_all("details"))
    assert "Endpoints side by side" not in soup.get_text()
    assert soup.find("strong").get_text() == "p1"  # the answer is prose
    cells = soup.find_all("td")
    assert "prose" in cells[0]["class"] and "prose" not in (cells[1].get("class") or [])
    assert soup.title.get_text() == f"{tmp_path.name}: study report"


def test_the_report_notebook_opens_with_the_answer_and_keeps_the_details_tagged():
    cells = json.loads(REPORT_NB.read_text())["cells"]
    code = [("".join(c["source"]), c["metadata"].get("tags", [])) for c in cells if c["cell_type"] == "code"]
    shown = [s for s, tags in code if "parameters" not in tags and not s.startswith("from vllm_study")]
    assert shown[:3] == ["ns.answer(r)", "ns.answer_figure(r)", "ns.pareto_figure(r)"]
    heads = [("".join(c["source"]).splitlines()[0], c["metadata"].get("tags", [])) for c in cells
             if c["cell_type"] == "markdown"]
    after = [h for h, _ in heads].index("## Details")
    assert all("report-details" in tags for _, tags in heads[after + 1:])
    assert not any("report-details" in tags for _, tags in heads[:after + 1])


def test_the_pareto_figure_keeps_its_size_where_its_labels_fit():
    """The committed reports' Pareto cell is checked by nbval, text/plain included:
    `<Figure size 1100x420 with 2 Axes>` must reproduce."""
    r = report.Run.load(REPO / "results" / "20261130T114104Z-h200-qwen2.5-32b-d63e4e9")
    assert plots.pareto_plot(decision.pareto_table(r.intervals)) is None
    fig = plt.gcf()
    assert repr(fig) == "<Figure size 1100x420 with 2 Axes>"
    plt.close(fig)


@pytest.mark.parametrize("slo, says", [("ttft_p95_ms=300", "ttft_p95_ms: not a latency bound the kit knows"),
                                       ("ttft_p90_ms", "write it as metric=bound pairs")])
def test_a_bad_slo_is_refused_by_report_as_by_export_with_exit_2(tmp_path, capsys, slo, says):
    from vllm_study import cli
    run = make_run(tmp_path, _vals({A: 100.0, B: 200.0, C: 110.0, D: 120.0}))
    for cmd in ("report", "export"):
        assert cli.main([cmd, str(run.path), "--slo", slo]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --slo {slo!r}: ") and says in err and "Traceback" not in err
        assert not (run.path / "report.ipynb").exists()
