"""What `serve` and `scheduler` check before anything starts, so that the smg gateway (started
once the scheduler is ready, deltaserve/openai_gateway.py) does not refuse it only after the model
has loaded: what it cannot front, its parser names, the HTTPS files, the OpenAI address (free,
and given to smg as an IP address)."""
from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
import ssl
import subprocess

from engine_common.configuration.listen_address import split_listen
from engine_common.configuration.settings import Rule
from engine_common.request.params import ParamError


def check_compatible(options, api) -> None:
    """Refuse, before anything starts, what smg cannot put in front of the gRPC port."""
    if api.api_key_file:
        raise ParamError("api_key_file", api.api_key_file,
                         "unset with the OpenAI listener on: the smg gateway sends no key to a "
                         "gRPC worker; use --api-key for the OpenAI API and keep --listen on "
                         "loopback, or --openai-listen off")
    if api.tls_cert:
        raise ParamError("tls_cert", api.tls_cert,
                         "unset with the OpenAI listener on: the smg gateway cannot reach a "
                         "TLS gRPC port; use --ssl-certfile/--ssl-keyfile for HTTPS on the "
                         "OpenAI API, or --openai-listen off")


def bind_address(host: str) -> str:
    """`host` as the IP address smg binds: it takes no host name (vLLM's `--host localhost`
    was refused once the model had loaded), so a name is resolved as a listening socket's
    would be, to its first address. One that does not resolve is left as given (check_free
    refused it before anything started)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError:
        return host


def check_parsers(smg: str, options) -> None:
    """ParamError naming --tool-call-parser / --reasoning-parser when the gateway would refuse
    the name: smg said so ("invalid choice") only once the model had loaded, and `serve` then
    stopped with exit code 1 (vLLM's `hermes` is no smg name). The names are the choices in
    `smg launch --help`, so they follow the installed gateway; help that cannot be read or
    lists none skips the check (the gateway still refuses at its start)."""
    asked = [(flag, value) for flag, value in (("--tool-call-parser", options.tool_call_parser),
                                               ("--reasoning-parser", options.reasoning_parser))
             if value is not None]
    if not asked:
        return
    try:
        usage = subprocess.run([smg, "launch", "--help"], capture_output=True, text=True,
                               timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return
    for flag, value in asked:
        listed = re.search(re.escape(flag) + r" \{([^}\s]*)\}", usage)
        if listed and value not in listed.group(1).split(","):
            raise ParamError(flag, value, "one of the gateway's: "
                             + ", ".join(listed.group(1).split(",")))


def check_tls(options) -> None:
    """ParamError naming --ssl-certfile unless it and --ssl-keyfile load as a certificate
    chain and its key (smg refused them only once the model had loaded). An encrypted key is
    refused too (smg reads none), without OpenSSL's passphrase prompt on the terminal."""
    if options.ssl_certfile is None:
        return
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
            options.ssl_certfile, options.ssl_keyfile, password=b"")
    except (ssl.SSLError, OSError) as e:
        raise ParamError("--ssl-certfile", options.ssl_certfile, "a PEM certificate chain "
                         f"whose key is --ssl-keyfile ({options.ssl_keyfile!r}); {e}") from None


def check_free(listen: str) -> None:
    """OSError naming `listen` when the OpenAI address cannot be bound now. Checked before
    anything starts, as vLLM binds its socket first: the gateway found it taken only once the
    model had loaded, and ended `serve` with its Python traceback and exit code 1."""
    host, port = split_listen(listen)
    if port == 0:
        return
    try:
        family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                    flags=socket.AI_PASSIVE)[0][0]
        with socket.create_server((host, port), family=family):
            pass
    except OSError as e:
        why = os.strerror(e.errno) if e.errno else str(e)
        raise OSError(f"could not listen on {listen} (the OpenAI API): {why}") from None


class OriginList(Rule):
    """vLLM's --allowed-origins: a JSON list of origins (strings), "*" for any."""

    allowed = 'a JSON list of origins, e.g. \'["https://example.com"]\' or \'["*"]\''

    def ok(self, value) -> bool:
        return cors_origins(value) is not None


def cors_origins(value: str) -> list[str] | None:
    """The origins of an --allowed-origins value for smg's --cors-allowed-origins ("*" alone
    when it is among them: smg takes it only alone), or None when it is no JSON list of
    non-empty strings."""
    try:
        origins = json.loads(value)
    except ValueError:
        return None
    if not isinstance(origins, list) or not all(isinstance(o, str) and o for o in origins):
        return None
    return ["*"] if "*" in origins else origins
