"""The public port as ApiOptions configure it: TLS (mutual with --tls-client-ca), the gate
(API keys, safe decoding) and the largest request message."""
from __future__ import annotations

import grpc

from engine_common.configuration.listen_address import check_bind_port
from engine_common.security.tls import read_pem, server_credentials
from scheduler_service.api.api_options import ApiOptions
from scheduler_service.api.api_keys import KeyBook, load_api_keys
from scheduler_service.api.guard import Gate


def port_options(api: ApiOptions) -> tuple:
    """A public port's gRPC server options: a port already in use is an error, not a silent
    share (no SO_REUSEPORT); requests up to --max-request-bytes."""
    return (("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", api.max_request_bytes))


def api_keys(api: ApiOptions) -> KeyBook:
    """The keys of --api-key-file and what each may do (the open book without one)."""
    return load_api_keys(api.api_key_file) if api.api_key_file else KeyBook()


def interceptors(api: ApiOptions, keys: KeyBook) -> list[grpc.aio.ServerInterceptor]:
    return [Gate(keys, api.open_reflection)]


def bind(server: grpc.aio.Server, listen: str, api: ApiOptions) -> int:
    """Bind `listen` with TLS when a certificate is given, plaintext otherwise; the port.
    OSError when the address cannot be bound."""
    check_bind_port(listen)
    try:
        if api.tls_cert is None:
            return server.add_insecure_port(listen)
        client_ca = read_pem(api.tls_client_ca, "tls_client_ca") if api.tls_client_ca else None
        credentials = server_credentials(read_pem(api.tls_cert, "tls_cert"),
                                         read_pem(api.tls_key, "tls_key"), client_ca)
        return server.add_secure_port(listen, credentials)
    except RuntimeError as e:   # grpc reports a failed bind this way
        raise OSError(f"could not listen on {listen}: {e}") from None
