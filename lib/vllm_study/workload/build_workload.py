"""The workload a study asks for, built for a tokenizer, and whether the model's chat
template can render it. Apart from workload.py, which the trace workload builds on."""
from __future__ import annotations

import random

from .trace_workload import TraceWorkload
from ..define.traces import Trace, floor_warning, read_trace
from .workload import (MixedWorkload, MultiTurnWorkload, RandomWorkload, SharedPrefixWorkload, TemplateError,
                       random_text)


def make_workload(tokenizer, w):
    """The workload object for params.Workload `w`."""
    common = dict(api=w.api, seed=w.seed)
    shared = dict(system_prompt_tokens=w.system_prompt_tokens, question_tokens=w.question_tokens,
                  output_tokens=w.output_tokens, prefixes=w.prefixes, **common)
    if w.kind == "shared_prefix":
        return SharedPrefixWorkload(tokenizer, **shared)
    if w.kind in ("mixed", "eviction"):
        classes = ("shared", "cold") if w.kind == "eviction" else ("short", "long")
        return MixedWorkload(tokenizer, long_fraction=w.long_fraction, long_prompt_tokens=w.long_prompt_tokens,
                             classes=classes, **shared)
    if w.kind == "multi_turn":
        return MultiTurnWorkload(tokenizer, turns=w.turns, **shared)
    if w.kind == "trace":  # the whole window; the point leaves out what its server cannot take (Trace.fit)
        if w.trace.windows:  # every window's requests, in one (what the checks of its prompts read)
            from . import windows
            whole, plan = windows.for_study(w.trace, w.seed)
            trace = Trace([r for x in plan.windows for r in x.trace(whole).requests], whole.block_tokens,
                          f"{whole.source}, {len(plan.windows)} windows")
            return TraceWorkload(tokenizer, api=w.api, seed=w.seed, trace=trace)
        return TraceWorkload(tokenizer, api=w.api, seed=w.seed, trace=read_trace(w.trace))
    return RandomWorkload(tokenizer, input_tokens=w.input_tokens, output_tokens=w.output_tokens, **common)


def check_template(tokenizer, w) -> tuple[list[str], list[str]]:
    """Can this tokenizer's chat template render what workload `w` sends? Returns
    (problems that stop the study, warnings), each with its fix."""
    problems, warnings = [], []
    no_template = ["the tokenizer has no chat template, so vLLM cannot serve chat requests for it; use "
                   "workload.api: completions, or a model folder whose tokenizer_config.json has one"]
    if w.kind == "trace" and w.api == "chat" and not getattr(tokenizer, "chat_template", None):
        return no_template, []  # (a trace workload renders its frame as it is made)
    try:
        wl = make_workload(tokenizer, w)
    except TemplateError as e:
        return [str(e)], []
    if w.kind == "trace" and wl.inexact:
        warnings.append(floor_warning(wl.inexact, len(wl.trace.requests), wl.prompt_floor))
    if w.api != "chat" or w.kind == "trace":  # a trace's frame was checked as its workload was made
        return problems, warnings
    if not getattr(tokenizer, "chat_template", None):
        return no_template, []
    system = random_text(wl._pieces, 64, random.Random(0))
    try:
        wl._render(system if w.system_prompt_tokens else None, " alpha beta")
    except Exception as e:  # jinja2's TemplateError, or a raise_exception() in the template
        return [f"the chat template fails on a {'system + ' if w.system_prompt_tokens else ''}user "
                f"conversation ({type(e).__name__}: {e}); use workload.api: completions"
                + (", or system_prompt_tokens: 0" if w.system_prompt_tokens else "")], []
    if w.system_prompt_tokens and w.kind != "random":
        shared = wl.shared_prefix_tokens(system)
        alone = len(tokenizer.encode(system, add_special_tokens=False))
        if shared < alone:
            warnings.append(f"the chat template puts per-request text before the system prompt "
                            f"(two requests share {shared} tokens, the 64-token system prompt alone is {alone}): "
                            "prefix caching cannot reuse it; consider workload.api: completions")
    return problems, warnings
