"""`deltaserve serve`: the embedded default, one worker and the scheduler on this machine.

The worker runs as a child process (`deltaserve worker`, in its own session so a terminal Ctrl-C
reaches only this process, and set to get SIGTERM if this process dies); the scheduler runs in
this process. The Worker protocol is authenticated by a random token made for this run and handed
to the worker on its standard input (never on a command line, never in a file). Ctrl-C or
SIGTERM drains the scheduler, then stops the worker: no orphan is left. With no --model, the
default model (SmolLM2-135M-Instruct, deltaserve/default_model.py) is fetched and converted once
into the cache directory; `--model tiny` serves a tiny model with random weights (for tests),
created once in the cache directory.
Both expose Prometheus metrics unless `--metrics-listen off`: the scheduler on --metrics-listen,
the worker on --worker-metrics-listen (default: the next port).
"""
from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from deltaserve.default_model import DefaultModelError, ensure_default_model
from deltaserve.paths import cache_dir
from engine_common.chat_template import load_chat_template
from engine_common.config import WorkerServiceOptions
from engine_common.device_defaults import device_defaults
from engine_common.listen_address import next_port
from engine_common.model_dir import ModelInfo
from engine_common.settings import from_args, to_flags
from engine_common.worker_auth import WorkerAuth, new_token
from scheduler_service.api.engine_flags import engine_settings
from scheduler_service.api.server import run_scheduler
from worker_service.models.tp_sizes import check_tp_size

TINY_MODEL_NAME = "tiny-qwen3"
TINY_MODEL_ARG = "tiny"         # --model tiny (a path named "tiny" is written ./tiny)
_WORKER_STOP_SECONDS = 10.0


def tiny_model_dir() -> Path:
    """The cached tiny model, created on first use (atomically: built aside, then renamed)."""
    target = cache_dir() / TINY_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    from worker_service.models.tiny_model import make_tiny_model

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{TINY_MODEL_NAME}-", dir=target.parent))
    make_tiny_model(staging, arch="qwen3", seed=0)
    try:
        staging.rename(target)
    except OSError:  # another process got there first
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return target


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux; elsewhere a no-op)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def start_worker(listen: str, options: WorkerServiceOptions, token: str) -> subprocess.Popen:
    """`deltaserve worker` as a child process that reads `token` from its standard input."""
    cmd = [sys.executable, "-m", "deltaserve.cli", "worker", "--listen", listen,
           "--worker-token-file", "-", *to_flags(options)]
    proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_parent,
                            stdin=subprocess.PIPE, text=True)
    proc.stdin.write(token + "\n")
    proc.stdin.close()
    return proc


def stop_worker(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not exited within a few seconds."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(_WORKER_STOP_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def resolve_model(model: str | None) -> str:
    """--model as a path: None -> the default model (fetched and converted on first use),
    "tiny" -> the tiny random test model, anything else as given."""
    if model is None:
        try:
            return str(ensure_default_model())
        except DefaultModelError as e:
            raise OSError(f"the default model is not available: {e}") from None
    if model == TINY_MODEL_ARG:
        path = str(tiny_model_dir())
        print(f"--model tiny: serving the tiny test model in {path}.\n"
              "Its weights are RANDOM: it produces gibberish.", flush=True)
        return path
    return model


def _examples(target: str, chat: bool, api) -> str:
    """Commands to try: a chat when the model has a chat template, else raw text; with TLS and
    API keys when the public port has them."""
    tls = "-cacert CA.pem" if api.tls_cert else "-plaintext"
    key = " -H 'authorization: Bearer KEY'" if api.api_key_file else ""
    client = (" --cacert CA.pem" if api.tls_cert else "") + (
        " --api-key-file KEYFILE" if api.api_key_file else "")
    if chat:
        question = "What is the capital of France?"
        body = (f'{{"messages": [{{"role": "user", "content": "{question}"}}], '
                '"stopping": {"max_tokens": 32}}')
        first = f'deltaserve chat --target {target}{client} "{question}"'
    else:
        body = '{"text": "Once upon a time", "stopping": {"max_tokens": 32}}'
        first = f'deltaserve generate --target {target}{client} "Once upon a time"'
    return (f"  {first}\n"
            f"  grpcurl {tls}{key} -d '{body}' {target} deltaserve.v1.Generation/Generate\n")


def _announce(listen: str, model_dir: str, api):
    chat = load_chat_template(model_dir) is not None

    def on_ready(app) -> None:
        host = listen.rsplit(":", 1)[0]
        target = f"{host}:{app.port}"
        print(f"DeltaServe ready on {target} (model {model_dir})\n"
              f"Try:\n{_examples(target, chat, api)}"
              f"Ctrl-C stops the server and its worker.", flush=True)
    return on_ready


def _worker_device(device: str) -> str:
    """The worker's device kind, without importing torch here (this process hosts the
    scheduler): for "auto", an NVIDIA device node stands for torch finding a GPU."""
    if device == "auto":
        return "cuda" if Path("/dev/nvidiactl").exists() else "cpu"
    return device


def serve(args) -> int:
    """Run until Ctrl-C / SIGTERM, until the worker exits on its own (exit code 1), or until the
    worker refuses the settings at start-up (exit code 2: one machine, one user's flags, so
    retrying cannot help)."""
    model_dir = resolve_model(args.model)
    worker_options = from_args(WorkerServiceOptions, args)
    if worker_options.local_ranks > 1:    # refused here, in one line, before anything starts
        check_tp_size(ModelInfo.from_dir(model_dir).hf_config, worker_options.local_ranks,
                      "--local-ranks")
    for name, value in device_defaults(_worker_device(worker_options.device)).items():
        if not hasattr(args, name):        # flags the user left unset
            setattr(args, name, value)
    settings = engine_settings(args, model_dir)
    on_ready = _announce(args.listen, model_dir, settings.api)
    worker_metrics = args.worker_metrics_listen or next_port(args.metrics_listen)
    token = new_token()
    worker = start_worker(args.worker_listen,
                          dataclasses.replace(worker_options, metrics_listen=worker_metrics),
                          token)

    def worker_gone() -> str | None:
        code = worker.poll()
        return None if code is None else f"the worker exited with code {code}"

    try:
        return run_scheduler([args.worker_listen], args.listen, settings.worker,
                             settings.policy, settings.server,
                             on_ready=on_ready,
                             should_stop=worker_gone, exit_on_refusal=True, api=settings.api,
                             worker_auth=WorkerAuth(token=token))
    finally:
        stop_worker(worker)
