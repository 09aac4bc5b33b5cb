"""The Worker protocol's credentials, the same on both sides: a shared token and/or mutual TLS.

    WorkerCredentials  the flags of `deltaserve worker` and `deltaserve scheduler` (declared
                       settings): --worker-token-file, --worker-tls-cert/--worker-tls-key/
                       --worker-tls-ca; the worker's alone: --worker-tls-allowed-clients
                       (WORKER_ONLY: the scheduler's parser skips it)
    WorkerAuth         what they hold once read: the token and the PEM bytes

The token travels on every Worker RPC as the metadata `authorization: Bearer <token>`; the worker
compares it in constant time. With TLS the worker requires a client certificate signed by its
--worker-tls-ca (with --worker-tls-allowed-clients, one that also carries a name listed there: a
DNS or URI subjectAltName or the subject's common name; a cluster CA signs the workers' own
certificates too, and without the list any of them may drive any worker), and the scheduler
verifies the worker's certificate against its own --worker-tls-ca. Either credential is enough;
both may be used together. A worker's token file may hold the token's SHA-256 digest instead
(`sha256:` and 64 hex digits, `token_digest_text`): the worker compares digests, and a worker
that is broken into yields nothing that drives another worker; the scheduler needs the token
itself. `deltaserve serve` makes a random token per run (`new_token`) and hands its digest to the
worker it starts on standard input.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import sys
from dataclasses import dataclass
from typing import TextIO

from engine_common.request.params import ParamError
from engine_common.configuration.settings import ReadableFile, setting, validate
from engine_common.security.tls import read_pem

AUTH_METADATA_KEY = "authorization"
MIN_TOKEN_CHARS = 16
# The token travels in a gRPC header, and gRPC refuses a call whose metadata passes 8-16 KiB:
# a longer token was taken at start-up, then no call ever authenticated (the scheduler waited
# for its workers for ever, RESOURCE_EXHAUSTED; the worker logged "no token").
MAX_TOKEN_CHARS = 1024
DIGEST_PREFIX = "sha256:"
_HEX = frozenset("0123456789abcdef")
_EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()
_TOKEN_CHARS = frozenset(chr(c) for c in range(0x21, 0x7f))   # printable ASCII, no space
# Settings of WorkerCredentials that only the worker has (a scheduler's parser skips them).
WORKER_ONLY = ("worker_tls_allowed_clients",)


@dataclass(frozen=True, kw_only=True)
class WorkerCredentials:
    """How the Worker protocol is authenticated: the same settings on the worker and on the
    scheduler (the token file holds the same secret; the CA signed the other side's cert)."""

    worker_token_file: str | None = setting(
        None, "file holding the secret token every Worker RPC carries (the same secret on the "
        "worker and the scheduler; '-': read it from standard input); a worker's may hold "
        "the token's digest instead, sha256:HEX (then the worker holds nothing that drives "
        "another)",
        rule=ReadableFile(stdin=True), metavar="FILE")
    worker_tls_cert: str | None = setting(
        None, "PEM certificate of this side of the Worker protocol (the worker's server "
        "certificate, the scheduler's client certificate); with --worker-tls-key and "
        "--worker-tls-ca", rule=ReadableFile(), metavar="FILE")
    worker_tls_key: str | None = setting(
        None, "PEM private key of --worker-tls-cert", rule=ReadableFile(), metavar="FILE")
    worker_tls_ca: str | None = setting(
        None, "PEM CA certificate that signed the other side's certificate (the worker "
        "requires scheduler certificates signed by it; the scheduler verifies the worker's)",
        rule=ReadableFile(), metavar="FILE")
    worker_tls_allowed_clients: str | None = setting(
        None, "worker only, with --worker-tls-*: comma-separated names of the clients that may "
        "drive this worker; a client certificate must carry one of them as a DNS or URI "
        "subjectAltName or as its subject's common name, exactly (unset: any certificate "
        "--worker-tls-ca signed, another worker's included)", metavar="NAMES")

    def __post_init__(self):
        validate(self)
        tls = {"worker_tls_cert": self.worker_tls_cert, "worker_tls_key": self.worker_tls_key,
               "worker_tls_ca": self.worker_tls_ca}
        given = [name for name, value in tls.items() if value is not None]
        if given and len(given) < len(tls):
            missing = sorted(set(tls) - set(given))
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise ParamError(missing[0], None, f"set together with {flags} (mutual TLS needs "
                             "the certificate, its key and the CA)")
        if self.worker_tls_allowed_clients is not None:
            if not given:
                raise ParamError("worker_tls_allowed_clients", self.worker_tls_allowed_clients,
                                 "set only with --worker-tls-cert/--worker-tls-key/"
                                 "--worker-tls-ca (it names client certificates)")
            if not self.allowed_clients:
                raise ParamError("worker_tls_allowed_clients", self.worker_tls_allowed_clients,
                                 "one or more comma-separated names")

    @property
    def allowed_clients(self) -> frozenset[str]:
        """The names of --worker-tls-allowed-clients (empty: any certificate of the CA)."""
        names = (self.worker_tls_allowed_clients or "").split(",")
        return frozenset(n.strip() for n in names if n.strip())

    @property
    def given(self) -> bool:
        return self.worker_token_file is not None or self.worker_tls_cert is not None

    def load(self, stdin: TextIO | None = None) -> "WorkerAuth":
        """Read the files (a token file "-" from `stdin`, default sys.stdin): the worker's
        credentials (its token file may hold the token's sha256: digest)."""
        token = digest = None
        if self.worker_token_file == "-":
            token, digest = parse_secret((stdin or sys.stdin).readline(), "standard input")
        elif self.worker_token_file is not None:
            token, digest = parse_secret(read_text(self.worker_token_file),
                                         self.worker_token_file)
        if self.worker_tls_cert is None:
            return WorkerAuth(token=token, token_digest=digest)
        return WorkerAuth(token=token, token_digest=digest,
                          cert=read_pem(self.worker_tls_cert, "worker_tls_cert"),
                          key=read_pem(self.worker_tls_key, "worker_tls_key"),
                          ca=read_pem(self.worker_tls_ca, "worker_tls_ca"),
                          allowed_clients=self.allowed_clients)

    def load_for_client(self, stdin: TextIO | None = None) -> "WorkerAuth":
        """load() for the side that calls workers (the scheduler): the token itself, since a
        digest cannot be sent."""
        auth = self.load(stdin)
        if auth.token_digest is not None and auth.token is None:
            raise ParamError("worker_token_file", self.worker_token_file,
                             "a file holding the token itself: the scheduler sends it, and a "
                             "sha256: digest only lets a worker check it")
        return auth


@dataclass(frozen=True)
class WorkerAuth:
    """The loaded credentials. Nothing set: the protocol runs without authentication."""

    token: str | None = None     # what a client sends; None on a worker given the digest
    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None
    # The worker's: names one of which a client certificate must carry (empty: any of the CA's).
    allowed_clients: frozenset[str] = frozenset()
    # What a worker compares a presented token's SHA-256 with (the token's, when given).
    token_digest: bytes | None = None

    def __post_init__(self):
        if self.token is not None and self.token_digest is None:
            object.__setattr__(self, "token_digest", sha256(self.token))

    def __repr__(self) -> str:   # never print the secret
        token = "set" if self.token else "digest" if self.token_digest else None
        return f"WorkerAuth(token={token}, tls={self.tls})"

    @property
    def tls(self) -> bool:
        return self.cert is not None

    @property
    def checks_token(self) -> bool:
        return self.token_digest is not None

    @property
    def enabled(self) -> bool:
        return self.checks_token or self.tls

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata a client adds to every Worker RPC."""
        return ((AUTH_METADATA_KEY, f"Bearer {self.token}"),) if self.token else ()

    def accepts(self, header: str | None) -> bool:
        """Whether an `authorization` metadata value carries the token: its SHA-256 against
        token_digest (constant time; equal lengths whatever was sent)."""
        if self.token_digest is None:
            return True
        scheme, _, presented = (header or "").partition(" ")
        given = sha256(presented.encode(errors="replace"))
        # A presented token must have a token file's shape: a digest made of an empty or short
        # string (a recipe run with $TOKEN unset) then matches nothing anyone can send.
        return (hmac.compare_digest(given, self.token_digest) and scheme == "Bearer"
                and is_token(presented))


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def parse_token(text: str, source: str) -> str:
    """The token in `text` (surrounding whitespace dropped); ParamError naming `source` unless
    it is at least MIN_TOKEN_CHARS printable ASCII characters without spaces."""
    token = text.strip()
    if not is_token(token):
        raise ParamError("worker_token_file", source,
                         f"a file holding one token of at least {MIN_TOKEN_CHARS} printable "
                         f"ASCII characters without spaces, at most {MAX_TOKEN_CHARS} (it "
                         "travels in a gRPC header; e.g. `openssl rand -hex 32`)")
    return token


def is_token(text: str) -> bool:
    """MIN_TOKEN_CHARS to MAX_TOKEN_CHARS printable ASCII characters without spaces."""
    return MIN_TOKEN_CHARS <= len(text) <= MAX_TOKEN_CHARS and set(text) <= _TOKEN_CHARS


def sha256(token: str | bytes) -> bytes:
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).digest()


def token_digest_text(token: str) -> str:
    """What a worker's token file may hold instead of `token`: sha256:HEX."""
    return DIGEST_PREFIX + sha256(token).hex()


def parse_secret(text: str, source: str) -> tuple[str | None, bytes]:
    """(token, its digest) from a token file's text, or (None, digest) from sha256:HEX."""
    text = text.strip()
    if text[:len(DIGEST_PREFIX)].lower() != DIGEST_PREFIX:    # SHA256: too, never a token
        token = parse_token(text, source)
        return token, sha256(token)
    hex_digits = text[len(DIGEST_PREFIX):].lower()
    if len(hex_digits) != 64 or not set(hex_digits) <= _HEX:
        raise ParamError("worker_token_file", source,
                         f"a token's digest as {DIGEST_PREFIX} and 64 hex digits (its SHA-256)")
    if hex_digits == _EMPTY_DIGEST:
        raise ParamError("worker_token_file", source,
                         "the digest of a token, not of the empty string (was $TOKEN set?)")
    return None, bytes.fromhex(hex_digits)


def read_text(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError as e:
        raise ParamError("worker_token_file", path, f"a readable file ({e.strerror})") from None
