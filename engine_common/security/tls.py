"""TLS material read from PEM files, as gRPC credentials, for both services' ports.

    server_credentials(cert, key, client_ca)  a server port; with client_ca, mutual TLS: a
                                              client must present a certificate signed by it
    channel_credentials(ca, cert, key)        a client channel that verifies the server against
                                              `ca`; with cert and key it also presents its own

A server certificate must name the address clients dial (a DNS name or an IP address in its
subjectAltName): gRPC checks it like any TLS client.
"""
from __future__ import annotations

import grpc

from engine_common.request.params import ParamError

_PEM_MARK = b"-----BEGIN "


def read_pem(path: str, field: str) -> bytes:
    """The bytes of a PEM file; ParamError naming `field` when it cannot be read or holds no PEM
    block."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ParamError(field, path, f"a readable PEM file ({e.strerror})") from None
    if _PEM_MARK not in data:
        raise ParamError(field, path, "a PEM file (no '-----BEGIN' block in it)")
    return data


def server_credentials(cert: bytes, key: bytes,
                       client_ca: bytes | None = None) -> grpc.ServerCredentials:
    """TLS for a server port; with `client_ca`, clients must present a certificate it signed."""
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def channel_credentials(ca: bytes | None, cert: bytes | None = None,
                        key: bytes | None = None) -> grpc.ChannelCredentials:
    """TLS for a client channel, verifying the server against `ca` (None: the system roots)."""
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                        certificate_chain=cert)
