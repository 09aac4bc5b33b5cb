"""Throwaway certificates for TLS tests, made with the openssl command line.

    ca = make_ca(tmp_path, "test-ca")
    server = make_cert(tmp_path, ca, "worker", hosts=("127.0.0.1", "localhost"))
    client = make_cert(tmp_path, ca, "scheduler")          # a client certificate
    both = make_cert(tmp_path, ca, "worker-1", hosts=("127.0.0.1",), client=True,
                     sans=("URI:spiffe://cluster/worker",))  # serves and presents itself too

Each returns a Pem with the paths of its certificate and key (the CA's too). EC P-256 keys, one
day of validity; server certificates name their hosts in subjectAltName (IP or DNS). The subject
is CN=<name> unless `common_name` is given.
"""
from __future__ import annotations

import ipaddress
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Pem:
    cert: Path
    key: Path


def _openssl(*args: str) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command line is not installed")
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def _key(path: Path) -> None:
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(path))


def make_ca(directory: Path, name: str) -> Pem:
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    _key(key)
    _openssl("req", "-x509", "-new", "-key", str(key), "-out", str(cert), "-days", "1",
             "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return Pem(cert, key)


def _san(host: str) -> str:
    try:
        ipaddress.ip_address(host)
        return f"IP:{host}"
    except ValueError:
        return f"DNS:{host}"


def make_cert(directory: Path, ca: Pem, name: str, hosts: tuple[str, ...] = (),
              client: bool | None = None, sans: tuple[str, ...] = (),
              common_name: str | None = None) -> Pem:
    """A certificate signed by `ca`: a server's (naming `hosts`) or, without hosts, a client's.
    `client=True` lets a server's certificate act as a client's too (as a cluster CA's usual
    "server and client auth" certificates do); `sans` are more subjectAltName entries written
    as openssl takes them ("DNS:scheduler.ns.svc", "URI:spiffe://..."); `common_name` replaces
    the subject's CN=<name> (the files keep `name`)."""
    cert, key, csr = (directory / f"{name}.crt", directory / f"{name}.key",
                      directory / f"{name}.csr")
    ext = directory / f"{name}.ext"
    client = not hosts if client is None else client
    usage = ",".join(u for u, on in (("serverAuth", bool(hosts)), ("clientAuth", client)) if on)
    lines = [f"extendedKeyUsage={usage}", "basicConstraints=CA:FALSE"]
    if hosts or sans:
        lines.append("subjectAltName=" + ",".join([*(_san(h) for h in hosts), *sans]))
    ext.write_text("\n".join(lines) + "\n")
    _key(key)
    _openssl("req", "-new", "-key", str(key), "-out", str(csr), "-subj",
             f"/CN={name if common_name is None else common_name}")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca.cert), "-CAkey", str(ca.key),
             "-CAcreateserial", "-out", str(cert), "-days", "1", "-extfile", str(ext))
    return Pem(cert, key)
