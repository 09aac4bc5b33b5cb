"""engine_common/security/worker_auth.py: the token and TLS settings both sides of the Worker protocol
share."""
from __future__ import annotations

import hashlib
import io

import pytest

from engine_common.request.params import ParamError
from engine_common.security.worker_auth import (WorkerAuth, WorkerCredentials, new_token, parse_token,
                                                 token_digest_text)


def test_a_token_is_read_from_a_file_or_stdin_and_never_printed(tmp_path):
    path = tmp_path / "token"
    path.write_text("  s3cret-token-0123456789\n")
    auth = WorkerCredentials(worker_token_file=str(path)).load()
    assert auth.token == "s3cret-token-0123456789" and auth.enabled and not auth.tls
    assert "s3cret" not in repr(auth)
    piped = WorkerCredentials(worker_token_file="-").load(io.StringIO(new_token() + "\n"))
    assert len(piped.token) >= 40
    assert auth.metadata() == (("authorization", "Bearer s3cret-token-0123456789"),)


def test_the_token_is_compared_exactly():
    auth = WorkerAuth(token="0123456789abcdef")
    assert auth.accepts("Bearer 0123456789abcdef")
    for header in (None, "", "0123456789abcdef", "Bearer 0123456789abcde",
                   "Bearer 0123456789abcdefX", "bearer 0123456789abcdef", "Bearer ∂"):
        assert not auth.accepts(header), header
    assert WorkerAuth().accepts(None) and not WorkerAuth().enabled


@pytest.mark.parametrize("text", ["short", "has a space inside it", "x" * 15, "tab\there-xxxxxxxx",
                                  "x" * 1025])
def test_a_weak_or_malformed_token_is_refused(text):
    with pytest.raises(ParamError, match="at least 16 printable ASCII characters"):
        parse_token(text, "file")


def test_the_longest_token_a_grpc_header_carries_is_taken():
    """1025 characters and more are refused above: gRPC refuses such a header on every call."""
    assert parse_token("x" * 1024, "file") == "x" * 1024


def test_tls_needs_the_certificate_its_key_and_the_ca(tmp_path):
    pem = tmp_path / "x.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\n")
    with pytest.raises(ParamError, match="worker_tls_ca=None is invalid: must be set together "
                                         "with --worker-tls-cert, --worker-tls-key"):
        WorkerCredentials(worker_tls_cert=str(pem), worker_tls_key=str(pem))
    with pytest.raises(ParamError, match="worker_token_file='/no/such' is invalid: must be a "
                                         "readable file or - "):
        WorkerCredentials(worker_token_file="/no/such")
    auth = WorkerCredentials(worker_tls_cert=str(pem), worker_tls_key=str(pem),
                             worker_tls_ca=str(pem)).load()
    assert auth.tls and auth.enabled and auth.token is None and auth.metadata() == ()


def test_allowed_clients_need_tls_and_one_name(tmp_path):
    pem = tmp_path / "x.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\n")
    tls = dict(worker_tls_cert=str(pem), worker_tls_key=str(pem), worker_tls_ca=str(pem))
    auth = WorkerCredentials(**tls, worker_tls_allowed_clients=" scheduler.ns.svc, ops,,").load()
    assert auth.allowed_clients == {"scheduler.ns.svc", "ops"}
    assert WorkerCredentials(**tls).load().allowed_clients == frozenset()
    with pytest.raises(ParamError, match="worker_tls_allowed_clients='ops' is invalid: must be "
                                         "set only with --worker-tls-cert"):
        WorkerCredentials(worker_tls_allowed_clients="ops")
    with pytest.raises(ParamError, match="must be one or more comma-separated names"):
        WorkerCredentials(**tls, worker_tls_allowed_clients=" , ")


def test_only_the_worker_has_the_allowed_clients_flag(capsys):
    from deltaserve.cli import build_parser
    parser = build_parser()
    args = parser.parse_args(["worker", "--listen", "127.0.0.1:1", "--worker-tls-allowed-clients",
                              "scheduler"])
    assert args.worker_tls_allowed_clients == "scheduler"
    with pytest.raises(SystemExit):   # the scheduler has no such flag: it names no client
        parser.parse_args(["scheduler", "--model", "m", "--workers", "w:1",
                           "--worker-tls-allowed-clients", "scheduler"])
    assert "unrecognized arguments: --worker-tls-allowed-clients" in capsys.readouterr().err


TOKEN = "s3cret-token-0123456789"


def test_a_worker_given_the_digest_checks_the_token_without_holding_it(tmp_path):
    path = tmp_path / "token.sha256"
    path.write_text(token_digest_text(TOKEN).upper().replace("SHA256:", "sha256:") + "\n")
    auth = WorkerCredentials(worker_token_file=str(path)).load()
    assert auth.token is None and auth.checks_token and auth.enabled and auth.metadata() == ()
    assert auth.accepts(f"Bearer {TOKEN}")
    for header in (None, "", TOKEN, f"bearer {TOKEN}", f"Bearer {TOKEN}x",
                   f"Bearer {token_digest_text(TOKEN)}", "Bearer " + path.read_text().strip()):
        assert not auth.accepts(header), header
    assert repr(auth) == "WorkerAuth(token=digest, tls=False)"
    # the token itself still works on a worker, and checks the same way
    assert WorkerAuth(token=TOKEN).token_digest == auth.token_digest


def test_the_scheduler_needs_the_token_itself(tmp_path):
    path = tmp_path / "token.sha256"
    path.write_text(token_digest_text(TOKEN))
    with pytest.raises(ParamError, match=f"worker_token_file='{path}' is invalid: must be a file "
                                         "holding the token itself"):
        WorkerCredentials(worker_token_file=str(path)).load_for_client()
    piped = WorkerCredentials(worker_token_file="-").load_for_client(io.StringIO(TOKEN))
    assert piped.metadata() == (("authorization", f"Bearer {TOKEN}"),)


@pytest.mark.parametrize("text", ["sha256:", "sha256:" + "0" * 63, "sha256:" + "g" * 64,
                                  "sha256:" + "0" * 65, "sha256: " + "0" * 64])
def test_a_malformed_digest_is_refused(text):
    with pytest.raises(ParamError, match="must be a token's digest as sha256: and 64 hex digits"):
        WorkerCredentials(worker_token_file="-").load(io.StringIO(text))


def test_a_digest_of_no_token_authenticates_nothing():
    """A digest recipe run with $TOKEN unset (or set to a short word) must not let a bare
    `Bearer` header in: the empty string's digest is refused at load, and a presented token
    needs a token file's shape whatever digest the worker holds."""
    empty = "sha256:" + hashlib.sha256(b"").hexdigest()
    with pytest.raises(ParamError, match="not of the empty string"):
        WorkerCredentials(worker_token_file="-").load(io.StringIO(empty))
    short = WorkerAuth(token_digest=hashlib.sha256(b"abc").digest())
    assert not short.accepts("Bearer abc")
    spaced = WorkerAuth(token_digest=hashlib.sha256(b"sixteen chars  x").digest())
    assert not spaced.accepts("Bearer sixteen chars  x")
    assert WorkerAuth(token_digest=hashlib.sha256(TOKEN.encode()).digest()).accepts(
        f"Bearer {TOKEN}")


def test_an_upper_case_digest_is_a_digest_not_a_token():
    """`SHA256:HEX` (as some tools print it) must not become a token equal to the digest text,
    which anyone who reads the workers' Secret could then send."""
    text = token_digest_text(TOKEN).replace("sha256:", "SHA256:").upper()
    auth = WorkerCredentials(worker_token_file="-").load(io.StringIO(text))
    assert auth.token is None and auth.accepts(f"Bearer {TOKEN}")
    assert not auth.accepts(f"Bearer {text}")
