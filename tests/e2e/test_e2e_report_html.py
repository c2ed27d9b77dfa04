"""report.html, rendered from a committed run, opened in headless Chromium (Debian's
chromium and chromium-driver; .ci/run installs them) at 1280 x 1000: the page loads
offline without console errors and reads as a page: the answer in prose on the first
screen, the heatmaps under it, the details collapsed, nothing wider than the window,
every figure decoded, and small. The run is re-rendered with this kit (as `python -m
vllm_study report` does), and its committed notebook is exported as it is too."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from paths import REPO

# A committed run whose report has every section: a grid, intervals, an answer.
RUN = REPO / "results" / "20261130T114104Z-h200-qwen2.5-32b-d63e4e9"
WIDTH, HEIGHT = 1280, 1000   # the window a reader has; the first screen is the top HEIGHT px
PAGE_BYTES = 450_000         # the old page was 1.2 MB (JupyterLab's CSS, full-colour PNGs)


@pytest.fixture(scope="module")
def browser():
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        if os.environ.get("CI"):
            pytest.fail("chromium and chromedriver are missing: .ci/run installs Debian's chromium and chromium-driver")
        pytest.skip("Debian's chromium and chromium-driver are not installed here (apt-get install chromium "
                    "chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    # headless, as root, and quiet on a machine without a network (no update or sync calls)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(driver), options=opts)
    # the viewport itself (a window size would include the browser's frame)
    d.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                      {"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False})
    yield d
    d.quit()


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    """The committed run re-rendered by this kit into a copy, with the parameters its
    committed report was rendered with (an SLO given at report time)."""
    from vllm_study.records.results import RunFolder
    from vllm_study.sweep import render_report
    folder = tmp_path_factory.mktemp("rendered") / RUN.name
    shutil.copytree(RUN, folder)
    params = json.loads((RUN / "report.ipynb").read_text())["metadata"]["papermill"]["parameters"]
    render_report(RunFolder(folder), params.get("slo", ""))
    return folder / "report.html"


@pytest.fixture(scope="module")
def committed_page(tmp_path_factory) -> Path:
    """The committed report notebook, as the kit writes it to a static page (runs commit
    the notebook only)."""
    from vllm_study.report.page import export_html
    from vllm_study.records.results import RunFolder
    folder = tmp_path_factory.mktemp("run")
    shutil.copy(RUN / "report.ipynb", folder / "report.ipynb")
    return export_html(RunFolder(folder))


def _open(browser, page: Path):
    browser.get(page.as_uri())
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


def _fits_and_decodes(browser, images: int = 4) -> None:
    """No horizontal overflow (tables scroll in their own box, text wraps), with every
    section open; every <img> embedded and decoded, at least `images` of them."""
    from selenium.webdriver.support.ui import WebDriverWait
    assert browser.execute_script("return window.innerWidth") == WIDTH
    browser.execute_script("document.querySelectorAll('details').forEach(d => d.open = true)")
    width = browser.execute_script("return document.documentElement.scrollWidth")
    assert width <= WIDTH, browser.execute_script(  # what sticks out, if anything does
        "return Array.from(document.querySelectorAll('main *')).filter(e => e.getBoundingClientRect().right > "
        "window.innerWidth && !e.closest('.jp-RenderedHTML')).slice(0, 5).map(e => e.tagName + '.' + e.className)")
    WebDriverWait(browser, 10).until(lambda d: d.execute_script(
        "return Array.from(document.images).every(i => i.complete)"))
    sizes = browser.execute_script(
        "return Array.from(document.images).map(i => [i.src.slice(0, 10), i.naturalWidth]);")
    assert len(sizes) >= images and all(src == "data:image" and w > 300 for src, w in sizes), sizes


def test_report_html_loads_offline_and_shows_the_answer(browser, page):
    from selenium.webdriver.common.by import By
    _open(browser, page)
    assert page.stat().st_size < PAGE_BYTES, page.stat().st_size
    text = browser.find_element(By.TAG_NAME, "body").text  # what is visible: the details are collapsed
    for heading in ("The answer", "Pareto fronts", "Did each knob bind?", "Each point, with 95% intervals",
                    "What the metrics mean"):
        assert heading in text, heading
    assert browser.execute_script("return Array.from(document.querySelectorAll('details')).every(d => !d.open)")
    assert "gpu_memory_utilization bound at" not in text  # inside a collapsed section ...
    # the answer, first, in prose: a paragraph (not printed text) that ends within the first screen
    answer = browser.execute_script("""
        const p = Array.from(document.querySelectorAll('p')).find(e => e.textContent.startsWith('Run mbt='));
        return p && [p.textContent, p.getBoundingClientRect().bottom + window.scrollY, p.closest('pre') === null,
                     getComputedStyle(p).fontFamily];""")
    assert answer, "no paragraph opens with the recommendation"
    said, bottom, not_pre, font = answer
    assert said.startswith("Run mbt=8192__gmu=0.70: output tokens/s") and bottom <= HEIGHT, answer
    assert not_pre and "mono" not in font.lower(), answer
    first_img = browser.execute_script("return document.images[0].getBoundingClientRect().top + window.scrollY")
    assert bottom < first_img < HEIGHT  # the heatmaps come right under it, on the first screen
    # a grid study has no endpoints: that section is left out, not printed as "not an endpoint study"
    whole = browser.execute_script("return document.body.textContent")
    assert "Endpoints side by side" not in whole and "not an endpoint study" not in whole
    _fits_and_decodes(browser)
    text = browser.find_element(By.TAG_NAME, "body").text
    assert "gpu_memory_utilization bound at" in text  # ... shown once opened
    assert "Run mbt=8192__gmu=0.70: output tokens/s" in text
    assert "import " not in text and "ns.answer(" not in text and "ns.recommendation(" not in text  # code hidden


def test_a_committed_report_exported_as_it_is_fits_the_window(browser, committed_page):
    """The committed notebook, exported as it is, opens offline, fits and is small; its
    collapsed details hold the answer point by point and the binding notes. A committed
    notebook keeps no figures (tools/lean_run.py: each is stored once, in figures/), so
    its page has none; `report` re-renders them (the test above)."""
    _open(browser, committed_page)
    assert committed_page.stat().st_size < PAGE_BYTES, committed_page.stat().st_size
    text = browser.execute_script("return document.body.textContent")  # collapsed sections too
    assert "Run mbt=" in text and "gpu_memory_utilization bound at" in text
    assert (RUN / "figures" / "heatmaps.png").exists()
    _fits_and_decodes(browser, images=0)
