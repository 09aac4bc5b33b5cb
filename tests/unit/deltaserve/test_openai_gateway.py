"""deltaserve/openai_gateway.py without the gateway: the flags (vLLM's --host/--port, on by
default in `serve` only), the `smg launch` command line, the refusals of what smg cannot front,
and the child supervision (output folded with a prefix, its exit reported, stopped) on a real
child process. The real gateway: tests/e2e/test_openai_listen.py."""
from __future__ import annotations

import io
import socket
import subprocess
import sys

import pytest

from deltaserve.cli import build_parser
from deltaserve.gateway_checks import check_compatible, check_parsers, check_tls
from deltaserve.openai_gateway import (GatewayChild, OpenAIOptions, find_smg, gateway_model_path,
                                       grpc_target_of, openai_front, openai_options, smg_command)
from engine_common.request.params import ParamError
from scheduler_service.api.api_options import ApiOptions


def _options(*argv: str) -> tuple[OpenAIOptions, bool]:
    return openai_options(build_parser().parse_args(list(argv)))


def test_serve_answers_openai_on_vllms_port_by_default_and_the_scheduler_does_not():
    options, asked = _options("serve")
    assert options.openai_listen == "127.0.0.1:8000" and options.enabled and not asked
    assert options.base_url == "http://127.0.0.1:8000/v1"
    options, asked = _options("scheduler", "--model", "m", "--workers", "w:1")
    assert not options.enabled and not asked


def test_host_and_port_name_the_openai_listener_and_off_turns_it_off():
    options, asked = _options("serve", "--host", "0.0.0.0", "--port", "8123")
    assert options.openai_listen == "0.0.0.0:8123" and asked
    assert options.base_url == "http://127.0.0.1:8123/v1"    # where a local client reaches it
    assert _options("serve", "--port", "9000")[0].openai_listen == "127.0.0.1:9000"
    assert _options("scheduler", "--model", "m", "--workers", "w:1", "--port", "9000"
                    )[0].openai_listen == "127.0.0.1:9000"
    assert not _options("serve", "--openai-listen", "off")[0].enabled
    with pytest.raises(ParamError, match="--host='0.0.0.0' is invalid: must be unset with "
                       "--openai-listen"):
        _options("serve", "--openai-listen", "127.0.0.1:1", "--host", "0.0.0.0")
    with pytest.raises(ParamError, match="--port=9000 is invalid: must be unset with "
                       "--openai-listen"):                       # was "host=None is invalid"
        _options("serve", "--openai-listen", "off", "--port", "9000")
    with pytest.raises(ParamError, match="--openai-listen='nowhere' is invalid"):
        _options("serve", "--openai-listen", "nowhere")


def test_https_needs_both_files(tmp_path):
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    with pytest.raises(ParamError, match="ssl_keyfile"):
        _options("serve", "--ssl-certfile", str(cert))
    options, _ = _options("serve", "--ssl-certfile", str(cert), "--ssl-keyfile", str(cert))
    assert options.base_url == "https://127.0.0.1:8000/v1"


def test_smg_command_carries_the_parsers_key_https_and_chat_template(tmp_path):
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    options, _ = _options("serve", "--port", "8001", "--api-key", "k1",
                          "--tool-call-parser", "qwen", "--reasoning-parser", "qwen3",
                          "--ssl-certfile", str(cert), "--ssl-keyfile", str(cert))
    cmd = smg_command("/bin/smg", options, "127.0.0.1:50051", "/models/m", 29001,
                      chat_template="/t.jinja")
    assert "--api-key=k1" in cmd           # one word: a key may start with '-'
    pairs = [word for word in cmd[2:] if not word.startswith("--api-key=")]
    flags = dict(zip(pairs[::2], pairs[1::2]))
    assert cmd[:2] == ["/bin/smg", "launch"]
    assert flags["--host"] == "127.0.0.1" and flags["--port"] == "8001"
    assert flags["--worker-urls"] == "grpc://127.0.0.1:50051"
    assert flags["--model-path"] == "/models/m" and flags["--prometheus-port"] == "29001"
    assert flags["--tool-call-parser"] == "qwen"
    assert flags["--reasoning-parser"] == "qwen3" and flags["--chat-template"] == "/t.jinja"
    assert flags["--tls-cert-path"] == str(cert) and flags["--tls-key-path"] == str(cert)
    plain = smg_command("/bin/smg", _options("serve")[0], "h:1", "/m", 1)
    assert not {"--api-key", "--tool-call-parser", "--chat-template"} & set(plain)
    assert not any(word.startswith("--api-key") for word in plain)
    with_sql = smg_command("/bin/smg", _options("serve")[0], "h:1", "/m", 1,
                           adapter_targets=("h:2",))     # --lora-engine-listen: one more worker
    urls = with_sql.index("--worker-urls")
    assert with_sql[urls + 1:urls + 4] == ["grpc://h:1", "grpc://h:2", "--model-path"]


def test_what_smg_cannot_front_is_refused_by_name(tmp_path):
    path = tmp_path / "f"
    path.write_text("k\n")
    options = OpenAIOptions(openai_listen="127.0.0.1:8000")
    with pytest.raises(ParamError, match="api_key_file.*sends no key"):
        check_compatible(options, ApiOptions(api_key_file=str(path)))
    with pytest.raises(ParamError, match="tls_cert.*TLS gRPC"):
        check_compatible(options, ApiOptions(tls_cert=str(path), tls_key=str(path)))
    check_compatible(options, ApiOptions())


def test_the_gateway_reaches_a_wildcard_bound_scheduler_on_loopback(tmp_path):
    assert grpc_target_of("0.0.0.0:50051", 50051) == "127.0.0.1:50051"
    assert grpc_target_of("localhost:0", 4242) == "localhost:4242"
    assert grpc_target_of("[::1]:1", 7) == "[::1]:7"
    assert gateway_model_path(str(tmp_path)) == str(tmp_path.resolve())
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    assert gateway_model_path(str(gguf)).endswith(".tokenizer-from-worker")   # GetTokenizer


def test_the_child_output_is_folded_with_a_prefix_and_its_exit_is_reported():
    out = io.StringIO()
    script = "import sys; print('\\x1b[32mINFO\\x1b[0m up'); sys.stderr.write('oops\\n'); sys.exit(3)"
    child = GatewayChild([sys.executable, "-c", script], out=out)
    assert child.proc.wait(30) == 3
    child.stop()
    assert child.gone() == "the OpenAI gateway (smg) exited with code 3"
    assert sorted(out.getvalue().splitlines()) == ["[smg] INFO up", "[smg] oops"]  # no colour


def test_a_running_child_is_stopped():
    # A child that runs until a signal stops it.
    child = GatewayChild([sys.executable, "-c", "import signal; signal.pause()"], out=io.StringIO())
    assert child.gone() is None
    child.stop()
    assert child.proc.returncode is not None and child.gone() is not None


def test_a_default_listener_gives_way_to_the_grpc_ports_keys_and_an_asked_one_is_refused(
        tmp_path, capsys):
    """`serve --api-key-file F` keeps working (gRPC only, with a note); asking for the OpenAI
    listener as well is refused by name."""
    if find_smg() is None:
        pytest.skip("the smg gateway is not installed")
    keys = tmp_path / "keys"
    keys.write_text("k" * 32 + "\n")
    parser = build_parser()
    args = parser.parse_args(["serve", "--api-key-file", str(keys)])
    assert openai_front(args, ApiOptions(api_key_file=str(keys)), "m", "localhost:1") is None
    assert "the OpenAI API is off: api_key_file" in capsys.readouterr().out
    args = parser.parse_args(["serve", "--api-key-file", str(keys), "--port", "8001"])
    with pytest.raises(ParamError, match="api_key_file"):
        openai_front(args, ApiOptions(api_key_file=str(keys)), "m", "localhost:1")


def test_the_gateway_is_given_the_drain_before_it_is_killed(monkeypatch):
    # Stopped while the scheduler drains, the gateway waits for the OpenAI streams the drain
    # still serves: killed 15 s after SIGTERM whatever --grace-period said, a client streaming
    # through a longer grace period got its connection cut instead of the drain's status.
    import math
    import threading
    from deltaserve import openai_gateway
    waited = []
    monkeypatch.setattr(openai_gateway, "stop_process", lambda proc, t: waited.append(t))
    child = GatewayChild.__new__(GatewayChild)
    child.proc, child._pump = object(), threading.Thread(target=lambda: None)
    child._pump.start()
    child.stop(60.0)
    child.stop(math.inf)          # --grace-period inf: never killed
    child.stop()                  # no drain (a start-up failure): the gateway's own stop
    assert waited == [60.0 + openai_gateway._STOP_SECONDS, None, openai_gateway._STOP_SECONDS]


def _model_that_must_not_reach_the_worker(tmp_path, monkeypatch) -> str:
    """A sim model dir; starting the worker fails the test (serve must refuse before it)."""
    from deltaserve import embedded
    from tests.support.sim_server import make_sim_model_dir

    def no_worker(*args, **kwargs):
        raise AssertionError("the worker was started")
    monkeypatch.setattr(embedded, "start_worker", no_worker)
    return str(make_sim_model_dir(tmp_path / "model"))


def test_an_openai_port_in_use_is_refused_before_anything_starts(tmp_path, monkeypatch,
                                                                  capsys):
    # Before, the model loaded, the worker started, and then the gateway failed to bind: its
    # Python traceback in our log and exit code 1, where a port in use is one line and 2.
    import socket
    from deltaserve import cli, openai_gateway

    monkeypatch.setattr(openai_gateway, "find_smg", lambda: "smg")
    model = _model_that_must_not_reach_the_worker(tmp_path, monkeypatch)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert cli.main(["serve", "--model", model, "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"deltaserve serve: error: could not listen on 127.0.0.1:{port} (the "
                       "OpenAI API): Address already in use"), err


@pytest.mark.skipif(find_smg() is None, reason="needs the smg gateway (the openai extra)")
def test_a_parser_name_the_gateway_refuses_is_refused_before_the_worker_starts(
        tmp_path, monkeypatch, capsys):
    # vLLM's `--tool-call-parser hermes`: smg refused it only once the model had loaded and the
    # gateway started ("invalid choice"), and serve stopped with exit code 1.
    from deltaserve import cli

    model = _model_that_must_not_reach_the_worker(tmp_path, monkeypatch)
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = str(probe.getsockname()[1])        # free once closed: check_free passes
    for flag, name, listed in (("--tool-call-parser", "hermes", " qwen,"),
                               ("--reasoning-parser", "nope", " deepseek_r1,")):
        assert cli.main(["serve", "--model", model, "--port", port, flag, name]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith(f"deltaserve serve: error: {flag}='{name}' is invalid: must "
                                  "be one of the gateway's: ") and listed in err[-1], err
    check_parsers(find_smg(), OpenAIOptions(tool_call_parser="qwen", reasoning_parser="qwen3"))


@pytest.mark.skipif(find_smg() is None, reason="needs the smg gateway (the openai extra)")
def test_https_files_that_hold_no_certificate_and_key_are_refused_before_the_worker_starts(
        tmp_path, monkeypatch, capsys):
    # Readable files with no PEM in them (or a key of another certificate): smg said "Failed to
    # create TLS config" only once the model had loaded, and serve stopped with exit code 1.
    from deltaserve import cli
    from tests.support.certs import make_ca, make_cert

    model = _model_that_must_not_reach_the_worker(tmp_path, monkeypatch)
    ca = make_ca(tmp_path, "ca")
    good = make_cert(tmp_path, ca, "server", hosts=("127.0.0.1",))
    junk = tmp_path / "junk.pem"
    junk.write_text("garbage\n")
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = str(probe.getsockname()[1])
    sealed = tmp_path / "sealed.key"          # encrypted: smg reads no such key
    subprocess.run(["openssl", "pkey", "-in", str(good.key), "-out", str(sealed), "-aes256",
                    "-passout", "pass:secret"], check=True, capture_output=True)
    for cert, key in ((junk, junk), (good.cert, junk), (good.cert, ca.key), (good.cert, sealed)):
        assert cli.main(["serve", "--model", model, "--port", port, "--ssl-certfile", str(cert),
                         "--ssl-keyfile", str(key)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith(f"deltaserve serve: error: --ssl-certfile='{cert}' is "
                                  f"invalid: must be a PEM certificate chain whose key is "
                                  f"--ssl-keyfile ('{key}'); "), err
    check_tls(OpenAIOptions(ssl_certfile=str(good.cert), ssl_keyfile=str(good.key)))


def test_a_host_name_reaches_smg_as_an_address_and_an_ipv6_url_is_bracketed():
    # vLLM's `--host localhost` (uvicorn binds a name): smg takes only an IP address, and
    # refused it once the model had loaded; --host ::1 announced http://::1:8000/v1.
    import ipaddress

    options, _ = _options("serve", "--host", "localhost")
    flags = dict(zip(*[iter(smg_command("/bin/smg", options, "h:1", "/m", 1)[2:])] * 2))
    assert ipaddress.ip_address(flags["--host"]).is_loopback, flags["--host"]
    assert options.base_url == "http://localhost:8000/v1"
    options, _ = _options("serve", "--host", "::1", "--port", "8001")
    assert options.base_url == "http://[::1]:8001/v1"
    flags = dict(zip(*[iter(smg_command("/bin/smg", options, "h:1", "/m", 1)[2:])] * 2))
    assert flags["--host"] == "::1"
    options, _ = _options("serve", "--openai-listen", "[::]:8002")
    assert options.base_url == "http://127.0.0.1:8002/v1"         # where a local client goes
