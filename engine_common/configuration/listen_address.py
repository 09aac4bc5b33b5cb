"""HOST:PORT settings of the optional endpoints (--metrics-listen): the rule and small helpers.

A value is HOST:PORT (port 0: any free port; an IPv6 host may be bracketed) or "off".
"""
from __future__ import annotations

from engine_common.configuration.settings import Rule
from engine_common.request.params import ParamError

OFF = "off"


class ListenAddress(Rule):
    """HOST:PORT with PORT in [0, 65535], or "off"."""

    allowed = "HOST:PORT (port in [0, 65535]) or off"

    def ok(self, value) -> bool:
        if value == OFF:
            return True
        host, sep, port = str(value).rpartition(":")
        return bool(sep and host) and port.isdigit() and int(port) <= 65535


def check_dial_address(flag: str, address: str) -> None:
    """ParamError unless `address` is HOST:PORT with a port another process can dial (1-65535):
    the scheduler dials --workers and serve's --worker-listen, where port 0 or a missing port
    only showed as a worker that never answered, retried for ever."""
    host, sep, port = address.rpartition(":")
    if not (sep and host and port.isdigit() and 1 <= int(port) <= 65535):
        raise ParamError(flag, address, "HOST:PORT with a port in [1, 65535] (the scheduler "
                         "dials it, so not port 0)")


def check_bind_port(address: str) -> None:
    """OSError when `address` names a port past 65535: gRPC binds such a port modulo 65536
    (127.0.0.1:99999 served on 34463) instead of refusing it."""
    port = address.rpartition(":")[2]
    if port.isdigit() and int(port) > 65535:
        raise OSError(f"could not listen on {address}: the port must be in [0, 65535]")


def split_listen(listen: str) -> tuple[str, int]:
    """(host, port) of a HOST:PORT."""
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


def next_port(listen: str) -> str:
    """The address one port above `listen`; port 0 stays 0 (any free port), "off" stays off."""
    if listen == OFF:
        return OFF
    port = split_listen(listen)[1]
    return f"{listen.rpartition(':')[0]}:{port + 1 if port else 0}"
