"""TLS for replica traffic between hosts (stdlib ``ssl``, TLS 1.3 only).

Every process of a job derives the same Ed25519 key and self-signed certificate from the
job's secret, so no certificate is ever distributed: a server presents it, a client
trusts it and nothing else. A host on the path that does not know the secret can neither
read the bytes nor stand in for a server (it cannot present the certificate); the
secret's HMAC handshake then runs inside TLS and proves the client. TLS 1.3's ephemeral
key exchange keeps recorded traffic unreadable even to whoever learns the secret later.

``--tls auto`` (the default) uses it for every connection that leaves loopback: each end
decides from the address alone (the client from where it connects, the server from
where the connection comes), so both agree without a word on the wire.
"""

from __future__ import annotations

import datetime
import functools
import hmac
import ipaddress
import os
import ssl
import tempfile
from typing import Literal

Mode = Literal["auto", "on", "off"]
MODES: tuple[Mode, ...] = ("auto", "on", "off")


def wanted(mode: str, host: str | None) -> bool:
    """Whether a connection to or from ``host`` (None: a Unix socket) goes over TLS."""
    if mode not in MODES:
        raise ValueError(f"tls mode must be one of {', '.join(MODES)}, got {mode!r}")
    if host is None or mode == "off":
        return False
    return mode == "on" or not is_loopback(host)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:  # a name other than localhost: treated as another host
        return False


@functools.lru_cache(maxsize=4)
def _identity(secret: bytes) -> tuple[bytes, bytes]:
    """(certificate, private key) of the job, PEM: the same bytes in every process."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.x509.oid import NameOID

    key = Ed25519PrivateKey.from_private_bytes(
        hmac.digest(secret, b"tierswap tls identity 1", "sha256")
    )
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tierswap job")])
    public = key.public_key()
    utc = datetime.UTC
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(1)  # every field fixed: Ed25519 signs deterministically
        .not_valid_before(datetime.datetime(2000, 1, 1, tzinfo=utc))
        .not_valid_after(datetime.datetime(9999, 12, 31, tzinfo=utc))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(public), critical=False)
        .sign(key, algorithm=None)
    )
    pem_key = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), pem_key


@functools.lru_cache(maxsize=4)
def server_context(secret: bytes) -> ssl.SSLContext:
    cert, key = _identity(secret)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    # ssl loads a key only from a file: a private folder, removed at once
    with tempfile.TemporaryDirectory(prefix="tierswap-tls-") as folder:
        path = os.path.join(folder, "job.pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key + cert)
        ctx.load_cert_chain(path)
    return ctx


@functools.lru_cache(maxsize=4)
def client_context(secret: bytes) -> ssl.SSLContext:
    cert, _ = _identity(secret)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False  # hosts are addresses; the one trusted certificate is the job's
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cadata=cert.decode())
    return ctx
