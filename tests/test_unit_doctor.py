"""doctor: each check finds what it is for and says the fix."""
from __future__ import annotations

import socket

from vllm_study import doctor


def test_proxy_that_captures_loopback_is_flagged_with_the_fix():
    f = doctor.check_proxies({"HTTPS_PROXY": "http://proxy.example:3128"})
    assert f.status == doctor.WARN and "NO_PROXY does not cover" in f.detail
    assert f.fix == "export NO_PROXY=127.0.0.1,localhost"


def test_proxy_with_loopback_exempted_is_fine():
    f = doctor.check_proxies({"HTTP_PROXY": "http://p:1", "NO_PROXY": "localhost, 127.0.0.1,.corp"})
    assert f.status == doctor.OK


def test_no_proxy_variables():
    assert doctor.check_proxies({}).status == doctor.OK


def test_port_in_use_is_reported():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        f = doctor.check_port(port)
    assert f.status == doctor.WARN and "in use" in f.detail
    assert doctor.check_port(port).status == doctor.OK  # free again once closed


def test_disk_below_need_fails(tmp_path):
    assert doctor.check_disk(tmp_path, need_gib=10**9).status == doctor.FAIL
    assert doctor.check_disk(tmp_path, need_gib=0).status == doctor.OK


def test_gpu_and_vllm_on_this_machine():
    from vllm_study.counters import NvmlProbe
    from vllm_study.server import vllm_distribution
    gpu = doctor.check_gpu()
    if NvmlProbe().available:
        assert gpu.status == doctor.OK and "driver" in gpu.detail
    else:  # CI: no GPU, said plainly, with what happens instead
        assert gpu.status == doctor.WARN and "CPU build" in gpu.detail
    v = doctor.check_vllm(gpu=False)
    assert v.status == doctor.OK and v.detail.startswith(f"{vllm_distribution()} ")


def test_finding_prints_the_fix_only_when_something_is_wrong():
    assert "fix:" in str(doctor.Finding(doctor.FAIL, "x", "broken", "do this"))
    assert "fix:" not in str(doctor.Finding(doctor.OK, "x", "fine", "do this"))
