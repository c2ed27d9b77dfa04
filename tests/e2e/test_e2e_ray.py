"""The ray executor on this machine's own Ray (ray.init() starts a local cluster): a
two-point CPU study runs as two Ray tasks, side by side; each task's start folder
comes back into the run folder, and the manifest records that the starts overlapped.
A live-knobs group is one task whose start serves both points. The servers are the fake
engine's (tests/fake_engine.py): what is tested is the executor, not vLLM."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import yaml

from e2e_support import UNI, fake_engine_study, sweep, tiny, write
from procs import group_gone
from vllm_study.records.results import RunFolder, StartRecord
from paths import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.fake_engine]
ONE_EACH = {"extra_cli_args": UNI, "live_knobs": False}  # a start (and a Ray task) a point


def test_a_two_point_study_runs_as_ray_tasks(tmp_path):
    study = fake_engine_study(tiny(grid={"max_num_batched_tokens": [128, 256]}, server=ONE_EACH, rounds=1,
                                   workload={**tiny()["workload"], "requests_per_round": 4, "warmup_requests": 1}))
    params = tmp_path / "study.yaml"
    params.write_text(yaml.safe_dump(study, sort_keys=False))
    r = subprocess.run([sys.executable, "-m", "vllm_study", "sweep", str(params),
                        "--results", str(tmp_path / "results"), "--executor", "ray", "--parallel", "2", "--no-report"],
                       cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "executor ray: 2 server start(s) at a time" in r.stdout
    (path,) = (tmp_path / "results").iterdir()
    run = RunFolder(path)
    summaries = run.summaries()
    assert [s.status for s in summaries] == ["ok", "ok"], [s.reasons for s in summaries]
    for s in summaries:
        (start,) = run.point(s.point).starts()
        assert start.rounds_ok == 1 and (run.point(s.point).start_dir(1) / "point.ipynb").exists()
        assert group_gone(start.launch.server_pgid)
    m = run.manifest()
    assert m.executor == "ray"
    assert len(m.overlaps) == 1 and m.overlaps[0]["seconds"] > 0  # the two starts ran side by side


def test_a_live_knobs_group_runs_as_one_ray_task(tmp_path):
    """Live knobs are on by default on the CPU engine: the two chunk sizes share one
    server start, which one Ray task runs. Each point's start folder comes back into its
    own place (the lead's with the server's launch and log, the other naming it), and
    each round ran under its own point's limits."""
    study = fake_engine_study(tiny(grid={"max_num_batched_tokens": [256, 512]}, rounds=1,
                                   workload={**tiny()["workload"], "requests_per_round": 4, "warmup_requests": 1}))
    r = sweep(write(tmp_path, study), "--results", tmp_path / "results", "--executor", "ray", "--no-report",
              timeout=1200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    run = RunFolder(next((tmp_path / "results").iterdir()))
    (unit,) = run.manifest().order
    lead = "mbt=512"
    assert unit.point == lead and sorted(unit.serves) == ["mbt=256", lead]
    starts = {p: run.point(p).start(1) for p in unit.serves}
    assert all(s.status == "ok" and s.rounds_ok == 1 for s in starts.values()), \
        {p: s.reason for p, s in starts.items()}
    assert starts[lead].serves == unit.serves and starts[lead].launch.startup_s > 0
    assert (run.point(lead).start_dir(1) / "server.log.gz").exists()
    assert group_gone(starts[lead].launch.server_pgid)
    assert starts["mbt=256"].served_by == f"{lead}/s1" and starts["mbt=256"].launch.command is None
    assert not (run.point("mbt=256").start_dir(1) / "server.log.gz").exists()
    for p in unit.serves:
        (rnd,) = run.point(p).rounds()
        assert rnd.status == "ok" and rnd.limits["max_num_batched_tokens"] == int(p.split("=")[1])
        assert 0 < rnd.limits["peak_step_tokens"] <= rnd.limits["max_num_batched_tokens"]
    assert {s.point: s.status for s in run.summaries()} == {p: "ok" for p in unit.serves}
    assert run.manifest().executor == "ray"


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _server_up(start_json: Path) -> int | None:
    """The server's pid (its group's id) once the start's server is up (its launch saved)."""
    try:
        rec = StartRecord.load_if(start_json)
    except (OSError, ValueError):  # its scratch folder is being removed
        return None
    return rec.launch.server_pgid if rec is not None else None


def _worker_running(server_pid: int, sweep: subprocess.Popen) -> psutil.Process | None:
    """The Ray worker running a start, from its server's pid: its first ancestor outside the
    sessions the start made (the server, the kernel and papermill each lead one), and one
    of the sweep's own descendants (the local Ray's raylet starts the workers)."""
    try:
        p = psutil.Process(server_pid)
        while p is not None and os.getsid(p.pid) == p.pid:
            p = p.parent()
        ours = {q.pid for q in psutil.Process(sweep.pid).children(recursive=True)}
    except (psutil.Error, OSError):
        return None
    return p if p is not None and p.pid in ours else None


def _pgid(p: psutil.Process) -> int | None:
    try:
        return os.getpgid(p.pid)
    except OSError:
        return None


def test_a_killed_ray_worker_is_a_failed_start_that_leaves_nothing_running(tmp_path):
    """kill -9 of the worker running the first point's start once its server is up (of
    every try of it: Ray used to run it again, unrecorded, beside the orphaned tree, and
    the sweep died once its retries were spent). The start is failed with the reason; its
    papermill, kernel and server are stopped; the other point runs; the report and the
    hint come; no scratch folder is left."""
    # steps of 0.1 s: the start measures for seconds once its server is up, as a vLLM start does,
    # so the worker is killed while it runs
    study = fake_engine_study(tiny(grid={"max_num_batched_tokens": [128, 256]}, server=ONE_EACH, rounds=2,
                                   workload={**tiny()["workload"], "requests_per_round": 4, "warmup_requests": 1}),
                              FAKE_ENGINE_STEP_S="0.1")
    # the workers' scratch folders in a folder of their own (TMPDIR reaches the Ray workers
    # through the raylet); Ray keeps its own folder where it always is. Short: vLLM puts its
    # IPC sockets in TMPDIR too.
    temp = Path(tempfile.mkdtemp(prefix="vst-"))
    env = {**os.environ, "TMPDIR": str(temp), "RAY_TMPDIR": tempfile.gettempdir()}
    out, err = tmp_path / "sweep.out", tmp_path / "sweep.err"
    with open(out, "w") as o, open(err, "w") as e:
        sweep = subprocess.Popen([sys.executable, "-m", "vllm_study", "sweep", str(write(tmp_path, study)),
                                  "--results", str(tmp_path / "results"), "--executor", "ray", "--parallel", "1"],
                                 cwd=REPO, env=env, stdout=o, stderr=e, start_new_session=True)
    seen, killed = set(), []  # scratch folders looked at; per killed worker: its descendants, their commands
    target = None
    try:
        deadline = time.monotonic() + 1200
        while sweep.poll() is None:
            assert time.monotonic() < deadline, "the sweep did not end"
            for start_json in temp.glob("vllm-study-*/points/*/s1/start.json"):
                scratch, point = start_json.parents[3], start_json.parents[1].name
                server = _server_up(start_json) if scratch not in seen and (target or point) == point else None
                worker = _worker_running(server, sweep) if server else None
                if worker is None:
                    continue
                seen.add(scratch)
                target = point
                tree = worker.children(recursive=True)
                cmds = [" ".join(p.cmdline()) for p in tree]
                worker.kill()
                killed.append((tree, cmds, server))
            time.sleep(0.1)
        stdout, stderr = out.read_text(), err.read_text()
        assert len(killed) == 1 and sweep.returncode == 0 and "Traceback" not in stderr, \
            f"{len(killed)} tries of the start were killed; exit {sweep.returncode}\n{stdout[-2000:]}{stderr[-3000:]}"

        (path,) = (tmp_path / "results").iterdir()
        run = RunFolder(path)
        lost = run.point(target).start(1)
        assert lost.status == "failed" and lost.reason.startswith("the Ray worker running this start died: "), lost
        (other,) = [p for p in run.point_ids() if p != target]
        assert run.point(other).start(1).status == "ok" and run.point(other).start(1).rounds_ok == 2
        assert {s.point: s.status for s in run.summaries()} == {target: "failed", other: "ok"}
        assert (path / "report.html").stat().st_size > 0 and (path / "summary.csv").exists()
        assert f"--resume {path} --retry-failed" in stdout
        assert run.manifest().overlaps == []  # nothing ran beside the other point's start

        ((tree, cmds, server_pgid),) = killed
        assert any("papermill" in c for c in cmds) and any("ipykernel" in c for c in cmds), cmds  # what was killed
        assert [p.pid for p in tree if not _gone(p)] == []  # papermill, kernel, server, engine core
        assert all(_gone(p) for p in psutil.process_iter() if _pgid(p) == server_pgid)
        assert list(temp.glob("vllm-study-*")) == []  # the killed start's, and the other one's
    finally:
        if sweep.poll() is None:
            sweep.terminate()
            try:
                sweep.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(sweep.pid, signal.SIGKILL)
                sweep.wait()
        shutil.rmtree(temp, ignore_errors=True)


def test_a_ray_start_that_never_comes_back_is_a_failed_start_not_a_crash(tmp_path, monkeypatch):
    """The driver's side, without vLLM: one unit's task kills its own worker, the other's
    raises. Each is tried once (Ray's retries used to run it again, then the sweep died of
    the WorkerCrashedError), comes back as a failed start with its reason in start.json,
    and is what `--resume --retry-failed` runs again."""
    import ray

    from vllm_study import executors
    from vllm_study.executors import ray_cluster
    from vllm_study.define.grid import expand
    from vllm_study.define.study_file import study_from_dict
    from vllm_study.sweep import create_run, unit_finished

    study = study_from_dict(fake_engine_study(tiny(grid={"max_num_batched_tokens": [128, 256]}, server=ONE_EACH,
                                                   rounds=1)))
    points = expand(study, "cpu")
    run = create_run(tmp_path / "results", study, "cpu", points)
    dies, raises = (u for u in run.manifest().order)
    tries = tmp_path / "tries"

    def task(plans: dict, unit: dict) -> dict:  # in place of ray_cluster.ray_start
        import os
        import signal
        (point_id,) = plans
        with open(tries, "a") as f:
            f.write(point_id + "\n")
        if point_id == dies.point:
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("the task's code raised")

    monkeypatch.setattr(ray_cluster, "ray_start", task)
    try:
        runner = executors.make("ray", run, study, "cpu", points)
        summaries = [runner(u, None, None) for u in (dies, raises)]
    finally:
        ray.shutdown()
    assert sorted(tries.read_text().split()) == sorted([dies.point, raises.point])  # each tried once
    assert [s.status for s in summaries] == ["failed", "failed"]
    died, raised = (run.point(u.point).start(u.start) for u in (dies, raises))
    assert died.status == "failed" and died.reason.startswith("the Ray worker running this start died: ")
    assert raised.status == "failed" and raised.reason.startswith(
        "the Ray task running this start failed: RayTaskError"), raised.reason
    assert "the task's code raised" in raised.reason
    assert all(unit_finished(run, u) and not unit_finished(run, u, retry_failed=True) for u in (dies, raises))


def test_a_lost_ray_start_that_served_several_points_fails_each(tmp_path, monkeypatch):
    """A shared start (live knobs) whose worker dies: every point it served has a failed
    start with Ray's reason, the others naming the lead's, and --retry-failed runs the
    whole start again."""
    import ray

    from vllm_study import executors
    from vllm_study.executors import ray_cluster
    from vllm_study.define.grid import expand
    from vllm_study.define.study_file import study_from_dict
    from vllm_study.sweep import create_run, unit_finished

    study = study_from_dict(fake_engine_study(tiny(grid={"max_num_batched_tokens": [128, 256]}, rounds=1)))
    points = expand(study, "cpu")
    run = create_run(tmp_path / "results", study, "cpu", points)
    (unit,) = run.manifest().order
    carried = tmp_path / "carried"

    def task(plans: dict, unit: dict) -> dict:  # in place of ray_cluster.ray_start
        import os
        import signal
        carried.write_text(" ".join(sorted(plans)))
        os.kill(os.getpid(), signal.SIGKILL)

    monkeypatch.setattr(ray_cluster, "ray_start", task)
    try:
        summary = executors.make("ray", run, study, "cpu", points)(unit, None, None)
    finally:
        ray.shutdown()
    assert carried.read_text() == "mbt=128 mbt=256"  # every served point's plan went with the task
    assert summary.point == unit.point == "mbt=256" and summary.status == "failed"
    lead, other = run.point("mbt=256").start(1), run.point("mbt=128").start(1)
    assert lead.serves == unit.serves and other.served_by == "mbt=256/s1"
    for rec in (lead, other):
        assert rec.status == "failed" and rec.reason.startswith("the Ray worker running this start died: ")
    assert {s.point: s.status for s in run.summaries()} == {"mbt=128": "failed", "mbt=256": "failed"}
    assert unit_finished(run, unit) and not unit_finished(run, unit, retry_failed=True)


def test_a_task_whose_notebook_died_before_the_served_points_folders_brings_back_the_lead_s(tmp_path,
                                                                                           monkeypatch):
    """The worker's side, without vLLM: the notebook makes the served points' folders, so
    one that died first leaves only the lead's start folder, which comes back alone (a
    missing folder must not fail the task: the lead's own reason would be lost)."""
    import ray

    from vllm_study.define.grid import Unit
    from vllm_study.executors import ray_cluster

    def died_early(run, unit, gpus=None):  # in place of run_unit: the lead's record only
        d = run.point(unit.point).start_dir(unit.start)
        d.mkdir(parents=True)
        (d / "start.json").write_text('{"status": "failed"}')

    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [])
    monkeypatch.setattr(ray_cluster, "run_unit", died_early)
    unit = Unit(point="mbt=256", start=1, block=1, serves=["mbt=256", "mbt=128"])
    packed = ray_cluster.ray_start({"mbt=256": "{}", "mbt=128": "{}"}, unit.model_dump())
    assert list(packed) == ["mbt=256"]
    run = RunFolder(tmp_path / "run")
    ray_cluster.unpack_start(run, unit, packed)
    assert (run.point("mbt=256").start_dir(1) / "start.json").read_text() == '{"status": "failed"}'
    assert not run.point("mbt=128").start_dir(1).exists()
