"""benchmarks/live_knobs_equivalence.py: its paired statistics, the rule's verdicts, and
the plan it resumes (no server: the starts are written as the benchmark writes them)."""
from __future__ import annotations

import importlib.util
import json
import math
import os

import numpy as np
import pytest
from scipy import stats as sps

from vllm_study.launch.machine import cpu_model
from paths import REPO

SCRIPT = REPO / "benchmarks" / "live_knobs_equivalence.py"
_spec = importlib.util.spec_from_file_location("live_knobs_equivalence", SCRIPT)
eq = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(eq)


def _start(pair: int, way: str, launch: int, by_value: dict[int, list[dict]], wall_s: float = 100.0) -> dict:
    """A start as starts.jsonl holds it: {value: [round metrics, ...]}."""
    rounds = [{"value": v, "round": i, "limits": {}, "wall_s": 30.0, "metrics": {"completed": 10, "failed": 0, **m}}
              for v, ms in by_value.items() for i, m in enumerate(ms)]
    return {"pair": pair, "way": way, "launch": {"max_num_batched_tokens": launch}, "rounds": rounds,
            "wall_s": wall_s, "startup_s": 60.0}


def _metrics(x: float, **over) -> dict:
    base = {m: x for m in eq.METRICS} | {"preemptions": 0, "kv_tokens": 1000}
    return base | over


def test_log_ratio_of_counts_that_can_be_zero():
    assert eq.log_ratio(0, 0) == 0.0          # no preemptions either way: alike
    assert eq.log_ratio(3, 0) == math.inf     # only one way preempted: no ratio says how far apart
    assert eq.log_ratio(0, 3) == -math.inf
    assert eq.log_ratio(110, 100) == pytest.approx(math.log(1.1))


def test_interval_is_the_t_interval_of_the_mean_log_ratio():
    d = np.array([0.01, 0.03, 0.02, 0.04])
    x = eq.interval(d)
    half = sps.t.ppf(0.975, 3) * d.std(ddof=1) / 2
    assert x["pairs"] == 4 and x["effect"] == pytest.approx(math.expm1(0.025))
    assert x["low"] == pytest.approx(math.expm1(0.025 - half)) and x["high"] == pytest.approx(math.expm1(0.025 + half))


def test_interval_edges_one_pair_constant_and_undefined():
    one = eq.interval([0.02])
    assert one["effect"] == pytest.approx(math.expm1(0.02)) and one["low"] is None   # no spread: no interval
    same = eq.interval([0.0, 0.0, 0.0])                      # equal in every pair (KV capacity, no preemptions)
    assert (same["low"], same["high"], same["sd"]) == (0.0, 0.0, 0.0)
    assert eq.interval([0.01, math.inf])["effect"] is None    # zero on one side in one pair


def test_t_interval_covers_about_95_percent_with_four_pairs():
    """Why t and not a percentile bootstrap: with 4 pairs the t interval keeps its 95%."""
    rng = np.random.default_rng(0)
    draws = rng.normal(0.01, 0.05, size=(1000, 4))
    hits = 0
    for d in draws:
        x = eq.interval(d)
        hits += math.log1p(x["low"]) <= 0.01 <= math.log1p(x["high"])
    assert 0.925 <= hits / len(draws) <= 0.975  # 95% +- 3.5 standard errors
    boot = [sps.bootstrap((d,), np.mean, n_resamples=199, method="percentile", rng=1).confidence_interval
            for d in draws[:200]]
    assert sum(c.low <= 0.01 <= c.high for c in boot) / len(boot) < 0.9  # the bootstrap over 4 pairs undercovers


@pytest.mark.parametrize("low, high, want", [
    (-0.02, 0.029, "equal"),
    (0.005, 0.02, "equal"),            # resolved, but within +-3%
    (-0.045, 0.01, "not resolved"),
    (-0.01, 0.049, "not resolved"),
    (0.01, 0.04, "differs"),           # resolved and past +3%, though inside +-5%
    (-0.09, -0.04, "differs"),
    (-0.02, 0.06, "too wide"),         # holds 0 but leaves +-5%: more pairs may settle it
])
def test_verdict_rule(low, high, want):
    assert eq.verdict({"pairs": 4, "effect": (low + high) / 2, "low": low, "high": high}) == want


def test_verdict_without_an_interval():
    assert eq.verdict({"pairs": 1, "effect": 0.01, "low": None, "high": None}) == "too few pairs"
    assert eq.verdict({"pairs": 0, "effect": None, "low": None, "high": None}) == "too few pairs"
    assert eq.verdict({"pairs": 3, "effect": None, "low": None, "high": None}) == "differs"


def test_pairs_needed_is_the_fewest_that_reach_the_width():
    sd, half = 0.04, math.log(1.03)
    n = eq.pairs_needed(sd, half)
    assert sps.t.ppf(0.975, n - 1) * sd / math.sqrt(n) <= half < sps.t.ppf(0.975, n - 2) * sd / math.sqrt(n - 1)
    assert eq.pairs_needed(0.0) == 2


def test_summary_pairs_medians_over_rounds_and_skips_incomplete_pairs():
    starts = []
    for p, k in enumerate((1.00, 1.02, 0.99, 1.01)):
        # fresh: rounds 100, 101, 90 (median 100); lowered: 100 k, and an outlier round
        starts.append(_start(p, "fresh", 2048, {2048: [_metrics(100), _metrics(101), _metrics(90)]}))
        starts.append(_start(p, "lowered", 8192, {2048: [_metrics(100 * k), _metrics(100 * k), _metrics(500)]}))
    starts.append(_start(4, "lowered", 8192, {2048: [_metrics(300)]}))  # its fresh start never ran
    s = eq.summary(starts, [2048])
    x = s["by_value"][2048]["ttft_p90_ms"]
    logs = np.log([1.00, 1.02, 0.99, 1.01])
    assert x["pairs"] == 4 and x["effect"] == pytest.approx(math.expm1(logs.mean()))
    assert x["fresh"] == pytest.approx(100) and x["verdict"] == "equal"
    assert s["by_value"][2048]["preemptions"]["verdict"] == "equal"
    assert s["passes"] and s["widest"]["metric"] in eq.METRICS


def test_summary_fails_on_preemptions_one_way_and_leaves_out_failed_rounds():
    starts = []
    for p in range(3):
        starts.append(_start(p, "fresh", 512, {512: [_metrics(100, preemptions=0)]}))
        starts.append(_start(p, "lowered", 8192, {512: [_metrics(100, preemptions=4 if p == 1 else 0),
                                                        {**_metrics(1), "completed": 0}]}))
    s = eq.summary(starts, [512])
    assert s["by_value"][512]["ttft_p50_ms"]["effect"] == 0.0  # the failed round (completed 0) is not counted
    assert s["by_value"][512]["preemptions"]["verdict"] == "differs" and not s["passes"]
    text = eq.report({"knob": "max_num_batched_tokens", "launch": 8192, "rounds": 1}, s)
    assert "does NOT pass (preemptions at 512 differs)" in text
    # too wide and nothing differing: not decided, and the kit still restarts until it is
    wide = {**s, "by_value": {512: {m: {**x, "verdict": "too wide" if m == "ttft_p90_ms" else "equal"}
                                    for m, x in s["by_value"][512].items()}}}
    text = eq.report({"knob": "max_num_batched_tokens", "launch": 8192, "rounds": 1}, wide)
    assert "not decided yet (ttft_p90_ms at 512 too wide; more pairs may settle it)" in text
    assert "does NOT pass" not in text and "the kit restarts" in text


def test_pair_plan_alternates_shuffles_and_extends_without_reordering():
    a = [eq.pair_units(p, [2048, 512], seed=0) for p in range(6)]
    assert all(u[-1][0] == "lowered" for u in a[0::2]) and all(u[0][0] == "lowered" for u in a[1::2])
    for units in a:  # the fresh starts follow the lowered start's order of values
        lowered = next(v for w, v in units if w == "lowered")
        assert [v[0] for w, v in units if w == "fresh"] == lowered and sorted(lowered) == [512, 2048]
    assert len({tuple(next(v for w, v in u if w == "lowered")) for u in a}) == 2  # the order is shuffled
    assert eq.pair_units(3, [2048, 512], seed=0) == a[3]


def test_resume_skips_finished_starts_and_stops_before_the_minutes():
    values = [2048, 512]
    plan = eq.todo([], 2, values, 8192, 0)
    assert len(plan) == 6
    done = [_start(0, w, 8192 if w == "lowered" else v[0], {x: [{}] for x in v}, wall_s=100.0 + 30 * len(v))
            for w, v in eq.pair_units(0, values, 0)]
    assert eq.todo(done, 2, values, 8192, 0) == plan[3:]
    # 100 s outside the rounds, 30 s a round, 20 s kept at the end: 2 rounds need 180 s
    assert eq.fits(done, 2, 360.0, 9) and not eq.fits(done, 2, 361.0, 9) and eq.fits(done, 1, 390.0, 9)
    assert eq.fits(done, 2, 10_000.0, 0) and eq.fits([], 2, 10_000.0, 9)  # no --minutes; the first start


def test_plan_file_refuses_another_measurement_but_takes_more_pairs(tmp_path):
    plan = {"params": "a.yaml", "params_sha256": "x", "knob": "max_num_seqs", "launch": 64, "values": [16, 4],
            "rounds": 1, "seed": 0, "pairs": 4}
    eq.check_plan(tmp_path, plan)
    eq.check_plan(tmp_path, {**plan, "pairs": 8, "params": "./a.yaml"})
    assert json.loads((tmp_path / "plan.json").read_text())["pairs"] == 8
    with pytest.raises(SystemExit, match="other values"):
        eq.check_plan(tmp_path, {**plan, "values": [16, 8]})


def test_a_resumed_run_refuses_other_hardware_and_its_report_names_the_device():
    h100 = [{**_start(p, w, 8192 if w == "lowered" else 2048, {2048: [_metrics(100)]}),
             "device": "NVIDIA H100 80GB HBM3"} for p in range(2) for w in ("fresh", "lowered")]
    eq.check_device(h100, "NVIDIA H100 80GB HBM3")
    eq.check_device([{k: v for k, v in st.items() if k != "device"} for st in h100], "NVIDIA H200")  # not recorded
    with pytest.raises(SystemExit, match="ran on NVIDIA H100 80GB HBM3; this machine is NVIDIA H200.*new --out"):
        eq.check_device(h100, "NVIDIA H200")
    s = eq.summary(h100, [2048])
    assert s["devices"] == ["NVIDIA H100 80GB HBM3"]
    assert "on NVIDIA H100 80GB HBM3;" in eq.report({"knob": "max_num_batched_tokens", "launch": 8192, "rounds": 1}, s)
    assert "device not recorded" in eq.report({"knob": "max_num_batched_tokens", "launch": 8192, "rounds": 1},
                                              {**s, "devices": []})
    name, gpus = eq.this_device()  # this machine: a GPU's NVML name and UUIDs, else its CPU model and none
    assert name and (gpus if not name.startswith("CPU: ") else gpus == [])
    host = eq.this_host()  # the machine around them: the same CPU model the kit's machine record reads
    assert host["cpu"] == cpu_model() and host["cores"] == os.cpu_count()
    assert (host["gpu_driver"] is None) == name.startswith("CPU: ")


def test_a_pair_across_two_gpus_or_declared_unpaired_is_left_out_and_named(tmp_path):
    """A machine's own speed is not the lowering's: a pair whose starts ran on two physical
    GPUs (their UUIDs) is left out, as is one the run's left_out.json declares (starts that
    predate the UUIDs); the report names each."""
    def pair(p, k, fresh_gpu="GPU-a", lowered_gpu="GPU-a"):
        return [{**_start(p, "fresh", 2048, {2048: [_metrics(100)]}), "gpus": [fresh_gpu]},
                {**_start(p, "lowered", 8192, {2048: [_metrics(100 * k)]}), "gpus": [lowered_gpu]}]
    starts = pair(0, 1.00) + pair(1, 1.01) + pair(2, 0.99) + pair(3, 1.60, lowered_gpu="GPU-b")
    s = eq.summary(starts, [2048])
    assert s["left_out"] == {"3": "its starts ran on two GPUs (GPU-a and GPU-b)"}
    assert s["by_value"][2048]["ttft_p90_ms"]["pairs"] == 3 and s["passes"]
    (tmp_path / eq.LEFT_OUT).write_text(json.dumps({"1": "its lowered start ran on an earlier machine"}))
    declared = eq.summary(starts, [2048], eq.read_left_out(tmp_path))
    assert set(declared["left_out"]) == {"1", "3"} and declared["by_value"][2048]["ttft_p90_ms"]["pairs"] == 2
    text = eq.report({"knob": "max_num_batched_tokens", "launch": 8192, "rounds": 1}, declared)
    assert "left out: pair 2, its lowered start ran on an earlier machine" in text
    assert "left out: pair 4, its starts ran on two GPUs" in text
    assert eq.read_left_out(tmp_path / "none") == {}


@pytest.mark.parametrize("text", ["", "2048,x", "512,512", "0,4"])
def test_bad_values_are_refused_with_the_fix(text):
    with pytest.raises(SystemExit, match="--values"):
        eq.parse_values(text)


def test_fresh_starts_run_the_kits_scheduler_only_where_the_plan_says_so(tmp_path):
    """--fresh-scheduler kit: the fresh starts launch the live-limits scheduler too, which
    splits the launch value's effect from the plugin's; the default plan (vLLM's own for
    the fresh starts) is written as before, so a run begun before resumes."""
    plan = {"knob": "max_num_batched_tokens", "launch": 8192, "values": [2048, 512], "rounds": 1, "seed": 0,
            "pairs": 4, "params": "p.yaml", "params_sha256": "x"}
    assert eq.runs_plugin("lowered", plan) and not eq.runs_plugin("fresh", plan)
    kit = plan | {"fresh_scheduler": "kit"}
    assert eq.runs_plugin("fresh", kit) and eq.runs_plugin("lowered", kit)
    eq.check_plan(tmp_path, plan)
    eq.check_plan(tmp_path, plan | {"pairs": 6})   # more pairs: the same run
    with pytest.raises(SystemExit, match="fresh_scheduler"):
        eq.check_plan(tmp_path, kit)                 # another design: a new --out
    s = {"by_value": {}, "passes": False, "widest": None, "method": "m"}
    assert "over fresh starts at each value (the kit's scheduler too);" in eq.report(kit, s)
    assert "over fresh starts at each value;" in eq.report(plan, s)


def test_kit_measuring_is_part_of_the_plan_and_the_report(tmp_path):
    """--kit-measuring gives the lowered start a sweep's counting flags and sampling: a
    run without it, begun before, is another design, and the report says which it is."""
    plan = {"knob": "max_num_batched_tokens", "launch": 2048, "values": [2048], "rounds": 3, "seed": 0,
            "pairs": 4, "params": "p.yaml", "params_sha256": "x"}
    eq.check_plan(tmp_path, plan)
    with pytest.raises(SystemExit, match="kit_measuring"):
        eq.check_plan(tmp_path, plan | {"kit_measuring": True})
    s = {"by_value": {}, "passes": False, "widest": None, "method": "m"}
    lowered = plan | {"launch": 8192, "values": [2048]}
    measured = eq.report(lowered | {"kit_measuring": True}, s)
    assert "launched at 8192 with the kit's measuring and lowered live" in measured
    assert "launched at 8192 and lowered live" in eq.report(lowered, s)
    assert "footprint target (every metric equal within +-3%, resolved): not decided" in eq.report(
        plan | {"kit_measuring": True}, s)


def test_footprint_run_is_judged_by_its_own_target_not_the_live_knobs_rule():
    plan = {"knob": "max_num_batched_tokens", "launch": 2048, "values": [2048], "rounds": 3, "kit_measuring": True}
    assert eq.footprint(plan) and not eq.footprint({**plan, "values": [2048, 512]})
    assert not eq.footprint({**plan, "kit_measuring": False})
    starts = []
    for p, k in enumerate((1.00, 1.20, 0.85, 1.10)):  # TTFT P90 spreads +-20% pair to pair
        starts.append(_start(p, "fresh", 2048, {2048: [_metrics(100)] * 3}))
        starts.append(_start(p, "lowered", 2048, {2048: [_metrics(100, ttft_p90_ms=100 * k)] * 3}))
    s = eq.summary(starts, [2048])
    text = eq.report(plan, s)
    assert "over plain vLLM starts" in text and "live knobs" not in text
    assert "not met: ttft_p90_ms (too wide)" in text and "tpot_p50_ms" not in text.split("not met:")[1]
    same = [_start(p, w, 2048, {2048: [_metrics(100)] * 3}) for p in range(3) for w in ("fresh", "lowered")]
    assert eq.footprint_verdict(eq.summary(same, [2048])).endswith(": met")


A_ROUND = math.sqrt(0.01 * 14 / 16)  # _planned_starts' round variance is then 0.01


def _planned_starts(c: float, a: float = A_ROUND, shift: float = 0.05, first: float = 0.0) -> list[dict]:
    """4 pairs, 3 rounds a start of 200 requests, 10 s a round and 60 s besides: each start's
    log TTFT P90 is its level -a, +0, +a over its rounds in the fresh start, +a, 0, -a in the
    lowered one (no round index offset; residual sum of squares 16a^2 on 24 - 8 - 2 = 14
    df: round variance 16a^2/14), plus `first` in every start's first round; the lowered
    start's level is the fresh one's + shift +-c, alternately (pair variance 4c^2/3)."""
    out = []
    for p in range(4):
        base = math.log(200.0) + 0.3 * p        # a drift the pairs share: cancelled
        for way, level in (("fresh", base), ("lowered", base + shift + (c if p % 2 else -c))):
            offs = (-a + first, 0.0, a) if way == "fresh" else (a + first, 0.0, -a)
            rounds = [{"value": 2048, "round": i, "limits": {}, "wall_s": 10.0,
                       "metrics": {"completed": 200, "failed": 0, "ttft_p90_ms": math.exp(level + off)}}
                      for i, off in enumerate(offs)]
            out.append({"pair": p, "way": way, "rounds": rounds, "wall_s": 90.0})
    return out


def test_variance_parts_recover_the_round_and_start_components():
    v = eq.variance_parts(_planned_starts(c=math.sqrt(0.02)), 2048, "ttft_p90_ms")
    assert v["var_round"] == pytest.approx(0.01) and v["df_round"] == 14       # 8 starts x 2, less 2 offsets
    assert v["var_pair"] == pytest.approx(4 * 0.02 / 3) and v["df_pair"] == 3
    assert v["var_start"] == pytest.approx(4 * 0.02 / 3 - 2 * 0.01 / 3)        # = 0.02
    assert v["rounds"] == 3 and v["requests"] == 200 and v["mean_diff"] == pytest.approx(0.05)
    assert v["round_effects"] == pytest.approx({0: 0.0, 1: 0.0, 2: 0.0}, abs=1e-12)


def test_a_first_round_slower_in_every_start_is_an_offset_not_round_noise():
    """A warm-up every start leaves unfinished reads the same in both starts of a pair and
    cancels in their difference: it is reported as the rounds' offsets, not counted as
    spread that more rounds or pairs must average away."""
    plain = eq.variance_parts(_planned_starts(c=math.sqrt(0.02)), 2048, "ttft_p90_ms")
    slow = eq.variance_parts(_planned_starts(c=math.sqrt(0.02), first=0.3), 2048, "ttft_p90_ms")
    assert slow["var_round"] == pytest.approx(plain["var_round"]) and slow["df_round"] == plain["df_round"]
    assert slow["var_pair"] == pytest.approx(plain["var_pair"])
    assert slow["round_effects"] == pytest.approx({0: 0.2, 1: -0.1, 2: -0.1})   # +0.3 on round 1, centred
    text = eq.plan_report(eq.verdict_plan(_planned_starts(c=math.sqrt(0.02), first=0.3), 2048, "ttft_p90_ms"))
    assert "round 1 +22.1%, round 2 -9.5%, round 3 -9.5%" in text
    assert "the run reads +5.1% (mean log ratio over 4 pairs)" in text


def test_verdict_plan_on_a_case_worked_by_hand():
    """No start part (pair variance = 2 var_round / 3 exactly): a pair's log difference has
    variance 0.02 / R, so at R = 2 its sd is 0.1, and a 95% t half-width within log(1.05)
    = 0.04879 takes 19 pairs (t(18) 2.101 x 0.1 / sqrt(19) = 0.0482; 18: 0.0497). A pair
    is 2 starts x (60 s + 2 rounds x 10 s) = 160 s: 19 pairs are 50.67 minutes."""
    half = math.log1p(0.05)
    assert sps.t.ppf(0.975, 17) * 0.1 / math.sqrt(18) > half >= sps.t.ppf(0.975, 18) * 0.1 / math.sqrt(19)
    plan = eq.verdict_plan(_planned_starts(c=math.sqrt(0.005)), 2048, "ttft_p90_ms", within=0.05)
    at = {x["rounds"]: x for x in plan["rows"]}
    assert plan["parts"]["var_start"] == pytest.approx(0.0, abs=1e-12)
    assert at[2]["sd_diff"] == pytest.approx(0.1) and at[2]["pairs"] == 19
    assert at[2]["minutes"] == pytest.approx(19 * 160 / 60)
    assert plan["pairs_at_infinite_rounds"] == 2     # nothing but rounds' noise to average away
    assert plan["times"] == {"fixed_s": 60.0, "round_s": 10.0, "pair_min": 3.0}
    # rounds of 400 requests: half the round variance at twice the round's time, so 1 round
    # of 400 is 2 rounds of 200: the same pairs and minutes
    doubled = {x["rounds"]: x for x in eq.verdict_plan(_planned_starts(c=math.sqrt(0.005)), 2048, "ttft_p90_ms",
                                                       within=0.05, requests=400)["rows"]}
    assert doubled[1]["pairs"] == 19 and doubled[1]["minutes"] == pytest.approx(19 * 160 / 60)
    # a live-knobs run of 2 values: a pair is 3 starts and 2 x 2 x R rounds
    two = {x["rounds"]: x for x in eq.verdict_plan(_planned_starts(c=math.sqrt(0.005)), 2048, "ttft_p90_ms",
                                                   values=2)["rows"]}
    assert two[2]["minutes"] == pytest.approx(19 * (3 * 60 + 2 * 2 * 2 * 10) / 60)
    text = eq.plan_report(plan)
    assert "cheapest:" in text and "upper bound (chi-square, df 3" in text


def test_the_plan_fits_the_interval_inside_the_bound_around_the_runs_own_reading():
    """The rule asks the whole interval inside +-5%: around a reading of +2% (log) the
    half-width may be only log(1.05) - 0.02, at the run's pair sd (4 x 0.005 / 3)."""
    plan = eq.verdict_plan(_planned_starts(c=math.sqrt(0.005), shift=0.02), 2048, "ttft_p90_ms", within=0.05)
    room, sd = math.log1p(0.05) - 0.02, math.sqrt(4 * 0.005 / 3)
    n = plan["pairs_inside"]
    assert sps.t.ppf(0.975, n - 1) * sd / math.sqrt(n) <= room < sps.t.ppf(0.975, n - 2) * sd / math.sqrt(n - 1)
    assert n > eq.pairs_needed(sd, math.log1p(0.05))   # more than an interval around zero would take
    assert f"an interval inside +-5% takes about {n} pairs at 3 rounds" in eq.plan_report(plan)
    # a reading outside the bound: no count of pairs brings the interval inside it
    far = eq.verdict_plan(_planned_starts(c=math.sqrt(0.005), shift=0.06), 2048, "ttft_p90_ms", within=0.05)
    assert far["pairs_inside"] is None and "the reading lies outside" in eq.plan_report(far)


def test_a_start_part_sets_the_fewest_pairs_however_many_rounds():
    plan = eq.verdict_plan(_planned_starts(c=math.sqrt(0.02)), 2048, "ttft_p90_ms", within=0.05)
    floor = eq.pairs_needed(math.sqrt(0.02), math.log1p(0.05), most=eq.MOST_PAIRS)
    assert plan["pairs_at_infinite_rounds"] == floor
    assert all(x["pairs"] >= floor for x in plan["rows"])
    assert plan["rows"][-1]["sd_diff"] == pytest.approx(math.sqrt(0.02 + 0.02 / 40))
    assert plan["upper"]["var_pair"] > plan["parts"]["var_pair"]   # its 90% upper bound, chi-square on 3 df
    assert plan["upper"]["cheapest"]["pairs"] > plan["cheapest"]["pairs"]


def test_a_plan_needs_two_rounds_a_start_and_two_pairs():
    one_pair = [s for s in _planned_starts(c=0.1) if s["pair"] == 0]
    with pytest.raises(ValueError, match="1 complete pair"):
        eq.variance_parts(one_pair, 2048, "ttft_p90_ms")
    one_round = [{**s, "rounds": s["rounds"][:1]} for s in _planned_starts(c=0.1)]
    with pytest.raises(ValueError, match="no start has 2 rounds"):
        eq.variance_parts(one_round, 2048, "ttft_p90_ms")


def test_pairs_assured_meet_the_width_in_that_share_of_simulated_runs():
    """At the pairs pairs_assured gives, the t interval of normal log differences is within
    the bound in about 80% of runs (simulated); at pairs_needed's, in little over half."""
    sd, half = 0.14, math.log1p(0.05)
    rng = np.random.default_rng(7)

    def share(n: int) -> float:
        d = rng.normal(0.0, sd, size=(8000, n))
        return float((sps.t.ppf(0.975, n - 1) * d.std(axis=1, ddof=1) / math.sqrt(n) <= half).mean())
    n80 = eq.pairs_assured(sd, half, 0.8)
    assert n80 > eq.pairs_needed(sd, half, most=eq.MOST_PAIRS)
    assert share(n80) == pytest.approx(0.8, abs=0.02) and share(n80 - 1) < 0.8
    # a little over half: pairs_needed rounds up to where the width at the true sd is at or under the bound
    assert 0.5 <= share(eq.pairs_needed(sd, half, most=eq.MOST_PAIRS)) < 0.7
