"""The public API's guards, declared once (engine_common/configuration/settings.py): TLS, API keys, and the
limits that keep one request from slowing the server down for everyone. Flags of `deltaserve
scheduler` and `deltaserve serve`; everything is off or generous by default, so the quick start
(plaintext on localhost, no key) works unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine_common.request.diff_limits import MAX_CONSTRAINT_CHARS, MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS
from engine_common.request.pair_prompts import DEFAULT_MAX_SCORE_TOKENS
from engine_common.request.params import ParamError
from engine_common.configuration.settings import (AtLeast, AtLeastZero, ReadableFile, setting,
                                                  validate)
from scheduler_service.api.stream_sends import DEFAULT_SEND_TIMEOUT_S

MIB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class ApiOptions:
    """TLS and API keys of the public port, and the per-request limits."""

    tls_cert: str | None = setting(
        None, "PEM certificate chain of the public API: serve TLS (with --tls-key)",
        rule=ReadableFile(), metavar="FILE")
    tls_key: str | None = setting(None, "PEM private key of --tls-cert", rule=ReadableFile(),
                                  metavar="FILE")
    tls_client_ca: str | None = setting(
        None, "PEM CA certificate: clients must present a certificate it signed (mutual TLS; "
        "needs --tls-cert)", rule=ReadableFile(), metavar="FILE")
    api_key_file: str | None = setting(
        None, "file of API keys, one per line, each with optional attributes `admin`, "
        "`salt=NAME`, `priority=LO..HI` (docs/security.md): every call but grpc.health.v1's "
        "Check (and reflection with --open-reflection) must carry `authorization: Bearer "
        "<key>`; Abort ends only requests made with the same key; each key's prefix cache is "
        "its own unless keys share a salt; KV events and FlushCache need an admin key",
        rule=ReadableFile(), metavar="FILE")
    open_reflection: bool = setting(
        False, "serve server reflection without an API key (with --api-key-file)")
    max_stop_strings: int = setting(64, "stop strings in one request", rule=AtLeast(0))
    max_stop_chars: int = setting(4096, "characters of one request's stop strings together",
                                  rule=AtLeast(0))
    max_stop_token_ids: int = setting(256, "stop token ids in one request",
                                      rule=AtLeast(0, MAX_STOP_TOKEN_IDS))
    max_prompt_chars: int = setting(
        4 << 20, "characters of a text prompt or a chat's messages (Generate, Tokenize), "
        "checked before rendering and tokenizing",
        rule=AtLeast(1))
    max_constraint_chars: int = setting(
        65536, "characters of a structured-output constraint (its schema, regex or grammar, or "
        "its choices together), checked before the grammar engine sees it",
        rule=AtLeast(1, MAX_CONSTRAINT_CHARS))
    max_logprobs: int = setting(20, "top alternatives a request may ask for per token",
                                rule=AtLeast(0, MAX_TOP_LOGPROBS))
    max_request_mib: int = setting(8, "largest request message in MiB (RESOURCE_EXHAUSTED "
                                   "beyond)", rule=AtLeast(1, 2047))
    max_requests_per_key: int | None = setting(
        None, "requests one API key may have queued or running at once (without keys: the whole "
        "port); more get RESOURCE_EXHAUSTED, so no tenant fills the waiting queue for the "
        "others. Unset: no bound", rule=AtLeast(1))
    max_score_tokens: int = setting(
        DEFAULT_MAX_SCORE_TOKENS, "tokens of one Score call's pairs (each pair's special "
        "tokens included) or one Classify call's texts together, counted as they are "
        "tokenized: more is INVALID_ARGUMENT naming text_2 (or input)", rule=AtLeast(1))
    stream_send_timeout_s: float = setting(
        DEFAULT_SEND_TIMEOUT_S, "seconds a Generate stream's client may read none of its output "
        "while it waits (each message's write; nginx's send_timeout): then the request is "
        "aborted, its KV blocks freed, and the call ends RESOURCE_EXHAUSTED naming this flag "
        "(a message over 64 KiB: this per 64 KiB of it). A client that reads, however slowly, "
        "is never cut. 0: no limit", rule=AtLeastZero(),
        flag="--stream-send-timeout", metavar="S")
    tokenizer_threads: int = setting(
        4, "threads that tokenize text prompts, off the event loop (one caller holds at most "
        "all but one of them)", rule=AtLeast(1))

    def __post_init__(self):
        validate(self)
        if (self.tls_cert is None) != (self.tls_key is None):
            missing = "tls_key" if self.tls_key is None else "tls_cert"
            raise ParamError(missing, None, "set together with --tls-cert/--tls-key")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ParamError("tls_client_ca", self.tls_client_ca,
                             "unset without --tls-cert (client certificates need TLS)")

    @property
    def max_request_bytes(self) -> int:
        return self.max_request_mib * MIB
