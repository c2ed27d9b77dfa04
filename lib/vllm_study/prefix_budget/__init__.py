"""Prefix Reuse Budget: a cache-aware admission plugin for vLLM's scheduler.

A waiting request joins the running batch only when the share of its prompt already
in the prefix cache is at least ``min_reuse_ratio``; requests below it are deferred
(never dropped) until they have waited ``max_defer_ms`` or nothing else waiting could
use the budget. Everything else is vLLM's default scheduling.

    vllm serve MODEL --enable-prefix-caching \\
        --scheduler-cls vllm_study.prefix_budget.PrefixBudgetScheduler \\
        --additional-config '{"prefix_budget": {"min_reuse_ratio": 0.8,
                              "max_defer_ms": 500, "stats_path": "/tmp/pb.json"}}'

    before = read_stats("/tmp/pb.json"); ...run a round...; after = read_stats(...)
    stats_delta(before, after)  # deferred, admitted_by_age, admitted_idle, defer_ms_p50/p99

Modules: ``policy`` (the rule as pure functions, parameter validation), ``stats``
(counters file, read_stats, stats_delta), ``scheduler`` (the vLLM subclasses; it
imports vLLM only when the engine builds the scheduler).
"""
from .policy import CONFIG_KEY, Decision, Params, decide, params_from_config, passes_alone
from .scheduler import PrefixBudgetMixin, PrefixBudgetScheduler, scheduler_class
from .counters_file import StatsRecorder, percentile, read_stats, stats_delta

__all__ = ["CONFIG_KEY", "Decision", "Params", "decide", "params_from_config", "passes_alone",
           "PrefixBudgetMixin", "PrefixBudgetScheduler", "scheduler_class",
           "StatsRecorder", "percentile", "read_stats", "stats_delta"]
