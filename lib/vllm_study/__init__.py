"""vllm_study: reproducible studies of vLLM serving knobs, driven by papermill notebooks.

The modules live in stage packages, lowest first. A module imports only from its own
package and from packages in a lower layer (tests/repo/test_unit_import_graph.py checks it;
`python tools/layout.py` prints it; docs/architecture.md explains it). "" is the top:
the modules at the package's root (the command line, the sweep, `doctor`, and the two
modules the notebooks import).
"""
__version__ = "0.1.0"

LAYERS = (
    ("vocab", "scheduler_plugin"),  # names, units, saving a figure; the scheduler plugin vLLM loads by its path
    ("launch", "capacity"),      # a vLLM server process; the load bracket a start's capacity comes from
    ("define",),                 # the study file, its grid of points, the models and traces it names
    ("records", "workload"),     # what a run folder holds; the requests a round sends
    ("measure", "analysis"),     # one server start and its rounds; intervals and the decision over a run
    ("search", "executors", "predict"),  # the configuration search; where each start runs; predicted configs
    ("report",),                 # the report, its figures, compare, export
    ("",),                       # cli, sweep, doctor, notebook_support, point_notebook
)
