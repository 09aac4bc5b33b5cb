"""The OpenAI-compatible HTTP API of `deltaserve serve` and `deltaserve scheduler`: the Shepherd
Model Gateway (`smg`, PyPI, the `openai` extra) run as a supervised child process in front of
this scheduler's gRPC port (the VllmEngine protocol, grpc://).

    client --HTTP /v1/*--> smg (child) --gRPC VllmEngine--> scheduler (this process) --> worker

The child starts once the scheduler is ready (the gateway registers a worker only after its gRPC
health check passes, and retries a failed one only 30 s later). It runs in its own session, so a
terminal Ctrl-C reaches only us; we stop it (SIGTERM, then SIGKILL) when we stop, and it gets
SIGTERM if we die. Its output is folded into our stderr, each line prefixed `[smg] `. When it
exits on its own, `gone()` says so and the whole group stops (exit code 1).

What is carried to smg and what is not (smg 1.13.0, checked):
  * --api-key KEY [KEY ...]: smg's --api-key (and --tenant-api-key for the others:
    deltaserve/vllm_lists.py); every /v1 request must send `Authorization: Bearer KEY`. smg's
    arguments go to it on its stdin, not its command line (smg_argv.py).
  * --served-model-name NAME [ALIAS ...]: each alias is smg's --model-alias ALIAS=NAME.
    smg sends no key to a gRPC worker, so a gRPC port guarded by --api-key-file cannot sit
    behind it: the default listener then stays off, an asked-for one is refused (use --api-key
    and keep --listen on loopback).
  * --ssl-certfile/--ssl-keyfile: HTTPS on the OpenAI listener (smg --tls-cert-path/-key-path).
    smg could not connect to a TLS gRPC worker (grpcs://: "transport error"), so --tls-cert on
    the gRPC port keeps the default listener off, and an asked-for one is refused.
  * --tool-call-parser, --reasoning-parser, --chat-template: passed through (a parser name the
    installed smg does not list is refused first: check_parsers).
"""
from __future__ import annotations

import argparse
import math
import re
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from deltaserve.child_process import child_environment, dying_with_parent, stop_process
from deltaserve.smg_argv import private_launch
from deltaserve.vllm_lists import (add_list_flags, check_adapter_names, checked_aliases,
                                   checked_keys, given_keys, smg_alias_flags, smg_key_flags)
from deltaserve.gateway_checks import (OriginList, bind_address, check_compatible, check_free,
                                       check_parsers, check_tls, cors_origins)
from engine_common.configuration.listen_address import OFF, ListenAddress, split_listen
from engine_common.request.params import ParamError
from engine_common.configuration.settings import (ReadableFile, add_flags, from_args,
                                                  setting, validate)

DEFAULT_OPENAI_PORT = 8000          # vllm serve's
SMG_INSTALL = "pip install 'deltaserve[openai]'"
_STOP_SECONDS = 15.0                # smg keeps its listener open 5 s after SIGTERM (drain)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ANY_HOST = ("0.0.0.0", "::", "")
_PORTS = "in [1, 65535] (the gateway refuses port 0)"


class GatewayListen(ListenAddress):
    """HOST:PORT with PORT in [1, 65535], or "off": smg refuses port 0 (any free port)."""

    allowed = "HOST:PORT with a port in [1, 65535] (the gateway refuses port 0), or off"

    def ok(self, value) -> bool:
        return super().ok(value) and (value == OFF or split_listen(value)[1] > 0)


@dataclass(frozen=True, kw_only=True)
class OpenAIOptions:
    """The OpenAI listener (the smg child) and what it is told."""

    openai_listen: str | None = setting(
        None, "HOST:PORT of the OpenAI-compatible HTTP API, or off (its flag: "
        "add_openai_flags, whose default depends on the command)", rule=GatewayListen(),
        cli=False)
    api_keys: tuple[str, ...] = setting(
        (), "the keys OpenAI clients may send as `Authorization: Bearer KEY` (--api-key)",
        cli=False)
    served_model_name: str | None = setting(
        None, "the model's name, which the aliases stand for (--served-model-name)", cli=False)
    model_aliases: tuple[str, ...] = setting(
        (), "more names the OpenAI API serves the model under (--served-model-name)", cli=False)
    ssl_certfile: str | None = setting(
        None, "PEM certificate chain: serve the OpenAI API over HTTPS (with --ssl-keyfile)",
        rule=ReadableFile(), metavar="FILE")
    ssl_keyfile: str | None = setting(None, "PEM private key of --ssl-certfile",
                                      rule=ReadableFile(), metavar="FILE")
    tool_call_parser: str | None = setting(
        None, "how the gateway finds tool calls in the output (smg --tool-call-parser: qwen, "
        "llama, mistral, json, pythonic, ...; unset: the gateway's choice for the model)",
        metavar="NAME")
    reasoning_parser: str | None = setting(
        None, "how the gateway splits reasoning from the answer (smg --reasoning-parser: "
        "qwen3, deepseek_r1, ...; unset: none)", metavar="NAME")
    allowed_origins: str | None = setting(
        None, "origins a browser page may call the OpenAI API from, as vLLM's JSON list "
        "(smg --cors-allowed-origins); unset: none, as in vLLM", rule=OriginList(),
        metavar="JSON")

    def __post_init__(self):
        validate(self)
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            missing = "ssl_keyfile" if self.ssl_keyfile is None else "ssl_certfile"
            raise ParamError(missing, None, "set together with --ssl-certfile/--ssl-keyfile")

    @property
    def api_key(self) -> str | None:
        """The first key (the one the gateway's own checks send), or None."""
        return self.api_keys[0] if self.api_keys else None

    @property
    def enabled(self) -> bool:
        return self.openai_listen not in (None, OFF)

    @property
    def base_url(self) -> str:
        host, port = split_listen(self.openai_listen)
        host = "127.0.0.1" if host in _ANY_HOST else host
        host = f"[{host}]" if ":" in host else host         # an IPv6 address in a URL
        scheme = "https" if self.ssl_certfile else "http"
        return f"{scheme}://{host}:{port}/v1"


def add_openai_flags(parser, default_listen: str | None) -> None:
    """The OpenAI listener's flags, and vLLM's --host/--port for its address (on by default
    where `default_listen` is given: `serve`)."""
    group = parser.add_argument_group(
        "OpenAI-compatible API (the smg gateway; vLLM's --host/--port)")
    shown = default_listen or "off"
    group.add_argument("--openai-listen", dest="openai_listen", default=argparse.SUPPRESS,
                       metavar="HOST:PORT",
                       help="HOST:PORT of the OpenAI-compatible HTTP API (/v1/chat/completions, "
                       "/v1/completions, /v1/models; the smg gateway as a child process), or "
                       f"off (default: {shown})")
    group.add_argument("--host", default=None,
                       help="host of the OpenAI API (default: "
                       f"{split_listen(default_listen)[0] if default_listen else '127.0.0.1'})")
    group.add_argument("--port", type=int, default=None,
                       help=f"port of the OpenAI API (default: {DEFAULT_OPENAI_PORT})")
    add_list_flags(group)
    add_flags(group, OpenAIOptions, skip=("openai_listen",))
    parser.set_defaults(openai_default_listen=default_listen)


def openai_options(args, environ=None) -> tuple[OpenAIOptions, bool]:
    """(the options, whether the user asked for the listener). --host/--port override the
    default address; with --openai-listen as well they are refused. Each refusal names the flag
    typed; `serve` and `scheduler` call this before the model is read, as smg would refuse a
    port 0 or an empty key only once the model had loaded."""
    asked = hasattr(args, "openai_listen") or args.host is not None or args.port is not None
    listen = getattr(args, "openai_listen", None)
    if args.port is not None and not 1 <= args.port <= 65535:
        raise ParamError("--port", args.port, _PORTS)
    if listen is not None and not GatewayListen().ok(listen):
        raise ParamError("--openai-listen", listen, GatewayListen.allowed)
    keys = checked_keys(given_keys(args, environ))
    name = getattr(args, "served_model_name", None)
    aliases = checked_aliases(name, getattr(args, "model_aliases", ()))
    check_adapter_names(name, aliases, getattr(args, "lora_engine_listen", None))
    if args.host is not None or args.port is not None:
        if listen is not None:
            # the flag the user gave (--port alone was refused as "host=None")
            flag, value = ("--host", args.host) if args.host is not None else ("--port", args.port)
            raise ParamError(flag, value, "unset with --openai-listen (one address)")
        base = args.openai_default_listen or f"127.0.0.1:{DEFAULT_OPENAI_PORT}"
        host, port = split_listen(base)
        listen = f"{args.host or host}:{args.port if args.port is not None else port}"
    if listen is None:
        listen = args.openai_default_listen
    options = from_args(OpenAIOptions, args, openai_listen=listen, api_keys=keys,
                        served_model_name=name, model_aliases=aliases)
    if not options.enabled:
        no_aliases(options)
    return options, asked


def no_aliases(options: OpenAIOptions) -> None:
    """ParamError when --served-model-name names aliases that no gateway would serve."""
    if options.model_aliases:
        raise ParamError("--served-model-name", [options.served_model_name,
                                                 *options.model_aliases],
                         "one name without the OpenAI API: its aliases are the gateway's")


def find_smg() -> str | None:
    """The `smg` command beside this Python, else on PATH."""
    beside = Path(sys.executable).parent / "smg"
    return str(beside) if beside.exists() else shutil.which("smg")


def smg_command(smg: str, options: OpenAIOptions, grpc_target: str, model: str,
                metrics_port: int, chat_template: str | None = None,
                adapter_targets: tuple[str, ...] = ()) -> list[str]:
    """`smg launch` in front of `grpc_target` (HOST:PORT) and the LoRA adapters' own ports
    (`adapter_targets`, --lora-engine-listen: one more worker each). `model`: a directory the
    gateway reads the tokenizer from, or a path that does not exist (it asks us, GetTokenizer)."""
    host, port = split_listen(options.openai_listen)
    urls = [f"grpc://{t}" for t in (grpc_target, *adapter_targets)]
    cmd = [smg, "launch", "--host", bind_address(host), "--port", str(port),
           "--worker-urls", *urls, "--model-path", model,
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
           "--log-level", "info"]
    cmd += smg_key_flags(options.api_keys)
    cmd += smg_alias_flags(options.served_model_name, options.model_aliases)
    optional = (("--tls-cert-path", options.ssl_certfile),
                ("--tls-key-path", options.ssl_keyfile),
                ("--tool-call-parser", options.tool_call_parser),
                ("--reasoning-parser", options.reasoning_parser),
                ("--chat-template", chat_template))
    for flag, value in optional:
        if value is not None:
            cmd += [flag, value]
    if options.allowed_origins is not None and cors_origins(options.allowed_origins):
        cmd += ["--cors-allowed-origins", *cors_origins(options.allowed_origins)]
    return cmd


def grpc_target_of(listen: str, port: int) -> str:
    """Where a local gateway reaches a scheduler bound to `listen` (on `port`)."""
    host = split_listen(listen)[0]
    host = "127.0.0.1" if host in _ANY_HOST else host
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def gateway_model_path(model_dir: str) -> str:
    """The model directory for smg's --model-path; for a GGUF file a path that does not exist,
    so the gateway takes the tokenizer from us (GetTokenizer)."""
    path = Path(model_dir).resolve()
    return str(path) if path.is_dir() else str(path) + ".tokenizer-from-worker"


def free_local_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GatewayChild:
    """One `smg launch` child: started, watched, its output folded into ours, stopped.
    `stdin_data`: written to its standard input, which is then closed (smg_argv.py)."""

    def __init__(self, cmd: list[str], out=None, stdin_data: bytes | None = None):
        self.out = out or sys.stderr
        self.proc = subprocess.Popen(
            dying_with_parent(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL if stdin_data is None else subprocess.PIPE,
            start_new_session=True, env=child_environment())
        if stdin_data is not None:    # off the caller's thread: it is the event loop, and a
            # list longer than a pipe holds waits there for the child to read it
            threading.Thread(target=self._feed, args=(stdin_data,), name="smg-argv",
                             daemon=True).start()
        self._pump = threading.Thread(target=self._fold, name="smg-output", daemon=True)
        self._pump.start()

    def _feed(self, data: bytes) -> None:
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.close()
        except (BrokenPipeError, ValueError):    # it died at once (gone() says so), or stopped
            pass

    def _fold(self) -> None:
        color = getattr(self.out, "isatty", lambda: False)()
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace")
            self.out.write("[smg] " + (line if color else _ANSI.sub("", line)))
            self.out.flush()

    def gone(self) -> str | None:
        """Why the gateway is no longer running, or None while it runs."""
        code = self.proc.poll()
        return None if code is None else f"the OpenAI gateway (smg) exited with code {code}"

    def wait_ready(self, base_url: str, api_key: str | None, timeout: float) -> bool:
        """Poll the gateway's /readiness (workers healthy, tokenizer loaded) until it answers
        200, the child exits or `timeout` passes."""
        url = base_url.rsplit("/v1", 1)[0] + "/readiness"
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        context = ssl._create_unverified_context()    # our own child, on our own certificate
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.gone() is None:
            try:
                with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                            timeout=5, context=context) as reply:
                    if reply.status == 200:
                        return True
            except OSError:
                pass
            time.sleep(0.5)
        return False

    def stop(self, grace_s: float = 0.0) -> None:
        """SIGTERM, then SIGKILL when it has not exited within `grace_s` (the scheduler's drain,
        which ends its open streams) and _STOP_SECONDS more; never with an infinite grace."""
        total = grace_s + _STOP_SECONDS
        stop_process(self.proc, total if math.isfinite(total) else None)
        self._pump.join(timeout=5)


class OpenAIFront:
    """The gateway in front of one scheduler: started by `on_ready` once the scheduler is
    ready; `announce(url)` runs once the gateway is ready too."""

    def __init__(self, options: OpenAIOptions, smg: str, model_dir: str, listen: str,
                 chat_template: str | None = None, ready_timeout: float = 300.0):
        self.options = options
        self.smg = smg
        self.model_dir = model_dir
        self.listen = listen
        self.chat_template = chat_template
        self.ready_timeout = ready_timeout
        self.child: GatewayChild | None = None

    def on_ready(self, app, announce) -> None:
        """Start the child (called on the scheduler's event loop: nothing here blocks)."""
        cmd = smg_command(self.smg, self.options, grpc_target_of(self.listen, app.port),
                          gateway_model_path(self.model_dir), free_local_port(),
                          self.chat_template, tuple(grpc_target_of(p.address, p.port)
                                                    for p in app.adapter_ports))
        launch, argv = private_launch(cmd)
        if argv is None and self.options.api_keys:
            print(f"deltaserve: {self.smg} is not smg's Python console script: its API keys "
                  "are on its command line, which every local user can read",
                  file=sys.stderr, flush=True)
        self.child = GatewayChild(launch, stdin_data=argv)
        threading.Thread(target=self._announce_when_ready, args=(announce,),
                         name="smg-ready", daemon=True).start()

    def _announce_when_ready(self, announce) -> None:
        url = self.options.base_url
        if self.child.wait_ready(url, self.options.api_key, self.ready_timeout):
            announce(url)
        elif self.child.gone() is None:
            print(f"deltaserve: the OpenAI gateway is not ready after {self.ready_timeout:.0f} s "
                  "(its log lines start with [smg])", file=sys.stderr, flush=True)

    def gone(self) -> str | None:
        return self.child.gone() if self.child else None

    def stop(self, grace_s: float = 0.0) -> None:
        """Stop the gateway, allowing it `grace_s` for the streams the scheduler still drains."""
        if self.child is not None:
            self.child.stop(grace_s)


def openai_front(args, api, model_dir: str, listen: str,
                 chat_template: str | None = None) -> OpenAIFront | None:
    """The OpenAI front the flags ask for, or None (off; or on by default but smg is not
    installed, or it cannot front the gRPC port's keys or TLS: then a note says why).
    ParamError for what was asked for and cannot work."""
    options, asked = openai_options(args)
    front = _front(options, asked, api, model_dir, listen, chat_template)
    if front is None:
        no_aliases(options)
    return front


def _front(options: OpenAIOptions, asked: bool, api, model_dir: str, listen: str,
           chat_template: str | None) -> OpenAIFront | None:
    if not options.enabled:
        return None
    smg = find_smg()
    if smg is None:
        if asked:
            raise ParamError("openai_listen", options.openai_listen,
                             f"off: the smg gateway is not installed ({SMG_INSTALL})")
        print(f"deltaserve: the OpenAI API is off: the smg gateway is not installed "
              f"({SMG_INSTALL}); --openai-listen off silences this", flush=True)
        return None
    try:
        check_compatible(options, api)
    except ParamError as e:
        if asked:
            raise
        print(f"deltaserve: the OpenAI API is off: {e}", flush=True)
        return None
    check_parsers(smg, options)
    check_tls(options)
    check_free(options.openai_listen)
    return OpenAIFront(options, smg, model_dir, listen, chat_template)
