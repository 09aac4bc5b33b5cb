"""`deltaserve serve`: the embedded default, one worker and the scheduler on this machine.

The worker runs as a child process (`deltaserve worker`, in its own session so a terminal Ctrl-C
reaches only this process, and set to get SIGTERM if this process dies); the scheduler runs in
this process. The Worker protocol is authenticated by a random token made for this run; the
worker gets its SHA-256 digest on its standard input (never on a command line, never in a
file), so the worker process holds nothing that could drive a worker. Ctrl-C or
SIGTERM drains the scheduler, then stops the worker: no orphan is left. With no --model, the
default model (SmolLM2-135M-Instruct, deltaserve/default_model.py) is fetched and converted once
into the cache directory; `--model tiny` serves a tiny model with random weights (for tests),
created once in the cache directory.
Both expose Prometheus metrics unless `--metrics-listen off`: the scheduler on --metrics-listen,
the worker on --worker-metrics-listen (default: the next port).
The OpenAI-compatible API is on by default (127.0.0.1:8000, vLLM's port; `--openai-listen off`
turns it off): the smg gateway as a third process of the group (deltaserve/openai_gateway.py),
started once the scheduler is ready; the ready line waits for it and names both APIs.
"""
from __future__ import annotations

import dataclasses
import functools
import subprocess
import sys
import tempfile
from pathlib import Path

from deltaserve.child_process import child_environment, dying_with_parent, stop_process
from deltaserve.default_model import DefaultModelError, ensure_default_model
from deltaserve.hub_cache import resolve_model_arg
from deltaserve.openai_gateway import OpenAIFront, openai_front, openai_options
from deltaserve.vllm_flags import quantization_problem
from engine_common.text.chat_template import load_chat_template
from engine_common.configuration.config import WorkerServiceOptions
from engine_common.configuration.device_defaults import device_defaults
from engine_common.configuration.listen_address import check_dial_address, next_port
from engine_common.model_files.model_dir import ModelInfo
from engine_common.request.params import ParamError
from engine_common.request.pooling import model_pooler_config
from engine_common.runtime.paths import cache_dir
from engine_common.configuration.settings import from_args, to_flags
from engine_common.security.worker_auth import WorkerAuth, new_token, token_digest_text
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


def start_worker(listen: str, options: WorkerServiceOptions, token: str) -> subprocess.Popen:
    """`deltaserve worker` as a child process that reads `token`'s digest from its standard
    input (the worker checks the token without holding it)."""
    # -P: `-m` would put the working directory first on sys.path, where any local user may
    # have left a json.py that then runs in the worker (Python 3.11+; 3.10 has no -P)
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    cmd = [sys.executable, *safe_path, "-m", "deltaserve.cli", "worker", "--listen", listen,
           "--worker-token-file", "-", *to_flags(options)]
    proc = subprocess.Popen(dying_with_parent(cmd), start_new_session=True,
                            stdin=subprocess.PIPE, text=True, env=child_environment())
    proc.stdin.write(token_digest_text(token) + "\n")
    proc.stdin.close()
    return proc


def stop_worker(proc: subprocess.Popen) -> None:
    stop_process(proc, _WORKER_STOP_SECONDS)


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


def _command(name: str) -> str:
    """A command installed beside this Python (the venv's bin/), so it runs as printed."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else name


def _examples(target: str, chat: bool, api, model_name: str, openai_url: str | None,
              openai_key: bool) -> str:
    """Commands to try: a chat when the model has a chat template, else raw text; with TLS and
    API keys when the public port has them; a curl of the OpenAI API when it is on."""
    tls = "-cacert CA.pem" if api.tls_cert else "-plaintext"
    key = " -H 'authorization: Bearer KEY'" if api.api_key_file else ""
    client = (" --cacert CA.pem" if api.tls_cert else "") + (
        " --api-key-file KEYFILE" if api.api_key_file else "")
    question = "What is the capital of France?"
    if chat:
        body = (f'{{"messages": [{{"role": "user", "content": "{question}"}}], '
                '"stopping": {"max_tokens": 32}}')
        first = f'{_command("deltaserve")} chat --target {target}{client} "{question}"'
    else:
        body = '{"text": "Once upon a time", "stopping": {"max_tokens": 32}}'
        first = (f'{_command("deltaserve")} generate --target {target}{client} '
                 '"Once upon a time"')
    lines = [first]
    if openai_url is not None:
        auth = " -H 'authorization: Bearer KEY'" if openai_key else ""
        curl_tls = " -k" if openai_url.startswith("https") else ""
        if chat:
            request = (f'{{"model": "{model_name}", "max_tokens": 32, "messages": '
                       f'[{{"role": "user", "content": "{question}"}}]}}')
            lines.append(f"curl{curl_tls} {openai_url}/chat/completions{auth} "
                         f"-H 'content-type: application/json' -d '{request}'")
        else:
            request = f'{{"model": "{model_name}", "max_tokens": 32, "prompt": "Once upon a time"}}'
            lines.append(f"curl{curl_tls} {openai_url}/completions{auth} "
                         f"-H 'content-type: application/json' -d '{request}'")
    lines.append(f"{_command('grpcurl')} {tls}{key} -d '{body}' {target} "
                 "deltaserve.v1.Generation/Generate")
    return "".join(f"  {line}\n" for line in lines)


def _pooling_examples(target: str, api, model_name: str, openai_url: str | None,
                      openai_key: bool, classify: bool) -> str:
    """Commands to try on a --runner pooling server: Embed and /v1/embeddings, or for a
    classification model Classify, Score and /v1/classify (docs/scoring.md)."""
    tls = "-cacert CA.pem" if api.tls_cert else "-plaintext"
    key = " -H 'authorization: Bearer KEY'" if api.api_key_file else ""
    text = "what is a KV cache?"
    calls = ([("Classify", f'{{"input": ["{text}"]}}'),
              ("Score", f'{{"text_1": ["{text}"], "text_2": ["keys and values", "a fox"]}}')]
             if classify else [("Embed", f'{{"text": "{text}"}}')])
    lines = [f"{_command('grpcurl')} {tls}{key} -d '{body}' {target} "
             f"deltaserve.v1.Generation/{rpc}" for rpc, body in calls]
    if openai_url is not None:
        auth = " -H 'authorization: Bearer KEY'" if openai_key else ""
        curl_tls = " -k" if openai_url.startswith("https") else ""
        request = f'{{"model": "{model_name}", "input": "{text}"}}'
        lines.append(f"curl{curl_tls} {openai_url}/{'classify' if classify else 'embeddings'}"
                     f"{auth} -H 'content-type: application/json' -d '{request}'")
    return "".join(f"  {line}\n" for line in lines)


def _announce(listen: str, model_dir: str, settings, front: OpenAIFront | None):
    server, api = settings.server, settings.api
    chat = load_chat_template(model_dir, server.chat_template) is not None
    model_name = server.served_model_name or ModelInfo.from_dir(model_dir).name

    def ready_line(target: str, openai_url: str | None) -> None:
        where = f", OpenAI API on {openai_url}" if openai_url else ""
        key = bool(front and front.options.api_key)
        examples = (_examples(target, chat, api, model_name, openai_url, key)
                    if server.runner != "pooling" else _pooling_examples(
                        target, api, model_name, openai_url, key,
                        model_pooler_config(model_dir).classify))
        print(f"DeltaServe ready on {target}{where} (model {model_dir})\n"
              f"Try:\n{examples}"
              f"Ctrl-C stops the server and its worker.", flush=True)

    def on_ready(app) -> None:
        target = f"{listen.rsplit(':', 1)[0]}:{app.port}"
        if front is None:
            ready_line(target, None)
        else:
            front.on_ready(app, lambda url: ready_line(target, url))
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
    check_dial_address("--worker-listen", args.worker_listen)   # before anything starts
    openai_options(args)            # its flags too: smg refused a bad one after the model loaded
    if args.worker_listen.rpartition(":")[2] == args.listen.rpartition(":")[2]:
        # Both on this machine: the worker failed to bind and serve exited 1 after its start.
        raise ParamError("--worker-listen", args.worker_listen,
                         f"a port other than --listen's ({args.listen})")
    model_dir = resolve_model(resolve_model_arg(args))
    worker_options = from_args(WorkerServiceOptions, args)
    if worker_options.local_ranks > 1:    # refused here, in one line, before anything starts
        check_tp_size(ModelInfo.from_dir(model_dir).hf_config, worker_options.local_ranks,
                      "--local-ranks")
    for name, value in device_defaults(_worker_device(worker_options.device)).items():
        if not hasattr(args, name):        # flags the user left unset
            setattr(args, name, value)
    settings = engine_settings(args, model_dir)
    # --max-model-len past the model's: refused here, before a worker starts and loads it
    info = ModelInfo.from_dir(model_dir, settings.worker.max_model_len)
    problem = quantization_problem(args, info.hf_config, model_dir)
    if problem is not None:             # vLLM's -q: a method the checkpoint is not in
        raise ParamError("--quantization", args.vllm_quantization, problem)
    front = openai_front(args, settings.api, model_dir, args.listen,
                         settings.server.chat_template)
    on_ready = _announce(args.listen, model_dir, settings, front)
    worker_metrics = args.worker_metrics_listen or next_port(args.metrics_listen)
    token = new_token()
    worker = start_worker(args.worker_listen,
                          dataclasses.replace(worker_options, metrics_listen=worker_metrics),
                          token)

    def worker_gone() -> str | None:
        code = worker.poll()
        if code is not None:
            return f"the worker exited with code {code}"
        return front.gone() if front else None

    try:
        return run_scheduler([args.worker_listen], args.listen, settings.worker,
                             settings.policy, settings.server,
                             on_ready=on_ready,
                             should_stop=worker_gone, exit_on_refusal=True, api=settings.api,
                             worker_auth=WorkerAuth(token=token),
                             on_drain=(None if front is None else functools.partial(
                                 front.stop, settings.server.grace_period_s)))
    finally:
        if front is not None:
            front.stop()
        stop_worker(worker)
