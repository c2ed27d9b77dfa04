"""report.html, rendered from a committed report notebook, opened in headless Chromium
(Debian's chromium and chromium-driver; .ci/run installs them): the page loads offline
without console errors and shows the recommendation, the tables and the heatmaps."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# A committed run whose report has every section: a grid, intervals, an answer.
RUN = REPO / "results" / "20261130T114104Z-h200-qwen2.5-32b-d63e4e9"


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
    yield d
    d.quit()


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    """The committed report notebook, as the kit writes it to a static page (runs commit
    the notebook only)."""
    from vllm_study.report import export_html
    from vllm_study.results import RunFolder
    folder = tmp_path_factory.mktemp("run")
    shutil.copy(RUN / "report.ipynb", folder / "report.ipynb")
    return export_html(RunFolder(folder))


def test_report_html_loads_offline_and_shows_the_answer(browser, page):
    from selenium.webdriver.common.by import By
    browser.get(page.as_uri())
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
    text = browser.find_element(By.TAG_NAME, "body").text
    for heading in ("The answer", "Pareto fronts", "Did each knob bind?", "Heatmaps", "What the metrics mean"):
        assert heading in text, heading
    assert "Run mbt=" in text  # the recommendation names a point
    assert "gpu_memory_utilization bound at" in text
    assert "import " not in text and "ns." not in text  # code hidden
    # every figure is embedded and decodes (nothing fetched from elsewhere)
    sizes = browser.execute_script(
        "return Array.from(document.images).map(i => [i.src.slice(0, 10), i.naturalWidth]);")
    assert len(sizes) >= 4 and all(src == "data:image" and w > 300 for src, w in sizes), sizes
