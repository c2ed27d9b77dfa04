"""The configuration codec (launch/flags.py) and the deployment a start launches
(launch/deployment.py): one reading of a flag whatever form it is written in, the argv
as written, the serve config vLLM's config loader turns back into the same flags."""
from __future__ import annotations

import pytest

from vllm_study.define.schema import EngineArgs
from vllm_study.launch import deployment, server
from vllm_study.launch.deployment import Endpoint, VllmServe
from vllm_study.launch.flags import Flags, field_name, flag_name, option


@pytest.mark.parametrize("written", ["--max_num_batched_tokens", "--max-num-batched-tokens",
                                     "max_num_batched_tokens", "--max-num-batched-tokens=8"])
def test_every_written_form_of_a_name_is_one_name(written):
    assert flag_name(written) == "max-num-batched-tokens"
    assert field_name(written) == "max_num_batched_tokens"
    assert option(written) == "--max-num-batched-tokens"


def test_parse_reads_values_bare_flags_negations_and_keeps_the_tokens_as_written():
    argv = ["python", "-m", "x", "--a", "1", "--b_c=2", "--d", "--no-e", "--no_f", "--g", "-3"]
    f = Flags.parse(argv)
    assert f.config() == {"a": "1", "b-c": "2", "d": True, "e": False, "f": False, "g": "-3"}
    assert f.argv() == argv  # what reaches the server is what the study wrote
    assert "b_c" in f and "--b-c" in f and "e" in f and "z" not in f
    assert f.get("--no-e") is False and f.get("b-c") == "2" and f.get("z", 7) == 7
    assert [x.written for x in f] == ["--a", "--b_c", "--d", "--no-e", "--no_f", "--g"]


def test_the_last_of_a_flag_given_twice_wins_as_in_vllms_parser():
    f = Flags.parse(["--max-num-seqs", "4"]) + Flags.parse(["--max_num_seqs=8"])
    assert f.get("max_num_seqs") == "8" and f.config() == {"max-num-seqs": "8"}


def test_without_drops_a_flag_in_every_form_with_its_value():
    argv = ["vllm", "serve", "m", "--port", "1", "--host=h", "--no-enable-mfu-metrics", "--custom_histogram_buckets",
            "[1]", "--seed", "3"]
    assert Flags.parse(argv).without({"port", "host", "enable-mfu-metrics", "custom-histogram-buckets"}).argv() == \
        ["vllm", "serve", "m", "--seed", "3"]


def test_engine_args_encode_through_the_codec():
    args = EngineArgs(max_num_batched_tokens=2048, enable_prefix_caching=False, enforce_eager=True,
                      gpu_memory_utilization=0.9)
    assert args.cli() == ["--max-num-batched-tokens", "2048", "--gpu-memory-utilization", "0.9",
                          "--no-enable-prefix-caching", "--enforce-eager"]
    # read back by the same codec: the values as strings, the booleans as they were
    assert Flags.parse(args.cli()).config() == {"max-num-batched-tokens": "2048", "gpu-memory-utilization": "0.9",
                                                "enable-prefix-caching": False, "enforce-eager": True}
    assert EngineArgs(enforce_eager=False).cli() == []  # store_true: no --no- form in vLLM


def test_serve_config_is_what_vllms_config_loader_turns_back_into_the_same_flags(tmp_path):
    """vLLM's own FlexibleArgumentParser reads the exported mapping as the flags the
    point ran with (less the kit's measurement flags)."""
    import yaml
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    d = VllmServe("m", "tiny", True, engine=EngineArgs(max_num_batched_tokens=512, enable_prefix_caching=False).flags(),
                  extra=Flags.parse(["--max_num_seqs", "8", "--no-enable-mfu-metrics", "--enable-chunked-prefill"]),
                  measuring=Flags.parse(["--custom-histogram-buckets", "[1, 2]"]))
    cfg = d.serve_config()
    assert cfg == {"max-num-batched-tokens": 512, "enable-prefix-caching": False, "max-num-seqs": "8",
                   "enable-chunked-prefill": True, "served-model-name": "tiny"}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    from_config = parser.parse_args(["--model", "m", "--config", str(path)])
    from_argv = parser.parse_args(["--model", "m", "--served-model-name", "tiny", *d.engine.argv(),
                                   "--max_num_seqs", "8", "--enable-chunked-prefill"])
    assert vars(from_config) == vars(from_argv)


def test_the_command_puts_engine_then_extra_then_measurement_flags():
    d = VllmServe("m", "tiny", True, engine=EngineArgs(seed=1).flags(), extra=Flags.parse(["--x_y", "2"]),
                  measuring=Flags.parse(["--enable-mfu-metrics"]))
    cmd = d.command(4321)
    assert cmd == server.serve_command("m", 4321, ["--seed", "1"], "tiny", True, ["--x_y", "2", "--enable-mfu-metrics"])
    assert Flags.parse(cmd).get("port") == "4321" and Flags.parse(cmd).get("x-y") == "2"


def test_a_start_whose_port_was_taken_is_started_once_more_and_says_so(tmp_path, monkeypatch):
    tries, spawned = [], []

    def start(self, hold=None):
        tries.append(self.port)
        if len(tries) == 1:
            raise server.ServerStartError("port in use (exit code 1)")
        return self
    monkeypatch.setattr(server.VllmServer, "start", start)
    handle = VllmServe("m", "tiny", True).start(tmp_path / "server.log", spawned=spawned.append)
    assert len(set(tries)) == 2 and spawned[-1] is handle and len(spawned) == 2
    assert handle.base_url == f"http://127.0.0.1:{tries[1]}" and handle.metrics_url == handle.base_url + "/metrics"
    assert handle.log_path == tmp_path / "server.log" and handle.pgid is None  # never spawned here
    assert handle.notes == [f"port {tries[0]} was taken before the server bound it: started again on another port"]


def test_another_failure_is_raised_with_the_server_it_spawned(tmp_path, monkeypatch):
    def start(self, hold=None):
        raise server.ServerStartError("out of memory")
    monkeypatch.setattr(server.VllmServer, "start", start)
    spawned = []
    with pytest.raises(server.ServerStartError, match="out of memory") as e:
        VllmServe("m", "tiny", True).start(tmp_path / "server.log", spawned=spawned.append)
    assert e.value.server is spawned[0] and len(spawned) == 1


def test_an_endpoint_starts_nothing():
    t = Endpoint("remote", "http://10.0.0.1:8000", "llama", api_key_env="KEY")
    h = t.start()
    assert (h.base_url, h.metrics_url, h.pgid, h.log_path) == ("http://10.0.0.1:8000", "http://10.0.0.1:8000/metrics",
                                                               None, None)
    assert h.alive() and not h.exited()
    h.stop()
    assert t.record() == {"name": "remote", "base_url": "http://10.0.0.1:8000", "model": "llama",
                          "api_key_env": "KEY", "proxy": None}
    assert deployment.MEASUREMENT_ONLY == {"custom-histogram-buckets", "enable-mfu-metrics"}


def test_the_default_program_is_vllms_serve_entrypoint_as_serve_command_builds_it():
    d = VllmServe("m", "tiny", True, engine=EngineArgs(seed=1).flags())
    assert d.program == server.vllm_program()
    assert d.command(4321) == server.serve_command("m", 4321, ["--seed", "1"], "tiny", True)
    assert d.command(4321)[:len(d.program)] == list(d.program)


@pytest.mark.parametrize("program, model_words", [(("/usr/bin/python3", "fake.py"), ["--model", "m"]),
                                                  (("vllm", "serve"), ["m"])])
def test_another_program_gets_vllms_command_line_after_it(program, model_words):
    d = VllmServe("m", "tiny", True, engine=EngineArgs(seed=1).flags(), extra=Flags.parse(["--x_y", "2"]),
                  program=program)
    cmd = d.command(4321)
    assert cmd == [*program, *model_words, "--host", "127.0.0.1", "--port", "4321", "--served-model-name", "tiny",
                   "--load-format", "dummy", "--seed", "1", "--x_y", "2"]
    # only the head differs from vLLM's: the configuration served reads the same
    vllm = VllmServe("m", "tiny", True, engine=EngineArgs(seed=1).flags(), extra=Flags.parse(["--x_y", "2"]))
    assert Flags.parse(cmd).without({"model"}).config() == Flags.parse(vllm.command(4321)).without({"model"}).config()
