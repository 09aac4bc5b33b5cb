"""`deltaserve serve` flags refused in one line, exit status 2, before any child starts:
--kv-cache-gib inf (an OverflowError traceback before) or a bad number (argparse's "invalid
gib_to_bytes value", which named neither rule nor range), and a --worker-listen the scheduler
cannot dial (port 0 left the scheduler waiting for ever for a worker it could not reach);
a config refusal names the flag (--step-timeout), not the field (step_timeout_s)."""
from __future__ import annotations

import pytest

from deltaserve import cli

NO_MODEL = "/nonexistent/model"     # never read: the flags are refused first


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "0", "-1", "x"])
def test_a_kv_cache_gib_that_is_no_finite_positive_size_is_refused_naming_the_rule(
        value, capsys):
    with pytest.raises(SystemExit) as stopped:
        cli.main(["serve", "--model", NO_MODEL, f"--kv-cache-gib={value}"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert (f"--kv-cache-gib={value} is invalid: must be a finite number of GiB > 0"
            in err), err
    assert "Traceback" not in err


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "127.0.0.1:65536", "nonsense", ":50052",
                                    "127.0.0.1:-1"])
def test_a_worker_listen_the_scheduler_cannot_dial_is_refused_before_the_worker_starts(
        listen, capsys, monkeypatch):
    from deltaserve import embedded

    def no_worker(*args, **kwargs):
        raise AssertionError("the worker was started")
    monkeypatch.setattr(embedded, "start_worker", no_worker)
    assert cli.main(["serve", "--model", NO_MODEL, "--worker-listen", listen]) == 2
    err = capsys.readouterr().err
    assert err.startswith("deltaserve serve: error: --worker-listen=") and (
        "is invalid: must be HOST:PORT with a port in [1, 65535]" in err), err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv,message", [
    (["--tensor-parallel-size", "0"], "--local-ranks=0 is invalid: must be an integer in "
     "[1, inf] (--tensor-parallel-size, -tp: the same flag)"),
    (["--step-timeout", "-1"], "--step-timeout=-1.0 is invalid: must be a number > 0"),
    (["--max-num-seqs", "0"], "--max-num-seqs=0 is invalid: must be an integer in [1, 65536]"),
])
def test_a_config_refusal_names_the_flag_the_operator_typed_not_the_field(
        argv, message, capsys):
    """local_ranks, step_timeout_s: fields no flag is called."""
    assert cli.main(["serve", "--model", NO_MODEL, *argv]) == 2
    err = capsys.readouterr().err
    assert err == f"deltaserve serve: error: {message}\n", err


@pytest.mark.parametrize("workers", ["127.0.0.1:0", "127.0.0.1:50052,nohost"])
def test_a_scheduler_worker_address_it_cannot_dial_is_refused_not_retried_for_ever(
        workers, capsys):
    assert cli.main(["scheduler", "--model", NO_MODEL, "--workers", workers]) == 2
    err = capsys.readouterr().err
    assert err.startswith("deltaserve scheduler: error: --workers=") and (
        "must be HOST:PORT with a port in [1, 65535]" in err), err


def test_a_worker_named_twice_in_scheduler_workers_is_refused(capsys):
    """It would be Init-ed as two nodes of one tensor-parallel group."""
    workers = "127.0.0.1:50052,127.0.0.1:50053,127.0.0.1:50052"
    assert cli.main(["scheduler", "--model", NO_MODEL, "--workers", workers]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"deltaserve scheduler: error: --workers={workers!r} is invalid: "
                           "must name each worker once (127.0.0.1:50052 given more than once)")


def test_the_worker_on_the_public_ports_number_is_refused_before_it_starts(capsys, monkeypatch):
    """The worker then failed to bind, and serve exited 1 once it had started it."""
    from deltaserve import embedded

    def no_worker(*args, **kwargs):
        raise AssertionError("the worker was started")
    monkeypatch.setattr(embedded, "start_worker", no_worker)
    assert cli.main(["serve", "--model", NO_MODEL, "--listen", "127.0.0.1:50061",
                     "--worker-listen", "localhost:50061"]) == 2
    err = capsys.readouterr().err
    assert err == ("deltaserve serve: error: --worker-listen='localhost:50061' is invalid: must "
                   "be a port other than --listen's (127.0.0.1:50061)\n"), err


@pytest.mark.parametrize("flag, bound", [("--max-num-seqs", "[1, 65536]"),
                                         ("--max-num-batched-tokens", "[1, 2147483647]"),
                                         ("--max-model-len", "[2, 2147483647]")])
def test_a_batch_limit_past_its_bound_is_refused_under_its_own_name(flag, bound, capsys):
    """--max-num-seqs 1e20 was blamed on --max-num-batched-tokens ("must be >= max_num_seqs")."""
    huge = "99999999999999999999"
    assert cli.main(["serve", "--model", NO_MODEL, flag, huge]) == 2
    err = capsys.readouterr().err
    assert err == (f"deltaserve serve: error: {flag}={huge} is invalid: must be an integer in "
                   f"{bound}\n")


@pytest.mark.parametrize("argv, message", [
    (["--port", "0"], "--port=0 is invalid: must be in [1, 65535] (the gateway refuses port 0)"),
    (["--port", "99999"], "--port=99999 is invalid: must be in [1, 65535] (the gateway refuses "
     "port 0)"),
    (["--openai-listen", "127.0.0.1:0"], "--openai-listen='127.0.0.1:0' is invalid: must be "
     "HOST:PORT with a port in [1, 65535] (the gateway refuses port 0), or off"),
    (["--api-key", ""], "--api-key='' is invalid: must be a key with a character other than "
     "whitespace"),
    (["--api-key", " \t"], "--api-key=' \\t' is invalid: must be a key with a character other "
     "than whitespace"),
])
def test_an_openai_listener_the_gateway_would_refuse_is_refused_before_the_model_loads(
        argv, message, capsys):
    """smg refuses port 0 and an empty --api-key, but only once the model had loaded and the
    worker started: its Python traceback, then "the OpenAI gateway (smg) exited with code 1";
    --port 99999 was blamed on openai_listen='127.0.0.1:99999', a flag nobody typed."""
    assert cli.main(["serve", "--model", NO_MODEL, *argv]) == 2
    err = capsys.readouterr().err
    assert err == f"deltaserve serve: error: {message}\n", err


def test_the_scheduler_refuses_an_openai_port_the_gateway_would_refuse_before_the_model(capsys):
    assert cli.main(["scheduler", "--model", NO_MODEL, "--workers", "127.0.0.1:50052",
                     "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err == ("deltaserve scheduler: error: --port=0 is invalid: must be in [1, 65535] "
                   "(the gateway refuses port 0)\n"), err


def test_the_model_may_be_given_as_vllm_serve_takes_it_positionally(capsys):
    """`vllm serve MODEL`: the same line here was "unrecognized arguments: MODEL"."""
    assert cli.main(["serve", NO_MODEL]) == 2
    err = capsys.readouterr().err
    assert err == f"deltaserve serve: error: model directory '{NO_MODEL}' does not exist\n", err


def test_two_different_models_positional_and_by_flag_are_refused(capsys):
    assert cli.main(["serve", NO_MODEL, "--model", "/other/model"]) == 2
    err = capsys.readouterr().err
    assert err == (f"deltaserve serve: error: MODEL='{NO_MODEL}' is invalid: must be the "
                   "--model given as well ('/other/model'), or given once\n"), err
