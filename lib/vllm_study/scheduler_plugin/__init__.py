"""The kit's scheduler plugin: the vLLM scheduler classes the kit's servers load by
their dotted path (``--scheduler-cls``), and what they carry into the engine core.

The Prefix Reuse Budget, a cache-aware admission rule: a waiting request joins the
running batch only when the share of its prompt already in the prefix cache is at least
``min_reuse_ratio``; requests below it are deferred (never dropped) until they have
waited ``max_defer_ms`` or nothing else waiting could use the budget. Everything else is
vLLM's default scheduling.

    vllm serve MODEL --enable-prefix-caching \\
        --scheduler-cls vllm_study.scheduler_plugin.PrefixBudgetScheduler \\
        --additional-config '{"prefix_budget": {"min_reuse_ratio": 0.8,
                              "max_defer_ms": 500, "stats_path": "/tmp/pb.json"}}'

    before = read_stats("/tmp/pb.json"); ...run a round...; after = read_stats(...)
    stats_delta(before, after)  # deferred, admitted_by_age, admitted_idle, defer_ms_p50/p99

With VLLM_STUDY_KNOBS_CONTROL set, the same scheduler (or ``LiveLimitsScheduler``,
without the budget rule) also takes max_num_batched_tokens, max_num_seqs and
long_prefill_token_threshold from a control file, capped at the launch values
(``knobs``, ``live_limits``; the kit's side is vllm_study.measure.live_knobs). With
VLLM_STUDY_STEPS set, every one of the kit's schedulers (and ``StepRecordsScheduler``,
vLLM's own scheduling otherwise) records each engine step (``step_records``, ``steps``).

Modules: ``prefix_budget`` (the Prefix Reuse Budget rule as pure functions, parameter
validation), ``counters_file`` (counters file, read_stats, stats_delta), ``steps`` (step
records' file format), ``step_records`` (the engine side: a row an engine step),
``knobs`` (the control message's checks), ``live_limits`` (the control channel in the
engine), ``scheduler`` (the vLLM subclasses; it imports vLLM only when the engine builds
the scheduler).
"""
from .prefix_budget import CONFIG_KEY, Decision, Params, decide, params_from_config, passes_alone
from .scheduler import (LiveLimitsScheduler, PrefixBudgetMixin, PrefixBudgetScheduler, StepRecordsScheduler,
                        scheduler_class)
from .counters_file import StatsRecorder, percentile, read_stats, stats_delta
from .knobs import CONTROL_ENV, Limits, Refused, check_message

__all__ = ["CONFIG_KEY", "Decision", "Params", "decide", "params_from_config", "passes_alone",
           "PrefixBudgetMixin", "PrefixBudgetScheduler", "scheduler_class",
           "StatsRecorder", "percentile", "read_stats", "stats_delta",
           "LiveLimitsScheduler", "StepRecordsScheduler", "CONTROL_ENV", "Limits", "Refused", "check_message"]
