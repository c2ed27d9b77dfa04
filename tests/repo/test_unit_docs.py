"""README.md and docs/*.md say only what the repository holds and does.

- Every relative link, and every repository path written in backticks (inline code or a
  fenced block), names a file or folder of the repository. Placeholders (`results/<run>`,
  a `*` glob, `...`) are checked up to the folder before them.
- Every `vllm-study ...` (or `python -m vllm_study ...`) command the pages show runs, in a cheap form that
  needs no GPU and starts no server: `sweep <params> --dry-run` (with `--engine cpu`
  for a GPU study), `doctor` as shown, and `--help` for each subcommand, whose options
  must include every flag the pages pass it. `my-study.yaml` is the README's first study,
  written to a temporary folder. Commands with placeholders (`results/<run>`) only get
  their subcommand's `--help`.
- The README's two commands are the Makefile's.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest
from paths import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TOP = ("lib", "params", "notebooks", "benchmarks", "tools", "results", "docs", "tests", ".ci")
PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable
PLACEHOLDER = re.compile(r"[<>*…]|\.\.\.")
EXTENSION = re.compile(r"\.[A-Za-z0-9]{1,6}$")
# sweep's options that take a value (cli.py): a word after one is not a params file
SWEEP_VALUED = {"--results", "--engine", "--max-minutes", "--resume", "--executor", "--ray-address", "--parallel"}
MAX_DRY_RUNS = 10  # each loads the study's tokenizer: a few seconds on two busy cores
TIMEOUT_S = 90
FIRST_STUDY = "my-study.yaml"


def _text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def _fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(info string, body) of every ``` block."""
    return re.findall(r"^```([^\n]*)\n(.*?)^```", text, flags=re.M | re.S)


def _inline_code(text: str) -> list[str]:
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.findall(r"`([^`\n]+)`", prose)


def _code_spans(text: str) -> list[str]:
    return _inline_code(text) + [body for _, body in _fenced_blocks(text)]


@lru_cache(maxsize=1)
def _repo_paths() -> frozenset[str]:
    """Files git tracks or would track (untracked, not ignored); without git, every file."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                             capture_output=True, text=True, timeout=30, check=True).stdout
        files = {f for f in out.split("\0") if f and (REPO / f).exists()}
    except (OSError, subprocess.SubprocessError):
        files = {str(p.relative_to(REPO)) for p in REPO.rglob("*") if p.is_file() and ".venv" not in p.parts}
    folders = {str(Path(f).parents[i]) for f in files for i in range(len(Path(f).parents) - 1)}
    return frozenset(files | folders)


def _exists(rel: str) -> bool:
    rel = os.path.normpath(rel.rstrip("/")) if rel.strip("/") else "."
    return rel == "." or rel in _repo_paths()


def _checked_part(path: str) -> str:
    """The part of a path a placeholder leaves to check: the folders before it."""
    m = PLACEHOLDER.search(path)
    if not m:
        return path
    head = path[:m.start()]
    return head[:head.rfind("/") + 1] if "/" in head else ""


def _path_like(word: str) -> bool:
    if "/" not in word or "://" in word or word.startswith(("/", "~", "$", "-", "http")):
        return False
    if word.split("/")[0] in TOP:
        return True
    return bool(EXTENSION.search(word.rstrip("/"))) and not word.startswith(".")


def _mentioned_paths(text: str) -> set[str]:
    found = set()
    for span in _code_spans(text):
        for word in re.split(r"[\s\[\](){}'\"=,;|]+", span):
            word = word.rstrip(".:;,")
            if _path_like(word):
                found.add(word)
    return found


def _links(text: str) -> set[str]:
    return {t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:|#", t)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_links_and_paths_exist(page):
    text = _text(page)
    missing = []
    for target in sorted(_links(text)):
        rel = os.path.relpath(page.parent / target.split("#")[0], REPO)
        if not _exists(rel):
            missing.append(f"link ({target})")
    for path in sorted(_mentioned_paths(text)):
        if not _exists(_checked_part(path)):
            missing.append(f"`{path}`")
    assert not missing, f"{page.name} names what the repository does not hold: {', '.join(missing)}"


def test_docs_pages_are_linked_from_the_readme():
    readme = _links(_text(REPO / "README.md"))
    pages = sorted(str(p.relative_to(REPO)) for p in PAGES[1:])
    assert pages, "docs/ holds no page"
    assert [p for p in pages if p not in readme] == []


# ---- the commands the pages show ---------------------------------------------------------

def _shown(pattern: str):
    """(page, match) for every line of the pages' code that matches `pattern`, in page order
    (a command continued with a backslash is one line)."""
    for page in PAGES:
        for span in _code_spans(_text(page)):
            for line in re.sub(r"\\\n\s*", " ", span).splitlines():
                m = re.search(pattern, line)
                if m:
                    yield page, m


def _shown_commands() -> list[tuple[str, list[str]]]:
    """(page, argv after `-m vllm_study`) for every command the pages show, in page order."""
    out = []
    for page, m in _shown(r"(?:python -m vllm_study|(?:^|\s)vllm-study)\s+(.*)"):
        rest = re.sub(r"\s#.*$", "", m.group(1))
        rest = re.sub(r"\[[^\]]*\]", "", rest)  # [--optional arguments]
        argv = shlex.split(rest)
        if argv and not argv[0].startswith("<"):
            out.append((page.name, argv))
    return out


def _first_study(folder: Path) -> Path:
    """The README's first study, written where a test can run it."""
    for info, body in _fenced_blocks(_text(REPO / "README.md")):
        if info.strip() == "yaml" and body.lstrip().startswith(f"# {FIRST_STUDY}"):
            path = folder / FIRST_STUDY
            path.write_text(body)
            return path
    raise AssertionError(f"README.md shows no yaml block beginning `# {FIRST_STUDY}`")


def _params_of(argv: list[str]) -> list[str]:
    words, skip = [], False
    for a in argv[1:]:
        if skip:
            skip = False
        elif a in SWEEP_VALUED:
            skip = True
        elif not a.startswith("-"):
            words.append(a)
    return words


def _cheap_form(argv: list[str]) -> tuple[str, ...] | None:
    """What to run for a shown command; None where only its subcommand's --help can be run."""
    if any(PLACEHOLDER.search(a) for a in argv):
        return None
    if argv[0] == "doctor":
        return tuple(argv)
    if argv[0] == "sweep" and "--resume" not in argv:
        params = _params_of(argv)
        if not params:
            return None
        engine = argv[argv.index("--engine"):argv.index("--engine") + 2] if "--engine" in argv else []
        return ("sweep", *params, "--dry-run", *engine)
    return None


def _needs_cpu_engine(params: list[str], folder: Path) -> bool:
    from vllm_study.define.study_file import load_study
    study = load_study(*[folder / p if p == FIRST_STUDY else REPO / p for p in params])
    return study.server.engine == "gpu"


def _to_run(shown) -> list[tuple[str, ...]]:
    """The cheap forms, each once, in page order: every doctor, the first MAX_DRY_RUNS sweeps."""
    cheap = list(dict.fromkeys(c for c in (_cheap_form(argv) for _, argv in shown) if c))
    sweeps = [c for c in cheap if c[0] == "sweep"][:MAX_DRY_RUNS]
    return [c for c in cheap if c[0] != "sweep" or c in sweeps]


SHOWN = _shown_commands()
RUN = _to_run(SHOWN)
SUBCOMMANDS = sorted({argv[0] for _, argv in SHOWN})


def _run(argv, cwd=REPO, timeout=TIMEOUT_S) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    return subprocess.run([PYTHON, "-m", "vllm_study", *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_pages_show_commands():
    assert {"sweep", "doctor", "report", "export", "compare"} <= set(SUBCOMMANDS), SUBCOMMANDS
    assert any(c[0] == "sweep" for c in RUN) and any(c[0] == "doctor" for c in RUN)


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_subcommand_help_lists_the_flags_shown(sub):
    r = _run([sub, "--help"], timeout=60)
    assert r.returncode == 0, r.stderr
    shown = {a.split("=")[0] for _, argv in SHOWN if argv[0] == sub for a in argv[1:] if a.startswith("--")}
    unknown = sorted(f for f in shown if f not in r.stdout)
    assert not unknown, f"the pages pass `{sub}` options its --help does not list: {unknown}"


@pytest.fixture(scope="module")
def study_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("docs-study")
    _first_study(folder)
    return folder


@pytest.mark.parametrize("argv", RUN, ids=" ".join)
def test_shown_command_runs(argv, study_folder):
    argv = list(argv)
    if argv[0] == "sweep":
        params = _params_of(argv)
        for p in params:
            assert p == FIRST_STUDY or (REPO / p).is_file(), f"the pages run a study that does not exist: {p}"
        if "--engine" not in argv and _needs_cpu_engine(params, study_folder):
            argv += ["--engine", "cpu"]  # a GPU study: list its points on the CPU engine
    argv = [str(study_folder / a) if a == FIRST_STUDY else a for a in argv]
    r = _run(argv)
    out = r.stdout + r.stderr
    if argv[0] == "doctor" and r.returncode == 1:  # documented: 1 where a check fails on this machine
        assert "[FAIL]" in r.stdout, out
        return
    assert r.returncode == 0, out
    assert "Traceback" not in out, out
    if argv[0] == "sweep":
        assert re.search(r"^study \S+: (\d+ points|a search over)", r.stdout, flags=re.M), out


def test_the_first_study_is_layered_over_the_default():
    shown = [argv for _, argv in SHOWN if FIRST_STUDY in argv]
    assert shown and all(argv[:3] == ["sweep", "params/default.yaml", FIRST_STUDY] for argv in shown), shown


# ---- the README's two commands -------------------------------------------------------------

def test_readme_two_commands_are_the_makefiles():
    readme, make = _text(REPO / "README.md"), _text(REPO / "Makefile")
    assert "make study" in readme and "make test" in readme
    assert re.search(r"^PARAMS \?= params/default\.yaml$", make, flags=re.M)
    assert re.search(r"^study: env\n\t\$\(BIN\)/python -m vllm_study sweep \$\(PARAMS\)$", make, flags=re.M)
    test_recipe = re.search(r"^test: env\n((?:\t.*\n?)+)", make, flags=re.M).group(1)
    assert "ruff check" in test_recipe and "pytest" in test_recipe and "--nbval" in make
    assert re.search(r"^make test$", _text(REPO / ".ci" / "run"), flags=re.M)


def test_scripts_take_the_flags_shown():
    """`python benchmarks/x.py ... --flag` and `python tools/x.py ...`: the script exists and
    defines every flag shown, or hands it on to the sweep (read from the source: nothing is run).
    A command a tool runs (`tools/detach.py ... -- python benchmarks/y.py --out D`) is checked
    as its own."""
    problems = []
    script_at = r"python ((?:benchmarks|tools)/\S+\.py)(.*)"
    shown = [(page, seg) for page, m in _shown(script_at) for seg in re.split(r"\s--\s", m.group(0))]
    for page, m in ((page, re.search(script_at, seg)) for page, seg in shown):
        if m is None:
            continue
        script = REPO / m.group(1)
        if not script.is_file():
            problems.append(f"{page.name}: {m.group(1)} does not exist")
            continue
        source = script.read_text()
        if "parse_known_args" in source:  # it hands what it does not know to the sweep
            source += (REPO / "lib" / "vllm_study" / "cli.py").read_text()
        flags = re.findall(r"(?<![\w-])(--[a-z][\w-]*)", re.sub(r"\s#.*$", "", m.group(2)))
        problems += [f"{page.name}: {m.group(1)} has no {f}" for f in flags if f'"{f}"' not in source]
    assert not problems, problems


def test_the_pages_teach_the_command_an_installed_package_gives():
    """`pip install .` gives the `vllm-study` command (pyproject's script): the pages show
    that, not the checkout's interpreter running the module."""
    assert re.search(r'^vllm-study = "vllm_study\.cli:main"$', _text(REPO / "pyproject.toml"), flags=re.M)
    taught = [p.name for p in PAGES if ".venv/bin/python -m vllm_study" in _text(p)]
    assert taught == [], f"pages teach the checkout's interpreter instead of `vllm-study`: {taught}"
    assert sum(argv[0] == "sweep" for page, argv in SHOWN if page == "README.md") >= 3
