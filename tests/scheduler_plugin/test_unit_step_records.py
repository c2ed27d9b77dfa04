"""Step records' file format (scheduler_plugin/steps.py): the raw file the engine appends
to, read while it writes, cut into a round and saved column-wise."""
import numpy as np

from vllm_study.scheduler_plugin import steps


def _rows(times):
    rows = np.zeros(len(times), dtype=steps.DTYPE)
    rows["t_scheduled"] = [t for t, _ in times]
    rows["t_done"] = [d for _, d in times]
    rows["prefill_tokens"] = np.arange(len(times)) * 100
    return rows


def test_a_torn_last_row_is_left_out(tmp_path):
    raw = tmp_path / "steps.bin"
    rows = _rows([(1.0, 1.02), (1.02, 1.05), (1.05, 1.06)])
    raw.write_bytes(rows.tobytes() + rows[:1].tobytes()[:17])  # the engine is mid-write
    back = steps.read_raw(raw)
    assert len(back) == 3 and back["prefill_tokens"].tolist() == [0, 100, 200]


def test_a_round_keeps_the_steps_scheduled_inside_it_and_loads_back(tmp_path):
    rows = _rows([(0.5, 0.6), (1.0, 1.1), (1.5, 1.6), (2.5, 2.6)])
    kept = steps.between(rows, 1.0, 2.0)
    assert kept["t_scheduled"].tolist() == [1.0, 1.5]
    path = steps.save_round(tmp_path, 3, kept)
    assert path == tmp_path / "steps" / "r3.npz"
    back = steps.load_round(path)
    assert back.dtype == steps.DTYPE and back["prefill_tokens"].tolist() == [100, 200]


def test_cycles_are_output_to_output_when_steps_overlap_and_own_time_after_idle():
    # async: step 2 scheduled before step 1's output; step 3 after an idle gap
    rows = _rows([(0.0, 0.030), (0.010, 0.055), (0.100, 0.120)])
    assert np.allclose(steps.cycles(rows), [0.030, 0.025, 0.020])
