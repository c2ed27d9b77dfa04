"""End to end beyond the tiny ChatML card: a model folder with a non-ChatML template
served with the Prefix Reuse Budget, and an exported `vllm serve --config` measured as a
plain endpoint."""
from __future__ import annotations

import subprocess
import sys

import pytest

from e2e_support import REPO, no_proxy_env, serve_on_a_free_port, sweep, tiny, write
from vllm_study.define import models
from vllm_study.define.params import ModelSpec
from vllm_study.records.results import RunFolder


@pytest.mark.e2e
def test_a_model_with_a_mistral_template_runs_end_to_end(tmp_path):
    """A model folder with a SentencePiece-style tokenizer and Mistral's [INST] template
    (no system role: the system prompt goes in front of the first user turn), dummy
    weights, served with the Prefix Reuse Budget scheduler: the study runs, the server
    counts exactly the prompt tokens the kit sent, the prefix cache reuses the shared
    prompt, and the plugin's counters are recorded per round."""
    import offline_tokenizers as ot
    folder = ot.model_folder(ot.mistral_style(), tmp_path / "mistral-style")
    study = tiny(model={"path": str(folder), "dummy_weights": True, "served_name": "tiny"}, rounds=1,
                 scheduler={"min_reuse_ratio": 0.5, "max_defer_ms": 200})
    r = sweep(write(tmp_path, study), "--results", tmp_path / "results", "--no-report")  # other tests render one
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (path,) = (tmp_path / "results").iterdir()
    run = RunFolder(path)
    (s,) = run.summaries()
    assert s.status == "ok", s.reasons
    (rnd,) = run.point(s.point).rounds()
    assert rnd.metrics["server_prompt_tokens"] == rnd.metrics["prompt_tokens"]  # the server's own count
    assert rnd.metrics["prefix_cache_hit_rate"] > 0.5
    assert rnd.metrics["prefix_cache_hit_rate"] <= rnd.metrics["expected_prefix_hit_rate"] + 0.01
    (start,) = run.point(s.point).starts()
    assert "vllm_study.scheduler_plugin.PrefixBudgetScheduler" in start.launch.command
    assert rnd.metrics["pb_deferred"] >= 0 and rnd.metrics["pb_admitted_by_age"] >= 0  # the plugin's counters


@pytest.mark.e2e
def test_an_exported_config_serves_and_is_measured_as_a_plain_endpoint(tmp_path):
    """A point exported as a `vllm serve --config` file starts the CPU engine as it is;
    that server, run by hand without dev mode, is then measured as a target with a random
    workload on /v1/completions: /metrics is scraped, the missing cache reset is said
    plainly, and the report renders."""
    from synthetic_run import make_run
    from vllm_study.report.export import export
    point = "mbt=256__kv=16MiB"
    synthetic = make_run(tmp_path / "synthetic", {point: {"output_throughput": 100.0, "ttft_p90_ms": 50.0}})
    cfg, _ = export(synthetic.path, point, tmp_path / "export")
    model, _ = models.resolve(ModelSpec(card="tiny-qwen2"))
    srv = serve_on_a_free_port(
        lambda port: [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--config", str(cfg), "--model",
                      model, "--load-format", "dummy", "--host", "127.0.0.1", "--port", str(port), "--enforce-eager"],
        tmp_path / "server.log", env={"VLLM_SERVER_DEV_MODE": "0"}, startup_timeout_s=600)
    try:
        study = {"name": "plain", "model": {"card": "tiny-qwen2"}, "rounds": 2,
                 "targets": [{"name": "direct", "base_url": f"{srv.url}/v1", "model": "tiny"}],
                 "workload": {"kind": "random", "api": "completions", "input_tokens": 256, "output_tokens": 8,
                              "requests_per_round": 8, "concurrency": 4, "warmup_requests": 1}}
        r = subprocess.run([sys.executable, "-m", "vllm_study", "sweep", str(write(tmp_path, study)), "--results",
                            str(tmp_path / "results")], cwd=REPO, capture_output=True, text=True, timeout=900,
                           env=no_proxy_env())
    finally:
        srv.stop()
    log = (tmp_path / "server.log").read_text()
    assert "'max_num_batched_tokens': 256" in log and "'kv_cache_memory_bytes': 16777216" in log  # from the config
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (path,) = (tmp_path / "results").iterdir()
    (s,) = RunFolder(path).summaries()
    assert s.status == "ok", s.reasons
    assert s.launch.has_metrics and not s.launch.cache_reset
    assert any("NOT reset between rounds" in w for w in s.warnings)
    assert s.estimates["output_steps"].median > 0  # server counters collected
    assert "direct" in (path / "report.html").read_text()
